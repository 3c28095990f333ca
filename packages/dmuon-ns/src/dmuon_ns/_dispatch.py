"""Run one prepared NS problem on the kernel that ``_registry.resolve`` chose.

``x`` arrives as the front end leaves it: (batch, m, n) with m ≤ n, contiguous, in the
iteration dtype, normalised. Two CUDA-only layers may wrap the kernel call: the autotuner
(when auto left several candidates) and CUDA-graph replay (when ``cuda_graphs`` is on). Both
live in their own modules, imported only on that path, so a CPU run never touches them.

[Note: which problems are graphed]
A captured graph keeps its static input and output allocated for the life of the process (and
its intermediates reserved in a private pool), i.e. at least twice the problem's size per
shape, on top of whatever the caller holds. Replay only pays where launch gaps dominate: on an
H200 it took a 1024×4096 call from 1.33 to 0.57 ms, and changed nothing measurable at
2048×8192, 4096×14336 or a 32×1024×4096 stack (BENCHMARKS.md, Newton–Schulz run A). So only
inputs of at most ``GRAPH_MAX_BYTES`` are graphed; larger ones run eagerly and leave nothing
behind.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from dmuon_ns._registry import NSKernel, Resolution

__all__ = ["GRAPH_MAX_BYTES", "run"]

# Largest prepared input replayed through a CUDA graph; see [Note: which problems are graphed].
GRAPH_MAX_BYTES = 16 * 2**20


def run(
    resolution: Resolution,
    x: Tensor,
    op: str,
    coefficients: tuple[tuple[float, float, float], ...],
    restart_iterations: tuple[int, ...],
    *,
    cuda_graphs: bool,
) -> Tensor:
    """``op`` ("gram" or "direct") on ``x`` with the resolved kernel; ``coefficients`` holds
    exactly one row per step."""
    kernel = _pick(resolution.kernels, x, op, coefficients, restart_iterations)

    def fn(t: Tensor) -> Tensor:
        if op == "gram":
            return kernel.gram(t, coefficients, restart_iterations)
        return kernel.direct(t, coefficients)

    if cuda_graphs and x.is_cuda and x.numel() * x.element_size() <= GRAPH_MAX_BYTES:
        from dmuon_ns import _graphs

        key = (kernel.name, op, tuple(x.shape), x.dtype, coefficients, restart_iterations)
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
