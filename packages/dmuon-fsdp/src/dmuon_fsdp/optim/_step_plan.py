"""What one ``Muon.step`` touches, worked out once: each Muon parameter's step view (from its
holder), the Newton–Schulz batches, the tensors each AdamW group steps, and the holders that
publish in the step.

[Note: the step plan]
Which matrices a rank steps, how they are batched for Newton–Schulz, and how each is
orthogonalised depend only on the owner plan, the param groups and the packing, all fixed once
``Muon(model)`` is built (it finishes the runtime's packing first). So :class:`StepPlan` is
built once, in the optimizer's constructor, from the step view each parameter's holder gives
(``muon_entries``, see [Note: parameter holders] in ``holder/_holder``): the plan never asks
what kind a parameter is. A weight with a declared split gives one entry per piece (its rows
of the weight, see [Note: what Muon steps] in ``_matrix``), so each piece goes where a
parameter of that shape would. Entries whose matrices share a shape, dtype, device,
Newton–Schulz function and batch tag share one NS call (up to ``ns_batch_bytes``); an entry
whose NS is ``None`` only advances its momentum here (another replica steps it), in stacks of
their own.
A step only reads what changes every step: the gradients (a matrix without one this step
drops out of its batch), the hyperparameters of its group (a scheduler may change them) and
the optimizer state, created on first use. The tensors themselves are read through their
holders at each step, so nothing here goes stale when a checkpoint load writes into them.

[Note: the post-update hook]
``Muon.register_post_update_hook(hook)`` runs ``hook(optimizer, parts)`` on every rank inside
``step()``, after Muon and AdamW have updated the weights this rank steps and before the
runtime publishes them (HSDP replicas, the replicated path's peers) or drops the copies
peers keep (Z2). ``parts`` maps the FQN of every parameter this rank steps to a
:class:`WeightPart`: the tensor it updates in place (the owner's full master of a dedicated
matrix, this rank's TP shard of it, the local shard of an FSDP2 parameter, a replicated
parameter whole) and where that part sits in the full parameter. A hook that changes a part in
place changes what every rank computes with from the next forward on: dedicated weights reach
peers through the next broadcast and replicas through the publish that follows the hook, and
FSDP2 shards through FSDP2's own all-gather. Peers never see the weight as it was between the
update and the hook. A hook must treat every rank's parts alike (it runs on every rank, with
the parts that rank holds, possibly none), may issue collectives that every rank issues, and
must not change shapes or dtypes. Hooks run in the order they were registered, except that one
registered with ``prepend=True`` runs before those registered so far: QK-clip registers so, as
part of the update, ahead of the EMA's average whichever was built first.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from dmuon_ownership import Route

from .._profile import span
from ..holder import (
    MuonEntry,
    ParamHolder,
    ShardedTensor,
    StepContext,
    WeightPart,
    WholeTensor,
    tensor_view,
)
from ..topology import DedicatedCommContext
from ._muon_math import shape_batches

__all__ = ["AdamWEntry", "StepPlan"]


class AdamWEntry(NamedTuple):
    """One parameter an AdamW group steps on this rank: the key of its state, and its step
    view (a dedicated weight's holder, which its owner steps through ``full``, or the view of
    the parameter itself, see [Note: tensor views] in ``holder/_tensors``)."""

    param: Tensor
    view: ParamHolder | WholeTensor | ShardedTensor


class StepPlan:
    """See [Note: the step plan]."""

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        holders: Mapping[int, ParamHolder],
        context: StepContext,
        *,
        ns_batch_bytes: int | None,
    ) -> None:
        self.layout = context.layout
        self.muon: list[MuonEntry] = []
        self.adamw: list[tuple[dict[str, Any], list[AdamWEntry]]] = []
        for group in param_groups:
            if group["optimizer"] == Route.MUON:
                # Only parameters dmuon holds take the Muon route.
                for p in group["params"]:
                    self.muon += holders[id(p)].muon_entries(group, context)
            elif group["optimizer"] == Route.ADAMW:
                views = [(p, holders.get(id(p))) for p in group["params"]]
                entries = [
                    AdamWEntry(p, tensor_view(p) if view is None else view)
                    for p, view in views
                    if view is None or view.steps_here
                ]
                self.adamw.append((group, entries))
        # Each Muon holder this rank steps once (a split weight has an entry per piece). Not
        # a stack shard whose momentum alone advances here (``ns`` None: an expert source on
        # another replica steps it and broadcasts it after the post-update hooks), whose
        # weight would read, in a hook, as it was before the step.
        self.holders = list(
            {id(e.holder): e.holder for e in self.muon if e.ns is not None}.values()
        )
        stepped = [e for e in self.muon if e.matrices]
        self.batches = shape_batches(
            [e for e in stepped if e.ns is not None], _batch_key, _batch_size, ns_batch_bytes
        )
        self.momentum_only = shape_batches(
            [e for e in stepped if e.ns is None], _batch_key, _batch_size, None
        )
        # The holders that send their update on in the step, by phase (expert sources).
        self.publishing: dict[str, list[ParamHolder]] = {}
        for holder in {id(e.holder): e.holder for e in stepped}.values():
            phase = holder.publish_phase
            if phase is not None:
                self.publishing.setdefault(phase, []).append(holder)
        # Every parameter of the groups' FQN, by id.
        self.names = {
            id(p): name
            for group in param_groups
            for name, p in zip(group["param_names"], group["params"])
        }
        self._parts: dict[str, WeightPart] | None = None

    def clip_views(self) -> Iterator[tuple[Tensor, ParamHolder | WholeTensor | ShardedTensor]]:
        """Every parameter this rank steps, with the view that hands its gradient to a clip
        (``clip_grad``)."""
        for entry in {id(e.holder): e for e in self.muon}.values():
            yield entry.param, entry.holder
        for _, entries in self.adamw:
            yield from entries

    def weight_parts(self) -> dict[str, WeightPart]:
        """Every part of a parameter this rank steps, by FQN (built at the first call)."""
        if self._parts is None:
            parts = {holder.fqn: holder.weight_part(self.layout) for holder in self.holders}
            for _, entries in self.adamw:
                for p, view in entries:
                    parts[self.names[id(p)]] = view.weight_part(self.layout)
            self._parts = parts
        return self._parts

    def publish(self, comm: DedicatedCommContext, mark: Callable[[str], None]) -> None:
        """Each publishing holder's update to the ranks that keep a copy, one step-profile
        phase per kind of publish, waited before the step goes on."""
        for phase, holders in self.publishing.items():
            with span(f"dmuon::{phase}"):
                for work in [holder.publish(comm) for holder in holders]:
                    work.wait()
            mark(phase)


def _batch_key(entry: MuonEntry) -> Hashable:
    return (
        entry.matrix_shape,
        entry.state_dtype,
        entry.param.device,
        entry.batch_tag,
        id(entry.ns),
    )


def _batch_size(entry: MuonEntry) -> tuple[int, int]:
    rows, cols = entry.matrix_shape
    itemsize = torch.empty((), dtype=entry.state_dtype).element_size()
    return entry.matrices, rows * cols * itemsize
