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

[Note: one launch per batch]
A step updates many matrices, and on a small model launching two kernels for each of them
costs more host time than the device spends (a ViT-S/16: 96 launches of about 30 µs each per
step, the device idle in between). So each pass takes the matrices of one shape at once, one
launch per dtype combination, one program per block and matrix (``program_id(1)``). Every
operand is passed as its first tensor plus an int64 table of element offsets, row ``i``
holding each operand's ``i``-th tensor's offset from that first one (``_table``: one small
host-to-device copy per launch; a single matrix uses a cached table of zeros). When every
tensor of an operand starts on 16 bytes, its offsets are multiples of a 16-byte vector's
elements and the kernel is told so (``VEC_*``), so it keeps the vector loads and stores that
one tensor per launch gets. The arithmetic per element is unchanged.

[Note: transposed updates]
Newton–Schulz orthogonalises a tall matrix as its transpose, so its result is a transposed
view (strides ``(1, rows)``). Read element by element in the weight's row-major order, as the
update pass reads a row-major result, consecutive programs' lanes would load addresses
``rows`` elements apart: one 32-byte sector per two-byte element, 16 times the traffic. For
such a result the pass runs on square tiles instead (``update_kernel``'s ``TILED``): each tile
of the result is loaded along its contiguous axis and the compiler moves it to the weight's
layout through shared memory. The arithmetic per element is the same, so are the bits.

[Note: hyperparameters on the device]
A CUDA graph replays its kernels with the arguments they were captured with, while a step's
learning rate (and with it the update's decay and step) changes at every step under a
schedule. So the graphed Muon phase (``_graphed_step``) hands the kernels their scalars on the
device: each launch's offset table gets one more column, the row of each matrix in an fp32
``(momentum, decay, step)`` table (a ``DeviceScalars``), and the kernels compiled with ``HP``
read their scalars from that row. The table holds the fp32 numbers the scalar arguments round
to (a Python float passed to a kernel is rounded to fp32 just so), so the bits are those of the
scalar arguments. A graphed phase makes its offset tables once (``static_tables``: a capture
cannot copy from the host) and keeps them with its graph; only the scalar table is rewritten
before each replay.

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
import contextlib
import functools
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "DeviceScalars",
    "FusedLayout",
    "advance_momentum",
    "compile_in_background",
    "fused_available",
    "kernels_ready",
    "momentum_into",
    "ns_input_into",
    "static_tables",
    "update_weight",
]

_BLOCK = 1024
_TILE = 64  # the edge of update_kernel's square tiles (TILED)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Compiles started by compile_in_background that the passes have not seen finish, and the
# errors they met.
_background: list[threading.Thread] = []
_background_errors: list[Exception] = []
# How long the interpreter's exit waits for a background compile.
_EXIT_WAIT_S = 60.0
# The offset tables of a graphed phase, while it runs (see static_tables).
_static: ContextVar[dict[Any, Tensor] | None] = ContextVar("dmuon_static_tables", default=None)


class DeviceScalars(NamedTuple):
    """What the kernels read from the device in a graphed step ([Note: hyperparameters on the
    device]): ``values`` is an fp32 ``(rows, 3)`` table of ``(momentum, decay, step)``,
    ``rows[i]`` the row of the call's ``i``-th matrix. For the momentum pass also where the
    gradients are: ``grad_offsets`` (int64) holds each gradient matrix's element offset from
    the ``anchors`` tensor of its dtype, ``grad_rows[i]`` the call's ``i``-th matrix's entry."""

    values: Tensor
    rows: Sequence[int]
    grad_offsets: Tensor | None = None
    grad_rows: Sequence[int] | None = None
    anchors: Mapping[torch.dtype, Tensor] | None = None


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
        table_ptr,
        skip_ptr,
        hp_ptr,
        grad_offsets_ptr,
        n,
        momentum,
        NESTEROV: tl.constexpr,
        VEC_BUF: tl.constexpr,
        VEC_GRAD: tl.constexpr,
        VEC_OUT: tl.constexpr,
        BLOCK: tl.constexpr,
        STORE_BUF: tl.constexpr = True,
        STORE_OUT: tl.constexpr = True,
        HP: tl.constexpr = False,
        DEVICE_GRADS: tl.constexpr = False,
    ):
        if HP:
            # The momentum from the device ([Note: hyperparameters on the device]).
            row = table_ptr + tl.program_id(1) * 4
            momentum = tl.load(hp_ptr + tl.load(row + 3) * 3)
        else:
            row = table_ptr + tl.program_id(1) * 3
        if DEVICE_GRADS:
            # The gradient's offset from the device too (the same note).
            grad_ptr += tl.multiple_of(tl.load(grad_offsets_ptr + tl.load(row + 1)), VEC_GRAD)
        else:
            grad_ptr += tl.multiple_of(tl.load(row + 1), VEC_GRAD)
        # Each operand's tensor of this matrix ([Note: one launch per batch]).
        buf_ptr += tl.multiple_of(tl.load(row), VEC_BUF)
        out_ptr += tl.multiple_of(tl.load(row + 2), VEC_OUT)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        skip = tl.load(skip_ptr) != 0
        old = tl.load(buf_ptr + offs, mask=mask)
        grad = tl.load(grad_ptr + offs, mask=mask).to(tl.float32)
        new = (old.to(tl.float32) * momentum + grad).to(old.dtype)
        if STORE_BUF:
            tl.store(buf_ptr + offs, tl.where(skip, old, new), mask=mask)
        if STORE_OUT:
            if NESTEROV:
                value = grad + momentum * new.to(tl.float32)
            else:
                value = new.to(tl.float32)
            tl.store(out_ptr + offs, value.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def update_kernel(
        p_ptr,
        u_ptr,
        table_ptr,
        skip_ptr,
        hp_ptr,
        n,
        cols,
        u_row,
        u_col,
        decay,
        step,
        VEC_P: tl.constexpr,
        BLOCK: tl.constexpr,
        TILED: tl.constexpr = False,
        HP: tl.constexpr = False,
    ):
        # TILED: BLOCK x BLOCK tiles of a matrix whose NS result is a transposed view
        # (u_row == 1), each operand read along its own contiguous axis ([Note: transposed
        # updates]); else BLOCK elements in the weight's row-major order.
        if HP:
            # The decay and step from the device ([Note: hyperparameters on the device]).
            row = table_ptr + tl.program_id(2 if TILED else 1) * 3
            hp = hp_ptr + tl.load(row + 2) * 3
            decay = tl.load(hp + 1)
            step = tl.load(hp + 2)
        else:
            row = table_ptr + tl.program_id(2 if TILED else 1) * 2
        p_ptr += tl.multiple_of(tl.load(row), VEC_P)
        u_ptr += tl.load(row + 1)  # read through its strides below: no vector hint
        if TILED:
            r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            mask = (r < n // cols)[:, None] & (c < cols)[None, :]
            offs = r[:, None] * cols + c[None, :]
            u_offs = r[:, None] * u_row + c[None, :] * u_col
        else:
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            u_offs = (offs // cols) * u_row + (offs % cols) * u_col
        skip = tl.load(skip_ptr) != 0
        old = tl.load(p_ptr + offs, mask=mask)
        update = tl.load(u_ptr + u_offs, mask=mask).to(tl.float32)
        new = (old.to(tl.float32) * decay + step * update).to(old.dtype)
        tl.store(p_ptr + offs, tl.where(skip, old, new), mask=mask)

    return momentum_kernel, update_kernel


def fused_available(*tensors: Tensor) -> bool:
    """Whether the kernels can run on ``tensors`` (CUDA, or CPU under Triton's interpreter;
    contiguous; fp32/bf16/fp16), compiled or not."""
    device = tensors[0].device
    if device.type != "cuda" and not (device.type == "cpu" and _interpreting()):
        return False
    # Every tensor of a step's pass (three per matrix), at every step: a plain loop, the first
    # tensor's device read once (about 0.4 µs a tensor less than a generator reading both).
    for t in tensors:
        if not (t.is_contiguous() and t.dtype in _DTYPES and t.device == device):
            return False
    return _kernels() is not None


def kernels_ready() -> bool:
    """Whether every background compile has finished (see [Note: compiling off the training
    thread]): until then the passes run as torch ops."""
    return not _background or _background_done()


def _no_scalars_by_value(hp: DeviceScalars | None) -> None:
    """The torch ops take the scalars by value: inside a capture they would fix this step's
    values in the graph, where the kernels read them from ``hp`` at each replay. Reported as a
    failed capture (the graphed phase then runs eagerly)."""
    if hp is not None and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "dmuon: a Muon pass would capture its hyperparameters by value (the fused kernels"
            " do not take these tensors: not contiguous, or not fp32/bf16/fp16)"
        )


def _use_kernels(*tensors: Tensor) -> bool:
    """Whether the passes run as kernels on ``tensors``: they can, and are compiled."""
    return kernels_ready() and fused_available(*tensors)


def _background_done() -> bool:
    """Whether every background compile has finished (see [Note: compiling off the training
    thread]); an error one of them met is raised here, on the caller's thread."""
    if any(thread.is_alive() for thread in _background):
        return False
    _background.clear()
    if _background_errors:
        raise _background_errors.pop(0)
    return True


def _grid(n: int, matrices: int) -> tuple[int, int]:
    return ((n + _BLOCK - 1) // _BLOCK, matrices)


def _tile_grid(rows: int, cols: int, matrices: int) -> tuple[int, int, int]:
    return ((rows + _TILE - 1) // _TILE, (cols + _TILE - 1) // _TILE, matrices)


@functools.cache
def _no_skip(device: torch.device) -> Tensor:
    """The skip flag of a step that cannot be skipped: a cleared flag, made once per device
    (the kernels only read it)."""
    return torch.zeros((), dtype=torch.bool, device=device)


@functools.cache
def _zero_table(device: torch.device, columns: int) -> Tensor:
    """The offset table of a launch over one matrix (every offset zero), made once."""
    return torch.zeros((1, columns), dtype=torch.int64, device=device)


def _table(
    operands: Sequence[Sequence[Tensor]],
    device: torch.device,
    hp_rows: Sequence[int] | None,
    grad_rows: Sequence[int] | None,
    ptrs: Sequence[Sequence[int]],
) -> Tensor:
    """The launch's offset table: row ``i``, column ``j`` is the element offset of
    ``operands[j][i]`` from ``operands[j][0]`` (``ptrs[j][i]``, their ``data_ptr()``; see
    [Note: one launch per batch]), and with
    ``hp_rows`` a last column, the row of matrix ``i``'s scalars; with ``grad_rows`` the
    second column holds those instead, each gradient's entry in the device's offsets
    ([Note: hyperparameters on the device])."""
    if len(operands[0]) == 1 and hp_rows is None:
        return _zero_table(device, len(operands))
    # Column by column (one comprehension per operand, not one per matrix), then the rows.
    columns = []
    for ts, column in zip(operands, ptrs, strict=True):
        base, size = column[0], ts[0].element_size()
        columns.append([(ptr - base) // size for ptr in column])
    if grad_rows is not None:
        columns[1] = list(grad_rows)
    if hp_rows is not None:
        columns.append(list(hp_rows))
    rows = list(zip(*columns, strict=True))
    memo = _static.get()
    if memo is None:
        return torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
    key = (device, tuple(map(tuple, rows)))
    table = memo.get(key)
    if table is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Reported as a failed capture: the phase then runs eagerly.
            raise RuntimeError(
                "dmuon: a CUDA-graph capture of the Muon phase needed an offset table that its"
                " eager run did not make"
            )
        table = memo[key] = torch.tensor(rows, dtype=torch.int64).to(device)
    return table


@contextlib.contextmanager
def static_tables(memo: dict[Any, Tensor]) -> Iterator[None]:
    """While inside, each launch takes its offset table from ``memo`` (made there on first
    use, never inside a CUDA-graph capture), which keeps it for the caller: a graph captured
    inside reads the tables for as long as ``memo`` holds them ([Note: hyperparameters on the
    device])."""
    token = _static.set(memo)
    try:
        yield
    finally:
        _static.reset(token)


def _vec(tensors: Sequence[Tensor], ptrs: Sequence[int]) -> int:
    """How many elements every offset from ``tensors[0]`` is a multiple of, as the kernels
    are told: a 16-byte vector's worth when every tensor starts on 16 bytes (``ptrs``, their
    ``data_ptr()``), else 1."""
    if all(ptr % 16 == 0 for ptr in ptrs):
        return 16 // tensors[0].element_size()
    return 1


def _by_dtypes(*operands: Sequence[Tensor]) -> Iterable[list[int]]:
    """The matrices' indices grouped by their operands' dtypes (one launch per group)."""
    groups: dict[tuple[torch.dtype, ...], list[int]] = {}
    for i, dtypes in enumerate(zip(*([t.dtype for t in ts] for ts in operands))):
        groups.setdefault(dtypes, []).append(i)
    return groups.values()


def _launch(
    kernel: Any,
    operands: Sequence[Sequence[Tensor]],
    vectors: Sequence[str],
    skip: Tensor | None,
    n: int,
    *args: Any,
    tiles: tuple[int, int] | None = None,
    hp: DeviceScalars | None = None,
    with_grad_offsets: bool = False,
    **constexprs: Any,
) -> None:
    """Run ``kernel`` over the matrices of ``operands`` (one list per tensor argument, each
    ``n`` elements per matrix): one launch per dtype combination, each given its first tensors,
    its offset table, the skip flag, the scalar table, ``n`` and ``args``; ``vectors`` names
    the vector hint of the leading operands (see [Note: one launch per batch]). ``tiles``: a
    2-D kernel's ``(rows, cols)`` of one matrix, cut into ``_TILE`` squares; else blocks of
    ``_BLOCK``. ``hp``: the scalars come from the device ([Note: hyperparameters on the
    device]), not from ``args``."""
    device = operands[0][0].device
    flag = _no_skip(device) if skip is None else skip
    for group in _by_dtypes(*operands):
        # Every matrix (one dtype combination, the usual case): the operands as they are.
        whole = len(group) == len(operands[0])
        picked = [list(ts) if whole else [ts[i] for i in group] for ts in operands]
        hp_rows = None if hp is None else [hp.rows[i] for i in group]
        # Each tensor's address, read once for the vector hints and the offset table.
        ptrs = [[t.data_ptr() for t in ts] for ts in picked]
        hints = {name: _vec(ts, p) for name, ts, p in zip(vectors, picked, ptrs)}
        bases: list[Tensor] = [ts[0] for ts in picked]
        grad_rows = grad_offsets = None
        if hp is not None and hp.grad_rows is not None:
            # The gradients (the second operand) from the device: offsets from an anchor.
            assert hp.anchors is not None and hp.grad_offsets is not None
            grad_rows = [hp.grad_rows[i] for i in group]
            grad_offsets = hp.grad_offsets
            bases[1] = hp.anchors[bases[1].dtype]
        grid: tuple[int, ...]
        if tiles is None:
            grid, block = _grid(n, len(group)), _BLOCK
        else:
            grid, block = _tile_grid(*tiles, len(group)), _TILE
        grads: tuple[Tensor, ...] = ()
        if with_grad_offsets:  # the momentum kernel's
            grads = (flag if grad_offsets is None else grad_offsets,)  # read with DEVICE_GRADS
            constexprs["DEVICE_GRADS"] = grad_offsets is not None
        kernel[grid](
            *bases,
            _table(picked, device, hp_rows, grad_rows, ptrs),
            flag,
            flag if hp is None else hp.values,  # never read without HP
            *grads,
            n,
            *args,
            **constexprs,
            **hints,
            BLOCK=block,
            HP=hp is not None,
            enable_fp_fusion=False,
        )


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
    bufs: Sequence[Tensor],
    grads: Sequence[Tensor],
    outs: Sequence[Tensor],
    skip: Tensor | None,
    momentum: float,
    nesterov: bool,
    *,
    kernel: bool | None = None,
    hp: DeviceScalars | None = None,
) -> None:
    """For each matrix ``i`` (all of one shape): ``bufs[i] = momentum·bufs[i] + grads[i]``
    (kept when ``skip``, a 0-d bool tensor, is set) and the NS input into ``outs[i]``:
    ``grads[i] + momentum·bufs[i]`` with Nesterov, ``bufs[i]`` without. ``kernel``: the Triton
    kernels (``True``), the torch ops (``False``) or, by default, the kernels where they run
    and are compiled (see [Note: fused momentum and update]). ``hp``: the kernels read
    ``momentum`` there (the same value; [Note: hyperparameters on the device])."""
    _momentum(bufs, grads, outs, skip, momentum, nesterov, kernel, store_buf=True, hp=hp)


def ns_input_into(
    bufs: Sequence[Tensor],
    grads: Sequence[Tensor],
    outs: Sequence[Tensor],
    momentum: float,
    nesterov: bool,
    *,
    kernel: bool | None = None,
) -> None:
    """The NS input of :func:`momentum_into` into ``outs`` (the same bits, as if the step were
    not skipped), leaving ``bufs`` as they are: the first half of a step split in two (see
    [Note: Newton–Schulz during backward] in ``_ns_overlap``)."""
    _momentum(bufs, grads, outs, None, momentum, nesterov, kernel, store_buf=False)


def advance_momentum(
    bufs: Sequence[Tensor],
    grads: Sequence[Tensor],
    skip: Tensor | None,
    momentum: float,
    *,
    kernel: bool | None = None,
) -> None:
    """``bufs[i]`` advanced exactly as :func:`momentum_into` advances it (kept when ``skip``
    is set), without an NS input: the second half of a step split in two."""
    _momentum(bufs, grads, None, skip, momentum, False, kernel, store_buf=True)


def _momentum(
    bufs: Sequence[Tensor],
    grads: Sequence[Tensor],
    outs: Sequence[Tensor] | None,
    skip: Tensor | None,
    momentum: float,
    nesterov: bool,
    kernel: bool | None,
    *,
    store_buf: bool,
    hp: DeviceScalars | None = None,
) -> None:
    """The momentum pass: the buffers advanced (``store_buf``) and/or the NS input written
    (``outs`` given), one arithmetic for all three uses."""
    momentum = float(momentum)
    if kernel is None:
        kernel = _use_kernels(*bufs, *grads, *(outs or ()))
    if kernel:
        momentum_kernel, _ = _kernels()
        _launch(
            momentum_kernel,
            (bufs, grads, bufs if outs is None else outs),  # no NS input: never stored
            ("VEC_BUF", "VEC_GRAD", "VEC_OUT"),
            skip,
            bufs[0].numel(),
            momentum,
            NESTEROV=nesterov,
            STORE_BUF=store_buf,
            STORE_OUT=outs is not None,
            hp=hp,
            with_grad_offsets=True,
        )
        return
    _no_scalars_by_value(hp)
    no_outs: list[Tensor | None] = [None] * len(bufs)
    for buf, grad, out in zip(bufs, grads, no_outs if outs is None else outs):
        # The kernel's arithmetic, op for op; the wide values are formed in ``out`` when it
        # has their dtype (no temporary).
        wide = _wide(buf, grad)
        new = out if out is not None and out.dtype == wide else torch.empty_like(buf, dtype=wide)
        _times(buf, momentum, out=new).add_(grad)
        if store_buf:
            _store(buf, new, skip)  # rounds once, to the buffer's dtype
            stored = buf
        else:
            stored = new.to(buf.dtype)  # the buffer as it would be stored
        if out is None:
            continue
        if nesterov:
            # grad + momentum·buf from the buffer as stored (a skipped step's input is unused).
            _times(stored, momentum, out=new).add_(grad)
            if new is not out:
                out.copy_(new)
        else:
            out.copy_(stored)


def _times(t: Tensor, factor: float, *, out: Tensor) -> Tensor:
    """``out = t·factor`` computed in ``out``'s dtype (widened first: a product in ``t``'s own
    narrower dtype would round there)."""
    if t.dtype == out.dtype:
        return torch.mul(t, factor, out=out)
    return out.copy_(t).mul_(factor)


def update_weight(
    params: Sequence[Tensor],
    updates: Sequence[Tensor],
    skip: Tensor | None,
    decay: float,
    step: float,
    *,
    kernel: bool | None = None,
    hp: DeviceScalars | None = None,
) -> None:
    """``params[i] = decay·params[i] + step·updates[i]`` (kept when ``skip`` is set) for 2-D
    ``params`` of one shape and ``updates`` of that shape, all with the same strides (any);
    ``kernel`` and ``hp`` (which holds ``decay`` and ``step``) as in :func:`momentum_into`."""
    decay, step = float(decay), float(step)
    if kernel is None:
        kernel = _use_kernels(*params)
    if kernel:
        _, update_kernel = _kernels()
        rows, cols = params[0].shape
        u_row, u_col = updates[0].stride()
        transposed = _transposed(rows, cols, u_row, u_col)
        # The NS results are read through their strides: no vector hint for them.
        _launch(
            update_kernel,
            (params, updates),
            ("VEC_P",),
            skip,
            rows * cols,
            cols,
            u_row,
            u_col,
            decay,
            step,
            tiles=(rows, cols) if transposed else None,
            hp=hp,
            TILED=transposed,
        )
        return
    _no_scalars_by_value(hp)
    for param, update in zip(params, updates):
        # The kernel's arithmetic, op for op.
        new = _times(update, step, out=torch.empty_like(param, dtype=_wide(param, update)))
        # decay·param + step·update; a decay of 1 multiplies exactly, so it is left out.
        new.add_(param if decay == 1.0 else _times(param, decay, out=torch.empty_like(new)))
        _store(param, new, skip)  # rounds once, to the parameter's dtype


def _transposed(rows: int, cols: int, u_row: int, u_col: int) -> bool:
    """Whether an NS result with these strides is a transposed view (see [Note: transposed
    updates])."""
    return u_row == 1 and rows > 1 and cols > 1


class FusedLayout(NamedTuple):
    """What the kernels see of one owned matrix in a step (see [Note: compiling off the
    training thread])."""

    shape: tuple[int, int]
    weight: torch.dtype  # the master weight the update writes
    grad: torch.dtype  # the reduced gradient
    state: torch.dtype  # the momentum buffer, the NS input and its result
    nesterov: bool
    split: bool = False  # the step split in two passes too (ns_overlap)
    hp: bool = False  # the scalars on the device (cuda_graph)


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
        table = MockTensor(torch.int64)
        scalars = MockTensor(torch.float32)
        torch.cuda.set_device(device)  # the current device is per thread; Triton keys on it
        for layout in layouts:
            rows, cols = layout.shape
            n = rows * cols
            # A tall matrix's NS result is the transpose of a wide one's (update_kernel).
            u_row, u_col = (1, rows) if rows > cols else (cols, 1)
            state = MockTensor(layout.state)
            # Tensors from torch's allocator start on 16 bytes (the VEC_* of _vec).
            vec_state, vec_grad, vec_weight = (
                16 // dtype.itemsize for dtype in (layout.state, layout.grad, layout.weight)
            )
            # The one-pass momentum, and with ``split`` its two halves (ns_input_into,
            # advance_momentum).
            passes = (
                [(True, True), (False, True), (True, False)] if layout.split else [(True, True)]
            )
            compiled = []
            for store_buf, store_out in passes:
                # The graphed step's one pass reads its scalars and gradients on the device.
                device_scalars = layout.hp and store_buf and store_out
                compiled.append(
                    momentum_kernel.warmup(
                        state,
                        MockTensor(layout.grad),
                        state,
                        table,
                        skip,
                        scalars if device_scalars else skip,
                        table if device_scalars else skip,
                        n,
                        0.5,
                        NESTEROV=layout.nesterov and store_out,
                        VEC_BUF=vec_state,
                        VEC_GRAD=vec_grad,
                        VEC_OUT=vec_state,
                        BLOCK=_BLOCK,
                        STORE_BUF=store_buf,
                        STORE_OUT=store_out,
                        HP=device_scalars,
                        DEVICE_GRADS=device_scalars,
                        enable_fp_fusion=False,
                        grid=(1, 1),
                    )
                )
            transposed = _transposed(rows, cols, u_row, u_col)
            compiled.append(
                update_kernel.warmup(
                    MockTensor(layout.weight),
                    state,
                    table,
                    skip,
                    scalars if layout.hp else skip,
                    n,
                    cols,
                    u_row,
                    u_col,
                    0.5,
                    0.5,
                    VEC_P=vec_weight,
                    BLOCK=_TILE if transposed else _BLOCK,
                    TILED=transposed,
                    HP=layout.hp,
                    enable_fp_fusion=False,
                    grid=(1, 1),
                )
            )
            for kernel in compiled:
                kernel.run  # noqa: B018 - builds the launcher and loads the module
    except Exception as err:  # raised on the training thread by _background_done
        _background_errors.append(err)
