"""The autotuner (CPU, fake kernels): no call measures anything, ``tune`` and ``tune_pending``
measure every candidate at once; the fastest accurate kernel is kept, inaccurate, non-finite
and failing ones are rejected; verdicts are remembered in memory and on disk, or come from a
shipped table, and run from a problem's first call; a verdict's kernel that fails gives way to
torch."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import Tensor

from dmuon_ns import POLAR_EXPRESS_COEFFICIENTS, _autotune, _tables, _verdict_cache
from dmuon_ns._environment import CACHE_DIR_ENV
from dmuon_ns._torch_kernel import TORCH_KERNEL
from dmuon_ns._warnings import warn
from dmuon_testing.warning_line import check_warning_line

COEFFS = tuple(tuple(row) for row in POLAR_EXPRESS_COEFFICIENTS[:5])
RESTARTS = (2,)


class FakeKernel:
    """The torch kernel's result after a delay, optionally spoiled; counts its calls."""

    def __init__(self, name: str, delay: float = 0.0, spoil: str | None = None) -> None:
        self.name = name
        self.delay = delay
        self.spoil = spoil
        self.calls = 0

    def unavailable_reason(self, device: torch.device) -> str | None:
        return None

    def _finish(self, out: Tensor) -> Tensor:
        self.calls += 1
        time.sleep(self.delay)
        if self.spoil == "noise":
            return out + 0.05 * torch.randn_like(out)
        if self.spoil == "nan":
            return torch.full_like(out, float("nan"))
        if self.spoil == "raise":
            raise RuntimeError("kernel launch failed")
        if self.spoil == "shape":
            return out[:, :-1]
        return out

    def gram(
        self,
        x: Tensor,
        coefficients: Sequence[tuple[float, float, float]],
        restarts: Sequence[int],
        out_dtype: torch.dtype | None = None,
    ) -> Tensor:
        return self._finish(TORCH_KERNEL.gram(x, coefficients, restarts, out_dtype))

    def direct(
        self,
        x: Tensor,
        coefficients: Sequence[tuple[float, float, float]],
        out_dtype: torch.dtype | None = None,
    ) -> Tensor:
        return self._finish(TORCH_KERNEL.direct(x, coefficients, out_dtype))


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(_autotune, "_TIMING_S", 0.02)  # minimum repetitions: fast tests
    _autotune.clear_cache()
    yield
    _autotune.clear_cache()


def _x(shape=(2, 12, 40), dtype=torch.float16) -> Tensor:
    x = torch.randn(shape)
    return (x / torch.linalg.matrix_norm(x, keepdim=True)).to(dtype)


def _fast_verdict(x: Tensor) -> Any:
    """Tune ``x``'s problem to a verdict for "fast" over a slower "torch"."""
    kernels = [FakeKernel("fast"), FakeKernel("torch", delay=0.02)]
    return _autotune.choose(kernels, x, "gram", COEFFS, RESTARTS, now=True)


def test_picks_the_fastest_accurate_kernel():
    slow = FakeKernel("slow", delay=0.06)
    fast = FakeKernel("fast")
    reference = FakeKernel("torch", delay=0.03)
    chosen = _autotune.choose([slow, reference, fast], _x(), "gram", COEFFS, RESTARTS, now=True)
    assert chosen is fast
    (verdict,) = _autotune.verdicts().values()
    assert verdict["kernel"] == "fast"
    assert set(verdict["times_ms"]) == {"slow", "torch", "fast"}
    assert verdict["times_ms"]["fast"] < verdict["times_ms"]["torch"] < verdict["times_ms"]["slow"]


@pytest.mark.parametrize("spoil", ["noise", "nan", "raise", "shape"])
def test_rejects_unsound_kernels_however_fast(spoil):
    bad = FakeKernel("bad", spoil=spoil)
    reference = FakeKernel("torch", delay=0.02)
    # A kernel that fails is a deliberate degradation: reported, with its reason.
    reported = (
        pytest.warns(RuntimeWarning, match=r"kernel 'bad' failed .*kernel launch failed")
        if spoil == "raise"
        else contextlib.nullcontext()
    )
    with reported:
        chosen = _autotune.choose([bad, reference], _x(), "direct", COEFFS, (), now=True)
    assert chosen is reference
    (verdict,) = _autotune.verdicts().values()
    assert "bad" in verdict["rejected"]
    assert "bad" not in verdict["times_ms"]


class KernelWithOwnFailures(FakeKernel):
    """Says that ``KeyError`` is how it reports a problem it cannot run."""

    def failure_types(self) -> tuple[type[Exception], ...]:
        return (KeyError,)

    def _finish(self, out: Tensor) -> Tensor:
        raise KeyError("no tile config fits")


def test_a_warning_names_the_callers_line_through_training_libraries():
    # Reached through the Trainer's loop and accelerate's optimizer wrapper (Muon.step under
    # DmuonTrainer), a warning named accelerate's line, not the user's trainer.train().
    check_warning_line(warn, "dmuon_ns._autotune")


def test_a_kernel_names_the_exceptions_that_reject_it():
    own = KernelWithOwnFailures("own")
    reference = FakeKernel("torch", delay=0.02)
    with pytest.warns(RuntimeWarning, match="no tile config fits") as caught:
        chosen = _autotune.choose([own, reference], _x(), "gram", COEFFS, RESTARTS, now=True)
    assert [w.filename for w in caught] == [__file__]  # the caller's line, not dmuon-ns's
    assert chosen is reference
    (verdict,) = _autotune.verdicts().values()
    assert verdict["rejected"]["own"].startswith("raised KeyError")


def test_an_unexpected_exception_is_a_bug_and_propagates():
    class Buggy(FakeKernel):
        def _finish(self, out: Tensor) -> Tensor:
            raise KeyError("a bug, not a kernel that cannot run")

    with pytest.raises(KeyError, match="a bug"):
        _autotune.choose(
            [Buggy("buggy"), FakeKernel("torch")], _x(), "gram", COEFFS, RESTARTS, now=True
        )


def test_accuracy_bar_is_twice_torchs_error():
    # A kernel exactly as accurate as torch passes; one with an extra error of ~10× torch's
    # error fails (noise above), so the bar sits between the two.
    twin = FakeKernel("twin")
    reference = FakeKernel("torch", delay=0.02)
    assert _autotune.choose([reference, twin], _x(), "gram", COEFFS, RESTARTS, now=True) is twin


def test_verdict_is_cached_in_memory():
    fast, reference = FakeKernel("fast"), FakeKernel("torch", delay=0.02)
    x = _x()
    _autotune.choose([fast, reference], x, "gram", COEFFS, RESTARTS, now=True)
    calls = (fast.calls, reference.calls)
    assert _autotune.choose([fast, reference], x, "gram", COEFFS, RESTARTS) is fast
    assert _autotune.choose([fast, reference], x, "gram", COEFFS, RESTARTS, now=True) is fast
    assert (fast.calls, reference.calls) == calls


def test_verdict_survives_on_disk(tmp_path):
    x = _x()
    _fast_verdict(x)
    path = tmp_path / "cache" / "verdicts.json"
    data = json.loads(path.read_text())
    assert [v["kernel"] for v in data["verdicts"].values()] == ["fast"]

    _autotune.clear_cache()  # a new process: memory empty, disk kept
    fast, reference = FakeKernel("fast"), FakeKernel("torch")
    # Nothing is measured again, and the verdict's kernel runs from the first call on (the
    # dispatcher runs it; choosing runs nothing).
    assert _autotune.choose([reference, fast], x, "gram", COEFFS, RESTARTS) is fast
    assert _autotune.choose([reference, fast], x, "gram", COEFFS, RESTARTS, now=True) is fast
    assert fast.calls == reference.calls == 0


@pytest.mark.parametrize("entry", ["fast", None, {"kernel": ["fast"]}])
def test_a_malformed_verdict_on_disk_is_ignored_with_a_warning(tmp_path, entry):
    # A file that parses but holds a verdict that is no {"kernel": name, ...} (edited by hand,
    # say) made every call of the problem raise AttributeError or TypeError.
    x = _x()
    _fast_verdict(x)
    path = tmp_path / "cache" / "verdicts.json"
    data = json.loads(path.read_text())
    data["verdicts"] = {key: entry for key in data["verdicts"]}
    path.write_text(json.dumps(data))
    _autotune.clear_cache()  # a new process: memory empty, disk kept
    warned = set(_verdict_cache._warned)
    _verdict_cache._warned.clear()
    try:
        with pytest.warns(RuntimeWarning, match="ignoring 1 malformed verdict"):
            chosen = _autotune.choose(
                [FakeKernel("torch"), FakeKernel("fast")], x, "gram", COEFFS, RESTARTS
            )
    finally:
        _verdict_cache._warned.clear()
        _verdict_cache._warned.update(warned)
    assert chosen.name == "torch"  # no verdict: the provisional kernel


def test_a_cached_kernel_that_is_no_longer_offered_is_retuned():
    x = _x()
    _fast_verdict(x)
    other = FakeKernel("other")
    reference = FakeKernel("torch", delay=0.02)
    assert _autotune.choose([reference, other], x, "gram", COEFFS, RESTARTS, now=True) is other
    assert other.calls > 0


def test_a_newly_available_kernel_is_compared_not_shadowed_by_an_old_verdict():
    # A verdict reached before the quack extra was installed must not decide for a process
    # that has it: the candidate set is part of the problem.
    x = _x()
    first = FakeKernel("middling", delay=0.01)
    reference = FakeKernel("torch", delay=0.02)
    assert _autotune.choose([first, reference], x, "gram", COEFFS, RESTARTS, now=True) is first
    _autotune.clear_cache()  # a later process; the disk cache holds the old verdict
    newcomer = FakeKernel("newcomer")
    chosen = _autotune.choose(
        [newcomer, FakeKernel("middling", delay=0.01), reference],
        x,
        "gram",
        COEFFS,
        RESTARTS,
        now=True,
    )
    assert chosen is newcomer and newcomer.calls > 0


def test_problem_key_separates_shape_dtype_op_and_coefficients():
    fast, reference = FakeKernel("fast"), FakeKernel("torch", delay=0.02)
    _autotune.choose([fast, reference], _x((2, 12, 40)), "gram", COEFFS, RESTARTS, now=True)
    _autotune.choose([fast, reference], _x((3, 12, 40)), "gram", COEFFS, RESTARTS, now=True)
    _autotune.choose(
        [fast, reference], _x(dtype=torch.bfloat16), "gram", COEFFS, RESTARTS, now=True
    )
    _autotune.choose([fast, reference], _x(), "direct", COEFFS, RESTARTS, now=True)
    _autotune.choose([fast, reference], _x(), "gram", COEFFS[:4], RESTARTS, now=True)
    _autotune.choose([fast, reference], _x(), "gram", COEFFS, (), now=True)
    assert len(_autotune.verdicts()) == 6


def test_corrupt_cache_file_is_ignored_with_one_warning(tmp_path, caplog):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "verdicts.json").write_text("{not json")
    warned = set(_verdict_cache._warned)
    _verdict_cache._warned.clear()
    try:
        with caplog.at_level(logging.WARNING, logger="dmuon_ns._verdict_cache"):
            with pytest.warns(RuntimeWarning, match="ignoring corrupt"):
                chosen = _fast_verdict(_x())
    finally:
        _verdict_cache._warned.clear()
        _verdict_cache._warned.update(warned)
    assert chosen.name == "fast"
    assert sum("corrupt" in r.getMessage() for r in caplog.records) == 1
    # The rewrite replaced the corrupt file with a valid one.
    assert json.loads((cache / "verdicts.json").read_text())["format"] == 1


def test_single_candidate_needs_no_tuning():
    only = FakeKernel("torch")
    assert _autotune.choose([only], _x(), "gram", COEFFS, RESTARTS) is only
    assert _autotune.choose([only], _x(), "gram", COEFFS, RESTARTS, now=True) is only
    assert only.calls == 0
    assert _autotune.verdicts() == {}


def test_no_call_measures_anything():
    slow, reference, fast = FakeKernel("slow", 0.06), FakeKernel("torch", 0.03), FakeKernel("f")
    kernels = [slow, reference, fast]
    for _ in range(5):  # however many calls a problem makes, and however late
        assert _autotune.choose(kernels, _x(), "gram", COEFFS, RESTARTS) is reference
    assert slow.calls == reference.calls == fast.calls == 0
    assert _autotune.verdicts() == {}
    # Asking measures every candidate at once; the verdict runs from the next call on.
    assert _autotune.choose(kernels, _x(), "gram", COEFFS, RESTARTS, now=True) is fast
    (verdict,) = _autotune.verdicts().values()
    assert verdict["kernel"] == "f" and set(verdict["ratios"]) == {"slow", "torch", "f"}
    assert verdict["ratios"]["f"] < verdict["ratios"]["torch"] == 1.0 < verdict["ratios"]["slow"]
    calls = (slow.calls, reference.calls, fast.calls)
    assert _autotune.choose(kernels, _x(), "gram", COEFFS, RESTARTS) is fast
    assert (slow.calls, reference.calls, fast.calls) == calls


def _table(monkeypatch, *rows: dict[str, Any]) -> None:
    """A shipped table for the device the tests run on (the CPU)."""
    entries = _tables.parse({"format": _tables.FORMAT_VERSION, "problems": list(rows)}, "test")
    monkeypatch.setattr(_tables, "load", lambda device_name: entries)


def _row(batch: int, ms: dict[str, float], **more: Any) -> dict[str, Any]:
    return {"op": "gram", "batch": batch, "m": 12, "n": 40, "dtype": "float16", "ms": ms, **more}


def test_a_table_verdict_runs_from_the_first_call_without_measuring(monkeypatch):
    _table(monkeypatch, _row(2, {"slow": 2.0, "torch": 1.0, "f": 0.5}))
    slow, reference, fast = FakeKernel("slow"), FakeKernel("torch"), FakeKernel("f")
    kernels = [slow, reference, fast]
    assert _autotune.choose(kernels, _x(), "gram", COEFFS, RESTARTS) is fast
    assert _autotune.choose(kernels, _x(), "gram", COEFFS, RESTARTS, now=True) is fast
    assert _autotune.tune_pending() == {"gram 2x12x40 float16": "f"}
    assert slow.calls == reference.calls == fast.calls == 0
    (verdict,) = _autotune.verdicts().values()
    assert verdict["table"] == "gram 2x12x40 float16" and verdict["kernel"] == "f"


def test_a_table_answers_for_the_nearest_batch_and_only_for_kernels_it_compared(monkeypatch):
    _table(
        monkeypatch,
        _row(1, {"torch": 1.0, "f": 2.0}),
        _row(8, {"torch": 1.0, "f": 0.5}),
        _row(4, {"torch": 1.0}, rejected={"f": "error 0.1 > 2 x torch's 0.01"}),
    )
    reference, fast = FakeKernel("torch"), FakeKernel("f")
    assert _autotune.choose([fast, reference], _x((1, 12, 40)), "gram", COEFFS, RESTARTS).name == (
        "torch"
    )
    assert _autotune.choose([fast, reference], _x((11, 12, 40)), "gram", COEFFS, RESTARTS) is fast
    # A batch of 3 is nearer 4 (by ratio) than 1: there "f" failed the cross-check.
    assert _autotune.choose([fast, reference], _x((3, 12, 40)), "gram", COEFFS, RESTARTS).name == (
        "torch"
    )
    # A kernel the table never saw leaves the problem to the autotuner: torch until measured.
    other = FakeKernel("other")
    assert (
        _autotune.choose([other, fast, reference], _x((8, 12, 40)), "gram", COEFFS, RESTARTS)
        is reference
    )
    # Other shapes, ops or dtypes are not answered for.
    for x, op in [(_x((8, 12, 48)), "gram"), (_x((8, 12, 40)), "direct")]:
        assert _autotune.choose([fast, reference], x, op, COEFFS, RESTARTS) is reference
    assert fast.calls == reference.calls == other.calls == 0


def test_a_measured_verdict_comes_before_the_table(monkeypatch):
    _table(monkeypatch, _row(2, {"torch": 1.0, "fast": 0.5}))
    x = _x()
    slower_here = FakeKernel("fast", delay=0.04)
    with_table = _autotune.choose([slower_here, FakeKernel("torch")], x, "gram", COEFFS, RESTARTS)
    assert with_table is slower_here and slower_here.calls == 0
    _autotune.clear_cache()
    _table(monkeypatch)  # a process where this problem was measured on this machine, not shipped
    reference = FakeKernel("torch", delay=0.02)
    assert _autotune.choose([slower_here, reference], x, "gram", COEFFS, RESTARTS, now=True) is (
        reference
    )
    _autotune.clear_cache()  # a later process: the disk verdict wins over the table
    _table(monkeypatch, _row(2, {"torch": 1.0, "fast": 0.5}))
    assert _autotune.choose([slower_here, reference], x, "gram", COEFFS, RESTARTS) is reference


def test_a_verdict_kernel_that_fails_gives_way_to_torch():
    x = _x()
    _fast_verdict(x)
    _autotune.clear_cache()  # a new process, where "fast" now fails
    broken, reference = FakeKernel("fast", spoil="raise"), FakeKernel("torch")
    kernels = [reference, broken]
    assert _autotune.choose(kernels, x, "gram", COEFFS, RESTARTS) is broken
    error = RuntimeError("kernel launch failed")
    with pytest.warns(RuntimeWarning, match="disk verdict .*kernel launch failed"):
        fallback = _autotune.failed(kernels, x, "gram", COEFFS, RESTARTS, broken, error)
    assert fallback is reference
    assert _autotune.choose(kernels, x, "gram", COEFFS, RESTARTS) is reference
    # The provisional kernel failing, or running out of memory, is the caller's error.
    assert _autotune.failed(kernels, x, "gram", COEFFS, RESTARTS, reference, error) is None
    oom = torch.OutOfMemoryError("CUDA out of memory")
    assert _autotune.failed(kernels, x, "gram", COEFFS, RESTARTS, broken, oom) is None


def test_measure_ignores_every_verdict_and_commits_nothing(monkeypatch):
    _table(monkeypatch, _row(2, {"torch": 1.0, "fast": 0.5}))
    fast, reference = FakeKernel("fast", delay=0.03), FakeKernel("torch")
    verdict = _autotune.measure([fast, reference], _x(), "gram", COEFFS, RESTARTS)
    assert verdict["kernel"] == "torch" and set(verdict["times_ms"]) == {"fast", "torch"}
    assert verdict["seconds"] > 0 and fast.calls > 0
    assert _autotune.verdicts() == {}


@pytest.mark.parametrize("where", ["sample", "kernel"])
def test_no_memory_to_measure_keeps_the_verdict_out_of_the_disk_cache(where, monkeypatch, tmp_path):
    def no_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.9 GiB")

    fast, reference = FakeKernel("fast"), FakeKernel("torch")
    if where == "sample":  # the sample and its float64 reference
        monkeypatch.setattr(_autotune._measure, "sample", no_memory)
    else:  # the candidate's run: no verdict on the kernel either
        monkeypatch.setattr(fast, "_finish", no_memory)
    with pytest.warns(RuntimeWarning, match="no memory left to measure 'fast'"):
        chosen = _autotune.choose([fast, reference], _x(), "gram", COEFFS, RESTARTS, now=True)
    assert chosen is reference
    (verdict,) = _autotune.verdicts().values()
    assert verdict["rejected"]["fast"].startswith("not measured: out of memory")
    assert not (tmp_path / "cache" / "verdicts.json").exists()


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="op must be 'gram' or 'direct'"):
        _autotune.choose([FakeKernel("torch")], _x(), "polar", COEFFS, RESTARTS)
    with pytest.raises(ValueError, match="candidates must name at least one kernel"):
        _autotune.choose([], _x(), "gram", COEFFS, RESTARTS)


def test_tune_pending_finishes_every_open_choice():
    import dmuon_ns

    fast, reference = FakeKernel("fast"), FakeKernel("torch", delay=0.02)
    for shape in [(2, 12, 40), (1, 8, 24)]:
        assert _autotune.choose([fast, reference], _x(shape), "gram", COEFFS, RESTARTS) is reference
    assert _autotune.verdicts() == {} and fast.calls == 0
    # A graph of NS calls captured now would run the reference: the version says when to
    # recapture (it moves with the tune, and stays while nothing changes).
    before = dmuon_ns.kernel_choices_version()
    _autotune.choose([fast, reference], _x(), "gram", COEFFS, RESTARTS)
    assert dmuon_ns.kernel_choices_version() == before
    assert dmuon_ns.tune_pending() == {
        "gram 2x12x40 float16": "fast",
        "gram 1x8x24 float16": "fast",
    }
    assert dmuon_ns.kernel_choices_version() > before
    assert len(_autotune.verdicts()) == 2
    assert _autotune.choose([fast, reference], _x(), "gram", COEFFS, RESTARTS) is fast
    settled = dmuon_ns.kernel_choices_version()
    assert dmuon_ns.tune_pending() and dmuon_ns.kernel_choices_version() == settled
    _autotune.clear_cache()
    assert dmuon_ns.kernel_choices_version() > settled
