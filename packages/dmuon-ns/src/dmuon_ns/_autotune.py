"""Per-shape kernel choice for ``kernel="auto"``: an immediate choice, measurements spread over
later calls, verdicts kept per machine.

[Note: what a verdict is]
A verdict answers "which kernel is fastest *and* numerically sound for this problem" where the
problem is (op, shape, dtype, device name, coefficients, restart iterations, the candidate
kernels) plus the versions of torch and of this package (a new build may change the answer).
How a candidate is measured is ``_measure``'s; where verdicts are kept is
``_verdict_cache``'s.

[Note: cold start]
Measuring is expensive the first time round: each accelerated kernel compiles for the shape
(Triton tunes its tiles, CuTe DSL compiles its products) and the cross-check runs a float64
iteration. Done before a problem's first call returned, it took 30-40 s per shape on an H200
(142 s at 8192×28672) and made a first training step 11-14 s. So measuring never happens
inside a first call:

1. The first call of a problem in a process runs the *provisional* kernel: torch (cuBLAS,
   nothing to compile; and the bar every other kernel is held to). Nothing is measured or
   compiled. (Off CUDA, torch is the only candidate and nothing here runs at all.)
2. No unit starts in the first ``_QUIET_START_S`` seconds after the process first opened a
   choice: the first training steps, which also pay FSDP2's lazy initialisation, CUDA's and
   Triton's start-up and the compiles of the optimizer's own kernels, run the provisional
   kernel and nothing else. Without this, a problem whose matrices are split over several
   batches made its second call, and so a unit, within the first step, and a unit that
   compiles (CuTe DSL, Triton's tile candidates) lasts as long as the compile: first steps of
   18-40 s against a warm 0.1-0.25 s on an H200. The compiles still happen, in the units of
   later steps, each step paying at most one.
3. After that, each later call of a problem whose choice is still open may do one *unit* of
   work: one candidate run (compiled) on a sample, cross-checked against float64 and, when
   it passes, timed against the provisional kernel, interleaved, for about
   ``_UNIT_TIMING_S``; or, for a verdict read from disk, one run of its kernel, which
   compiles it in this process before it replaces the provisional one. Units never overlap, and together they take at most
   ``_TUNING_SHARE`` of the wall time: after a unit of d seconds the next waits
   d·(1 − share)/share. A training step with several new shapes therefore pays one unit, not
   one per shape; a unit that compiles lasts as long as the compile, once per kernel and
   shape.
4. After the last candidate's unit the verdict is committed (memory, then disk) and the
   fastest sound kernel runs from then on. Candidates are ranked by their time relative
   to the provisional kernel's in the same unit, so clocks that drift between units do not
   decide.
5. Callers that rather pay at once can: ``NewtonSchulz.tune(g)`` settles the problems of
   given tensors before their first call (``choose(now=True)``), and ``dmuon_ns.tune_pending()``
   settles every problem seen so far, e.g. after a training loop's first step
   (``tune_pending``). Benchmarks do one or the other before they time.

A choice changes results only within the cross-check: the provisional kernel is the bar
itself, and a verdict's kernel passed the cross-check on this problem. Inside another
caller's CUDA-graph capture no unit runs (nothing may synchronise there): the call takes the
current choice.
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

from dmuon_ns import _measure, _verdict_cache
from dmuon_ns._coefficients import CoefficientRows
from dmuon_ns._registry import NSKernel, Problem
from dmuon_ns._verdict_cache import AutotuneVerdict

__all__ = ["AutotuneVerdict", "choose", "clear_cache", "tune_pending", "verdicts"]

logger = logging.getLogger(__name__)

# The most of the wall time that spread-out tuning units may take (see [Note: cold start]).
_TUNING_SHARE = 0.1
# How long after the process first opened a choice the first unit may start (step 2 of
# [Note: cold start]).
_QUIET_START_S = 30.0
# Timing budget of one unit: the candidate and the provisional kernel, interleaved.
_UNIT_TIMING_S = 0.1
# The kernel that runs while a problem's choice is open (see [Note: cold start]).
_PROVISIONAL = "torch"

Coefficients = tuple[tuple[float, float, float], ...]


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
    """One problem's kernel: the one calls run now, and the units left before it is final."""

    problem: _Problem
    candidates: tuple[NSKernel, ...]
    provisional: NSKernel
    kernel: NSKernel  # what calls run now
    to_measure: list[NSKernel]
    to_warm: NSKernel | None = None  # a verdict's kernel to run once before it is used
    times_ms: dict[str, float] = field(default_factory=dict)
    provisional_ms: list[float] = field(default_factory=list)
    ratios: dict[str, float] = field(default_factory=dict)
    errors: dict[str, float | None] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    unmeasured: bool = False  # a candidate could not be measured here: keep the verdict local
    lock: threading.Lock = field(default_factory=threading.Lock)  # one unit at a time

    @property
    def open(self) -> bool:
        return bool(self.to_measure) or self.to_warm is not None


_lock = threading.Lock()
_memory: dict[str, AutotuneVerdict] = {}  # committed verdicts, read from disk or measured here
_choices: dict[str, _Choice] = {}
# _clock() time before which no spread-out unit starts; None until a choice is first opened.
_next_unit_at: float | None = None
_clock = time.monotonic


def choose(
    candidates: Sequence[NSKernel],
    x: Problem,
    op: str,
    coefficients: CoefficientRows,
    restart_iterations: Sequence[int],
    *,
    now: bool = False,
) -> Any:
    """The kernel to run ``x``'s problem now (see [Note: cold start]).

    ``candidates`` are in priority order and all usable on ``x.device``; ``op`` is ``"gram"``
    or ``"direct"``. A single candidate is returned at once. Otherwise the first call runs the
    provisional kernel, later calls may each do one unit of measurement, and once the verdict
    is in, every call returns its kernel (a dictionary lookup). ``now=True`` does every unit
    left at once and returns the verdict's kernel.
    """
    if op not in ("gram", "direct"):
        raise ValueError(f"op must be 'gram' or 'direct', got {op!r}")
    if not candidates:
        raise ValueError("candidates must name at least one kernel (the 'torch' kernel)")
    if len(candidates) == 1:
        return candidates[0]
    choice, first = _choice(tuple(candidates), x, op, coefficients, restart_iterations)
    if now:
        _finish(choice)
    elif choice.open and not first:
        # Inside another caller's CUDA-graph capture nothing may synchronise: no unit.
        if not (x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _spread_unit(choice)
    return choice.kernel


def tune_pending() -> dict[str, str]:
    """Finish every choice still open (measure what is left, warm cached verdicts' kernels)
    now; returns every problem seen so far, described, with the kernel it runs."""
    with _lock:
        choices = list(_choices.values())
    for choice in choices:
        _finish(choice)
    return {_describe(choice.problem): choice.kernel.name for choice in choices}


def verdicts() -> dict[str, AutotuneVerdict]:
    """A copy of the committed verdicts, keyed by the problem key (for status reports)."""
    with _lock:
        return {key: dict(value) for key, value in _memory.items()}


def clear_cache(*, disk: bool = False) -> None:
    """Forget every verdict and open choice in memory (and the on-disk file when ``disk``)."""
    global _next_unit_at
    with _lock:
        _memory.clear()
        _choices.clear()
        _next_unit_at = None
    if disk:
        _verdict_cache.delete()


def _choice(
    candidates: tuple[NSKernel, ...],
    x: Problem,
    op: str,
    coefficients: CoefficientRows,
    restart_iterations: Sequence[int],
) -> tuple[_Choice, bool]:
    """The problem's choice, made on its first call (then ``True``) from a committed verdict
    or as a measurement plan."""
    coeffs = tuple((float(a), float(b), float(c)) for a, b, c in coefficients)
    restarts = tuple(int(i) for i in restart_iterations)
    names = tuple(kernel.name for kernel in candidates)
    key = _problem_key(op, x, coeffs, restarts, names)
    with _lock:
        existing = _choices.get(key)
        verdict = _memory.get(key)
    if existing is not None:
        return existing, False
    if verdict is None:
        verdict = _verdict_cache.read().get(key)  # file I/O outside the lock
    problem = _Problem(key, x.shape, x.dtype, x.device, op, coeffs, restarts)
    by_name = {kernel.name: kernel for kernel in candidates}
    provisional = by_name.get(_PROVISIONAL, candidates[0])
    choice = _Choice(problem, candidates, provisional, provisional, to_measure=[])
    if verdict is not None and verdict.get("kernel") in by_name:
        chosen = by_name[verdict["kernel"]]
        if chosen is not provisional:
            choice.to_warm = chosen
    else:
        verdict = None
        choice.to_measure = [k for k in candidates if k.name != _PROVISIONAL]
        logger.info(
            "dmuon-ns autotune %s: %r runs while %s are measured over the next calls",
            key,
            provisional.name,
            ", ".join(repr(k.name) for k in choice.to_measure),
        )
    global _next_unit_at
    with _lock:
        if verdict is not None:
            _memory[key] = verdict
        kept = _choices.setdefault(key, choice)  # another thread may have been first
        if kept.open and _next_unit_at is None:
            _next_unit_at = _clock() + _QUIET_START_S
    return kept, kept is choice


def _finish(choice: _Choice) -> None:
    while choice.open:
        with choice.lock:
            _unit(choice)


def _spread_unit(choice: _Choice) -> None:
    """One unit of ``choice``'s work, when the tuning share allows one now and no other unit
    is running (see [Note: cold start])."""
    global _next_unit_at
    with _lock:
        if _next_unit_at is None or _clock() < _next_unit_at:
            return
        _next_unit_at = math.inf  # claimed: no other unit starts until this one ends
    start, ran = _clock(), False
    try:
        if choice.lock.acquire(blocking=False):
            try:
                ran = _unit(choice)
            finally:
                choice.lock.release()
    finally:
        elapsed = _clock() - start if ran else 0.0
        with _lock:
            _next_unit_at = _clock() + elapsed * (1 - _TUNING_SHARE) / _TUNING_SHARE


def _unit(choice: _Choice) -> bool:
    """The next unit of ``choice`` (its lock held); ``False`` when none was left."""
    with torch.profiler.record_function("dmuon::ns_autotune"), torch.no_grad():
        if choice.to_warm is not None:
            kernel, choice.to_warm = choice.to_warm, None
            _warm(choice, kernel)
            return True
        if not choice.to_measure:
            return False
        _measure_one(choice, choice.to_measure.pop(0))
        if not choice.to_measure:
            _commit(choice)
        return True


def _warm(choice: _Choice, kernel: NSKernel) -> None:
    """Run a committed verdict's kernel once, so that its compile happens here, not in a
    caller's call; then it replaces the provisional kernel."""
    problem = choice.problem
    failures: tuple[type[Exception], ...] = (
        torch.OutOfMemoryError,
        *_measure.failure_types(kernel),
    )
    try:
        sample = _measure.sample(problem, problem.op, problem.coefficients, problem.restarts)
        sample.run(kernel)
        if problem.device.type == "cuda":
            torch.cuda.synchronize(problem.device)
    except failures as err:
        _measure.report(
            f"dmuon-ns autotune: kernel {kernel.name!r}, the cached verdict for"
            f" {_describe(problem)}, failed ({type(err).__name__}: {err}); running"
            f" {choice.provisional.name!r} for it in this process"
        )
        return
    choice.kernel = kernel


def _measure_one(choice: _Choice, kernel: NSKernel) -> None:
    """Cross-check ``kernel`` on a sample and, if it passes, time it against the provisional
    kernel (``_measure``'s notes). Running out of memory is no verdict on the kernel: the
    candidate is left out here, and the verdict stays in this process (see ``_commit``)."""
    try:
        _cross_check_and_time(choice, kernel)
    except torch.OutOfMemoryError as err:  # the float64 reference needs ~4x the input
        choice.rejected[kernel.name] = f"not measured: out of memory ({err})"
        choice.unmeasured = True
        _measure.report(
            f"dmuon-ns autotune: no memory left to measure {kernel.name!r} on"
            f" {_describe(choice.problem)}; it is not used for this problem in this process"
        )


def _cross_check_and_time(choice: _Choice, kernel: NSKernel) -> None:
    problem, base = choice.problem, choice.provisional
    sample = _measure.sample(problem, problem.op, problem.coefficients, problem.restarts)
    base_error = sample.error(sample.run(base))
    torch_error = base_error if base.name == "torch" else sample.torch_error()
    choice.errors[base.name] = base_error if math.isfinite(base_error) else None
    try:
        out = sample.run(kernel)
    except torch.OutOfMemoryError:
        raise  # no verdict on the kernel: see _measure_one
    except _measure.failure_types(kernel) as err:
        choice.rejected[kernel.name] = f"raised {type(err).__name__}: {err}"
        _measure.report(
            f"dmuon-ns autotune: kernel {kernel.name!r} failed on {_describe(problem)}"
            f" ({choice.rejected[kernel.name]}); it is not used for this problem"
        )
        return
    error = sample.error(out)
    choice.errors[kernel.name] = error if math.isfinite(error) else None
    rejection = sample.rejection(error, torch_error)
    if rejection is not None:
        choice.rejected[kernel.name] = rejection
        return
    kernel_ms, base_ms = _measure.compare_ms(
        functools.partial(sample.run, kernel),
        functools.partial(sample.run, base),
        problem.device,
        _UNIT_TIMING_S,
    )
    choice.times_ms[kernel.name] = kernel_ms
    choice.provisional_ms.append(base_ms)
    choice.ratios[kernel.name] = kernel_ms / max(base_ms, 1e-9)


def _commit(choice: _Choice) -> None:
    """The fastest sound candidate by its time relative to the provisional kernel (ties go
    to the earlier in priority order); remembered in memory and on disk."""
    ratios = dict(choice.ratios)
    if choice.provisional.name == _PROVISIONAL:
        ratios[_PROVISIONAL] = 1.0  # the bar itself: sound by definition
    best: NSKernel | None = None
    for kernel in choice.candidates:
        if kernel.name in ratios and (best is None or ratios[kernel.name] < ratios[best.name]):
            best = kernel
    if best is None:
        # Nothing passed (a provisional kernel other than torch failed too): the first
        # candidate by priority, which the dispatcher lists as the most trusted.
        best = choice.candidates[0]
    times = dict(choice.times_ms)
    if choice.provisional_ms and choice.provisional.name not in times:
        times[choice.provisional.name] = statistics.median(choice.provisional_ms)
    verdict: AutotuneVerdict = {
        "kernel": best.name,
        "times_ms": {name: round(ms, 5) for name, ms in times.items()},
        "ratios": {name: round(ratio, 4) for name, ratio in ratios.items()},
        "errors": choice.errors,
        "rejected": choice.rejected,
    }
    key = choice.problem.key
    logger.info(
        "dmuon-ns autotune %s: chose %r (ms %s, rejected %s)",
        key,
        best.name,
        verdict["times_ms"],
        choice.rejected,
    )
    with _lock:
        _memory[key] = verdict
    if not choice.unmeasured:  # another process may have the memory to measure them all
        _verdict_cache.write({key: verdict})
    choice.kernel = best


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
    dtype = str(problem.dtype).removeprefix("torch.")
    return f"{problem.op} {'x'.join(str(s) for s in problem.shape)} {dtype}"


@functools.cache
def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


@functools.cache
def _package_version() -> str:
    # Cached: the problem key is built on every NS call, and a metadata lookup scans sys.path.
    try:
        return importlib.metadata.version("dmuon-ns")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
