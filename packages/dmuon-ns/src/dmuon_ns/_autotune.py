"""Per-shape kernel choice for ``kernel="auto"``: cross-check, time, remember.

[Note: what a verdict is]
A verdict answers "which kernel is fastest *and* numerically sound for this problem" where the
problem is (op, shape, dtype, device name, coefficients, restart iterations, the candidate
kernels) plus the versions of torch and of this package (a new build may change the answer). The verdict never depends on
the caller's data: candidates run on a fresh random input of the same shape and dtype, so an
all-zero or degenerate first gradient cannot fool the cross-check or the clock.

[Note: the numerical cross-check]
Every candidate's output is compared with a float64 evaluation of the same polynomial
iteration. The plain-torch kernel sets the bar: a candidate whose relative Frobenius error
(worst over the batch) exceeds ``_ERROR_FACTOR`` times torch's, or whose output is not finite,
is rejected, whatever its speed. The float64 reference uses the direct form; in exact
arithmetic the Gram form (with any restarts) computes the same matrix, so one reference serves
both ops.

[Note: the on-disk cache]
Verdicts live in one JSON file, ``verdicts.json``, in one directory: ``~/.cache/dmuon/
ns-autotune`` unless ``DMUON_NS_CACHE_DIR`` names another (``_environment``).
Writes go to a temporary file that is renamed over the old one, so concurrent ranks never
leave a torn file; the last writer wins, which only costs a re-tune elsewhere. An unreadable
or unwritable cache degrades to the in-memory one with a single warning.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import logging
import math
import os
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dmuon_ns._environment import CACHE_DIR_ENV, cache_dir_override
from dmuon_ns._registry import NSKernel, Problem

__all__ = [
    "CACHE_DIR_ENV",
    "AutotuneVerdict",
    "cache_dir",
    "choose",
    "clear_cache",
    "verdicts",
]

logger = logging.getLogger(__name__)

_CACHE_FILE = "verdicts.json"
_FORMAT_VERSION = 1
# A candidate may be at most this many times less accurate than plain torch.
_ERROR_FACTOR = 2.0
# Floor for the accepted error so that an (unlikely) exact torch result does not reject
# candidates that differ from it only by rounding.
_ERROR_FLOOR = 1e-6
# Timing budget per candidate: enough repetitions for a stable median, bounded in time.
_MIN_REPS = 3
_MAX_REPS = 25
_TARGET_SECONDS = 0.2
_SEED = 20_241_129
# What a registered kernel without ``failure_types`` may raise to say it cannot run a problem.
_DEFAULT_FAILURES: tuple[type[Exception], ...] = (RuntimeError, ValueError, NotImplementedError)


AutotuneVerdict = dict[str, Any]
"""JSON-friendly record: ``kernel`` (the choice), ``times_ms``, ``errors`` and ``rejected``
(name -> reason) for every candidate that was tried."""

_lock = threading.Lock()
_memory: dict[str, AutotuneVerdict] = {}
_disk_warned = False


def cache_dir() -> Path:
    """The one directory holding autotune verdicts (``DMUON_NS_CACHE_DIR`` overrides)."""
    override = cache_dir_override()
    if override is not None:
        return override
    return Path.home() / ".cache" / "dmuon" / "ns-autotune"


def clear_cache(*, disk: bool = False) -> None:
    """Forget every in-memory verdict (and the on-disk file when ``disk=True``)."""
    with _lock:
        _memory.clear()
        if disk:
            try:
                (cache_dir() / _CACHE_FILE).unlink(missing_ok=True)
            except OSError as err:
                _warn_disk_once(f"could not delete the autotune cache: {err}")


def verdicts() -> dict[str, AutotuneVerdict]:
    """A copy of the in-memory verdicts, keyed by the problem key (for status reports)."""
    with _lock:
        return {key: dict(value) for key, value in _memory.items()}


def choose(
    candidates: Sequence[NSKernel],
    x: Problem,
    op: str,
    coefficients: Sequence[tuple[float, float, float]],
    restart_iterations: Sequence[int],
) -> Any:
    """Return the fastest candidate that passes the cross-check for ``x``'s problem.

    ``candidates`` are in priority order and all usable on ``x.device``; ``op`` is ``"gram"``
    or ``"direct"``. A single candidate is returned without tuning. The first call per problem
    key runs and times every candidate (see the module notes); later calls are a dictionary
    lookup.
    """
    if op not in ("gram", "direct"):
        raise ValueError(f"op must be 'gram' or 'direct', got {op!r}")
    if not candidates:
        raise ValueError("candidates must name at least one kernel (the 'torch' kernel)")
    if len(candidates) == 1:
        return candidates[0]
    if x.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # Inside someone else's capture nothing may synchronise: take the priority choice.
        return candidates[0]
    coeffs = tuple((float(a), float(b), float(c)) for a, b, c in coefficients)
    restarts = tuple(int(i) for i in restart_iterations)
    key = _problem_key(op, x, coeffs, restarts, tuple(kernel.name for kernel in candidates))
    by_name = {kernel.name: kernel for kernel in candidates}

    with _lock:
        cached = _memory.get(key)
        if cached is None:
            cached = _read_disk().get(key)
            if cached is not None:
                _memory[key] = cached
    if cached is not None and cached.get("kernel") in by_name:
        return by_name[cached["kernel"]]

    with torch.profiler.record_function("dmuon::ns_autotune"):
        verdict = _tune(candidates, x, op, coeffs, restarts)
    logger.info(
        "dmuon-ns autotune %s: chose %r (times ms %s, rejected %s)",
        key,
        verdict["kernel"],
        verdict["times_ms"],
        verdict["rejected"],
    )
    with _lock:
        _memory[key] = verdict
        _write_disk(key, verdict)
    return by_name[verdict["kernel"]]


def _problem_key(
    op: str,
    x: Problem,
    coeffs: tuple[tuple[float, float, float], ...],
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


def _tune(
    candidates: Sequence[NSKernel],
    x: Problem,
    op: str,
    coeffs: tuple[tuple[float, float, float], ...],
    restarts: tuple[int, ...],
) -> AutotuneVerdict:
    with torch.no_grad():
        sample = _random_input(x)
        reference = _reference(sample, coeffs)

        def run(kernel: NSKernel) -> Tensor:
            if op == "gram":
                return kernel.gram(sample, coeffs, restarts)
            return kernel.direct(sample, coeffs)

        errors: dict[str, float] = {}
        rejected: dict[str, str] = {}
        for kernel in candidates:
            try:
                out = run(kernel)
            except _failure_types(kernel) as exc:  # see [Note: a kernel that fails]
                rejected[kernel.name] = f"raised {type(exc).__name__}: {exc}"
                _report(
                    f"dmuon-ns autotune: kernel {kernel.name!r} failed on {x.dtype}"
                    f" {tuple(x.shape)} ({rejected[kernel.name]}); it is not used for this"
                    " problem"
                )
                continue
            errors[kernel.name] = _relative_error(out, reference, sample.shape)

        torch_error = errors.get("torch")
        if torch_error is None or not math.isfinite(torch_error):
            torch_error = _torch_error(sample, op, coeffs, restarts, reference)
        bound = max(_ERROR_FACTOR * torch_error, _ERROR_FLOOR)
        for name, error in errors.items():
            if name == "torch":
                continue
            if not math.isfinite(error):
                rejected[name] = "non-finite output"
            elif error > bound:
                rejected[name] = (
                    f"error {error:.3g} > {_ERROR_FACTOR:g} x torch's {torch_error:.3g}"
                )

        times: dict[str, float] = {}
        for kernel in candidates:
            if kernel.name in rejected or kernel.name not in errors:
                continue
            times[kernel.name] = _median_ms(_as_run(functools.partial(run, kernel), sample.device))

    if not times:
        # Nothing survived (even torch failed): fall back to the first candidate by priority,
        # which the dispatcher lists as the most trusted.
        choice = candidates[0].name
    else:
        choice = min(times, key=lambda name: times[name])
    return {
        "kernel": choice,
        "times_ms": {k: round(v, 5) for k, v in times.items()},
        "errors": {k: (v if math.isfinite(v) else None) for k, v in errors.items()},
        "rejected": rejected,
    }


def _failure_types(kernel: NSKernel) -> tuple[type[Exception], ...]:
    """The exceptions by which ``kernel`` says it cannot run a problem.

    [Note: a kernel that fails]
    A candidate that fails during tuning (a compile error, an out-of-resources launch, a shape
    its library rejects) is rejected for that problem, and the failure is reported through
    ``logging`` and ``warnings`` with its reason: ``auto`` keeps running on the others. Which
    exceptions mean "cannot run" is the kernel's to say (``LoopKernel.failure_types``: Triton's
    and CuTe DSL's error types besides ``RuntimeError`` and ``ValueError``); a registered
    kernel that says nothing gets ``_DEFAULT_FAILURES``. Anything else is a bug and propagates.
    """
    failure_types = getattr(kernel, "failure_types", None)
    return failure_types() if callable(failure_types) else _DEFAULT_FAILURES


def _report(message: str) -> None:
    """A deliberate degradation, made visible in logs and to the user."""
    logger.warning("%s", message)
    warnings.warn(message, RuntimeWarning, stacklevel=2)


def _random_input(x: Problem) -> Tensor:
    """A fresh normalised Gaussian input with ``x``'s shape, dtype and device."""
    generator = torch.Generator(device=x.device).manual_seed(_SEED)
    sample = torch.randn(x.shape, generator=generator, device=x.device, dtype=torch.float32)
    norms = torch.linalg.matrix_norm(sample, keepdim=True).clamp_min(1e-12)
    return (sample / norms).to(x.dtype).contiguous()


def _reference(sample: Tensor, coeffs: tuple[tuple[float, float, float], ...]) -> Tensor:
    """Direct-form NS in float64 (equal to the Gram form in exact arithmetic)."""
    x = sample.to(torch.float64)
    for a, b, c in coeffs:
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x


def _relative_error(out: Tensor, reference: Tensor, shape: torch.Size) -> float:
    if out.shape != shape:
        return math.inf
    diff = torch.linalg.matrix_norm(out.to(torch.float64) - reference)
    scale = torch.linalg.matrix_norm(reference).clamp_min(1e-30)
    worst = (diff / scale).max()
    value = float(worst)
    return value if math.isfinite(value) else math.inf


def _torch_error(
    sample: Tensor,
    op: str,
    coeffs: tuple[tuple[float, float, float], ...],
    restarts: tuple[int, ...],
    reference: Tensor,
) -> float:
    """Error of the plain-torch kernel when it is not among the candidates."""
    from dmuon_ns._torch_kernel import TORCH_KERNEL as kernel

    out = kernel.gram(sample, coeffs, restarts) if op == "gram" else kernel.direct(sample, coeffs)
    return _relative_error(out, reference, sample.shape)


def _as_run(fn: Callable[[], object], device: torch.device) -> tuple[Callable[[], object], str]:
    """How the candidate will really run: replayed from a CUDA graph where it can be captured.

    [Note: timing as it runs]
    The dispatcher replays kernels from CUDA graphs by default, so launch overhead, which
    dominates small problems and differs a lot between backends (Python-side launch work of
    Triton and CuTe DSL against cuBLAS), must not decide the choice. Each candidate is
    captured after its warm-up and its replays are timed; one that cannot be captured is
    timed eagerly, as it would then run.
    """
    if device.type != "cuda":
        return fn, device.type
    fn()  # warm-up outside capture: compilation, library autotuning, allocator growth
    torch.cuda.synchronize(device)
    try:
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as err:  # how CUDA reports a capture it cannot make
        _report(
            f"dmuon-ns autotune: CUDA-graph capture failed ({type(err).__name__}: {err});"
            " timing this candidate eagerly, as it would then run"
        )
        return fn, "cuda"
    return graph.replay, "cuda"


def _median_ms(runnable: tuple[Callable[[], object], str]) -> float:
    fn, device_type = runnable
    fn()  # warm-up: compilation and allocator growth stay out of the numbers
    if device_type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        first = start.elapsed_time(end)
    else:
        t0 = time.perf_counter()
        fn()
        first = (time.perf_counter() - t0) * 1e3
    reps = int(min(_MAX_REPS, max(_MIN_REPS, _TARGET_SECONDS * 1e3 / max(first, 1e-3))))
    samples: list[float] = []
    for _ in range(reps):
        if device_type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _warn_disk_once(message: str) -> None:
    global _disk_warned
    if not _disk_warned:
        _disk_warned = True
        logger.warning("dmuon-ns autotune: %s; verdicts are kept in memory only", message)


def _read_disk() -> dict[str, AutotuneVerdict]:
    path = cache_dir() / _CACHE_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as err:
        _warn_disk_once(f"could not read {path}: {err}")
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        _warn_disk_once(f"ignoring corrupt {path}: {err}")
        return {}
    if not isinstance(data, dict) or data.get("format") != _FORMAT_VERSION:
        return {}
    entries = data.get("verdicts")
    return entries if isinstance(entries, dict) else {}


def _write_disk(key: str, verdict: AutotuneVerdict) -> None:
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        entries = _read_disk()
        entries[key] = verdict
        payload = json.dumps({"format": _FORMAT_VERSION, "verdicts": entries}, indent=1)
        fd, tmp = tempfile.mkstemp(prefix=".verdicts.", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(payload)
            os.replace(tmp, directory / _CACHE_FILE)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as err:
        _warn_disk_once(f"could not write {directory / _CACHE_FILE}: {err}")
