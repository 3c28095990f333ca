"""The "triton" NS kernel: the Gram and direct iterations on the Triton products of
``_triton_kernels`` (symmetric m×m products on one triangle of tiles, fused epilogues).

Importing this module registers the kernel; Triton itself is imported only when the kernel
first runs, so ``unavailable_reason`` can explain a missing install instead of failing.

[Note: what Triton adds to the shared loops]
The loops are ``_iterations``' (the same products, rounded at the same places as the torch
kernel). One thing differs, in Triton's favour: every m×m iterate is exactly symmetric (one
triangle computed and mirrored; about 10% lower final error in an fp64 emulation of the fp16
rounding).
"""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor

from dmuon_ns._environment import triton_interpreting
from dmuon_ns._iterations import LoopKernel, Products
from dmuon_ns._prepare import ScalePass, scale_with_torch
from dmuon_ns._registry import cuda_capability_reason, install_hint, register_kernel

__all__ = ["TRITON_KERNEL", "TritonKernel", "triton_scale_pass"]


class TritonKernel(LoopKernel):
    """Gram/direct NS on Triton symmetric products; CUDA (SM80+), or the CPU interpreter."""

    name = "triton"

    def unavailable_reason(self, device: torch.device) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return f"triton is not installed: {install_hint('triton')}"
        if device.type == "cuda":
            return cuda_capability_reason(device, 8)
        if device.type == "cpu" and triton_interpreting():
            return None
        return f"needs a CUDA device (got {device.type}; TRITON_INTERPRET=1 runs it on CPU)"

    def products_for(self, x: Tensor) -> Products:
        from dmuon_ns._triton_kernels import TRITON_PRODUCTS

        return TRITON_PRODUCTS

    def scale_pass(self, source: Tensor, norm: Tensor) -> ScalePass:
        return triton_scale_pass(norm)

    def failure_types(self) -> tuple[type[Exception], ...]:
        from triton.errors import TritonError  # compilation, resources, the autotuner

        return (*super().failure_types(), TritonError)


def triton_scale_pass(norm: Tensor) -> ScalePass:
    """The one-pass Triton scaling of ``_triton_kernels.scale_cast``, for inputs whose norm is
    fp32 (every input dtype but float64, whose formula runs in float64: torch ops)."""
    if norm.dtype != torch.float32:
        return scale_with_torch
    from dmuon_ns._triton_kernels import scale_cast

    return scale_cast


TRITON_KERNEL = TritonKernel()
register_kernel(TRITON_KERNEL)
