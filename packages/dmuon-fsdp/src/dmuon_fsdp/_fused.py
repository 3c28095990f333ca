"""Muon's elementwise passes (momentum and the weight update) with the non-finite skip folded
in: one Triton program per block on CUDA, torch ops elsewhere, the same bits from both.

[Note: fused momentum and update]

With separate ``torch`` ops, a step that may be skipped on the device (see [Note: non-finite
gradients] in :mod:`._muon_math`) costs extra passes over every matrix: the advanced momentum
is formed apart and then selected into the buffer, and the new weight likewise. On an H200 that
was 15 ms of a 165 ms step for an 8-layer H=4096 stack. One Triton program per block does it
all in one pass instead:

- momentum: reads ``buf`` and ``grad``, writes ``buf`` (the old value when skipped) and the NS
  input (``grad + momentum·buf`` with Nesterov, ``buf`` without): four transfers, where the
  separate ops take eight even without a skip;
- update: reads ``p`` and the NS result, writes ``p`` (kept when skipped): three transfers, as
  ``p.add_`` alone.

Both passes have one definition of their arithmetic, whichever code runs it: every input is
read as fp32 (fp64 stays fp64), each multiply and each add rounds to fp32 on its own (no fused
multiply-add: the kernels are compiled with ``enable_fp_fusion=False``), and a stored value
rounds once, to its tensor's dtype. The torch ops here (the ``kernel=False`` branches of
:func:`momentum_into` and :func:`update_weight`) spell out the same operations in the same
order, so the kernels and the torch ops give the same bits (``tests/test_fused.py`` checks it under Triton's interpreter
and on a GPU). The torch ops run on CPU, on tensors the kernels do not take (not contiguous,
fp64), and on CUDA until the kernels are compiled (see the next note). A skipped step stores
exactly the old values.

[Note: compiling off the training thread]
On a new node the first launch of these kernels cost about 2.3 s on an H200 (Triton's driver
start and key hashing, the compile, and a C launcher built by the host compiler per signature),
all of it inside the first ``optimizer.step()``. So ``Muon(model)`` calls
:func:`compile_in_background` with what its owned matrices will pass (shapes and dtypes, known
once the runtime has packed its parameters), and a daemon thread compiles and loads every
signature while training goes on. Until that thread has finished, the passes run as torch ops;
since both give the same bits, no result depends on when it finishes, and no step waits for
it. A signature the thread did not foresee (an NS callable returning another dtype or layout)
compiles at its first launch. An error the thread met is raised by the first pass after it.
"""

from __future__ import annotations

import atexit
import functools
import os
import threading
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "FusedLayout",
    "compile_in_background",
    "fused_available",
    "momentum_into",
    "update_weight",
]

_BLOCK = 1024
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Compiles started by compile_in_background that the passes have not seen finish, and the
# errors they met.
_background: list[threading.Thread] = []
_background_errors: list[Exception] = []
# How long the interpreter's exit waits for a background compile.
_EXIT_WAIT_S = 60.0


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
    """Whether the kernels can run on ``tensors`` (CUDA, or CPU under Triton's interpreter;
    contiguous; fp32/bf16/fp16), compiled or not."""
    first = tensors[0]
    if first.device.type != "cuda" and not (first.device.type == "cpu" and _interpreting()):
        return False
    if not all(
        t.is_contiguous() and t.dtype in _DTYPES and t.device == first.device for t in tensors
    ):
        return False
    return _kernels() is not None


def _use_kernels(*tensors: Tensor) -> bool:
    if _background and not _background_done():
        return False
    return fused_available(*tensors)


def _background_done() -> bool:
    """Whether every background compile has finished (see [Note: compiling off the training
    thread]); an error one of them met is raised here, on the caller's thread."""
    if any(thread.is_alive() for thread in _background):
        return False
    _background.clear()
    if _background_errors:
        raise _background_errors.pop(0)
    return True


def _grid(n: int) -> tuple[int]:
    return ((n + _BLOCK - 1) // _BLOCK,)


def _skip_flag(skip: Tensor | None, like: Tensor) -> Tensor:
    return skip if skip is not None else torch.zeros((), dtype=torch.bool, device=like.device)


def _store(target: Tensor, new: Tensor, skip: Tensor | None) -> None:
    """``new`` into ``target`` (rounded to its dtype), unless ``skip`` is set (decided on the
    device)."""
    if skip is None:
        target.copy_(new)
    else:
        torch.where(skip, target, new.to(target.dtype), out=target)


def _wide(*tensors: Tensor) -> torch.dtype:
    """The dtype the passes compute in: fp32, or fp64 when an input is fp64."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def momentum_into(
    buf: Tensor,
    grad: Tensor,
    out: Tensor,
    skip: Tensor | None,
    momentum: float,
    nesterov: bool,
    *,
    kernel: bool | None = None,
) -> None:
    """``buf = momentum·buf + grad`` (kept when ``skip``, a 0-d bool tensor, is set) and the NS
    input into ``out``: ``grad + momentum·buf`` with Nesterov, ``buf`` without. ``kernel``:
    the Triton kernel (``True``), the torch ops (``False``) or, by default, the kernel where it
    runs and is compiled (see [Note: fused momentum and update])."""
    momentum = float(momentum)
    if kernel is None:
        kernel = _use_kernels(buf, grad, out)
    if kernel:
        momentum_kernel, _ = _kernels()
        n = buf.numel()
        momentum_kernel[_grid(n)](
            buf,
            grad,
            out,
            _skip_flag(skip, buf),
            n,
            momentum,
            NESTEROV=nesterov,
            BLOCK=_BLOCK,
            enable_fp_fusion=False,
        )
        return
    # The kernel's arithmetic, op for op; the wide values are formed in ``out`` when it has
    # their dtype (no temporary).
    wide = _wide(buf, grad)
    new = out if out.dtype == wide else torch.empty_like(out, dtype=wide)
    _times(buf, momentum, out=new).add_(grad)
    _store(buf, new, skip)  # rounds once, to the buffer's dtype
    if nesterov:
        # grad + momentum·buf from the buffer as stored (a skipped step's NS input is unused).
        _times(buf, momentum, out=new).add_(grad)
        if new is not out:
            out.copy_(new)
    else:
        out.copy_(buf)


def _times(t: Tensor, factor: float, *, out: Tensor) -> Tensor:
    """``out = t·factor`` computed in ``out``'s dtype (widened first: a product in ``t``'s own
    narrower dtype would round there)."""
    if t.dtype == out.dtype:
        return torch.mul(t, factor, out=out)
    return out.copy_(t).mul_(factor)


def update_weight(
    param: Tensor,
    update: Tensor,
    skip: Tensor | None,
    decay: float,
    step: float,
    *,
    kernel: bool | None = None,
) -> None:
    """``param = decay·param + step·update`` (kept when ``skip`` is set) for a 2-D ``param``
    and an ``update`` of its shape with any strides; ``kernel`` as in :func:`momentum_into`."""
    decay, step = float(decay), float(step)
    if kernel is None:
        kernel = _use_kernels(param)
    if kernel:
        _, update_kernel = _kernels()
        n = param.numel()
        cols = param.shape[1]
        u_row, u_col = update.stride()
        update_kernel[_grid(n)](
            param,
            update,
            _skip_flag(skip, param),
            n,
            cols,
            u_row,
            u_col,
            decay,
            step,
            BLOCK=_BLOCK,
            enable_fp_fusion=False,
        )
        return
    # The kernel's arithmetic, op for op.
    new = _times(update, step, out=torch.empty_like(param, dtype=_wide(param, update)))
    # decay·param + step·update; a decay of 1 multiplies exactly, so it is left out.
    new.add_(param if decay == 1.0 else _times(param, decay, out=torch.empty_like(new)))
    _store(param, new, skip)  # rounds once, to the parameter's dtype


class FusedLayout(NamedTuple):
    """What the kernels see of one owned matrix in a step (see [Note: compiling off the
    training thread])."""

    shape: tuple[int, int]
    weight: torch.dtype  # the master weight the update writes
    grad: torch.dtype  # the reduced gradient
    state: torch.dtype  # the momentum buffer, the NS input and its result
    nesterov: bool


def compile_in_background(layouts: Iterable[FusedLayout], device: torch.device) -> None:
    """Start compiling and loading the kernels for ``layouts`` on ``device`` in a daemon thread
    (a CUDA device with Triton only; otherwise nothing happens)."""
    wanted = list(dict.fromkeys(layouts))  # one entry per distinct layout, in order
    if device.type != "cuda" or _interpreting() or not wanted or _kernels() is None:
        return
    thread = threading.Thread(
        target=_compile_each, args=(wanted, device), name="dmuon-fused-compile", daemon=True
    )
    _wait_at_exit()
    _background.append(thread)
    thread.start()


@functools.cache
def _wait_at_exit() -> None:
    """A script that ends within seconds of ``Muon(model)`` must not tear CUDA and Triton down
    under a thread that is still loading a kernel: the interpreter's exit waits for it."""
    atexit.register(_join_background)


def _join_background() -> None:
    for thread in list(_background):
        thread.join(timeout=_EXIT_WAIT_S)


def _compile_each(layouts: list[FusedLayout], device: torch.device) -> None:
    try:
        from triton.runtime.jit import MockTensor

        momentum_kernel, update_kernel = _kernels()
        skip = MockTensor(torch.bool)
        torch.cuda.set_device(device)  # the current device is per thread; Triton keys on it
        for layout in layouts:
            rows, cols = layout.shape
            n = rows * cols
            # A tall matrix's NS result is the transpose of a wide one's (update_kernel).
            u_row, u_col = (1, rows) if rows > cols else (cols, 1)
            state = MockTensor(layout.state)
            compiled = [
                momentum_kernel.warmup(
                    state,
                    MockTensor(layout.grad),
                    state,
                    skip,
                    n,
                    0.5,
                    NESTEROV=layout.nesterov,
                    BLOCK=_BLOCK,
                    enable_fp_fusion=False,
                    grid=(1,),
                ),
                update_kernel.warmup(
                    MockTensor(layout.weight),
                    state,
                    skip,
                    n,
                    cols,
                    u_row,
                    u_col,
                    0.5,
                    0.5,
                    BLOCK=_BLOCK,
                    enable_fp_fusion=False,
                    grid=(1,),
                ),
            ]
            for kernel in compiled:
                kernel.run  # noqa: B018 - builds the launcher and loads the module
    except Exception as err:  # raised on the training thread by _background_done
        _background_errors.append(err)
