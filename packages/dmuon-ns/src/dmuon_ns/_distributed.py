"""Gram NS of a matrix whose columns are spread over several processes (tensor parallel).

[Note: distributed Gram NS]
Rank i holds ``Xᵢ = X[:, colsᵢ]`` of an (m, n) matrix, m ≤ n. Everything Gram NS needs from
``X`` is its Gram matrix, and ``X·Xᵀ = Σᵢ Xᵢ·Xᵢᵀ``: each rank forms its local m×m product and
one all-reduce sums them, so O(m²) travels instead of the O(m·n) of gathering ``X``.

* The Frobenius norm comes for free: ``‖X‖²_F = trace(X·Xᵀ)``. The first Gram matrix is
  therefore taken from the raw input in fp32 (no normalisation before the reduce), and both
  the norm and the normalised ``R = X·Xᵀ / (‖X‖ + eps)²`` follow from the reduced sum.
* The m×m iteration (``_iterations.gram_iterations``) then runs identically on every rank:
  same reduced ``R``, same coefficients, same products, hence the same ``Q`` everywhere.
* A restart needs the Gram matrix of ``Q·X``, which is again a sum of local products, so each
  restart costs one more all-reduce.
* Each rank returns ``Q·Xᵢ``, its own columns of the result.

Reductions run in fp32 (summing half-precision partial products would add a rounding per
rank); the result matches the single-process Gram NS up to that rounding. The iteration dtype
is the torch kernel's (``_prepare``'s [Note: the iteration dtype]): fp32 on the CPU, fp16 on
CUDA, unless ``dtype`` names one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Unpack

import torch
from torch import Tensor

from dmuon_ns._config import NewtonSchulz
from dmuon_ns._iterations import TorchProducts, as_dtype, gram_iterations
from dmuon_ns._newton_schulz import NSKeywords, takes_newton_schulz_keywords
from dmuon_ns._prepare import check_matrix, iteration_dtype, without_autocast
from dmuon_ns._profiling import span

__all__ = ["gram_newton_schulz_distributed"]


class _DistributedKeywords(NSKeywords, total=False):
    restart_iterations: Sequence[int] | None
    dtype: torch.dtype | None


@takes_newton_schulz_keywords
def gram_newton_schulz_distributed(
    x_local: Tensor,
    all_reduce: Callable[[Tensor], object],
    **options: Unpack[_DistributedKeywords],
) -> Tensor:
    """Gram NS of the matrix whose column block ``x_local`` (..., m, n_local) this rank holds.

    ``all_reduce(t)`` must sum the fp32 tensor ``t`` in place over every rank holding a block
    of the same matrix (e.g. ``lambda t: dist.all_reduce(t, group=tp_group)``); every rank must
    call this function with the same ``m``, leading dims and arguments. The blocks must be
    column blocks (each holds all ``m`` rows): for a matrix split by rows pass ``x_local.mT``
    and transpose the result back, since NS(Xᵀ) = NS(X)ᵀ. The Gram side is m×m, so the form
    pays off when the whole matrix is wide (m ≤ n). Returns this rank's block of the result,
    in ``x_local``'s shape and dtype. See the module note.
    """
    check_matrix(x_local, "x_local")
    # The config object validates the arguments exactly as the front end does.
    config = NewtonSchulz(**options)
    rows, cols = x_local.shape[-2], x_local.shape[-1]
    with span("dmuon::newton_schulz_distributed"), without_autocast(x_local.device):
        x32 = x_local.reshape(-1, rows, cols).float()
        r32 = torch.bmm(x32, x32.mT)
        all_reduce(r32)
        trace = r32.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(0.0)
        scale = 1.0 / (trace.sqrt() + config.eps)  # (batch,)
        dtype = iteration_dtype(config.dtype, x_local.device, ["torch"])  # torch products
        x = (x32 * scale[:, None, None]).to(dtype)
        r = (r32 * (scale * scale)[:, None, None]).to(dtype)

        products = _ReducedGramProducts(all_reduce)
        last = gram_iterations(products, x, config.step_coefficients, config.restarts, r=r)
        y = last.finish()
        return as_dtype(y, x_local.dtype).reshape(x_local.shape)


class _ReducedGramProducts(TorchProducts):
    """Torch products whose Gram matrix is the fp32 sum of every rank's local one."""

    def __init__(self, all_reduce: Callable[[Tensor], object]) -> None:
        self._all_reduce = all_reduce

    def gram(self, x: Tensor) -> Tensor:
        partial = torch.bmm(x, x.mT).float()
        self._all_reduce(partial)
        return partial.to(x.dtype)
