"""``clip_grad_norm_`` and ``clip_grad_value_`` for dmuon's dedicated Muon gradients.

[Note: where the Muon clip sits]
dmuon's Muon gradients do not live in ``param.grad``: after backward each matrix's averaged
gradient is on its owner only. The clip therefore asks the optimizer for them
(``muon_grads_for_clip()`` waits for pending reduces and TP gathers) and scales them in place
before ``step()`` runs momentum and Newton-Schulz. Since NS fixes the scale of the update, this
clip guards the momentum buffer against outliers and non-finite gradients more than it sets the
step size. dmuon-clip duck-types the optimizer and never imports dmuon-fsdp.

Under tensor parallelism a matrix's gradient is split into shards on several ranks, and a whole
(not tensor-parallel) matrix is kept by several ranks at once. The optimizer hands the clip
each element once (``grads``, summed over ``process_group``) and the extra copies apart
(``copies``): the copies are scaled by the same coefficient, so every copy of a matrix stays
equal, and the norm counts none of them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from dmuon_clip._buckets import clip_coefficient, scale_, validate_max_norm, validate_norm_type
from dmuon_clip._compile import eager_under_compile
from dmuon_clip._profiling import span
from dmuon_clip._strategy import clips_per_matrix, get_muon_grad_clip_strategy
from dmuon_clip._types import (
    MuonClipGradsLike,
    MuonGradClipStats,
    SupportsMuonGradsForClip,
    clip_copies,
    is_sharded,
)

__all__ = ["clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_"]


@eager_under_compile("dmuon.clip_grad_norm_")
def clip_grad_norm_(
    optimizer: SupportsMuonGradsForClip,
    max_norm: float | None,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    strategy: str = "global_norm",
    params: str | Iterable[Tensor] = "muon",
) -> MuonGradClipStats:
    """Clip dmuon's Muon gradients in place (see [Note: where the Muon clip sits]), or, with
    ``params``, those of its AdamW route or of both.

    With the default ``"global_norm"`` strategy the norm is taken over every Muon matrix of every
    owner with one collective, and the coefficient is ``torch.nn.utils.clip_grad_norm_``'s,
    ``min(max_norm / (total_norm + 1e-6), 1)``. ``max_norm=None`` measures without scaling. A
    non-finite norm sets ``found_inf`` and leaves the grads untouched. The returned stats are
    device tensors: nothing here waits for the GPU, except ``error_if_nonfinite=True``, which
    agrees on ``found_inf`` over the ranks (one small collective), reads it on the host (a sync)
    and raises ``RuntimeError`` on every rank alike: ``"global_norm"`` has scaled nothing by
    then, ``"per_matrix"`` every matrix of a finite norm.

    Args:
        optimizer: dmuon's :class:`~dmuon.Muon` (any object with ``muon_grads_for_clip()``;
            another raises ``TypeError``); its owned Muon gradients are clipped, which the next
            ``step()`` reads. Collective over every rank the optimizer runs on.
        max_norm: the largest norm the Muon gradients keep, a number >= 0: when their norm
            is larger they are scaled so that it is ``max_norm`` (within the ``1e-6`` of the
            coefficient); ``None`` or ``inf`` (as torch's "do not clip"): measure only.
        norm_type: ``p`` of the p-norm, a number > 0 or ``float('inf')`` (``"inf"`` too, as torch
            spells it); a bool or another string raises ``ValueError``, as for ``max_norm``.
        error_if_nonfinite: ``True`` raises ``RuntimeError`` on every rank when a norm is NaN
            or infinite on any rank (agreed over the ranks, then read on the host: a sync);
            ``False`` reports it in ``found_inf`` (rank-local under ``"per_matrix"``). Either
            way a gradient of a non-finite norm is left as it is.
        strategy: the name of a registered strategy: ``"global_norm"`` (one norm over every
            Muon matrix of every owner), ``"per_matrix"`` (each matrix by its own norm; refused
            under tensor parallelism), or one added with ``register_muon_grad_clip_strategy``.
            An unknown name raises ``ValueError``.
        params: which gradients: ``"muon"`` (the Muon route's: the dedicated matrices on
            their owners, expert stacks), ``"adamw"`` (the AdamW route's: FSDP2 shards of the
            embeddings, norms, head..., and dedicated weights routed to AdamW, on their
            owners), ``"all"`` (both, by one norm, as torch's ``clip_grad_norm_`` of
            ``model.parameters()`` on a model without dmuon), one of the optimizer's
            parameters or an iterable of them (as torch takes ``parameters``). All but
            ``"muon"`` need ``optimizer.grads_for_clip(params)``.

    Under ``torch.compile`` it runs eagerly, one graph break (see [Note: the clip under
    torch.compile]): call it outside the compiled function, or compile without
    ``fullgraph=True``, which refuses it naming this.
    """
    max_norm = validate_max_norm(max_norm)
    norm_type = validate_norm_type(norm_type)
    if not isinstance(error_if_nonfinite, bool):  # a string such as "no" would be truthy
        raise TypeError(f"error_if_nonfinite must be a bool, got {error_if_nonfinite!r}")
    fn = get_muon_grad_clip_strategy(strategy)
    if isinstance(params, Iterator):  # model.parameters(): read by the check and the take
        params = list(params)
    take = _grads_for_clip(optimizer, params, "clip_grad_norm_")
    per_matrix = clips_per_matrix(strategy)
    if per_matrix and _split_over_ranks(optimizer, params):
        # Before the gradients are taken: taking them turns ns_overlap off.
        raise _per_matrix_refused(strategy, _split_param(optimizer, params))
    with span("dmuon::clip_grad_norm"):
        muon = take()
        if per_matrix and is_sharded(muon):  # an optimizer without grads_split_over_ranks
            raise _per_matrix_refused(strategy)
        grads = list(muon.grads)
        if per_matrix:  # a tensor of fewer dims is one matrix of its own (see _as_matrix)
            grads = [_as_matrix(g) for g in grads]
        stats = fn(grads, max_norm, norm_type, muon.process_group, torch.device(muon.device))
        if not isinstance(stats, MuonGradClipStats):
            raise TypeError(
                f"the clip strategy {strategy!r} returned {type(stats).__name__}; a strategy"
                " returns MuonGradClipStats (see register_muon_grad_clip_strategy)"
            )
        copies = clip_copies(muon)
        if copies:
            # Another rank counted these matrices (see [Note: where the Muon clip sits]). They
            # take the coefficient the strategy applied to the others; a per-matrix strategy
            # has one per matrix, so a copy is clipped by its own norms, as the counting rank
            # clips it.
            if max_norm is not None and per_matrix:
                matrices = [_as_matrix(g) for g in copies]
                fn(matrices, max_norm, norm_type, None, torch.device(muon.device))
            elif max_norm is not None:
                scale_(copies, stats.clip_coef)
            stats = dataclasses.replace(stats, param_count=stats.param_count + len(copies))
    if error_if_nonfinite and _on_any_rank(stats.found_inf, muon.process_group):
        raise RuntimeError(
            f"the norm of order {norm_type} of the gradients to clip ({_label(params)}) is"
            " non-finite on some rank "
            f"({float(stats.total_norm)} here), so it cannot be clipped; "
            + _LEFT.get(strategy, f"strategy {strategy!r} decided what to scale")
            + ". Pass error_if_nonfinite=False to get found_inf in the stats instead"
            + (" (inf-norm: a NaN is reported as inf)" if norm_type == math.inf else "")
        )
    return stats


@eager_under_compile("dmuon.clip.clip_grads_with_norm_")
def clip_grads_with_norm_(
    optimizer: SupportsMuonGradsForClip,
    max_norm: float,
    total_norm: Tensor | float,
    params: str | Iterable[Tensor] = "muon",
) -> None:
    """Scale the gradients ``params`` selects in place by ``min(max_norm / (total_norm +
    1e-6), 1)`` for a ``total_norm`` measured before: the second half of
    :func:`clip_grad_norm_`, as ``torch.nn.utils.clip_grads_with_norm_`` is of torch's clip,
    after ``torch.nn.utils.get_total_norm``. Measure with ``clip_grad_norm_(optimizer, None,
    norm_type, params=...)`` (its ``total_norm``), combine it with other norms if need be
    (pipeline stages, other optimizers: ``(a**p + b**p) ** (1/p)``), then scale. Torch's
    ``clip_grads_with_norm_`` of ``model.parameters()`` does not reach the dedicated matrices'
    gradients, which live on their owners. Pass the same ``total_norm`` on every rank; no
    collective runs but a DTensor's ``full_tensor()`` (torch's ``get_total_norm`` of FSDP2
    gradients is one). A non-finite ``total_norm`` leaves the gradients as they are (never
    multiplied by a NaN), as :func:`clip_grad_norm_` does; nothing waits for the device.

    Args:
        optimizer: dmuon's :class:`~dmuon.Muon` (any object with ``muon_grads_for_clip()``;
            another raises ``TypeError``).
        max_norm: the norm the gradients are scaled to when ``total_norm`` is larger, a
            number >= 0 (``inf``: nothing is scaled, as in torch).
        total_norm: the norm to clip by, a number or a one-element tensor (``clip_grad_norm_``'s
            ``total_norm``, or one combined from it; a DTensor is made whole first); another
            value raises ``TypeError``.
        params: which gradients, as for :func:`clip_grad_norm_`: ``"muon"``, ``"adamw"``,
            ``"all"``, one of the optimizer's parameters or an iterable of them.

    Under ``torch.compile`` it runs eagerly, one graph break (see [Note: the clip under
    torch.compile]): call it outside the compiled function, or compile without
    ``fullgraph=True``, which refuses it naming this.
    """
    if max_norm is None:  # measuring is clip_grad_norm_'s, with max_norm=None
        raise ValueError(
            "clip_grads_with_norm_ scales to a max_norm, a number >= 0, got None;"
            " measure with clip_grad_norm_(optimizer, None, ...)"
        )
    threshold = validate_max_norm(max_norm)  # None: inf, which scales nothing
    if isinstance(total_norm, DTensor):  # torch's get_total_norm of FSDP2 gradients
        total_norm = total_norm.full_tensor()
    if isinstance(total_norm, Tensor) and total_norm.numel() == 1:
        norm = total_norm.detach().reshape(()).to(torch.float32)
    elif not isinstance(total_norm, bool) and isinstance(total_norm, (int, float)):
        norm = torch.tensor(float(total_norm), dtype=torch.float32)
    else:
        raise TypeError(
            "clip_grads_with_norm_: total_norm must be a number or a one-element tensor (the"
            " total_norm of clip_grad_norm_(optimizer, None, ...)), got"
            f" {type(total_norm).__name__}"
        )
    take = _grads_for_clip(optimizer, params, "clip_grads_with_norm_")
    if threshold is None:  # scales nothing: nothing is taken, the selection is checked
        _check_selection(optimizer, params)
        return
    with span("dmuon::clip_grads_with_norm"), torch.no_grad():
        muon = take()
        device = torch.device(muon.device)
        if norm.device.type == "cpu" and device.type != "cpu":
            # A host norm (a number, a CPU tensor) is written on the device by a fill, not
            # copied there: a copy from pageable host memory would wait for the stream.
            norm = torch.full((), float(norm), dtype=torch.float32, device=device)
        norm = norm.to(device)
        coef = clip_coefficient(norm, threshold)
        coef = torch.where(torch.isfinite(norm), coef, 1.0)
        scale_([*muon.grads, *clip_copies(muon)], coef)


@eager_under_compile("dmuon.clip.clip_grad_value_")
def clip_grad_value_(
    optimizer: SupportsMuonGradsForClip,
    clip_value: float,
    params: str | Iterable[Tensor] = "muon",
) -> None:
    """Clamp dmuon's Muon gradients in place to ``[-clip_value, clip_value]``, or, with
    ``params``, those of its AdamW route or of both: what ``torch.nn.utils.clip_grad_value_``
    does to ``param.grad``, which never holds a dedicated matrix's gradient (see [Note: where
    the Muon clip sits]). Each element is clamped where it is kept, every copy of a matrix
    alike, so nothing is communicated beyond the optimizer's handing over of the gradients;
    a NaN stays NaN, as in torch. A DTensor gradient (FSDP2's ``Shard``, or ``Replicate``) is
    clamped in its local tensor; one with a ``Partial`` placement raises ``ValueError`` before
    anything is clamped (its ranks hold summands, as torch refuses it too). Call it on every
    rank between ``backward()`` and ``step()``.
    As every clip of Muon gradients, the first one turns dmuon's ``ns_overlap`` off (NS
    during backward would have read them unclamped).

    Args:
        optimizer: dmuon's :class:`~dmuon.Muon` (any object with ``muon_grads_for_clip()``;
            another raises ``TypeError``).
        clip_value: the largest magnitude a gradient element keeps, a number >= 0 (``inf``
            clamps nothing, as in torch).
        params: which gradients, as for :func:`clip_grad_norm_`: ``"muon"``, ``"adamw"``,
            ``"all"`` (as torch's ``clip_grad_value_`` of ``model.parameters()`` on a model
            without dmuon), one of the optimizer's parameters or an iterable of them.

    Under ``torch.compile`` it runs eagerly, one graph break (see [Note: the clip under
    torch.compile]): call it outside the compiled function, or compile without
    ``fullgraph=True``, which refuses it naming this.
    """
    if isinstance(clip_value, bool) or not isinstance(clip_value, (int, float)):
        raise TypeError(f"clip_value must be a number, got {clip_value!r}")
    if not clip_value >= 0:  # NaN fails the comparison too
        raise ValueError(f"clip_value must be a number >= 0, got {clip_value!r}")
    take = _grads_for_clip(optimizer, params, "clip_grad_value_")
    if clip_value == math.inf:  # clamps nothing: nothing is taken, the selection is checked
        _check_selection(optimizer, params)
        return
    with span("dmuon::clip_grad_value"), torch.no_grad():
        muon = take()
        by_kind: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for i, g in enumerate([*muon.grads, *clip_copies(muon)]):
            if isinstance(g, DTensor) and any(p.is_partial() for p in g.placements):
                # Each rank holds a summand: clamping the summands is not clamping their sum
                # (two ranks' 0.4 + 0.4 would stay 0.8 under clip_value=0.5). Checked for
                # every gradient before any is clamped.
                raise ValueError(
                    f"clip_grad_value_: gradient {i} is a DTensor with a Partial placement"
                    f" ({g.placements}), whose ranks hold summands of it; clamping them would"
                    " not clamp their sum. Reduce it first (grad.redistribute(placements="
                    "[Replicate()]) or a Shard placement), as torch.nn.utils.clip_grad_value_"
                    " refuses it too"
                )
            local = g.to_local() if isinstance(g, DTensor) else g
            by_kind.setdefault((local.device, local.dtype), []).append(local)
        for tensors in by_kind.values():
            torch._foreach_clamp_min_(tensors, -clip_value)
            torch._foreach_clamp_max_(tensors, clip_value)


def _check_selection(optimizer: SupportsMuonGradsForClip, params: str | Iterable[Tensor]) -> None:
    """Refuse a bad ``params`` without taking the gradients (taking turns dmuon's
    ``ns_overlap`` off), where the optimizer can check it so."""
    probe = getattr(optimizer, "clip_group_and_device", None)
    if callable(probe):
        probe(params)


def _grads_for_clip(
    optimizer: SupportsMuonGradsForClip, params: str | Iterable[Tensor], where: str
) -> Callable[[], MuonClipGradsLike]:
    """How to take the gradients ``params`` selects from ``optimizer`` (called inside the
    clip's span); raises ``TypeError`` for an optimizer without the clip protocol."""
    method = "muon_grads_for_clip" if isinstance(params, str) and params == "muon" else None
    if not callable(getattr(optimizer, method or "grads_for_clip", None)):
        if isinstance(optimizer, Tensor | Iterable):
            # torch's clip takes the parameters first. On a model with dmuon, torch's own clip
            # of model.parameters() misses the dedicated matrices' gradients (they live on
            # their owners): pointing there, as for another optimizer, would be wrong advice.
            raise TypeError(
                f"dmuon's {where} takes dmuon's Muon optimizer first, not the parameters (got"
                f" a {type(optimizer).__name__}): dmuon.clip.{where}(optimizer, ...,"
                " params='all') for every gradient the optimizer steps, or params=<the"
                f" parameters> for some; torch.nn.utils.{where}(model.parameters()) does not"
                " reach the gradients of the dedicated matrices, which live on their owners"
            )
        raise TypeError(
            f"{type(optimizer).__name__} has no {method or 'grads_for_clip'}();"
            f" dmuon_clip.{where} takes dmuon's Muon optimizer; on a model without dmuon,"
            f" clip plain param.grad with torch.nn.utils.{where}"
        )
    if method is not None:
        return optimizer.muon_grads_for_clip
    return lambda: optimizer.grads_for_clip(params)  # type: ignore[attr-defined]


def _split_over_ranks(optimizer: object, params: str | Iterable[Tensor]) -> bool:
    """``optimizer.grads_split_over_ranks(params)`` (which takes no gradient, and so leaves
    dmuon's ``ns_overlap`` on), ``False`` for an optimizer without it (the clip then reads
    ``sharded`` of the gradients it took)."""
    probe = getattr(optimizer, "grads_split_over_ranks", None)
    return callable(probe) and bool(probe(params))


def _split_param(optimizer: object, params: str | Iterable[Tensor]) -> str | None:
    """``optimizer.param_split_over_ranks(params)``: the name of the first selected parameter
    whose gradient ranks hold parts of (``None`` for an optimizer without it)."""
    probe = getattr(optimizer, "param_split_over_ranks", None)
    return probe(params) if callable(probe) else None


def _per_matrix_refused(strategy: str, name: str | None = None) -> ValueError:
    which = "some of these gradients" if name is None else f"the gradient of {name!r}"
    return ValueError(
        f"strategy={strategy!r} clips each tensor by the norm this rank sees of it, but"
        f" a rank holds only a shard of {which} (a tensor-parallel matrix, or FSDP2's shard"
        " of an AdamW parameter); use strategy='global_norm' (the default), which reduces"
        " over every rank (without tensor parallelism params='muon' selects whole matrices"
        " only: each on its owner)"
    )


def _as_matrix(g: Tensor) -> Tensor:
    """``g`` as a per-matrix strategy sees it: itself from 2 dims up (a matrix, or an expert
    stack's batch of them), else a 1 × n view (in place, its scaling is ``g``'s): the gradient
    of a norm or a bias, which ``params="adamw"`` or ``"all"`` selects on the replicated path,
    is clipped whole by its own norm."""
    while g.ndim < 2:
        g = g.unsqueeze(0)
    return g


def _label(params: str | Iterable[Tensor]) -> str:
    names = {"muon": "Muon", "adamw": "AdamW", "all": "Muon and AdamW"}
    return names.get(params, "given") if isinstance(params, str) else "given"


# What the built-in strategies did to the gradients when the norm is non-finite.
_LEFT = {
    "global_norm": "the gradients were left as they are",
    "per_matrix": "each matrix of a finite norm was clipped, the others were left as they are",
}


def _on_any_rank(found_inf: Tensor, process_group: object) -> bool:
    """Whether any rank of ``process_group`` found a non-finite norm (a host sync): a
    strategy's ``found_inf`` may be rank-local ("per_matrix"'s is), and every rank must raise
    alike, or the others would wait for it in their next collective."""
    if process_group is None:
        return bool(found_inf)
    found = found_inf.to(torch.float32).reshape(1)
    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=process_group)
    return bool(found)
