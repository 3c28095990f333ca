"""Per-shape kernel choice for ``kernel="auto"``: verdicts looked up at a problem's first call,
measured only when asked, kept per machine and shipped for measured cards.

[Note: what a verdict is]
A verdict answers "which kernel is fastest *and* numerically sound for this problem" where the
problem is (op, shape, dtype, device name, coefficients, restart iterations, the candidate
kernels) plus the versions of torch and of this package (a new build may change the answer).
How a candidate is measured is ``_measure``'s; where measured verdicts are kept is
``_verdict_cache``'s; the tables shipped with the package are ``_tables``'.

[Note: where a verdict comes from]
At a problem's first call in a process, in this order:

1. memory: a verdict measured or looked up earlier in this process;
2. the on-disk cache: a verdict ``tune`` measured on this machine, in any process;
3. the table of the device, shipped with the package (``_tables``' [Note: shipped tables]),
   which covers the common shapes on the cards measured.

The verdict's kernel runs from that first call on; that call compiles it where no earlier
call did (Triton and CuTe DSL keep compiled kernels on disk, so a machine compiles a kernel
once). A problem that none of them answers runs the *provisional* kernel, torch: cuBLAS,
nothing to compile, and the bar every other kernel is held to. Either way the kernel a problem
runs is fixed at its first call and changes only when ``tune`` is asked to measure it: the
choice does not depend on timing noise of the run, and two runs of a job on one machine run
the same kernels.

[Note: measuring only when asked]
No NS call measures anything: it never times candidates, compiles kernels it will not run or
builds a float64 reference, however many calls a problem makes. Measuring happens where the
caller asks for a stall:

- ``NewtonSchulz.tune(g)`` settles the problems of given tensors before their first call;
- ``dmuon_ns.tune_pending()`` settles every problem seen so far that has no verdict, e.g.
  after a training loop's first step.

Each problem is measured in one go: one sample of its shape (``_measure``), torch's error on
it, then per candidate one run (which compiles it), the cross-check against float64 and, when
it passes, ``_TIMING_S`` of interleaved timing against torch. Candidates are ranked by their
time relative to torch's in the same comparison, so clocks that drift between candidates do
not decide. The verdict is committed to memory, then disk. Inside another caller's CUDA-graph
capture nothing may synchronise, so ``now`` is ignored there and the call takes the current
choice.

[Note: a verdict's kernel that fails]
A verdict's kernel can fail where it was not measured (a cached verdict from another install,
a table from another build): its first run raises one of the kernel's own failure types. The
dispatcher then calls ``failed``: the failure is reported (``logging`` and ``warnings``) and
the problem runs the provisional kernel for the rest of the process. Running out of memory is
no verdict on a kernel and propagates.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import math
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from dmuon_ns import _measure, _tables, _verdict_cache
from dmuon_ns._coefficients import CoefficientRows, Coefficients
from dmuon_ns._prepare import problem_name
from dmuon_ns._profiling import span
from dmuon_ns._registry import NSKernel, Problem, choices_changed
from dmuon_ns._verdict_cache import AutotuneVerdict

__all__ = [
    "AutotuneVerdict",
    "choose",
    "clear_cache",
    "failed",
    "measure",
    "tune_pending",
    "verdicts",
]

logger = logging.getLogger(__name__)

# Timing budget of one candidate: the candidate and the provisional kernel, interleaved.
_TIMING_S = 0.1
# The kernel that runs a problem without a verdict (see [Note: where a verdict comes from]).
_PROVISIONAL = "torch"


class _Problem(NamedTuple):
    key: str
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    op: str
    coefficients: Coefficients
    restarts: tuple[int, ...]


@dataclass
class _Choice:
    """One problem's kernel and where it came from (``None``: no verdict yet)."""

    problem: _Problem
    candidates: tuple[NSKernel, ...]
    provisional: NSKernel
    kernel: NSKernel
    source: str | None  # "memory", "disk", "table", "measured"
    lock: threading.Lock = field(default_factory=threading.Lock)  # one measurement at a time

    @property
    def open(self) -> bool:
        return self.source is None


_lock = threading.Lock()
_memory: dict[str, AutotuneVerdict] = {}  # committed verdicts, read or measured here
_choices: dict[str, _Choice] = {}
# The call's arguments, as given, to its choice: spares a call the problem key's formatting.
_fast: dict[tuple[Any, ...], _Choice] = {}


def choose(
    candidates: Sequence[NSKernel],
    x: Problem,
    op: str,
    coefficients: CoefficientRows,
    restart_iterations: Sequence[int],
    *,
    now: bool = False,
) -> NSKernel:
    """The kernel that runs ``x``'s problem (see [Note: where a verdict comes from]).

    ``candidates`` are in priority order and all usable on ``x.device``; ``op`` is ``"gram"``
    or ``"direct"``. A single candidate is returned at once. Otherwise the verdict's kernel,
    looked up at the problem's first call, or the provisional kernel where there is none;
    ``now=True`` measures a problem without a verdict first ([Note: measuring only when
    asked]).
    """
    if op not in ("gram", "direct"):
        raise ValueError(f"op must be 'gram' or 'direct', got {op!r}")
    if not candidates:
        raise ValueError("candidates must name at least one kernel (the 'torch' kernel)")
    if len(candidates) == 1:
        return candidates[0]
    choice = _choice(tuple(candidates), x, op, coefficients, restart_iterations)
    if now and choice.open:
        if not (x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _settle(choice)
    return choice.kernel


def tune_pending() -> dict[str, str]:
    """Measure every problem seen so far that has no verdict; returns every problem seen so
    far, described, with the kernel it runs."""
    with _lock:
        choices = list(_choices.values())
    for choice in choices:
        _settle(choice)
    return {_describe(choice.problem): choice.kernel.name for choice in choices}


def failed(
    candidates: Sequence[NSKernel],
    x: Problem,
    op: str,
    coefficients: CoefficientRows,
    restart_iterations: Sequence[int],
    kernel: NSKernel,
    error: Exception,
) -> NSKernel | None:
    """``kernel``, run for ``x``'s problem, raised ``error``, one of its failure types: report
    it and run the provisional kernel for the problem from now on, which is returned (see
    [Note: a verdict's kernel that fails]). ``None`` when ``kernel`` is the provisional one or
    the problem never chose it: the error is then the caller's to raise."""
    if len(candidates) < 2 or isinstance(error, torch.OutOfMemoryError):
        return None
    choice = _choice(tuple(candidates), x, op, coefficients, restart_iterations)
    if kernel is choice.provisional or kernel is not choice.kernel:
        return None
    _measure.report(
        f"dmuon-ns autotune: kernel {kernel.name!r}, the {choice.source} verdict for"
        f" {_describe(choice.problem)}, failed ({type(error).__name__}: {error}); running"
        f" {choice.provisional.name!r} for it in this process"
    )
    choice.kernel = choice.provisional
    choices_changed()
    return choice.provisional


def measure(
    candidates: Sequence[NSKernel],
    x: Problem,
    op: str,
    coefficients: CoefficientRows,
    restart_iterations: Sequence[int],
) -> AutotuneVerdict:
    """Measure ``x``'s problem now, whatever verdict exists, and return the verdict (with
    ``"seconds"``, the time the measurement took); nothing is committed. For the table
    builder, ``benchmarks/ns_tables.py``."""
    problem = _problem(candidates, x, op, coefficients, restart_iterations)
    with torch.no_grad():
        verdict, _, _ = _measured(problem, tuple(candidates))
    return verdict


def verdicts() -> dict[str, AutotuneVerdict]:
    """A copy of the committed verdicts, keyed by the problem key (for status reports)."""
    with _lock:
        return {key: dict(value) for key, value in _memory.items()}


def clear_cache(*, disk: bool = False) -> None:
    """Forget every verdict and choice in memory (and the on-disk file when ``disk``)."""
    with _lock:
        _memory.clear()
        _choices.clear()
        _fast.clear()
    choices_changed()
    if disk:
        _verdict_cache.delete()


def _problem(
    candidates: Sequence[NSKernel],
    x: Problem,
    op: str,
    coefficients: CoefficientRows,
    restart_iterations: Sequence[int],
) -> _Problem:
    """``x``'s problem, keyed (see [Note: what a verdict is]), its coefficients as floats."""
    coeffs = tuple((float(a), float(b), float(c)) for a, b, c in coefficients)
    restarts = tuple(int(i) for i in restart_iterations)
    key = _problem_key(op, x, coeffs, restarts, tuple(k.name for k in candidates))
    return _Problem(key, x.shape, x.dtype, x.device, op, coeffs, restarts)


def _provisional(candidates: Sequence[NSKernel]) -> NSKernel:
    """The kernel that runs a problem without a verdict: torch, else the first candidate."""
    return {kernel.name: kernel for kernel in candidates}.get(_PROVISIONAL, candidates[0])


def _choice(
    candidates: tuple[NSKernel, ...],
    x: Problem,
    op: str,
    coefficients: CoefficientRows,
    restart_iterations: Sequence[int],
) -> _Choice:
    """The problem's choice, made at its first call (see [Note: where a verdict comes
    from])."""
    fast_key: tuple[Any, ...] | None = None
    if isinstance(coefficients, tuple):  # hashable as given
        restarts = tuple(restart_iterations)
        fast_key = (op, tuple(x.shape), x.dtype, x.device, coefficients, restarts, candidates)
        with _lock:
            known = _fast.get(fast_key)
        if known is not None:
            return known
    problem = _problem(candidates, x, op, coefficients, restart_iterations)
    with _lock:
        choice = _choices.get(problem.key)
    if choice is None:
        choice = _first_choice(problem, candidates)
    if fast_key is not None:
        with _lock:
            _fast[fast_key] = choice
    return choice


def _first_choice(problem: _Problem, candidates: tuple[NSKernel, ...]) -> _Choice:
    """The choice of a problem seen for the first time: its verdict's kernel, or the
    provisional one; committed unless another thread committed one first (then that one)."""
    names = tuple(kernel.name for kernel in candidates)
    by_name = {kernel.name: kernel for kernel in candidates}
    provisional = _provisional(candidates)
    verdict, source = _verdict(problem, names, by_name)
    if verdict is None:
        logger.info(
            "dmuon-ns autotune %s: no verdict; %r runs until tune() or tune_pending() measures %s",
            problem.key,
            provisional.name,
            ", ".join(repr(name) for name in names),
        )
    kernel = provisional if verdict is None else by_name[verdict["kernel"]]
    made = _Choice(problem, candidates, provisional, kernel, source)
    with _lock:
        if verdict is not None:
            _memory.setdefault(problem.key, verdict)
        return _choices.setdefault(problem.key, made)


def _verdict(
    problem: _Problem, names: tuple[str, ...], by_name: dict[str, NSKernel]
) -> tuple[AutotuneVerdict | None, str | None]:
    """The problem's verdict, one whose kernel is among the candidates (``by_name``), and its
    source, from the first of memory, the on-disk cache and the device's table that answers
    (see [Note: where a verdict comes from]); ``(None, None)`` when none does."""
    with _lock:
        verdict, source = _memory.get(problem.key), "memory"
    if verdict is None:
        verdict, source = _verdict_cache.read().get(problem.key), "disk"  # I/O outside the lock
    if verdict is None or verdict.get("kernel") not in by_name:
        verdict, source = _table_verdict(problem, names), "table"
    return (verdict, source) if verdict is not None else (None, None)


def _table_verdict(problem: _Problem, names: tuple[str, ...]) -> AutotuneVerdict | None:
    """The shipped table's verdict for the problem, when the device has a table that answers
    for it (``_tables``' note; only measured CUDA cards have one)."""
    if len(problem.shape) != 3:
        return None
    entries = _tables.load(_device_name(problem.device))
    dtype = str(problem.dtype).removeprefix("torch.")
    batch, m, n = (int(s) for s in problem.shape)
    entry = _tables.entry_for(entries, problem.op, batch, m, n, dtype)
    kernel = None if entry is None else _tables.verdict_kernel(entry, names)
    if entry is None or kernel is None:
        return None
    return {
        "kernel": kernel,
        "times_ms": {name: entry.ms[name] for name in names if name in entry.ms},
        "rejected": {name: entry.rejected[name] for name in names if name in entry.rejected},
        "table": f"{problem.op} {entry.batch}x{entry.m}x{entry.n} {entry.dtype}",
    }


def _settle(choice: _Choice) -> None:
    """Measure an open choice and commit its verdict ([Note: measuring only when asked])."""
    with choice.lock:
        if not choice.open:
            return
        with span("dmuon::ns_autotune"), torch.no_grad():
            verdict, best, unmeasured = _measured(choice.problem, choice.candidates)
        key = choice.problem.key
        logger.info(
            "dmuon-ns autotune %s: chose %r (ms %s, rejected %s)",
            key,
            best.name,
            verdict["times_ms"],
            verdict["rejected"],
        )
        with _lock:
            _memory[key] = verdict
        if not unmeasured:  # another process may have the memory to measure them all
            _verdict_cache.write({key: verdict})
        choice.kernel, choice.source = best, "measured"
    choices_changed()


def _measured(
    problem: _Problem, candidates: tuple[NSKernel, ...]
) -> tuple[AutotuneVerdict, NSKernel, bool]:
    """Cross-check and time every candidate on one sample of the problem; the verdict (with
    ``"seconds"``, the time this took), its kernel and whether a candidate could not be
    measured (no memory)."""
    start = time.perf_counter()
    provisional = _provisional(candidates)
    times: dict[str, float] = {}
    provisional_ms: list[float] = []
    ratios: dict[str, float] = {}
    errors: dict[str, float | None] = {}
    rejected: dict[str, str] = {}
    others = [kernel for kernel in candidates if kernel is not provisional]
    try:
        sample = _measure.sample(problem, problem.op, problem.coefficients, problem.restarts)
        base_error = sample.error(sample.run(provisional))
        torch_error = base_error if provisional.name == "torch" else sample.torch_error()
        errors[provisional.name] = base_error if math.isfinite(base_error) else None
        unmeasured = False
    except torch.OutOfMemoryError as err:  # the sample and its reference
        for kernel in others:
            _no_memory(problem, kernel, err, rejected)
        others, unmeasured = [], True  # no sample to measure them on
    for kernel in others:
        try:
            ms = _cross_check_and_time(sample, kernel, provisional, torch_error, errors, rejected)
        except torch.OutOfMemoryError as err:
            _no_memory(problem, kernel, err, rejected)
            unmeasured = True
            continue
        if ms is not None:
            times[kernel.name], base_ms = ms
            provisional_ms.append(base_ms)
            ratios[kernel.name] = times[kernel.name] / max(base_ms, 1e-9)
    if provisional.name == _PROVISIONAL:
        ratios[_PROVISIONAL] = 1.0  # the bar itself: sound by definition
    if provisional_ms and provisional.name not in times:
        times[provisional.name] = statistics.median(provisional_ms)
    best = _fastest(candidates, ratios)
    verdict: AutotuneVerdict = {
        "kernel": best.name,
        "times_ms": {name: round(ms, 5) for name, ms in times.items()},
        "ratios": {name: round(ratio, 4) for name, ratio in ratios.items()},
        "errors": errors,
        "rejected": rejected,
        "seconds": round(time.perf_counter() - start, 3),
    }
    return verdict, best, unmeasured


def _fastest(candidates: tuple[NSKernel, ...], ratios: dict[str, float]) -> NSKernel:
    """The candidate of least time relative to torch's (ties: the earlier in priority order).
    Where nothing passed (a provisional kernel other than torch failed too), the first
    candidate by priority, which the dispatcher lists as the most trusted."""
    passed = [kernel for kernel in candidates if kernel.name in ratios]
    return min(passed, key=lambda kernel: ratios[kernel.name]) if passed else candidates[0]


def _cross_check_and_time(
    sample: _measure.Sample,
    kernel: NSKernel,
    base: NSKernel,
    torch_error: float,
    errors: dict[str, float | None],
    rejected: dict[str, str],
) -> tuple[float, float] | None:
    """Run ``kernel`` on the sample, cross-check it and, when it passes, time it against
    ``base``: (kernel ms, base ms), or ``None`` with the reason in ``rejected``."""
    try:
        out = sample.run(kernel)
    except torch.OutOfMemoryError:
        raise  # no verdict on the kernel: the caller leaves it out here
    except _measure.failure_types(kernel) as err:
        rejected[kernel.name] = f"raised {type(err).__name__}: {err}"
        _measure.report(
            f"dmuon-ns autotune: kernel {kernel.name!r} failed on"
            f" {sample.op} {'x'.join(str(s) for s in sample.input.shape)}"
            f" ({rejected[kernel.name]}); it is not used for this problem"
        )
        return None
    error = sample.error(out)
    del out
    errors[kernel.name] = error if math.isfinite(error) else None
    rejection = sample.rejection(error, torch_error)
    if rejection is not None:
        rejected[kernel.name] = rejection
        return None
    return _measure.compare_ms(
        functools.partial(sample.run, kernel),
        functools.partial(sample.run, base),
        sample.input.device,
        _TIMING_S,
    )


def _no_memory(
    problem: _Problem, kernel: NSKernel, err: Exception, rejected: dict[str, str]
) -> None:
    """Running out of memory is no verdict on ``kernel``: it is left out here, and the
    verdict stays in this process."""
    rejected[kernel.name] = f"not measured: out of memory ({err})"
    _measure.report(
        f"dmuon-ns autotune: no memory left to measure {kernel.name!r} on"
        f" {_describe(problem)}; it is not used for this problem in this process"
    )


def _problem_key(
    op: str,
    x: Problem,
    coeffs: Coefficients,
    restarts: tuple[int, ...],
    candidates: tuple[str, ...],
) -> str:
    device = _device_name(x.device)
    shape = "x".join(str(s) for s in x.shape)
    dtype = str(x.dtype).removeprefix("torch.")
    # The candidate set is part of the problem: a verdict reached without a kernel that is
    # installed now never compared it (an H200 run reused "triton" for a shape where the
    # newly installed quack kernel was 4% faster).
    return (
        f"{op}|{shape}|{dtype}|{device}|{coeffs!r}|{restarts!r}|{','.join(sorted(candidates))}"
        f"|torch={torch.__version__}|dmuon_ns={_package_version()}"
    )


def _describe(problem: _Problem) -> str:
    return problem_name(problem.op, problem.shape, problem.dtype)


@functools.cache
def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


@functools.cache
def _package_version() -> str:
    # Cached: the problem key is built at every problem's first call, and a metadata lookup
    # scans sys.path.
    try:
        return importlib.metadata.version("dmuon-ns")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
