"""One hook boundary: its packs, the state of their weights, and their per-backward bookkeeping.

[Note: the group's state machine]

The packs of a boundary (see [Note: packs] in :mod:`._pack`) are in one :class:`GroupState`:

``RESHARDED`` -> ``UNSHARDING`` (broadcasts issued) -> ``UNSHARDED`` (waited) -> ``RESHARDED``

Callers never look at the state; they use verbs that are safe to call in any state, as
FSDP2's ``FSDPParamGroup`` does:

- :meth:`DedicatedGroup.unshard` issues the broadcasts if the weights are not resident or on
  their way (``async_op=True`` returns without waiting: a prefetch);
- :meth:`DedicatedGroup.wait_for_unshard` waits for broadcasts in flight;
- :meth:`DedicatedGroup.reshard` waits if needed, then frees the peer packs;
- :meth:`DedicatedGroup.publish` / :meth:`DedicatedGroup.wait_for_publish` do the same for the
  publish of the owners' updated packs: in HSDP to their shard column, on the replicated path
  to every rank of the shard group.

A group with no transient pack (a shard size of one and no separate master) never frees or
broadcasts anything and stays ``UNSHARDED``. With a shard size of one but an owner's compute
copy (mixed precision) the transitions run and only cast and free that copy.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import torch
from torch import nn

from ..holder import DedicatedParam, Role
from ..topology import Axis, CommKind, DedicatedCommContext
from ._collectives import CollectiveResult, ReplicatedBucket, broadcast, wait
from ._order import ReduceOrder
from ._pack import Pack

__all__ = ["DedicatedGroup", "GroupState"]


class GroupState(Enum):
    RESHARDED = auto()  # peer packs hold no storage
    UNSHARDING = auto()  # broadcasts issued, not yet waited on
    UNSHARDED = auto()  # every pack holds the current weight


@dataclass(eq=False)
class DedicatedGroup:
    """A hook boundary: the module whose forward hooks move the weights of its packs.

    ``members`` (one list per owner, in plan order) become ``packs`` in :meth:`pack`, once the
    parameters are materialised and their precision is known."""

    fqn: str
    module: nn.Module
    members: list[list[DedicatedParam]]
    comm: DedicatedCommContext
    packs: list[Pack] = field(default_factory=list)
    # Every rank keeps every weight (the replicated path): nothing is broadcast before forward,
    # and the owners publish their updates to the shard group after a step.
    replicated: bool = False
    # The dtype this boundary's forward inputs are cast to (param_policy), or None.
    input_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    _state: GroupState = GroupState.UNSHARDED
    _broadcasts: list[CollectiveResult] = field(default_factory=list)
    _publishes: list[CollectiveResult] = field(default_factory=list)
    # What the publishes write (the receivers' copies) or read (the senders' buffers).
    _receiving: list[DedicatedParam] = field(default_factory=list)
    # Per forward/backward bookkeeping, cleared by :meth:`reset_backward`.
    backward_started: bool = False  # a pre-backward hook of this boundary fired
    needs_backward: bool = False  # the forward produced outputs that require grad
    _grads_seen: dict[Pack, int] = field(default_factory=dict)
    # The replicated path: one of this boundary's replicated weights got a gradient, perhaps
    # from outside the boundary (a norm of a dropped layer that a penalty reads).
    replicated_grad_seen: bool = False
    # The order this boundary's collectives leave in (its packs, then on the replicated path
    # the bucket of its replicated parameters), set at the first forward, and how far this
    # backward got through it; see [Note: reduce points].
    order: ReduceOrder[Pack | ReplicatedBucket] = field(default_factory=lambda: ReduceOrder(()))
    # The reduce points (their autograd nodes, weakly) registered by the forwards since the
    # last backward; how many of them the backward under way runs (known at the first it
    # reaches) and has reached.
    points: list[weakref.ref[Any]] = field(default_factory=list)
    points_due: int = 0
    points_reached: int = 0

    def pack(self) -> None:
        """Build the packs: one per (owner, precision) of the members, and one for each member
        whose kind packs alone (tensor-parallel), see [Note: packs]."""
        split: dict[tuple[object, object, str], list[DedicatedParam]] = {}
        for dps in self.members:
            for dp in dps:
                alone = dp.fqn if dp.packs_alone else ""
                split.setdefault((dp.owner, dp.precision, alone), []).append(dp)
        self.packs = [Pack.build(dps, self.comm.layout, self.replicated) for dps in split.values()]
        self._state = GroupState.RESHARDED if self._cycles else GroupState.UNSHARDED

    @property
    def _cycles(self) -> bool:
        """Whether the state machine runs at all. With more than one shard it runs on every
        rank of the row alike (a sender takes part in each broadcast it sends, even when it
        holds no transient pack itself); with one shard only to cast and free an owner's
        compute copy, which needs no other rank."""
        if self.replicated:
            return False
        return self.comm.layout.shard_size > 1 or any(p.transient for p in self.packs)

    @property
    def status(self) -> str:
        """The weights' state as a word, for diagnostics: resharded, unsharding, unsharded."""
        return self._state.name.lower()

    # -- weights: see [Note: the group's state machine] ----------------------------------------

    def unshard(self, async_op: bool = False) -> None:
        """Make every pack hold the current weight; ``async_op`` only issues the broadcasts."""
        if self._state is GroupState.RESHARDED:
            self._issue_broadcasts()
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        if self._state is not GroupState.UNSHARDING:
            return
        for result in self._broadcasts:
            wait(result)
        self._broadcasts.clear()
        self._state = GroupState.UNSHARDED

    def reshard(self) -> None:
        """Free the transient packs (after waiting for broadcasts in flight into them)."""
        self.wait_for_unshard()
        if self._state is not GroupState.UNSHARDED or not self._cycles:
            return
        for pack in self.packs:
            if pack.transient:
                pack.free()
        self._state = GroupState.RESHARDED

    def _issue_broadcasts(self) -> None:
        # A publish in flight writes the senders' buffers that these broadcasts read.
        self.wait_for_publish()
        comm = self.comm
        stream = comm.broadcast_stream
        for pack in self.packs:
            if stream is not None and not pack.is_sender:
                # Allocate in the comm stream: see [Note: issuing on CPU and on CUDA].
                stream.wait_stream(torch.cuda.current_stream(pack.buffer.device))
                with torch.cuda.stream(stream):
                    pack.alloc()
            elif pack.transient:
                pack.alloc()  # the owner's compute copy, cast from its master
            if comm.layout.shard_size > 1:
                self._broadcasts.append(
                    broadcast(
                        pack.buffer, pack.sender, comm.shard_group, stream, comm.counter, Axis.SHARD
                    )
                )
        self._state = GroupState.UNSHARDING

    # -- publish: HSDP and the replicated path --------------------------------------------------

    def publish(self) -> None:
        """Send the owners' updated packs to the ranks that keep a copy: in HSDP the owner's
        replicate peers (its shard column), on the replicated path every rank of the shard
        group. Waited by :meth:`wait_for_publish`, at the latest before this boundary's next
        broadcast or forward."""
        comm = self.comm
        if self.replicated:
            if comm.layout.shard_size == 1:
                # No peer to send to, but the owner's compute copy is resident (never cast
                # again by an unshard): cast it from the new master, or every later forward
                # would compute with the weights of before the step.
                for pack in self.packs:
                    if pack.masters is not None:
                        pack.alloc()
                return
            group, axis = comm.shard_group, Axis.SHARD
            packs = [(pack, pack.sender) for pack in self.packs]
        elif comm.replicate_group is not None and comm.layout.replicate_size > 1:
            group, axis = comm.replicate_group, Axis.REPLICATE
            # Inside the owner's shard column only.
            packs = [(pack, pack.owner_rank) for pack in self.packs if pack.role is not Role.PEER]
        else:
            return
        self.wait_for_publish()
        for pack, source in packs:
            if pack.masters is not None:
                # The owner's compute copy of its new master (replicas keep theirs: they send
                # it in their rows). The next unshard casts again; the values are the same.
                pack.alloc()
            self._publishes.append(
                broadcast(
                    pack.buffer,
                    source,
                    group,
                    comm.publish_stream,
                    comm.counter,
                    axis,
                    CommKind.PUBLISH,
                )
            )
        # Reads of the copies being written, and writes of the buffers being sent, wait: see
        # [Note: reads before a publish lands].
        self._receiving = [dp for p, _ in packs for dp in p.params]
        wait = weakref.WeakMethod(self.wait_for_publish)
        for dp in self._receiving:
            dp.receive(wait)

    def wait_for_publish(self) -> None:
        for result in self._publishes:
            wait(result)
        self._publishes.clear()
        for dp in self._receiving:
            dp.landed()
        self._receiving = []

    def adopt_writes(self) -> None:
        """The replicated path: owners' masters take in-place writes into their resident
        compute copies (see [Note: writes into a resident compute copy] in :mod:`._runtime`)."""
        for pack in self.packs:
            pack.adopt_writes()

    # -- per-backward bookkeeping ---------------------------------------------------------------

    def live_points(self) -> list[weakref.ref[Any]]:
        """``points`` less those of forwards whose graph was dropped (never run, nor counted)."""
        return [ref for ref in self.points if ref() is not None]

    def reset_backward(self) -> None:
        self.backward_started = False
        self.needs_backward = False
        self.points_due = 0
        self.points_reached = 0
        self._grads_seen.clear()
        self.replicated_grad_seen = False
        self.order.reset()

    @property
    def backward_touched(self) -> bool:
        """Whether the current backward reached this boundary at all, or gave one of its
        replicated weights a gradient from outside it."""
        return self.needs_backward or bool(self._grads_seen) or self.replicated_grad_seen

    def count_grad(self, pack: Pack) -> bool:
        """One more parameter of ``pack`` has its local gradient; ``True`` once all have."""
        seen = self._grads_seen.get(pack, 0) + 1
        self._grads_seen[pack] = seen
        return seen == len(pack.params)

    @property
    def all_packs_sent(self) -> bool:
        """Whether every pack left in this backward (each leaves once: its order hands it out
        once per backward)."""
        return all(self.order.passed(pack) for pack in self.packs)
