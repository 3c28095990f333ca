"""How the autotuner measures one candidate kernel on one problem: accuracy, then speed.

[Note: the numerical cross-check]
A candidate's output on a sample input is compared with a float64 evaluation of the same
polynomial iteration. The plain-torch kernel sets the bar on the same sample: a candidate whose
relative Frobenius error (worst over the batch) exceeds ``ERROR_FACTOR`` times torch's, or
whose output is not finite or not of the input's shape, is rejected, whatever its speed. The
float64 reference uses the direct form; in exact arithmetic the Gram form (with any restarts)
computes the same matrix, so one reference serves both ops.

The sample never depends on the caller's data: it is a fresh random input of the problem's
shape and dtype (a fixed seed), so an all-zero or degenerate first gradient cannot fool the
cross-check or the clock.

[Note: a kernel that fails]
A candidate that fails while measured (a compile error, an out-of-resources launch, a shape its
library rejects) is rejected for that problem, and the failure is reported through ``logging``
and ``warnings`` with its reason: ``auto`` keeps running on the others. Which exceptions mean
"cannot run" is the kernel's to say (``LoopKernel.failure_types``: Triton's and CuTe DSL's
error types besides ``RuntimeError`` and ``ValueError``); a registered kernel that says nothing
gets ``DEFAULT_FAILURES``. Anything else is a bug and propagates.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from dmuon_ns._registry import NSKernel, Problem

__all__ = [
    "DEFAULT_FAILURES",
    "ERROR_FACTOR",
    "Sample",
    "compare_ms",
    "failure_types",
    "report",
    "sample",
]

logger = logging.getLogger(__name__)

# A candidate may be at most this many times less accurate than plain torch.
ERROR_FACTOR = 2.0
# Floor for the accepted error so that an (unlikely) exact torch result does not reject
# candidates that differ from it only by rounding.
_ERROR_FLOOR = 1e-6
# Repetitions of one timing: enough for a stable median, bounded by the caller's budget.
_MIN_REPS = 3
_MAX_REPS = 25
_SEED = 20_241_129
# What a registered kernel without ``failure_types`` may raise to say it cannot run a problem.
DEFAULT_FAILURES: tuple[type[Exception], ...] = (RuntimeError, ValueError, NotImplementedError)

Coefficients = tuple[tuple[float, float, float], ...]


class Sample(NamedTuple):
    """A sample input of one problem, its float64 result, and how to run a kernel on it."""

    input: Tensor
    reference: Tensor
    op: str
    coefficients: Coefficients
    restarts: tuple[int, ...]

    def run(self, kernel: NSKernel) -> Tensor:
        if self.op == "gram":
            return kernel.gram(self.input, self.coefficients, self.restarts)
        return kernel.direct(self.input, self.coefficients)

    def error(self, out: Tensor) -> float:
        """The relative error of ``out`` (inf when not finite or not of the input's shape)."""
        if out.shape != self.input.shape:
            return math.inf
        diff = torch.linalg.matrix_norm(out.to(torch.float64) - self.reference)
        scale = torch.linalg.matrix_norm(self.reference).clamp_min(1e-30)
        value = float((diff / scale).max())
        return value if math.isfinite(value) else math.inf

    def torch_error(self) -> float:
        """The bar's base: the plain-torch kernel's error on this sample."""
        from dmuon_ns._torch_kernel import TORCH_KERNEL

        return self.error(self.run(TORCH_KERNEL))

    def rejection(self, error: float, torch_error: float) -> str | None:
        """Why a candidate with ``error`` fails the cross-check (``None``: it passes)."""
        if not math.isfinite(error):
            return "non-finite output"
        if error > max(ERROR_FACTOR * torch_error, _ERROR_FLOOR):
            return f"error {error:.3g} > {ERROR_FACTOR:g} x torch's {torch_error:.3g}"
        return None


def sample(
    problem: Problem, op: str, coefficients: Coefficients, restarts: tuple[int, ...]
) -> Sample:
    """A fresh normalised Gaussian input of ``problem``'s shape, dtype and device, and its
    float64 NS (direct form: equal to the Gram form in exact arithmetic)."""
    generator = torch.Generator(device=problem.device).manual_seed(_SEED)
    x = torch.randn(problem.shape, generator=generator, device=problem.device)
    x = (x / torch.linalg.matrix_norm(x, keepdim=True).clamp_min(1e-12)).to(problem.dtype)
    x = x.contiguous()
    reference = x.to(torch.float64)
    for a, b, c in coefficients:
        gram = reference @ reference.mT
        reference = a * reference + (b * gram + c * (gram @ gram)) @ reference
    return Sample(x, reference, op, coefficients, restarts)


def failure_types(kernel: NSKernel) -> tuple[type[Exception], ...]:
    """The exceptions by which ``kernel`` says it cannot run a problem (see the note)."""
    declared = getattr(kernel, "failure_types", None)
    return declared() if callable(declared) else DEFAULT_FAILURES


def report(message: str) -> None:
    """A deliberate degradation, made visible in logs and to the user."""
    logger.warning("%s", message)
    warnings.warn(message, RuntimeWarning, stacklevel=2)


def compare_ms(
    first: Callable[[], object], second: Callable[[], object], device: torch.device, budget_s: float
) -> tuple[float, float]:
    """Median milliseconds of ``first`` and ``second``, timed alternately (so that drifting
    clocks touch both alike) for about ``budget_s`` in all, each as it will really run (see
    ``_as_run``)."""
    runs = [_as_run(first, device), _as_run(second, device)]
    once = [_time_ms(fn, device) for fn in runs]  # also the warm-up of a replayed graph
    reps = int(min(_MAX_REPS, max(_MIN_REPS, budget_s * 1e3 / max(sum(once), 1e-3))))
    samples: list[list[float]] = [[], []]
    for _ in range(reps):
        for times, fn in zip(samples, runs, strict=True):
            times.append(_time_ms(fn, device))
    return statistics.median(samples[0]), statistics.median(samples[1])


def _as_run(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """How a kernel will really run: replayed from a CUDA graph where it can be captured.

    [Note: timing as it runs]
    The dispatcher replays kernels from CUDA graphs by default, so launch overhead, which
    dominates small problems and differs a lot between backends (Python-side launch work of
    Triton and CuTe DSL against cuBLAS), must not decide the choice. Each kernel is captured
    after its warm-up and its replays are timed; one that cannot be captured is timed eagerly,
    as it would then run, and the failed capture is reported.
    """
    if device.type != "cuda":
        return fn
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
        report(
            f"dmuon-ns autotune: CUDA-graph capture failed ({type(err).__name__}: {err});"
            " timing this kernel eagerly, as it would then run"
        )
        return fn
    return graph.replay


def _time_ms(fn: Callable[[], object], device: torch.device) -> float:
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    end.synchronize()
    return float(begin.elapsed_time(end))
