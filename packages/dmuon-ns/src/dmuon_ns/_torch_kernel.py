"""The plain-torch NS kernel: batched cuBLAS (or CPU BLAS) products, always available.

The loops are ``_iterations``' on ``TorchProducts``; see the notes there for the Gram
iteration, its restarts and its fused epilogues.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dmuon_ns._iterations import TORCH_PRODUCTS, direct_iterations, gram_iterations

__all__ = ["TORCH_KERNEL", "TorchKernel"]


def _cast(y: Tensor, out_dtype: torch.dtype | None) -> Tensor:
    # cuBLAS writes its operands' dtype, so the result dtype costs a cast pass here. It runs
    # after the loop returns, when the loop's iterates (the restarted X, Q, R) are freed: the
    # cast inside the last product would keep them alive at the step's memory peak.
    return y.to(out_dtype) if out_dtype is not None else y


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
        y = gram_iterations(TORCH_PRODUCTS, x, coefficients, restart_iterations)
        return _cast(y, out_dtype)

    def direct(
        self,
        x: Tensor,
        coefficients: Sequence[tuple[float, float, float]],
        out_dtype: torch.dtype | None = None,
    ) -> Tensor:
        return _cast(direct_iterations(TORCH_PRODUCTS, x, coefficients), out_dtype)

    def __repr__(self) -> str:
        return "TorchKernel()"


TORCH_KERNEL = TorchKernel()
