"""The plain-torch NS kernel: batched cuBLAS (or CPU BLAS) products, always available.

[Note: the Gram iteration]
For a wide ``X`` (m ≤ n) with ``R = X·Xᵀ``, one quintic step is ``X ← Z·X`` with
``Z = aI + bR + cR²``. Every ``Z`` is a polynomial in ``R``, so the steps can run on the
m×m side alone: keep ``Q`` (the product of the ``Z`` so far) and the Gram matrix of the
current iterate, ``R ← Z·R·Z`` (``X·Xᵀ`` of ``Z·X``), and apply ``Q·X`` once at the end.
That is ~3 m×m×m products per step instead of two m×m×n ones and one m×n×m, a large saving
when n ≫ m.

Half precision is the catch: ``R`` is updated by repeated products instead of recomputed
from ``X``, and its rounding errors compound step by step. A *restart* at iteration ``i``
materialises ``X ← Q·X``, recomputes ``R = X·Xᵀ`` from it and resets ``Q = I`` before step
``i`` runs, so the error grows from a fresh start (the Gram Newton–Schulz reference,
Dao-AILab/gram-newton-schulz, restarts at iteration 2 by default). A restart at iteration 0
would be the starting state; the front end rejects it.

[Note: fused epilogues]
``aI + Z'`` with ``Z' = bR + cR²`` is never formed in half precision where it can be avoided:
adding ``a`` (up to ~8) to the diagonal would round away the low bits of ``Z'`` there.
Instead the ``a`` term rides in the epilogue of the next product, accumulated in fp32:
``Q·(aI + Z') = a·Q + Q·Z'`` and ``R·(aI + Z') = a·R + R·Z'`` are one ``baddbmm`` each.
Only the very first ``Q`` (no product to fuse into) is ``Z' + aI``, rounded once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["TORCH_KERNEL", "TorchKernel", "gram_iterations"]


def gram_iterations(
    x: Tensor,
    r: Tensor,
    coefficients: Sequence[tuple[float, float, float]],
    restart_iterations: Sequence[int],
    gram: Callable[[Tensor], Tensor],
) -> Tensor:
    """The Gram NS loop on ``x`` (batch, m, n) whose Gram matrix is ``r`` (batch, m, m).

    ``gram(x)`` returns ``x·xᵀ`` for a restart: a local product for one process, a reduced
    product of row shards for the distributed form. Returns ``Q·x``.
    """
    restarts = frozenset(restart_iterations)
    last = len(coefficients) - 1
    q: Tensor | None = None
    for i, (a, b, c) in enumerate(coefficients):
        if i in restarts and i != 0 and q is not None:
            x = torch.bmm(q, x)
            r = gram(x)
            q = None
        # Z' = b·R + c·R²; the a·I part is fused into the products below.
        z = torch.baddbmm(r, r, r, beta=b, alpha=c)
        if q is None:
            q = _add_diagonal(z, a)
        else:
            q = torch.baddbmm(q, q, z, beta=a)
        if i < last and (i + 1) not in restarts:
            rz = torch.baddbmm(r, r, z, beta=a)  # R·(aI + Z')
            r = torch.baddbmm(rz, z, rz, beta=a)  # (aI + Z')·R·(aI + Z')
    assert q is not None, "coefficients must hold at least one row"
    return torch.bmm(q, x)


def _add_diagonal(z: Tensor, a: float) -> Tensor:
    out = z.clone()
    out.diagonal(dim1=-2, dim2=-1).add_(a)
    return out


class TorchKernel:
    """Batched torch products (``bmm``/``baddbmm``); runs on any device torch supports."""

    name = "torch"

    def unavailable_reason(self, device: torch.device) -> str | None:
        return None

    def gram(
        self,
        x: Tensor,
        coefficients: Sequence[tuple[float, float, float]],
        restart_iterations: Sequence[int],
        out_dtype: torch.dtype | None = None,
    ) -> Tensor:
        def local_gram(t: Tensor) -> Tensor:
            return torch.bmm(t, t.mT)

        y = gram_iterations(x, local_gram(x), coefficients, restart_iterations, local_gram)
        return y.to(out_dtype or y.dtype)  # cuBLAS products write their operands' dtype

    def direct(
        self,
        x: Tensor,
        coefficients: Sequence[tuple[float, float, float]],
        out_dtype: torch.dtype | None = None,
    ) -> Tensor:
        for a, b, c in coefficients:
            r = torch.bmm(x, x.mT)
            z = torch.baddbmm(r, r, r, beta=b, alpha=c)  # b·R + c·R²
            x = torch.baddbmm(x, z, x, beta=a)  # a·X + Z'·X
        return x.to(out_dtype or x.dtype)

    def __repr__(self) -> str:
        return "TorchKernel()"


TORCH_KERNEL = TorchKernel()
