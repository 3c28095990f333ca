"""The values dmuon-clip takes and returns, and the optimizer protocol it duck-types."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

__all__ = [
    "GradClipBucket",
    "GradClipBucketStats",
    "MuonClipGradsLike",
    "MuonGradClipStats",
    "SegmentedGradClipResult",
    "SupportsMuonGradsForClip",
]


class MuonClipGradsLike(Protocol):
    """What ``optimizer.grads_for_clip(params)`` returns (ARCHITECTURE.md, dmuon-fsdp contract).

    ``grads``: this rank's part of the gradients to clip (possibly none): whole matrices on
    their owners, or shards; a weight Muon steps as several matrices (a fused projection with
    a declared split) hands each piece over as a tensor of its own, a view of its gradient.
    ``process_group``: the group over which a sum of ``grads``' elements counts every element
    of every selected gradient exactly once; ``None`` when not
    distributed. ``device``: where the norm accumulator lives (it must be a device the group's
    backend can reduce, e.g. CUDA for NCCL).

    Two optional attributes (read with a default, so an object without them still fits):
    ``copies`` (default none): gradients this rank scales with ``grads`` but that another rank
    counts (a whole matrix kept by every tensor-parallel grid, a shard kept by every HSDP
    replica); they enter no norm and are multiplied by the strategy's ``clip_coef``
    (``"per_matrix"`` clips each of their matrices by its own norm, as the counting rank does).
    ``sharded`` (default ``False``): some gradient is split over several ranks (a TP shard of
    a matrix, an FSDP2 shard of an AdamW parameter), so its own norm needs a collective and
    the rank-local ``"per_matrix"`` strategy is refused."""

    @property
    def grads(self) -> Sequence[Tensor]: ...

    @property
    def process_group(self) -> Any: ...

    @property
    def device(self) -> torch.device: ...


def clip_copies(muon: MuonClipGradsLike) -> list[Tensor]:
    """``muon.copies`` (see :class:`MuonClipGradsLike`), none when it has no such attribute."""
    return list(getattr(muon, "copies", ()))


def is_sharded(muon: MuonClipGradsLike) -> bool:
    """``muon.sharded`` (see :class:`MuonClipGradsLike`), ``False`` when absent."""
    return bool(getattr(muon, "sharded", False))


class SupportsMuonGradsForClip(Protocol):
    """An optimizer that hands its gradients to dmuon-clip (dmuon's ``Muon``):
    ``muon_grads_for_clip()`` those of its Muon route; ``grads_for_clip(params)``, which
    :func:`dmuon_clip.clip_grad_norm_` needs for any other ``params``, those ``params`` names.
    Optional, read with ``getattr``: ``grads_split_over_ranks(params) -> bool``, the
    ``sharded`` of ``grads_for_clip(params)`` without taking the gradients (which has effects:
    dmuon's turns ``ns_overlap`` off), so that a rank-local strategy is refused first;
    ``param_split_over_ranks(params) -> str | None``, the name of the first such parameter,
    which the refusal names."""

    def muon_grads_for_clip(self) -> MuonClipGradsLike: ...


@dataclass(frozen=True)
class MuonGradClipStats:
    """The outcome of :func:`dmuon_clip.clip_grad_norm_`; every tensor lives on the device of
    the accumulator, so reading them is the only host sync.

    Args:
        total_norm: fp32 0-dim, the norm before clipping.
        clip_coef: fp32 0-dim, the factor the grads were multiplied by (1.0 when nothing was
            clipped, when measuring only, or when the norm is non-finite).
        clipped: bool 0-dim, whether the grads were scaled down.
        found_inf: bool 0-dim, whether the norm was non-finite (the grads are then untouched).
        param_count: a Python ``int``, the number of gradient tensors this rank clipped
            (rank-local; no collective counts them): a weight with a declared split counts
            once per piece.
    """

    total_norm: Tensor
    clip_coef: Tensor
    clipped: Tensor
    found_inf: Tensor
    param_count: int

    if not TYPE_CHECKING:  # a type checker keeps refusing a misspelt field

        def __getattr__(self, name: str) -> Any:
            """Name the field for a tensor method asked of the stats (``stats.item()``, as of
            the total norm ``torch.nn.utils.clip_grad_norm_`` returns); any other name fails
            as usual. Only missing attributes reach here."""
            if not name.startswith("_") and (hasattr(Tensor, name) or name == "full_tensor"):
                raise AttributeError(
                    f"MuonGradClipStats has no {name!r}: dmuon's clip_grad_norm_ returns these"
                    " stats, where torch.nn.utils.clip_grad_norm_ returns the total norm alone;"
                    f" the norm is stats.total_norm (stats.total_norm.{name}), a plain 0-dim"
                    " tensor, already the whole model's on every rank"
                )
            return object.__getattribute__(self, name)  # Python's own AttributeError


@dataclass(frozen=True)
class GradClipBucket:
    """One segment of a segmented clip: its own norm, its own coefficient.

    ``reduce=True`` sums (or, for the inf-norm, maxes) the bucket's norm over ``process_group``:
    use it when each rank holds a disjoint part of the bucket (FSDP shards, Muon owners).
    ``reduce=False`` keeps the norm rank-local (replicated grads, DDP).

    Args:
        name: the bucket's name, a non-empty string, unique among the buckets of one call and
            the key of its threshold in a ``max_norm`` mapping and of its stats.
        grads: the bucket's gradient tensors, scaled in place (possibly none); plain tensors,
            not DTensors (pass a DTensor's ``to_local()`` with ``reduce=True``); another
            type raises ``ValueError``.
        reduce: whether the bucket's norm is reduced over the call's ``process_group``; a
            bool, the same on every rank.
    """

    name: str
    grads: Sequence[Tensor]
    reduce: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"GradClipBucket name must be a non-empty string, got {self.name!r}")
        grads = tuple(self.grads)
        for i, g in enumerate(grads):
            if not isinstance(g, Tensor):
                raise ValueError(
                    f"GradClipBucket {self.name!r}: grads[{i}] is {type(g).__name__}, not a "
                    "Tensor; drop parameters whose .grad is None before building the bucket"
                )
            if is_dtensor(g):
                raise ValueError(
                    f"GradClipBucket {self.name!r}: grads[{i}] is a DTensor; pass its local "
                    "shard (grad.to_local()) and set reduce=True with the shard group as "
                    "process_group, so the norm costs one collective instead of one per tensor"
                )
        object.__setattr__(self, "grads", grads)


def is_dtensor(t: Tensor) -> bool:
    """Whether ``t`` is a DTensor (by name: no import of torch.distributed.tensor needed)."""
    # A DTensor's norm would issue its own collectives behind our back (one per tensor).
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


@dataclass(frozen=True)
class GradClipBucketStats:
    """Per-bucket outcome of a segmented clip. Tensors are 0-dim on the accumulator device.

    Args:
        name: the bucket's name, as given.
        total_norm: fp32 0-dim, the bucket's norm before clipping.
        max_norm: the bucket's threshold (``None``: measured only).
        clip_coef: fp32 0-dim, the factor applied (1.0 when not clipped, measuring only, or
            non-finite).
        clipped: bool 0-dim, whether the bucket's grads were scaled down.
        param_count: the Python ``int`` number of tensors in the bucket on this rank.
        found_inf: bool 0-dim, whether the bucket's norm was non-finite (its grads are then
            untouched).
        fastpath: ``True`` when the fused kernel handled every tensor of the bucket.
    """

    name: str
    total_norm: Tensor
    max_norm: float | None
    clip_coef: Tensor
    clipped: Tensor
    param_count: int
    found_inf: Tensor
    fastpath: bool


@dataclass(frozen=True)
class SegmentedGradClipResult:
    """The outcome of a segmented clip; ``result[name]`` is the stats of the bucket ``name``.

    Args:
        total_norm: fp32 0-dim norm over every bucket combined (as if all grads were one
            vector).
        bucket_stats: one :class:`GradClipBucketStats` per bucket, in the order given.
        fastpath: the fused kernel handled every tensor.
        fallback_reason: why it did not (``None`` when it did).
    """

    total_norm: Tensor
    bucket_stats: tuple[GradClipBucketStats, ...]
    fastpath: bool
    fallback_reason: str | None

    def __getitem__(self, name: str) -> GradClipBucketStats:
        for stats in self.bucket_stats:
            if stats.name == name:
                return stats
        names = [s.name for s in self.bucket_stats]
        raise KeyError(f"no bucket named {name!r}; the buckets are {names}")
