"""Segmented clipping: several buckets, each with its own norm and coefficient, one collective.

[Note: one collective for all buckets]
Every bucket's local sum of ``|g|^p`` (max ``|g|`` for the inf-norm) is written into one fp32
vector, ordered so that the buckets with ``reduce=True`` come first; a single all-reduce (SUM, or
MAX for the inf-norm) over that prefix makes them global, the ``reduce=False`` buckets stay local.
Norms, coefficients and flags are then computed on the device and the grads scaled in place, so a
call never waits for the host. Which tensors went through the fused kernel and which through
torch's foreach ops changes only how the local sums are formed, never the collective, so ranks
that fall back differently still match. Every rank must pass the same bucket names in the same
order with the same ``reduce`` flags.

[Note: non-finite norms]
A bucket whose norm is NaN or inf gets ``found_inf=True`` and coefficient 1: its grads are left
exactly as they are. Multiplying by a NaN coefficient would turn every finite entry into NaN, and
a non-finite gradient must be reported (``found_inf``, the caller decides to skip the step), never
silently turned into a corrupted weight. Other buckets are clipped normally: their sums never mix
with the bad one. The combined ``total_norm`` is then non-finite too.

[Note: accumulator precision]
Sums are accumulated in fp32 whatever the grads' dtype (fp16/bf16 per-tensor norms are taken with
an fp32 output, not rounded to the grads' dtype as ``torch.nn.utils.clip_grad_norm_`` does), and
the collective is always fp32, so ranks that hold grads of different dtypes, or none, still agree
on the reduced dtype.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon_clip import _fastpath
from dmuon_clip._compile import eager_under_compile
from dmuon_clip._profiling import span
from dmuon_clip._types import (
    GradClipBucket,
    GradClipBucketStats,
    SegmentedGradClipResult,
    SupportsMuonGradsForClip,
    clip_copies,
)

__all__ = [
    "clip_coefficient",
    "clip_grad_norm_buckets_",
    "scale_",
    "try_clip_optimizer_grad_norm_buckets_",
    "validate_max_norm",
    "validate_norm_type",
]

logger = logging.getLogger(__name__)

# The same epsilon as torch.nn.utils.clip_grad_norm_: coef = max_norm / (total_norm + 1e-6).
_EPS = 1e-6
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _as_float(value: object, *strings: str) -> float | None:
    """``float(value)`` for a number (a 0-dim tensor too), or for one of ``strings``; ``None``
    for a bool (``True`` would clip at 1.0), any other string and anything else."""
    if isinstance(value, bool) or (isinstance(value, str | bytes) and value not in strings):
        return None
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def validate_norm_type(norm_type: float) -> float:
    # "inf" as torch.nn.utils.clip_grad_norm_ documents it for the inf-norm.
    p = _as_float(norm_type, "inf")
    if p is None or not (p > 0.0):  # rejects NaN too
        raise ValueError(
            f"norm_type must be a positive number or float('inf'), got {norm_type!r}; use 2.0 "
            "for the Euclidean norm"
        )
    return p


def validate_max_norm(max_norm: float | None, what: str = "max_norm") -> float | None:
    """``max_norm`` as a float, or ``None`` to measure without scaling: ``None`` itself or
    ``inf``, whose coefficient torch's ``clip_grad_norm_`` clamps to 1 (its "log the norm, do
    not clip")."""
    if max_norm is None:
        return None
    value = _as_float(max_norm)
    if value is None or not value >= 0.0:  # NaN fails the comparison too
        raise ValueError(
            f"{what} must be a number >= 0 (inf, as in torch, or None measures without "
            f"clipping), got {max_norm!r}"
        )
    return None if value == math.inf else value


class _Plan(NamedTuple):
    buckets: tuple[GradClipBucket, ...]  # slot order: reduce=True first, then the local ones
    slot_of: tuple[int, ...]  # bucket index (as given) -> slot
    max_norms: tuple[float | None, ...]  # per slot
    n_reduce: int
    norm_type: float
    device: torch.device


def _resolve_device(
    device: torch.device | str | None, buckets: Sequence[GradClipBucket]
) -> torch.device:
    if device is None:
        first = next((g for b in buckets for g in b.grads), None)
        resolved = first.device if first is not None else torch.device("cpu")
    else:
        resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def _make_plan(
    buckets: Sequence[GradClipBucket],
    max_norm: float | Mapping[str, float | None] | None,
    norm_type: float,
    device: torch.device | str | None,
) -> _Plan:
    buckets = tuple(buckets)
    names = [b.name for b in buckets]
    for b in buckets:
        if not isinstance(b, GradClipBucket):
            raise ValueError(f"buckets must hold GradClipBucket objects, got {type(b).__name__}")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"bucket names must be unique; {duplicates} appear more than once")
    if isinstance(max_norm, Mapping):
        missing = [n for n in names if n not in max_norm]
        extra = sorted(set(max_norm) - set(names))
        if missing or extra:
            raise ValueError(
                f"max_norm as a mapping needs exactly one entry per bucket; missing {missing}, "
                f"unknown {extra} (the buckets are {names})"
            )
        per_bucket = [validate_max_norm(max_norm[n], f"max_norm[{n!r}]") for n in names]
    else:
        per_bucket = [validate_max_norm(max_norm)] * len(buckets)
    order = [i for i, b in enumerate(buckets) if b.reduce] + [
        i for i, b in enumerate(buckets) if not b.reduce
    ]
    slot_of = [0] * len(buckets)
    for slot, i in enumerate(order):
        slot_of[i] = slot
    return _Plan(
        buckets=tuple(buckets[i] for i in order),
        slot_of=tuple(slot_of),
        max_norms=tuple(per_bucket[i] for i in order),
        n_reduce=sum(1 for b in buckets if b.reduce),
        norm_type=validate_norm_type(norm_type),
        device=_resolve_device(device, buckets),
    )


def _group(tensors: Sequence[Tensor]) -> dict[tuple[torch.device, torch.dtype, bool], list[Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype, bool], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype, t.is_sparse), []).append(t)
    return groups


def _torch_local_sum(tensors: Sequence[Tensor], p: float, device: torch.device) -> Tensor:
    """This rank's ``sum |g|^p`` (``max |g|`` for p = inf) of some tensors, fp32 0-dim on ``device``."""
    norms: list[Tensor] = []
    # Empty tensors (an FSDP2 shard of a dimension smaller than the world) add nothing, and
    # the inf-norm of an empty tensor is an error.
    for (_, dtype, sparse), group in _group([t for t in tensors if t.numel()]).items():
        if sparse:
            values = [g.coalesce().values() for g in group]
            norms += [torch.linalg.vector_norm(v, p).float() for v in values if v.numel()]
        elif dtype in _KERNEL_DTYPES:
            norms += torch._foreach_norm(group, p, dtype=torch.float32)
        else:
            norms += [n.float() for n in torch._foreach_norm(group, p)]
    if not norms:
        return torch.zeros((), dtype=torch.float32, device=device)
    stacked = torch.stack([n.to(device) for n in norms])
    if p == math.inf:
        # See [Note: NaN under the inf-norm] in _kernels.py: NaN must not vanish in a max.
        return torch.where(stacked.isnan(), math.inf, stacked).max()
    if p == 2.0:
        return stacked.square().sum()
    return stacked.pow(p).sum()


def scale_(tensors: Sequence[Tensor], coef: Tensor) -> None:
    """Multiply ``tensors`` in place by the 0-dim ``coef`` (torch foreach ops, any device)."""
    for (dev, _, sparse), group in _group(tensors).items():
        c = coef.to(dev)
        if sparse:
            for g in group:
                g.mul_(c)
        else:
            torch._foreach_mul_(group, c)


def clip_coefficient(norm: Tensor, max_norm: Tensor | float) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_``'s coefficient, ``min(max_norm / (norm + 1e-6), 1)``,
    elementwise, with its arithmetic (the reciprocal, then the product); the callers decide
    what a non-finite norm gets."""
    return torch.clamp(torch.reciprocal(norm + _EPS) * max_norm, max=1.0)


def _torch_finalize(
    sums: Tensor, max_norms: Tensor, p: float
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The torch twin of ``_kernels.finalize``: same formula, same order of operations."""
    if p == math.inf:
        totals = sums
        combined = sums.max() if sums.numel() else sums.new_zeros(())
    elif p == 2.0:
        totals = sums.sqrt()
        combined = sums.sum().sqrt()
    else:
        totals = sums.pow(1.0 / p)
        combined = sums.sum().pow(1.0 / p)
    found_inf = ~torch.isfinite(totals)
    coef = clip_coefficient(totals, max_norms)
    clipped = ~found_inf & (max_norms >= 0.0) & (coef < 1.0)
    applied = torch.where(clipped, coef, 1.0)
    return totals, applied, clipped, found_inf, combined


def _all_reduce(sums: Tensor, n_reduce: int, p: float, process_group: Any) -> None:
    if process_group is None or n_reduce == 0:
        return
    op = dist.ReduceOp.MAX if p == math.inf else dist.ReduceOp.SUM
    with span("dmuon::clip_all_reduce"):
        dist.all_reduce(sums[:n_reduce], op=op, group=process_group)


def clip_grad_norm_buckets_(
    buckets: Sequence[GradClipBucket],
    max_norm: float | Mapping[str, float | None] | None,
    *,
    norm_type: float = 2.0,
    process_group: Any = None,
    device: torch.device | str | None = None,
) -> SegmentedGradClipResult:
    """Clip each bucket by its own norm, in place, with one collective for all reducing buckets.

    Per bucket this is ``torch.nn.utils.clip_grad_norm_`` (coefficient ``min(max_norm /
    (norm + 1e-6), 1)``) with two differences: a non-finite norm leaves the bucket's grads untouched
    and sets ``found_inf`` ([Note: non-finite norms]), and nothing waits for the host. The norm
    is a sum of ``|g|^p`` over the bucket, where torch takes the norm of per-tensor norms, so
    beyond the inf-norm it can differ from torch's by a few fp32 ulps.

    Args:
        buckets: the segments; names unique; identical names / order / ``reduce`` on every rank.
        max_norm: one threshold for every bucket, or a mapping ``{bucket name: threshold}``
            with exactly one entry per bucket; ``None`` (globally or for one bucket) measures
            without scaling.
        norm_type: ``p`` of the p-norm, ``> 0`` or ``float('inf')`` (``"inf"`` too, as torch
            spells it); a bool or another string raises ``ValueError``.
        process_group: the group ``reduce=True`` buckets are reduced over; ``None`` means not
            distributed: no collective at all.
        device: where the accumulators live; default: the first grad's device (CPU if there is
            none). With NCCL it must be this rank's CUDA device, also on ranks without grads.
    """
    with torch.no_grad(), span("dmuon::clip_grad_norm_buckets"):
        plan = _make_plan(buckets, max_norm, norm_type, device)
        reason = _fastpath.unavailable_reason(plan.device, plan.norm_type)
        if reason is None:
            return _run(plan, process_group, use_kernel=True)
        return _run(plan, process_group, use_kernel=False, reason=reason)


def _run(
    plan: _Plan, process_group: Any, *, use_kernel: bool, reason: str | None = None
) -> SegmentedGradClipResult:
    p, device = plan.norm_type, plan.device
    n = len(plan.buckets)
    inf_norm = p == math.inf
    kernel_tensors: list[tuple[int, Tensor]] = []
    fallback: list[list[Tensor]] = [[] for _ in range(n)]
    for slot, bucket in enumerate(plan.buckets):
        for g in bucket.grads:
            if use_kernel and _fastpath.kernel_accepts(g, device):
                kernel_tensors.append((slot, g))
            elif g.numel() > 0:
                fallback[slot].append(g)
    n_fallback = sum(len(f) for f in fallback)
    if use_kernel and n_fallback:
        reason = (
            f"{n_fallback} tensor(s) outside the kernel's contract (dense, contiguous, "
            "16-byte aligned fp16/bf16/fp32 on the accumulator device) went through torch"
        )
        logger.debug("clip_grad_norm_buckets_: %s", reason)

    max_norm_table = _fastpath.upload(
        [-1.0 if m is None else m for m in plan.max_norms], torch.float32, device
    )
    with span("dmuon::clip_local_norms"):
        kernel_plan = None
        if kernel_tensors:
            sums, kernel_plan = _fastpath.partial_sums(kernel_tensors, n, device, inf_norm)
            if n_fallback:
                extra = torch.stack([_torch_local_sum(f, p, device) for f in fallback])
                sums = torch.maximum(sums, extra) if inf_norm else sums + extra
        elif n:
            sums = torch.stack([_torch_local_sum(f, p, device) for f in fallback])
        else:
            sums = torch.zeros(0, dtype=torch.float32, device=device)
    _all_reduce(sums, plan.n_reduce, p, process_group)
    with span("dmuon::clip_scale"):
        if use_kernel:
            totals, coefs, clipped, found_inf, combined = _fastpath.finalize(
                sums, max_norm_table, inf_norm
            )
        else:
            totals, coefs, clipped, found_inf, combined = _torch_finalize(sums, max_norm_table, p)
        if kernel_plan is not None:
            _fastpath.scale_(kernel_plan, coefs)
        for slot, tensors in enumerate(fallback):
            if tensors and plan.max_norms[slot] is not None:
                scale_(tensors, coefs[slot])

    stats = []
    for slot in plan.slot_of:  # in the order given
        bucket = plan.buckets[slot]
        stats.append(
            GradClipBucketStats(
                name=bucket.name,
                total_norm=totals[slot],
                max_norm=plan.max_norms[slot],
                clip_coef=coefs[slot],
                clipped=clipped[slot],
                param_count=len(bucket.grads),
                found_inf=found_inf[slot],
                fastpath=use_kernel and not fallback[slot],
            )
        )
    fastpath = use_kernel and n_fallback == 0
    return SegmentedGradClipResult(
        total_norm=combined,
        bucket_stats=tuple(stats),
        fastpath=fastpath,
        fallback_reason=None if fastpath else reason,
    )


@eager_under_compile("dmuon.clip.try_clip_optimizer_grad_norm_buckets_")
def try_clip_optimizer_grad_norm_buckets_(
    optimizer: SupportsMuonGradsForClip,
    *,
    regular_grads: Sequence[Tensor | None],
    adamw_grads: Sequence[Tensor | None],
    max_norm: float | Mapping[str, float | None] | None,
    process_group: Any = None,
) -> SegmentedGradClipResult | None:
    """Clip the three segments of a dmuon step, ``"regular"`` (ordinary ``param.grad``),
    ``"muon"`` (``optimizer.muon_grads_for_clip()``) and ``"adamw"``, each by its own 2-norm,
    in one fused call; ``None`` when the fast path is unavailable.

    The rule: returns ``None``, having taken no Muon gradient, touched no gradient and issued
    no collective, when triton is not installed or this process has neither CUDA nor the
    Triton interpreter, or when any tensor of the three segments (and the Muon gradients'
    device) is not on one and the same CUDA device (the CPU counts while Triton interprets,
    ``TRITON_INTERPRET=1``). The Muon gradients' group and device come from
    ``optimizer.clip_group_and_device("muon")`` (dmuon's ``Muon`` has it), which takes nothing;
    an optimizer without it has its Muon gradients taken first where the kernels may run in
    this process, and a ``None`` then follows the take (see [Note: a declined call takes
    nothing]). Otherwise it clips, and tensors outside the kernel's contract (non-contiguous,
    float64, ...) go through torch inside the call, as reported by ``fallback_reason``. A bad
    ``max_norm``, gradient list or ``process_group`` raises ``ValueError`` either way, before
    anything is taken (the group: where the optimizer has ``clip_group_and_device``), and an
    optimizer without ``muon_grads_for_clip()`` ``TypeError``.

    Groups: the Muon segment is reduced over the optimizer's group. ``process_group=None`` keeps
    the regular and AdamW norms rank-local (replicated grads, as under DDP); a group reduces them
    over it (each rank passes its disjoint shard, e.g. FSDP2's ``grad.to_local()``) and must then
    be the Muon group itself, since one collective serves all three segments. ``None`` entries in
    the grad lists (params without a grad) are skipped. ``max_norm`` is a float, ``None``, or a
    mapping with the keys ``"regular"``, ``"muon"``, ``"adamw"``.

    Args:
        optimizer: dmuon's :class:`~dmuon.Muon` (any object with ``muon_grads_for_clip()``;
            another, such as accelerate's ``AcceleratedOptimizer``, raises ``TypeError``): its
            owned Muon gradients are the ``"muon"`` segment.
        regular_grads: the gradients of the ``"regular"`` segment (ordinary ``param.grad``,
            or this rank's local shards of them), clipped by their own norm; ``None`` entries
            are skipped.
        adamw_grads: the gradients of the ``"adamw"`` segment, clipped by their own norm;
            ``None`` entries are skipped.
        max_norm: one threshold for all three segments, a number >= 0, or a mapping
            ``{"regular": ..., "muon": ..., "adamw": ...}`` with one entry per segment;
            ``None`` or ``inf`` (for all or for one segment) measures without scaling.
        process_group: ``None``: the regular and AdamW norms stay rank-local (replicated
            gradients); otherwise the group their norms are summed over (each rank passing its
            disjoint shard), which must be the optimizer's Muon group (``ValueError``
            otherwise).

    Under ``torch.compile`` it runs eagerly, one graph break (see [Note: the clip under
    torch.compile]): call it outside the compiled function, or compile without
    ``fullgraph=True``, which refuses it naming this.
    """
    # [Note: a declined call takes nothing]
    # Taking the Muon gradients is not free of effects: dmuon's Muon waits for its reduces and
    # turns ns_overlap off for good (NS during backward would have read unclipped gradients).
    # A call that returns None lets its caller clip the usual way, or not at all, so it must
    # decide before the take: where the kernels run, the Muon group and device are read from
    # the optimizer's clip_group_and_device(), which takes nothing. Bad input raises either
    # way: the two buckets check their gradients once, here, and the plan of this call checks
    # max_norm against all three names.
    if not callable(getattr(optimizer, "muon_grads_for_clip", None)):
        raise TypeError(
            f"{type(optimizer).__name__} has no muon_grads_for_clip();"
            " dmuon_clip.try_clip_optimizer_grad_norm_buckets_ takes dmuon's Muon optimizer (of"
            " accelerate's AcceleratedOptimizer, its .optimizer); on a model without dmuon,"
            " clip plain param.grad with dmuon_clip.clip_grad_norm_buckets_"
        )
    regular = GradClipBucket(
        "regular", [g for g in regular_grads if g is not None], reduce=process_group is not None
    )
    adamw = GradClipBucket(
        "adamw", [g for g in adamw_grads if g is not None], reduce=process_group is not None
    )
    _make_plan([regular, GradClipBucket("muon", ()), adamw], max_norm, 2.0, "cpu")
    given = [*regular.grads, *adamw.grads]
    probe = getattr(optimizer, "clip_group_and_device", None)
    if callable(probe):
        muon_group, muon_device = probe("muon")
        _check_segment_group(process_group, muon_group)
        if _declined(given, torch.device(muon_device)) is not None:
            return None
    elif _fastpath.unavailable_in_process() is not None:
        return None
    muon = optimizer.muon_grads_for_clip()
    copies = clip_copies(muon)
    muon_group = muon.process_group
    _check_segment_group(process_group, muon_group)
    group = muon_group if muon_group is not None else process_group
    device = _declined_or_device([*given, *muon.grads, *copies], torch.device(muon.device))
    if device is None:  # without the probe, or gradients not where the probe said
        return None
    buckets = [regular, GradClipBucket("muon", muon.grads, reduce=muon_group is not None), adamw]
    result = clip_grad_norm_buckets_(
        buckets, max_norm, norm_type=2.0, process_group=group, device=device
    )
    if copies and result["muon"].max_norm is not None:
        # Counted on another rank; scaled like the rest of the Muon bucket (see
        # MuonClipGradsLike).
        scale_(copies, result["muon"].clip_coef)
    return result


def _check_segment_group(process_group: Any, muon_group: Any) -> None:
    """Refuse a ``process_group`` that is not the Muon gradients' (one collective serves all
    three segments of ``try_clip_optimizer_grad_norm_buckets_``)."""
    if process_group is not None and muon_group is not None and process_group is not muon_group:
        raise ValueError(
            "process_group must be None or the group of optimizer.muon_grads_for_clip() (one "
            "collective serves all three segments); clip the regular/AdamW grads separately "
            "when they are sharded over another group"
        )


def _declined(tensors: Sequence[Tensor], muon_device: torch.device) -> str | None:
    """Why the fused clip declines ``tensors`` and the Muon gradients on ``muon_device``
    (``None``: it runs): not all on one device, or none the kernels run on."""
    # "cuda" (an optimizer may say so) is the current CUDA device, as for the accumulator.
    devices = {_resolve_device(d, ()) for d in {t.device for t in tensors} | {muon_device}}
    if len(devices) != 1:
        return f"grads on several devices {devices}"
    (device,) = devices
    return _fastpath.unavailable_reason(device, 2.0)


def _declined_or_device(
    tensors: Sequence[Tensor], muon_device: torch.device
) -> torch.device | None:
    """The one device the fused clip runs on for ``tensors`` and the Muon gradients on
    ``muon_device`` (their accumulator's), or ``None`` when it declines them."""
    reason = _declined(tensors, muon_device)
    if reason is not None:
        logger.debug("try_clip_optimizer_grad_norm_buckets_: %s", reason)
        return None
    return _resolve_device(muon_device, ())
