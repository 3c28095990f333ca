"""The front end's pipeline: check, prepare, resolve the kernel, dispatch, restore.

[Note: lists of matrices]
``orthogonalize_many`` groups the inputs by (shape, dtype, device) and runs each group as one
batched call: one launch per product for all of a rank's same-shape matrices instead of one
per matrix. Results come back in input order. Every kernel treats batch entries
independently, so a matrix gets the same result alone, in a batch or in a list (bit for bit
with the torch kernel on CPU; on GPU up to the BLAS library's batch-dependent tiling).

[Note: an empty batch]
A tensor whose leading dims hold no matrix (shape (0, m, n), say) gets an empty result of its
shape and dtype once its kernel is resolved (a kernel named but unavailable still raises),
and no kernel, autotuner or CUDA graph sees it: a kernel's input holds at least one matrix
(the autotuner's table lookup divides by the batch and its sample indexes into it, and a
graph of an empty problem captures nothing). ``tune`` settles nothing for it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from dmuon_ns import _dispatch
from dmuon_ns._prepare import (
    check_matrix,
    describe,
    iteration_dtype,
    prepare,
    problem_name,
    restore,
    without_autocast,
)
from dmuon_ns._profiling import span

if TYPE_CHECKING:
    from dmuon_ns._config import NewtonSchulz
    from dmuon_ns._registry import Resolution

__all__ = ["op_for", "orthogonalize", "orthogonalize_many", "tune"]

# Result dtypes every kernel writes from its last product (saving a cast pass over the output);
# any other input dtype (float64) comes back through ``restore``'s cast.
_KERNEL_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def op_for(config: NewtonSchulz, rows: int, cols: int) -> str:
    """ "gram" or "direct" for an (rows, cols) matrix under ``config`` (see ``_config``)."""
    if config.backend == "gram" and rows != cols:
        return "gram"
    return "direct"


class _Setup(NamedTuple):
    """What a call runs a problem with: the resolved kernel(s), the iteration dtype, the op
    and the restarts it takes."""

    resolution: Resolution
    dtype: torch.dtype
    op: str
    restarts: tuple[int, ...]


def _setup(config: NewtonSchulz, device: torch.device, rows: int, cols: int) -> _Setup:
    """How ``config`` runs (rows, cols) matrices on ``device``: one answer for a call and for
    ``tune``, which settles the problem the call will run."""
    resolution = config._resolution(device)
    names = [kernel.name for kernel in resolution.kernels]
    op = op_for(config, rows, cols)
    restarts = config.restarts if op == "gram" else ()
    return _Setup(resolution, iteration_dtype(config.dtype, device, names), op, restarts)


def orthogonalize(config: NewtonSchulz, g: Tensor, what: str = "G") -> Tensor:
    """NS of one tensor (2-D or batched) under ``config``, in ``g``'s shape and dtype."""
    check_matrix(g, what)
    with span("dmuon::newton_schulz"), without_autocast(g.device):
        setup = _setup(config, g.device, g.shape[-2], g.shape[-1])
        if g.numel() == 0:  # a batch of no matrices: see [Note: an empty batch]
            return torch.empty(g.shape, dtype=g.dtype, device=g.device)
        prepared = prepare(g, setup.dtype, config.eps)
        y = _dispatch.run(
            setup.resolution,
            prepared,
            setup.op,
            config.step_coefficients,
            setup.restarts,
            out_dtype=g.dtype if g.dtype in _KERNEL_OUT_DTYPES else None,
            cuda_graphs=config.cuda_graphs,
        )
        return restore(y, prepared)


def orthogonalize_many(config: NewtonSchulz, gs: Sequence[Tensor]) -> list[Tensor]:
    """NS of every tensor in ``gs``; same-shape tensors run as one batch (see the note)."""
    out: list[Tensor | None] = [None] * len(gs)
    for members in _batches(gs).values():
        if len(members) == 1:
            out[members[0]] = orthogonalize(config, gs[members[0]], f"G[{members[0]}]")
            continue
        stacked = torch.stack([gs[i] for i in members])
        result = orthogonalize(config, stacked)
        for j, i in enumerate(members):
            out[i] = result[j]
    return [t for t in out if t is not None]


def tune(config: NewtonSchulz, gs: Sequence[Tensor]) -> dict[str, str]:
    """Settle now the kernel of every problem that ``config(gs)`` would run (only the shapes,
    dtypes and devices of ``gs`` matter); ``"<op> <batch>x<m>x<n> <dtype>"`` -> kernel name."""
    chosen: dict[str, str] = {}
    for (shape, _, device), members in _batches(gs).items():
        batched = shape if len(members) == 1 else (len(members), *shape)
        resolution, dtype, op, restarts = _setup(config, device, shape[-2], shape[-1])
        if math.prod(batched) == 0:  # runs no kernel: see [Note: an empty batch]
            continue
        problem = describe(batched, dtype, device)
        coefficients = config.step_coefficients
        kernel = _dispatch.pick(resolution.kernels, problem, op, coefficients, restarts, now=True)
        chosen[problem_name(op, problem.shape, problem.dtype)] = kernel.name
    return chosen


def _batches(gs: Sequence[Tensor]) -> dict[tuple[torch.Size, torch.dtype, torch.device], list[int]]:
    """The indices of ``gs`` that run as one batch, by (shape, dtype, device); checks each."""
    groups: dict[tuple[torch.Size, torch.dtype, torch.device], list[int]] = {}
    for i, g in enumerate(gs):
        check_matrix(g, f"G[{i}]")
        groups.setdefault((g.shape, g.dtype, g.device), []).append(i)
    return groups
