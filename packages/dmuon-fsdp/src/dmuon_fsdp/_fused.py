"""Fused elementwise passes of the Muon update on CUDA, with the non-finite skip folded in.

[Note: fused momentum and update]

With ``torch`` ops, a step that may be skipped on the device (see [Note: non-finite gradients]
in :mod:`._muon_math`) costs extra passes over every matrix: the advanced momentum is formed
apart and then selected into the buffer, and the new weight likewise. On an H200 that was 15
ms of a 165 ms step for an 8-layer H=4096 stack. One Triton program per block does it all in
one pass instead:

- momentum: reads ``buf`` and ``grad``, writes ``buf`` (the old value when skipped) and the NS
  input (``grad + momentum·buf`` with Nesterov): four transfers, where the unfused in-place
  ops take eight even without a skip;
- update: reads ``p`` and the NS result, writes ``p`` (kept when skipped): three transfers,
  as ``p.add_`` alone.

Arithmetic runs in fp32 and rounds once per stored value (``momentum·buf + grad`` as one
multiply-add), so the last bit can differ from the unfused ops', which round after the
multiply too; every rank and every run of one build computes the same bits. A skipped step
stores exactly the old values. The kernels take contiguous tensors of one of the three float
dtypes; anything else (and every CPU tensor) takes the ``torch`` ops. Triton's interpreter
runs them on CPU for the tests.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from torch import Tensor

__all__ = ["fused_available", "momentum_into", "update_weight"]

_BLOCK = 1024
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _kernels() -> Any:
    """The compiled kernels, or ``None`` without Triton (imported on first use only)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def momentum_kernel(
        buf_ptr,
        grad_ptr,
        out_ptr,
        skip_ptr,
        n,
        momentum,
        NESTEROV: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        skip = tl.load(skip_ptr) != 0
        old = tl.load(buf_ptr + offs, mask=mask)
        grad = tl.load(grad_ptr + offs, mask=mask).to(tl.float32)
        new = (old.to(tl.float32) * momentum + grad).to(old.dtype)
        tl.store(buf_ptr + offs, tl.where(skip, old, new), mask=mask)
        if NESTEROV:
            value = grad + momentum * new.to(tl.float32)
        else:
            value = new.to(tl.float32)
        tl.store(out_ptr + offs, value.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def update_kernel(
        p_ptr, u_ptr, skip_ptr, n, cols, u_row, u_col, decay, step, BLOCK: tl.constexpr
    ):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        skip = tl.load(skip_ptr) != 0
        old = tl.load(p_ptr + offs, mask=mask)
        # The NS result may be a transposed view (tall matrices are orthogonalised as their
        # transpose): address it by its strides.
        u_offs = (offs // cols) * u_row + (offs % cols) * u_col
        update = tl.load(u_ptr + u_offs, mask=mask).to(tl.float32)
        new = (old.to(tl.float32) * decay + step * update).to(old.dtype)
        tl.store(p_ptr + offs, tl.where(skip, old, new), mask=mask)

    return momentum_kernel, update_kernel


def fused_available(*tensors: Tensor) -> bool:
    """Whether the fused kernels can run on ``tensors`` (CUDA, or CPU under Triton's
    interpreter; contiguous; fp32/bf16/fp16)."""
    first = tensors[0]
    if first.device.type != "cuda" and not (first.device.type == "cpu" and _interpreting()):
        return False
    if not all(
        t.is_contiguous() and t.dtype in _DTYPES and t.device == first.device for t in tensors
    ):
        return False
    return _kernels() is not None


def _grid(n: int) -> tuple[int]:
    return ((n + _BLOCK - 1) // _BLOCK,)


def momentum_into(
    buf: Tensor, grad: Tensor, out: Tensor, skip: Tensor, momentum: float, nesterov: bool
) -> None:
    """``buf = momentum·buf + grad`` (unless ``skip``) and the NS input into ``out``, in one
    pass; the caller checked :func:`fused_available`."""
    momentum_kernel, _ = _kernels()
    n = buf.numel()
    momentum_kernel[_grid(n)](
        buf, grad, out, skip, n, float(momentum), NESTEROV=nesterov, BLOCK=_BLOCK
    )


def update_weight(param: Tensor, update: Tensor, skip: Tensor, decay: float, step: float) -> None:
    """``param = decay·param + step·update`` (unless ``skip``), in one pass, for a contiguous
    2-D ``param`` and an ``update`` of its shape with any strides; the caller checked
    :func:`fused_available` on ``param``."""
    _, update_kernel = _kernels()
    n = param.numel()
    cols = param.shape[1]
    u_row, u_col = update.stride()
    update_kernel[_grid(n)](
        param, update, skip, n, cols, u_row, u_col, float(decay), float(step), BLOCK=_BLOCK
    )
