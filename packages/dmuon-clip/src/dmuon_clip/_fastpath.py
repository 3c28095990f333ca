"""The fused segmented clip: when it applies, its tables, and its launches.

[Note: fast-path contract]
The fused kernels run when (a) triton imports, (b) the norm is the 2-norm or the inf-norm, and
(c) the accumulator device is CUDA (or the CPU while Triton runs its interpreter,
``TRITON_INTERPRET=1``, which is how the kernels are tested without a GPU). Inside a call each
tensor then goes through the kernels when it is a plain dense contiguous tensor on that device,
float16 / bfloat16 / float32, 16-byte aligned and non-empty; any other tensor (non-contiguous,
sparse, float64, a misaligned view, another device) is measured and scaled by torch's foreach
ops instead. That per-tensor choice never changes the collectives: every bucket's local sum is
formed first, then one all-reduce covers all of them.
"""

from __future__ import annotations

import contextlib
import importlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from dmuon_clip._environment import triton_interpreting

__all__ = [
    "KernelPlan",
    "finalize",
    "kernel_accepts",
    "partial_sums",
    "scale_",
    "unavailable_reason",
    "upload",
]

# Elements per program. 64 Ki elements keep a 3.5 GB gradient set at ~27k programs (cheap stage-2
# walk) while each program still streams enough to hide its latency; tests shrink it to exercise
# many chunks per tensor on tiny inputs.
_CHUNK = 65536
_BLOCK = 4096
_NUM_WARPS = 8
_REDUCE_BLOCK = 1024
_ALIGN_BYTES = 16
_CACHE_SIZE = 8

_table_cache: OrderedDict[tuple, KernelPlan] = OrderedDict()
_upload_cache: OrderedDict[tuple, Tensor] = OrderedDict()


def _kernels() -> Any:
    return importlib.import_module("dmuon_clip._kernels")


def _kernels_missing() -> str | None:
    """Why the kernel module cannot run anywhere in this process (``None``: it imports and
    triton is there)."""
    try:
        kernels = _kernels()
    except ImportError as exc:  # pragma: no cover - depends on the environment
        return f"the kernel module failed to import ({exc})"
    if kernels.triton is None:
        return "triton is not installed (pip install 'triton>=3.4')"
    return None


def unavailable_in_process() -> str | None:
    """Why the fused kernels can run on no device of this process (``None``: on some they may):
    neither CUDA nor the Triton interpreter, or no triton."""
    if not torch.cuda.is_available() and not triton_interpreting():
        return "neither CUDA nor the Triton interpreter (TRITON_INTERPRET=1) is available"
    return _kernels_missing()


def unavailable_reason(device: torch.device, norm_type: float) -> str | None:
    """Why the fused kernels cannot run for this accumulator device and norm (``None``: they can)."""
    if norm_type not in (2.0, float("inf")):
        return f"the fused kernel computes the 2-norm and the inf-norm only (norm_type={norm_type})"
    if device.type != "cuda" and not (device.type == "cpu" and triton_interpreting()):
        return f"the accumulator device is {device}, not CUDA"
    return _kernels_missing()


def kernel_accepts(t: Tensor, device: torch.device) -> bool:
    """Whether one tensor fits the kernels' contract (see [Note: fast-path contract])."""
    return (
        type(t) is Tensor
        and t.layout == torch.strided
        and t.device == device
        and t.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and t.is_contiguous()
        and t.numel() > 0
        and t.data_ptr() % _ALIGN_BYTES == 0
    )


def upload(
    values: Sequence[float] | Sequence[int], dtype: torch.dtype, device: torch.device
) -> Tensor:
    """A small host-side table on ``device`` without a host sync: a pageable copy would block, so
    the values go through pinned memory with ``non_blocking=True`` (the pinned block stays
    reserved until the copy has run). Cached, because the same table comes back every step."""
    key = (tuple(values), dtype, device, _stream_id(device))
    cached = _upload_cache.get(key)
    if cached is not None:
        _upload_cache.move_to_end(key)
        return cached
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        out = host
    else:
        out = host.pin_memory().to(device, non_blocking=True)
    _remember(_upload_cache, key, out)
    return out


def _stream_id(device: torch.device) -> int | None:
    # Cached device tables were written on the stream current at upload; a call on another stream
    # gets its own copy rather than racing that upload (or outliving it in the allocator's view).
    if device.type != "cuda":
        return None
    return torch.cuda.current_stream(device).stream_id


def _remember(cache: OrderedDict, key: tuple, value: Any) -> None:
    cache[key] = value
    if len(cache) > _CACHE_SIZE:
        cache.popitem(last=False)


class _Launch(NamedTuple):
    base: Tensor  # the launch's first tensor: chunk offsets are relative to it
    lo: int  # its rows in the chunk table
    hi: int
    vec: int


class KernelPlan(NamedTuple):
    """The chunk table of one set of kernel tensors (see [Note: chunk table])."""

    table: Tensor  # (n_chunks, 4) int64 on the device
    launches: tuple[_Launch, ...]  # one per dtype
    n_chunks: int


def _build_plan(slot_tensors: Sequence[tuple[int, Tensor]], device: torch.device) -> KernelPlan:
    chunk = _CHUNK
    key = (
        chunk,
        device,
        _stream_id(device),
        *((s, t.data_ptr(), t.numel(), t.dtype) for s, t in slot_tensors),
    )
    cached = _table_cache.get(key)
    if cached is not None:
        _table_cache.move_to_end(key)
        # The bases must be this call's tensors (same addresses, possibly new tensor objects).
        return cached._replace(launches=_rebase(cached.launches, slot_tensors))
    by_dtype: dict[torch.dtype, list[tuple[int, Tensor]]] = {}
    for slot, t in slot_tensors:
        by_dtype.setdefault(t.dtype, []).append((slot, t))
    parts: list[Tensor] = []
    launches = []
    n_rows = 0
    for dtype, members in by_dtype.items():
        itemsize = torch.empty((), dtype=dtype).element_size()
        vec = _ALIGN_BYTES // itemsize
        base = members[0][1]
        rows = _chunk_rows(members, base.data_ptr(), itemsize, vec, chunk)
        parts.append(rows)
        launches.append(_Launch(base, n_rows, n_rows + rows.shape[0], vec))
        n_rows += rows.shape[0]
    table = torch.cat(parts) if parts else torch.empty((0, 4), dtype=torch.int64)
    if device.type != "cpu":
        table = table.pin_memory().to(device, non_blocking=True)
    plan = KernelPlan(table, tuple(launches), n_rows)
    _remember(_table_cache, key, plan)
    return plan


def _chunk_rows(
    members: Sequence[tuple[int, Tensor]], base_ptr: int, itemsize: int, vec: int, chunk: int
) -> Tensor:
    # Vectorised on the host: a 3.5 GB gradient set is ~27k rows, too many for a Python loop.
    ptrs = torch.tensor([t.data_ptr() for _, t in members], dtype=torch.int64)
    numels = torch.tensor([t.numel() for _, t in members], dtype=torch.int64)
    slots = torch.tensor([s for s, _ in members], dtype=torch.int64)
    n_chunks = (numels + chunk - 1) // chunk
    owner = torch.repeat_interleave(torch.arange(len(members)), n_chunks)
    first_row = torch.cumsum(n_chunks, 0) - n_chunks
    start = (torch.arange(owner.numel()) - first_row[owner]) * chunk
    remaining = torch.clamp(numels[owner] - start, max=chunk)
    tail = remaining % vec
    offset = torch.div(ptrs[owner] - base_ptr, itemsize, rounding_mode="floor") + start
    return torch.stack([offset, remaining - tail, tail, slots[owner]], dim=1)


def _rebase(
    launches: tuple[_Launch, ...], slot_tensors: Sequence[tuple[int, Tensor]]
) -> tuple[_Launch, ...]:
    # Launches start at the first tensor of each dtype, in order of appearance.
    firsts: dict[torch.dtype, Tensor] = {}
    for _, t in slot_tensors:
        firsts.setdefault(t.dtype, t)
    return tuple(launch._replace(base=firsts[launch.base.dtype]) for launch in launches)


def _device_ctx(device: torch.device) -> Any:
    # Triton launches on the current CUDA device; make it the grads' one.
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def partial_sums(
    slot_tensors: Sequence[tuple[int, Tensor]],
    n_slots: int,
    device: torch.device,
    inf_norm: bool,
) -> tuple[Tensor, KernelPlan]:
    """Pass 1 and stage 2: the per-slot sum of squares (max |x| for the inf-norm), fp32 (n_slots,)."""
    plan = _build_plan(slot_tensors, device)
    kernels = _kernels()
    sums = torch.empty(n_slots, dtype=torch.float32, device=device)
    partials = torch.empty(max(plan.n_chunks, 1), dtype=torch.float32, device=device)
    with _device_ctx(device):
        for launch in plan.launches:
            kernels.partial_norm[(launch.hi - launch.lo,)](
                launch.base,
                plan.table[launch.lo : launch.hi],
                partials[launch.lo : launch.hi],
                INF_NORM=inf_norm,
                CHUNK=_CHUNK,
                BLOCK=_BLOCK,
                VEC=launch.vec,
                num_warps=_NUM_WARPS,
            )
        kernels.bucket_reduce[(n_slots,)](
            plan.table,
            partials,
            plan.n_chunks,
            sums,
            INF_NORM=inf_norm,
            BLOCK=_REDUCE_BLOCK,
            N_ITERS=next_power_of_2(-(-plan.n_chunks // _REDUCE_BLOCK)),
        )
    return sums, plan


def finalize(
    sums: Tensor, max_norms: Tensor, inf_norm: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One launch: ``(totals, coefs, clipped, found_inf, combined_total)`` from the reduced sums."""
    n = sums.numel()
    out = torch.empty(2 * n + 1, dtype=torch.float32, device=sums.device)
    flags = torch.empty(2 * n, dtype=torch.uint8, device=sums.device)
    with _device_ctx(sums.device):
        _kernels().finalize[(1,)](
            sums,
            max_norms,
            n,
            out,
            flags,
            INF_NORM=inf_norm,
            BLOCK_S=max(next_power_of_2(n), 2),
        )
    flags_b = flags.view(torch.bool)
    return out[:n], out[n : 2 * n], flags_b[:n], flags_b[n:], out[2 * n]


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def scale_(plan: KernelPlan, coefs: Tensor) -> None:
    """Pass 2: every kernel tensor times its slot's coefficient, in place."""
    kernels = _kernels()
    with _device_ctx(coefs.device):
        for launch in plan.launches:
            kernels.scale[(launch.hi - launch.lo,)](
                launch.base,
                plan.table[launch.lo : launch.hi],
                coefs,
                CHUNK=_CHUNK,
                BLOCK=_BLOCK,
                VEC=launch.vec,
                num_warps=_NUM_WARPS,
            )
