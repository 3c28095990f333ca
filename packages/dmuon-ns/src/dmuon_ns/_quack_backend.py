"""The "quack" NS kernel: the Gram and direct iterations on quack-kernels' CuTe DSL products
(``gemm_symmetric`` for the symmetric m×m products, ``gemm`` / ``gemm_add`` for the rest).

quack-kernels is an optional extra (``pip install 'dmuon-ns[cute]'``), imported only when the
kernel first runs; it is never vendored. Importing this module only registers the kernel.

[Note: small Gram sides]
quack's symmetric product works on square tiles of up to 256 rows; for m ≤ 256 the whole
problem is a single tile and the library's launch cost dominates, so (as the Gram
Newton–Schulz reference does) those problems run on batched torch products inside this
kernel. So do shapes whose rows are not 16-byte aligned (m or n not a multiple of 8 in
fp16/bf16): quack loads through TMA and rejects them (seen on an H200 for 3×333×1000). The iteration is step for step the torch kernel's (``_torch_kernel``), so the
autotuner's accuracy bar compares like with like.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from dmuon_ns._registry import register_kernel

__all__ = ["QUACK_KERNEL", "QuackKernel"]

_INSTALL_HINT = "pip install 'dmuon-ns[cute]'"
_SMALL_GRAM_SIDE = 256


class _Ops:
    """The three products the iteration needs, on quack or on torch."""

    def __init__(
        self,
        sym: Callable[..., Tensor],
        mm: Callable[[Tensor, Tensor, torch.dtype | None], Tensor],
        mm_add: Callable[[Tensor, Tensor, Tensor, float, torch.dtype | None], Tensor],
    ) -> None:
        self.sym = sym  # sym(a, b, c=None, alpha=1, beta=1) -> alpha·a·b + beta·c, symmetric
        self.mm = mm  # mm(a, b, out_dtype) -> a·b, written in out_dtype (None: a's dtype)
        self.mm_add = mm_add  # mm_add(a, b, c, beta, out_dtype) -> a·b + beta·c


def _torch_sym(
    a: Tensor, b: Tensor, c: Tensor | None = None, alpha: float = 1.0, beta: float = 1.0
) -> Tensor:
    if c is None:
        return torch.bmm(a, b) if alpha == 1.0 else torch.bmm(a, b).mul_(alpha)
    return torch.baddbmm(c, a, b, beta=beta, alpha=alpha)


def _torch_mm(a: Tensor, b: Tensor, out_dtype: torch.dtype | None) -> Tensor:
    return torch.bmm(a, b).to(out_dtype or a.dtype)


def _torch_mm_add(
    a: Tensor, b: Tensor, c: Tensor, beta: float, out_dtype: torch.dtype | None
) -> Tensor:
    return torch.baddbmm(c, a, b, beta=beta).to(out_dtype or a.dtype)


_TORCH_OPS = _Ops(_torch_sym, _torch_mm, _torch_mm_add)
_quack_ops: _Ops | None = None


def _quack() -> _Ops:
    global _quack_ops
    if _quack_ops is None:
        from quack.gemm_interface import gemm, gemm_add, gemm_symmetric

        def sym(
            a: Tensor, b: Tensor, c: Tensor | None = None, alpha: float = 1.0, beta: float = 1.0
        ) -> Tensor:
            out: Any = gemm_symmetric(a, b, C=c, alpha=alpha, beta=beta)
            return out  # type: ignore[no-any-return]

        def mm(a: Tensor, b: Tensor, out_dtype: torch.dtype | None) -> Tensor:
            out: Any = gemm(a, b, out_dtype=out_dtype)
            return out  # type: ignore[no-any-return]

        def mm_add(
            a: Tensor, b: Tensor, c: Tensor, beta: float, out_dtype: torch.dtype | None
        ) -> Tensor:
            out: Any = gemm_add(a, b, c, beta=beta, out_dtype=out_dtype)
            return out  # type: ignore[no-any-return]

        _quack_ops = _Ops(sym, mm, mm_add)
    return _quack_ops


def _ops_for(x: Tensor) -> _Ops:
    m, n = x.shape[-2], x.shape[-1]
    small = m <= _SMALL_GRAM_SIDE
    # quack's products load through TMA, which needs every stride a multiple of 16 bytes.
    unaligned = (m * x.element_size()) % 16 != 0 or (n * x.element_size()) % 16 != 0
    return _TORCH_OPS if small or unaligned else _quack()


class QuackKernel:
    """Gram/direct NS on quack-kernels (CuTe DSL); CUDA SM90+ with the ``cute`` extra."""

    name = "quack"

    def unavailable_reason(self, device: torch.device) -> str | None:
        for module in ("quack", "cutlass"):
            if importlib.util.find_spec(module) is None:
                return f"{module} is not installed: {_INSTALL_HINT}"
        if device.type != "cuda":
            return f"needs a CUDA device of SM90 or newer (got {device.type})"
        if not torch.cuda.is_available():
            return "needs a CUDA device, and torch sees none"
        major, minor = torch.cuda.get_device_capability(device)
        if major < 9:
            return f"needs a CUDA device of SM90 or newer (Hopper), this one is SM{major}{minor}"
        return None

    def gram(
        self,
        x: Tensor,
        coefficients: Sequence[tuple[float, float, float]],
        restart_iterations: Sequence[int],
        out_dtype: torch.dtype | None = None,
    ) -> Tensor:
        ops = _ops_for(x)
        restarts = frozenset(restart_iterations)
        last = len(coefficients) - 1
        r = ops.sym(x, x.mT)
        q: Tensor | None = None
        for i, (a, b, c) in enumerate(coefficients):
            if i in restarts and i != 0 and q is not None:
                x = ops.mm(q, x, None)
                r = ops.sym(x, x.mT)
                q = None
            z = ops.sym(r, r, c=r, alpha=c, beta=b)  # Z' = b·R + c·R²
            if q is None:
                q = z.clone()
                q.diagonal(dim1=-2, dim2=-1).add_(a)
            else:
                q = ops.sym(q, z, c=q, beta=a)  # Q·(aI + Z')
            if i < last and (i + 1) not in restarts:
                rz = ops.sym(r, z, c=r, beta=a)  # R·(aI + Z')
                r = ops.sym(z, rz, c=rz, beta=a)  # (aI + Z')·R·(aI + Z')
        if q is None:
            raise ValueError("coefficients must hold at least one (a, b, c) row")
        return ops.mm(q, x, out_dtype)

    def direct(
        self,
        x: Tensor,
        coefficients: Sequence[tuple[float, float, float]],
        out_dtype: torch.dtype | None = None,
    ) -> Tensor:
        ops = _ops_for(x)
        last = len(coefficients) - 1
        for i, (a, b, c) in enumerate(coefficients):
            r = ops.sym(x, x.mT)
            z = ops.sym(r, r, c=r, alpha=c, beta=b)  # b·R + c·R²
            x = ops.mm_add(z, x, x, a, out_dtype if i == last else None)  # Z'·X + a·X
        return x

    def __repr__(self) -> str:
        return "QuackKernel()"


QUACK_KERNEL = QuackKernel()
register_kernel(QUACK_KERNEL)
