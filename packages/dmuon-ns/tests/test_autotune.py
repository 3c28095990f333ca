"""The autotuner (CPU, fake kernels): it keeps the fastest accurate kernel, rejects inaccurate,
non-finite and failing ones, and remembers verdicts in memory and on disk."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

from dmuon_ns import POLAR_EXPRESS_COEFFICIENTS, _autotune
from dmuon_ns._torch_kernel import TORCH_KERNEL

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
    monkeypatch.setenv(_autotune.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(_autotune, "_TARGET_SECONDS", 0.02)  # minimum repetitions: fast tests
    _autotune.clear_cache()
    yield
    _autotune.clear_cache()


def _x(shape=(2, 12, 40), dtype=torch.float16) -> Tensor:
    x = torch.randn(shape)
    return (x / torch.linalg.matrix_norm(x, keepdim=True)).to(dtype)


def test_picks_the_fastest_accurate_kernel():
    slow = FakeKernel("slow", delay=0.02)
    fast = FakeKernel("fast")
    reference = FakeKernel("torch", delay=0.01)
    chosen = _autotune.choose([slow, reference, fast], _x(), "gram", COEFFS, RESTARTS)
    assert chosen is fast
    (verdict,) = _autotune.verdicts().values()
    assert verdict["kernel"] == "fast"
    assert set(verdict["times_ms"]) == {"slow", "torch", "fast"}
    assert verdict["times_ms"]["fast"] < verdict["times_ms"]["torch"] < verdict["times_ms"]["slow"]


@pytest.mark.parametrize("spoil", ["noise", "nan", "raise", "shape"])
def test_rejects_unsound_kernels_however_fast(spoil):
    bad = FakeKernel("bad", spoil=spoil)
    reference = FakeKernel("torch", delay=0.005)
    # A kernel that fails is a deliberate degradation: reported, with its reason.
    reported = (
        pytest.warns(RuntimeWarning, match=r"kernel 'bad' failed .*kernel launch failed")
        if spoil == "raise"
        else contextlib.nullcontext()
    )
    with reported:
        chosen = _autotune.choose([bad, reference], _x(), "direct", COEFFS, ())
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


def test_a_kernel_names_the_exceptions_that_reject_it():
    own = KernelWithOwnFailures("own")
    reference = FakeKernel("torch", delay=0.005)
    with pytest.warns(RuntimeWarning, match="no tile config fits"):
        assert _autotune.choose([own, reference], _x(), "gram", COEFFS, RESTARTS) is reference
    (verdict,) = _autotune.verdicts().values()
    assert verdict["rejected"]["own"].startswith("raised KeyError")


def test_an_unexpected_exception_is_a_bug_and_propagates():
    class Buggy(FakeKernel):
        def _finish(self, out: Tensor) -> Tensor:
            raise KeyError("a bug, not a kernel that cannot run")

    with pytest.raises(KeyError, match="a bug"):
        _autotune.choose([Buggy("buggy"), FakeKernel("torch")], _x(), "gram", COEFFS, RESTARTS)


def test_accuracy_bar_is_twice_torchs_error():
    # A kernel exactly as accurate as torch passes; one with an extra error of ~10× torch's
    # error fails (noise above), so the bar sits between the two.
    twin = FakeKernel("twin")
    reference = FakeKernel("torch", delay=0.005)
    assert _autotune.choose([reference, twin], _x(), "gram", COEFFS, RESTARTS) is twin


def test_verdict_is_cached_in_memory():
    fast, reference = FakeKernel("fast"), FakeKernel("torch", delay=0.005)
    x = _x()
    _autotune.choose([fast, reference], x, "gram", COEFFS, RESTARTS)
    calls = (fast.calls, reference.calls)
    assert _autotune.choose([fast, reference], x, "gram", COEFFS, RESTARTS) is fast
    assert (fast.calls, reference.calls) == calls


def test_verdict_survives_on_disk(tmp_path):
    x = _x()
    _autotune.choose(
        [FakeKernel("fast"), FakeKernel("torch", delay=0.005)], x, "gram", COEFFS, RESTARTS
    )
    path = tmp_path / "cache" / "verdicts.json"
    data = json.loads(path.read_text())
    assert [v["kernel"] for v in data["verdicts"].values()] == ["fast"]

    _autotune.clear_cache()  # a new process: memory empty, disk kept
    fast, reference = FakeKernel("fast"), FakeKernel("torch")
    assert _autotune.choose([reference, fast], x, "gram", COEFFS, RESTARTS) is fast
    assert fast.calls == reference.calls == 0


def test_a_cached_kernel_that_is_no_longer_offered_is_retuned():
    x = _x()
    _autotune.choose(
        [FakeKernel("fast"), FakeKernel("torch", delay=0.005)], x, "gram", COEFFS, RESTARTS
    )
    other = FakeKernel("other")
    reference = FakeKernel("torch", delay=0.005)
    assert _autotune.choose([reference, other], x, "gram", COEFFS, RESTARTS) is other
    assert other.calls > 0


def test_a_newly_available_kernel_is_compared_not_shadowed_by_an_old_verdict():
    # A verdict reached before the quack extra was installed must not decide for a process
    # that has it: the candidate set is part of the problem.
    x = _x()
    first = FakeKernel("middling", delay=0.002)
    reference = FakeKernel("torch", delay=0.005)
    assert _autotune.choose([first, reference], x, "gram", COEFFS, RESTARTS) is first
    _autotune.clear_cache()  # a later process; the disk cache holds the old verdict
    newcomer = FakeKernel("newcomer")
    chosen = _autotune.choose(
        [newcomer, FakeKernel("middling", delay=0.002), reference], x, "gram", COEFFS, RESTARTS
    )
    assert chosen is newcomer and newcomer.calls > 0


def test_problem_key_separates_shape_dtype_op_and_coefficients():
    fast, reference = FakeKernel("fast"), FakeKernel("torch", delay=0.002)
    _autotune.choose([fast, reference], _x((2, 12, 40)), "gram", COEFFS, RESTARTS)
    _autotune.choose([fast, reference], _x((3, 12, 40)), "gram", COEFFS, RESTARTS)
    _autotune.choose([fast, reference], _x(dtype=torch.bfloat16), "gram", COEFFS, RESTARTS)
    _autotune.choose([fast, reference], _x(), "direct", COEFFS, RESTARTS)
    _autotune.choose([fast, reference], _x(), "gram", COEFFS[:4], RESTARTS)
    _autotune.choose([fast, reference], _x(), "gram", COEFFS, ())
    assert len(_autotune.verdicts()) == 6


def test_corrupt_cache_file_is_ignored_with_one_warning(tmp_path, caplog):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "verdicts.json").write_text("{not json")
    monkey_warned = _autotune._disk_warned
    _autotune._disk_warned = False
    try:
        with caplog.at_level(logging.WARNING, logger="dmuon_ns._autotune"):
            chosen = _autotune.choose(
                [FakeKernel("fast"), FakeKernel("torch", delay=0.005)],
                _x(),
                "gram",
                COEFFS,
                RESTARTS,
            )
    finally:
        _autotune._disk_warned = monkey_warned
    assert chosen.name == "fast"
    assert sum("corrupt" in r.getMessage() for r in caplog.records) == 1
    # The rewrite replaced the corrupt file with a valid one.
    assert json.loads((cache / "verdicts.json").read_text())["format"] == 1


def test_single_candidate_needs_no_tuning():
    only = FakeKernel("torch")
    assert _autotune.choose([only], _x(), "gram", COEFFS, RESTARTS) is only
    assert only.calls == 0
    assert _autotune.verdicts() == {}


def test_cache_dir_default_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv(_autotune.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert _autotune.cache_dir() == tmp_path / ".cache" / "dmuon" / "ns-autotune"
    monkeypatch.setenv(_autotune.CACHE_DIR_ENV, str(tmp_path / "elsewhere"))
    assert _autotune.cache_dir() == tmp_path / "elsewhere"


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="op must be 'gram' or 'direct'"):
        _autotune.choose([FakeKernel("torch")], _x(), "polar", COEFFS, RESTARTS)
    with pytest.raises(ValueError, match="candidates must name at least one kernel"):
        _autotune.choose([], _x(), "gram", COEFFS, RESTARTS)
