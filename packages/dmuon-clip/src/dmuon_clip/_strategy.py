"""Muon clipping strategies: a registry of named functions and the two built in.

A strategy is ``fn(grads, max_norm, norm_type, process_group, device) -> MuonGradClipStats``: it
receives this rank's part of the gradients ``clip_grad_norm_`` selected (the Muon matrices
this rank owns by default; with its ``params``, AdamW gradients too, FSDP2 shards among them),
scales them in place, and returns device-tensor stats without a host sync. ``"global_norm"``
(the default) clips them all by their joint norm across ranks; ``"per_matrix"`` clips each
matrix by its own norm.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from dmuon_clip._buckets import (
    clip_coefficient,
    clip_grad_norm_buckets_,
    validate_max_norm,
    validate_norm_type,
)
from dmuon_clip._types import GradClipBucket, MuonGradClipStats, is_dtensor

__all__ = [
    "MuonGradClipStrategy",
    "get_muon_grad_clip_strategy",
    "register_muon_grad_clip_strategy",
    "registered_muon_grad_clip_strategies",
    "unregister_muon_grad_clip_strategy",
]

MuonGradClipStrategy = Callable[
    [list[Tensor], float | None, float, Any, torch.device], MuonGradClipStats
]


class _Registered(NamedTuple):
    fn: MuonGradClipStrategy
    per_matrix: bool  # one coefficient per matrix (see register_muon_grad_clip_strategy)


_STRATEGIES: dict[str, _Registered] = {}


def register_muon_grad_clip_strategy(
    name: str, fn: MuonGradClipStrategy, *, overwrite: bool = False, per_matrix: bool = False
) -> None:
    """Make ``fn`` available as ``clip_grad_norm_(..., strategy=name)``.

    Raises ``ValueError`` when ``name`` is taken (pass ``overwrite=True`` to replace it), empty,
    or ``fn`` is not callable.

    Args:
        name: the strategy's name, a non-empty string (the built-in ones are ``"global_norm"``
            and ``"per_matrix"``).
        fn: ``fn(grads, max_norm, norm_type, process_group, device) -> MuonGradClipStats``:
            it gets the list of this rank's gradients to clip (the Muon matrices it owns, or
            those ``clip_grad_norm_``'s ``params`` selects), the validated ``max_norm``
            (``None``: measure only) and ``norm_type``, the group over which a sum counts every
            element once (``None``: not distributed) and the accumulator's device; it scales
            the gradients in place and returns device-tensor stats, without a host sync.
        overwrite: ``True`` replaces a strategy already registered under ``name``; ``False``
            raises ``ValueError`` instead.
        per_matrix: ``True`` when ``fn`` clips each matrix by a coefficient of its own
            (``"per_matrix"`` does): the gradients another rank counts (``.copies``) are then
            clipped by calling ``fn`` on them too, where a strategy of one coefficient scales
            them by its ``clip_coef``; and ``clip_grad_norm_`` refuses it under tensor
            parallelism, where a rank holds a part of a matrix. Such an ``fn`` gets every
            gradient with 2 dims or more: a norm's or a bias's (``params="adamw"`` on the
            replicated path) comes as a 1 × n view. A bool.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"strategy name must be a non-empty string, got {name!r}")
    if not callable(fn):
        raise ValueError(
            f"strategy {name!r} must be callable as fn(grads, max_norm, norm_type, "
            f"process_group, device) -> MuonGradClipStats, got {type(fn).__name__}"
        )
    if name in _STRATEGIES and not overwrite:
        raise ValueError(
            f"a Muon grad clip strategy named {name!r} is already registered; pass "
            "overwrite=True to replace it, or pick another name"
        )
    if not isinstance(per_matrix, bool):
        raise TypeError(f"per_matrix must be a bool, got {per_matrix!r}")
    _STRATEGIES[name] = _Registered(fn, per_matrix)


def unregister_muon_grad_clip_strategy(name: str) -> None:
    """Remove a registered strategy (``ValueError`` if there is none by that name)."""
    if name not in _STRATEGIES:
        raise ValueError(
            f"no Muon grad clip strategy named {name!r}; registered: {sorted(_STRATEGIES)}"
        )
    del _STRATEGIES[name]


def registered_muon_grad_clip_strategies() -> tuple[str, ...]:
    """The names ``clip_grad_norm_(strategy=...)`` accepts, sorted."""
    return tuple(sorted(_STRATEGIES))


def clips_per_matrix(name: str) -> bool:
    """Whether the strategy registered as ``name`` was registered with ``per_matrix=True``."""
    registered = _STRATEGIES.get(name)
    return registered is not None and registered.per_matrix


def get_muon_grad_clip_strategy(name: str) -> MuonGradClipStrategy:
    try:
        return _STRATEGIES[name].fn
    except KeyError:
        raise ValueError(
            f"unknown Muon grad clip strategy {name!r}; registered: {sorted(_STRATEGIES)} "
            "(add one with register_muon_grad_clip_strategy)"
        ) from None


class ClipRequest(NamedTuple):
    """One call of a built-in strategy, checked once: the gradients as a list, ``max_norm`` and
    ``norm_type`` validated, ``device`` a ``torch.device``."""

    grads: list[Tensor]
    max_norm: float | None
    norm_type: float
    process_group: Any
    device: torch.device


def _builtin(
    name: str, *, per_matrix: bool = False
) -> Callable[[Callable[[ClipRequest], MuonGradClipStats]], MuonGradClipStrategy]:
    """Register ``fn(request)`` under ``name`` as a strategy of the public signature (which
    is written here once)."""

    def register(fn: Callable[[ClipRequest], MuonGradClipStats]) -> MuonGradClipStrategy:
        @functools.wraps(fn)
        def strategy(
            grads: Sequence[Tensor],
            max_norm: float | None,
            norm_type: float,
            process_group: Any,
            device: torch.device,
        ) -> MuonGradClipStats:
            max_norm = validate_max_norm(max_norm)
            p = validate_norm_type(norm_type)
            return fn(ClipRequest(list(grads), max_norm, p, process_group, torch.device(device)))

        register_muon_grad_clip_strategy(name, strategy, per_matrix=per_matrix)
        return strategy

    return register


@_builtin("global_norm")
def global_norm_strategy(request: ClipRequest) -> MuonGradClipStats:
    """Every gradient clipped by their joint p-norm over every rank: one bucket, one
    collective (sum of ``|g|^p``; max for the inf-norm) over ``process_group``."""
    grads, max_norm, norm_type, process_group, device = request
    try:
        bucket = GradClipBucket("muon", grads, reduce=process_group is not None)
    except ValueError:
        # GradClipBucket's own words are for its callers; an optimizer's author gets these.
        # Looked for only on this failure path: the bucket checks each gradient once.
        i = next((i for i, g in enumerate(grads) if is_dtensor(g)), None)
        if i is None:
            raise
        raise ValueError(
            f"the 'global_norm' clip strategy got a DTensor as gradient {i}; the optimizer's"
            " muon_grads_for_clip() / grads_for_clip() hands over each rank's local tensor"
            " (grad.to_local()) and, as process_group, the group over which those add up"
            " (the shard group), so that the norm costs one all-reduce for all of them"
        ) from None
    result = clip_grad_norm_buckets_(
        [bucket], max_norm, norm_type=norm_type, process_group=process_group, device=device
    )
    stats = result.bucket_stats[0]
    return MuonGradClipStats(
        total_norm=stats.total_norm,
        clip_coef=stats.clip_coef,
        clipped=stats.clipped,
        found_inf=stats.found_inf,
        param_count=stats.param_count,
    )


@_builtin("per_matrix", per_matrix=True)
def per_matrix_strategy(request: ClipRequest) -> MuonGradClipStats:
    """Each matrix clipped by its own p-norm (``min(max_norm / (norm + 1e-6), 1)``): a
    gradient of shape ``(..., rows, cols)`` (an expert stack) is a batch of matrices, each
    clipped alone, so a stack's result does not depend on how many of its experts a rank
    holds (``clip_grad_norm_`` hands a norm's or a bias's gradient over as a 1 × n matrix); a
    matrix with a non-finite norm is left untouched. A whole matrix lives on its owner, so no
    collective runs and the stats are rank-local: ``total_norm`` is the joint norm of this
    rank's matrices before clipping, ``clip_coef`` the smallest factor applied, ``clipped`` /
    ``found_inf`` whether any local matrix was clipped / non-finite."""
    grads, max_norm, p, _, dev = request  # whole matrices are local: no process group
    if not grads:
        zero = torch.zeros((), dtype=torch.float32, device=dev)
        false = torch.zeros((), dtype=torch.bool, device=dev)
        return MuonGradClipStats(zero, torch.ones_like(zero), false, false.clone(), 0)
    with torch.no_grad():
        per_grad = [_matrix_norms(g, p).to(dev) for g in grads]
        norms = torch.cat(per_grad)
        finite = torch.isfinite(norms)
        if p == math.inf:
            total = torch.where(norms.isnan(), math.inf, norms).max()
        else:
            total = norms.pow(p).sum().pow(1.0 / p)
        if max_norm is None:
            coefs = torch.ones_like(norms)
            clipped = torch.zeros_like(finite)
        else:
            coefs = clip_coefficient(norms, max_norm)
            clipped = finite & (coefs < 1.0)
            coefs = torch.where(clipped, coefs, 1.0)
            for g, c in zip(grads, coefs.split([n.numel() for n in per_grad])):
                g.mul_(_per_matrix(c, g))
    return MuonGradClipStats(
        total_norm=total,
        clip_coef=coefs.min(),
        clipped=clipped.any(),
        found_inf=~finite.all(),
        param_count=len(grads),
    )


def _matrix_norms(g: Tensor, p: float) -> Tensor:
    """The p-norm of each matrix of ``g`` (..., rows, cols), flat, accumulated in fp32 (fp64
    for fp64 gradients, which torch will not narrow), returned in fp32 as the stats are."""
    acc = torch.promote_types(g.dtype, torch.float32)
    norms = torch.linalg.vector_norm(g, p, dim=(-2, -1), dtype=acc)
    return norms.reshape(-1).to(torch.float32)


def _per_matrix(coefs: Tensor, g: Tensor) -> Tensor:
    """``coefs`` (one per matrix of ``g``, as ``_matrix_norms`` counts them) shaped to scale
    ``g``."""
    return coefs.to(g.device).reshape(*g.shape[:-2], 1, 1)
