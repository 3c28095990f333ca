"""The "quack" NS kernel: the Gram and direct iterations on quack-kernels' CuTe DSL products
(``gemm_symmetric`` for the symmetric m×m products and Gram matrices, ``gemm`` / ``gemm_add``
for the rest), run by the shared loops of ``_iterations``.

quack-kernels is an optional extra (``pip install 'dmuon-ns[cute]'``), imported only when the
kernel first runs; it is never vendored. Importing this module only registers the kernel.

[Note: problems quack does not take]
quack's symmetric product works on square tiles of up to 256 rows; for m ≤ 256 the whole
problem is a single tile and the library's launch cost dominates, so (as the Gram
Newton–Schulz reference does) those problems run on torch products inside this kernel. So do
shapes whose rows are not 16-byte aligned (m or n not a multiple of 8 in fp16/bf16): quack
loads through TMA and rejects them (seen on an H200 for 3×333×1000). Either way the loop is
the same, so the autotuner's accuracy bar compares like with like.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch import Tensor

from dmuon_ns._iterations import TORCH_PRODUCTS, LoopKernel, Products, TorchProducts
from dmuon_ns._registry import cuda_capability_reason, register_kernel

__all__ = ["QUACK_KERNEL", "QuackKernel"]

_INSTALL_HINT = "pip install 'dmuon-ns[cute]'"
_SMALL_GRAM_SIDE = 256
_TMA_ALIGN_BYTES = 16


class _QuackProducts(TorchProducts):
    """quack's products; the first ``Q`` is torch's copy-plus-diagonal of quack's ``Z'``."""

    def __init__(self) -> None:
        from quack.gemm_interface import gemm, gemm_add, gemm_symmetric

        self._gemm: Any = gemm
        self._gemm_add: Any = gemm_add
        self._gemm_symmetric: Any = gemm_symmetric

    def gram(self, x: Tensor) -> Tensor:
        out: Tensor = self._gemm_symmetric(x, x.mT)
        return out

    def sym(self, a: Tensor, b: Tensor, c: Tensor, *, alpha: float = 1.0, beta: float) -> Tensor:
        out: Tensor = self._gemm_symmetric(a, b, C=c, alpha=alpha, beta=beta)
        return out

    def mm(self, a: Tensor, b: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
        out: Tensor = self._gemm(a, b, out_dtype=out_dtype)
        return out

    def mm_add(
        self, a: Tensor, b: Tensor, c: Tensor, beta: float, out_dtype: torch.dtype | None = None
    ) -> Tensor:
        out: Tensor = self._gemm_add(a, b, c, beta=beta, out_dtype=out_dtype)
        return out


_quack_products: _QuackProducts | None = None


def _quack() -> Products:
    global _quack_products
    if _quack_products is None:
        _quack_products = _QuackProducts()
    return _quack_products


def _products_for(x: Tensor) -> Products:
    """quack's products, or torch's for the problems of the module note."""
    m, n = x.shape[-2], x.shape[-1]
    row_bytes = (m * x.element_size(), n * x.element_size())
    unaligned = any(size % _TMA_ALIGN_BYTES for size in row_bytes)
    return TORCH_PRODUCTS if m <= _SMALL_GRAM_SIDE or unaligned else _quack()


class QuackKernel(LoopKernel):
    """Gram/direct NS on quack-kernels (CuTe DSL); CUDA SM90+ with the ``cute`` extra."""

    name = "quack"

    def unavailable_reason(self, device: torch.device) -> str | None:
        for module in ("quack", "cutlass"):
            if importlib.util.find_spec(module) is None:
                return f"{module} is not installed: {_INSTALL_HINT}"
        if device.type != "cuda":
            return f"needs a CUDA device of SM90 or newer (got {device.type})"
        return cuda_capability_reason(device, 9)

    def products_for(self, x: Tensor) -> Products:
        return _products_for(x)


QUACK_KERNEL = QuackKernel()
register_kernel(QUACK_KERNEL)
