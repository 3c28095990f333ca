"""The plain-torch NS kernel: batched cuBLAS (or CPU BLAS) products, always available.

The loops are ``_iterations``' on ``TorchProducts``; see the notes there for the Gram
iteration, its restarts, its fused epilogues and where the result dtype is written.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dmuon_ns._iterations import TORCH_PRODUCTS, LoopKernel, Products

__all__ = ["TORCH_KERNEL", "TorchKernel"]


class TorchKernel(LoopKernel):
    """Batched torch products (``bmm``/``baddbmm``); runs on any device torch supports."""

    name = "torch"

    def unavailable_reason(self, device: torch.device) -> str | None:
        return None

    def products_for(self, x: Tensor) -> Products:
        return TORCH_PRODUCTS


TORCH_KERNEL = TorchKernel()
