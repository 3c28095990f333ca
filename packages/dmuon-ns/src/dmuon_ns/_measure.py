"""How the autotuner measures one candidate kernel on one problem: accuracy, then speed.

[Note: the numerical cross-check]
A candidate's output on a sample input is compared with a float64 evaluation of the same
polynomial iteration. The plain-torch kernel sets the bar on the same sample: a candidate whose
relative Frobenius error (worst over the matrices checked) exceeds ``ERROR_FACTOR`` times
torch's, or whose output is not finite or not of the input's shape, is rejected, whatever its
speed.

The sample never depends on the caller's data: it is a fresh random input of the problem's
shape and dtype (a fixed seed), so an all-zero or degenerate first gradient cannot fool the
cross-check or the clock.

[Note: a lean reference]
The reference must not cost many times the problem's memory (a float64 copy of an m×n matrix
is four times its fp16 input, and the direct iteration holds three of them). It is computed
on the small side instead: every step's polynomial is a polynomial in ``R = X·Xᵀ``
(``_iterations``' [Note: the Gram iteration]), so the output is ``Q·X`` with ``Q`` the
product of the steps' m×m factors, in exact arithmetic for both ops and any restarts.
``R`` accumulates over column blocks of ``X`` in float64, ``Q`` is iterated in float64, and
the error is summed over the same blocks, ``‖out − Q·X‖`` against ``‖Q·X‖``, so float64 never
holds more than m×m matrices and one block. It is checked on up to ``CHECKED`` matrices of a
batch, the first and the last among them (every kernel treats batch entries alike; the two
ends catch a wrong batch stride). The sample's inputs are Gaussian, whose Gram matrices are
well conditioned, so forming ``R`` loses nothing float64 needs.

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
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from dmuon_ns._coefficients import Coefficients
from dmuon_ns._registry import NSKernel, Problem
from dmuon_ns._warnings import warn

__all__ = [
    "CHECKED",
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
# Matrices of a batch the cross-check covers, and the column block of the float64 reference
# (see [Note: a lean reference]).
CHECKED = 4
_BLOCK_COLUMNS = 4096
# What a registered kernel without ``failure_types`` may raise to say it cannot run a problem.
DEFAULT_FAILURES: tuple[type[Exception], ...] = (RuntimeError, ValueError, NotImplementedError)


class Sample(NamedTuple):
    """A sample input of one problem, its float64 reference and how to run a kernel on it."""

    input: Tensor
    q: Tensor  # (checked, m, m) float64: the output is q·input for the checked matrices
    checked: tuple[int, ...]  # the batch indices the error is taken over
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
        worst = 0.0
        for q, b in zip(self.q, self.checked, strict=True):
            diff_sq = ref_sq = 0.0
            for start in range(0, self.input.shape[-1], _BLOCK_COLUMNS):
                block = slice(start, start + _BLOCK_COLUMNS)
                ref = q @ self.input[b, :, block].to(torch.float64)
                diff_sq += float(torch.sum((out[b, :, block].to(torch.float64) - ref) ** 2))
                ref_sq += float(torch.sum(ref**2))
            value = math.sqrt(diff_sq) / max(math.sqrt(ref_sq), 1e-30)
            if not math.isfinite(value):
                return math.inf
            worst = max(worst, value)
        return worst

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
    float64 reference on the small side (see [Note: a lean reference])."""
    from dmuon_ns._prepare import scale_with_torch

    generator = torch.Generator(device=problem.device).manual_seed(_SEED)
    x = torch.randn(problem.shape, generator=generator, device=problem.device, dtype=problem.dtype)
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), dtype=torch.float32)
    scale_with_torch(x, norm, 0.0, x)  # in place: one buffer of the problem's size
    batch = x.shape[0]
    checked = tuple(sorted({round(i * (batch - 1) / max(CHECKED - 1, 1)) for i in range(CHECKED)}))
    q = torch.stack([_reference_q(x[b], coefficients) for b in checked])
    return Sample(x, q, checked, op, coefficients, restarts)


def _reference_q(x: Tensor, coefficients: Coefficients) -> Tensor:
    """The float64 m×m factor ``Q`` with NS(x) = Q·x (see [Note: a lean reference])."""
    m, n = x.shape
    r = torch.zeros(m, m, dtype=torch.float64, device=x.device)
    for start in range(0, n, _BLOCK_COLUMNS):
        block = x[:, start : start + _BLOCK_COLUMNS].to(torch.float64)
        r.addmm_(block, block.mT)
    eye = torch.eye(m, dtype=torch.float64, device=x.device)
    q = eye
    for a, b, c in coefficients:
        z = torch.addmm(r, r, r, beta=b, alpha=c).add_(eye, alpha=a)  # aI + bR + cR²
        q = z @ q
        r = z @ r @ z
    return q


def failure_types(kernel: NSKernel) -> tuple[type[Exception], ...]:
    """The exceptions by which ``kernel`` says it cannot run a problem (see the note)."""
    declared = getattr(kernel, "failure_types", None)
    return declared() if callable(declared) else DEFAULT_FAILURES


def report(message: str) -> None:
    """A deliberate degradation, made visible in logs and to the user."""
    logger.warning("%s", message)
    warn(message, RuntimeWarning)


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
