"""Run one prepared NS problem on the kernel that ``_registry.resolve`` chose.

``x`` arrives as the front end leaves it: (batch, m, n) with m ≤ n, contiguous, in the
iteration dtype, normalised. Two CUDA-only layers may wrap the kernel call: the autotuner
(when auto left several candidates) and CUDA-graph replay (when ``cuda_graphs`` is on). Both
live in their own modules, imported only on that path, so a CPU run never touches them.

[Note: which problems are graphed]
A captured graph keeps its static input and output allocated for the life of the process (and
its intermediates reserved in a private pool), i.e. at least twice the problem's size per
shape, on top of whatever the caller holds. Replay pays where the host cannot keep ahead of
the GPU: on an H200 it took a 1024×4096 call from 1.33 to 0.57 ms (BENCHMARKS.md,
Newton–Schulz run A), and the quack kernel spends ~40 µs of host time per product, as long
as a whole product takes at 2048×8192. Above 64 MiB (8192×4096 in fp16) every product runs
long enough to hide its launch, so only inputs of at most ``GRAPH_MAX_BYTES`` are graphed;
larger ones run eagerly and leave nothing behind (a training step's peak memory counts).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dmuon_ns._registry import NSKernel, Resolution

__all__ = ["GRAPH_MAX_BYTES", "run"]

# Largest prepared input replayed through a CUDA graph; see [Note: which problems are graphed].
GRAPH_MAX_BYTES = 64 * 2**20


def run(
    resolution: Resolution,
    x: Tensor,
    op: str,
    coefficients: tuple[tuple[float, float, float], ...],
    restart_iterations: tuple[int, ...],
    *,
    out_dtype: torch.dtype | None,
    cuda_graphs: bool,
) -> Tensor:
    """``op`` ("gram" or "direct") on ``x`` with the resolved kernel, the result written in
    ``out_dtype`` (``None``: ``x``'s); ``coefficients`` holds exactly one row per step."""
    kernel = _pick(resolution.kernels, x, op, coefficients, restart_iterations)

    def fn(t: Tensor) -> Tensor:
        if op == "gram":
            return kernel.gram(t, coefficients, restart_iterations, out_dtype)
        return kernel.direct(t, coefficients, out_dtype)

    if cuda_graphs and x.is_cuda and x.numel() * x.element_size() <= GRAPH_MAX_BYTES:
        from dmuon_ns import _graphs

        key = (kernel.name, op, coefficients, restart_iterations, out_dtype)
        return _graphs.run_graphed(fn, x, key)
    return fn(x)


def _pick(
    candidates: Sequence[NSKernel],
    x: Tensor,
    op: str,
    coefficients: tuple[tuple[float, float, float], ...],
    restart_iterations: tuple[int, ...],
) -> NSKernel:
    if len(candidates) == 1 or not x.is_cuda:
        return candidates[0]
    from dmuon_ns import _autotune

    chosen: NSKernel = _autotune.choose(candidates, x, op, coefficients, restart_iterations)
    return chosen
