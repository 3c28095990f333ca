"""Run one prepared NS problem on the kernel that ``_registry.resolve`` chose.

The input arrives as the front end leaves it, a ``Prepared``: (batch, m, n) with m ≤ n and
each matrix's norm known, not yet scaled or written in the iteration dtype (``write`` does
both, into the kernel's input buffer, with the scaling pass of the kernel picked here: see
``_prepare``'s [Note: the scaling pass follows the kernel]). Two CUDA-only layers may wrap the
kernel call: the autotuner (when auto left several candidates) and CUDA-graph replay (when
``cuda_graphs`` is on). Both live in their own modules, imported only on that path, so a CPU
run never touches them. Kernels made of the shared loops (``LoopKernel``) are called up to
their last product, which runs outside the graph (``_iterations``' [Note: the last product]).

[Note: which problems are graphed]
A captured graph keeps its static input and the last product's operands allocated for the
life of the process, about twice the problem's size per shape, on top of whatever the caller
holds (its intermediates live in a pool that every NS graph shares: ``_graphs``' [Note: one
pool for every graph]). Replay pays where the host
cannot keep ahead of the GPU: on an H200 it took a 1024×4096 call from 1.33 to 0.57 ms
(benchmarks/HISTORY.md, Newton–Schulz run A), and the quack kernel spends ~40 µs of host time
per product, as long as a whole product takes at 2048×8192. Above 64 MiB (8192×4096 in fp16)
every product runs long enough to hide its launch, so only inputs of at most
``GRAPH_MAX_BYTES`` are graphed; larger ones run eagerly and leave nothing behind (a training
step's peak memory counts).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from dmuon_ns._iterations import LastProduct, LoopKernel, Owned, finished
from dmuon_ns._prepare import Prepared
from dmuon_ns._registry import NSKernel, Problem, Resolution

__all__ = ["GRAPH_MAX_BYTES", "pick", "run"]

# Largest prepared input replayed through a CUDA graph; see [Note: which problems are graphed].
GRAPH_MAX_BYTES = 64 * 2**20


def run(
    resolution: Resolution,
    prepared: Prepared,
    op: str,
    coefficients: tuple[tuple[float, float, float], ...],
    restart_iterations: tuple[int, ...],
    *,
    out_dtype: torch.dtype | None,
    cuda_graphs: bool,
) -> Tensor:
    """``op`` ("gram" or "direct") on the prepared input with the resolved kernel, the result
    written in ``out_dtype`` (``None``: the iteration dtype); ``coefficients`` holds exactly
    one row per step. Under auto, a verdict's kernel that fails falls back to the provisional
    one (``_autotune``'s [Note: a verdict's kernel that fails])."""
    kernels = resolution.kernels
    kernel = pick(kernels, prepared, op, coefficients, restart_iterations)
    call = _Call(prepared, op, coefficients, restart_iterations, out_dtype, cuda_graphs)
    try:
        return _run_on(kernel, kernels, call)
    except Exception as err:
        if len(kernels) < 2 or prepared.device.type != "cuda":
            raise
        from dmuon_ns import _autotune, _measure

        if not isinstance(err, _measure.failure_types(kernel)):
            raise
        fallback = _autotune.failed(
            kernels, prepared, op, coefficients, restart_iterations, kernel, err
        )
        if fallback is None:
            raise
    return _run_on(fallback, kernels, call)


class _Call(NamedTuple):
    """One ``run``: what every kernel it may try runs on."""

    prepared: Prepared
    op: str
    coefficients: tuple[tuple[float, float, float], ...]
    restart_iterations: tuple[int, ...]
    out_dtype: torch.dtype | None
    cuda_graphs: bool


def _run_on(kernel: NSKernel, candidates: Sequence[NSKernel], call: _Call) -> Tensor:
    prepared, op, coefficients, restarts, out_dtype, cuda_graphs = call
    if isinstance(kernel, LoopKernel):
        prepared = prepared._replace(scale_pass=kernel.scale_pass(prepared.source, prepared.norm))

    def fn(x: Tensor | Owned) -> Tensor | LastProduct:
        if isinstance(kernel, LoopKernel):
            return kernel.loop(op, x, coefficients, restarts, out_dtype)
        x = x.take() if isinstance(x, Owned) else x
        if op == "gram":
            return kernel.gram(x, coefficients, restarts, out_dtype)
        return kernel.direct(x, coefficients, out_dtype)

    nbytes = math.prod(prepared.shape) * prepared.dtype.itemsize
    if cuda_graphs and prepared.device.type == "cuda" and nbytes <= GRAPH_MAX_BYTES:
        from dmuon_ns import _graphs

        # The key names the candidates, the variant the one picked: a kernel asked for by name
        # keeps its own graph, and auto's problem keeps one, for its current pick.
        names = tuple(k.name for k in candidates)
        key = (names, op, coefficients, restarts, out_dtype)
        return _graphs.run_graphed(fn, prepared, key, variant=kernel.name)
    # Handed over: the loop frees the input once it has read it for the last time.
    return finished(fn(Owned(prepared.write())))


def pick(
    candidates: Sequence[NSKernel],
    problem: Problem,
    op: str,
    coefficients: tuple[tuple[float, float, float], ...],
    restart_iterations: tuple[int, ...],
    *,
    now: bool = False,
) -> NSKernel:
    """The candidate that runs ``problem``: the only one, or the autotuner's choice on CUDA
    (``now``: measured now where it has no verdict; ``_autotune``'s notes)."""
    if len(candidates) == 1 or problem.device.type != "cuda":
        return candidates[0]
    from dmuon_ns import _autotune

    return _autotune.choose(candidates, problem, op, coefficients, restart_iterations, now=now)
