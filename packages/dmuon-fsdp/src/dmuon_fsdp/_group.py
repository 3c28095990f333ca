"""One hook boundary: the packed buffers of its owners, their state and their collectives.

[Note: packs and states]

The parameters of one boundary are split by owner (and dtype) into *packs*; a pack is one
contiguous buffer and travels in one collective, so a boundary with k owners issues k
broadcasts that run concurrently on different senders' links. In row ``r`` of the grid the
sender of a pack owned by ``(s, r_o)`` is ``(s, r)``: the owner itself in its own row, a
column replica in the others (column presence, SPEC section 4).

The boundary as a whole is in one :class:`GroupState`:

``FREED`` -> ``to_broadcasting()`` -> ``BROADCASTING`` -> ``to_ready()`` -> ``READY`` ->
``to_freed()`` -> ``FREED``

Only peer packs (this rank neither owns nor replicates them) change storage: they allocate in
``to_broadcasting`` and free in ``to_freed``. Sender packs always hold the weight; for them
the transitions only issue the collective they send.

[Note: gradient reduction]

A pack's gradient is reduced when every one of its parameters has its local gradient
(``register_post_accumulate_grad_hook``), or at the end of backward for parameters that got
none (they count as zero). The local gradients are copied into one flat buffer, the parameters'
``.grad`` is dropped (FSDP2, AdamW and ``torch.nn.utils.clip_grad_norm_`` never see it), and
the buffer is summed over the shard group into the row's sender, then (HSDP) over the
replicate group into the global owner, which divides once by ``G · R``. Summing first and
dividing once at the end makes the result independent of Z2/Z3 and of sync/async publish; the
only thing that changes it is the summation order of the reduce itself (1-D vs HSDP).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from enum import Enum, auto

import torch
from torch import nn

from dmuon_ownership import Owner

from ._collectives import Axis, CollectiveResult, CommKind, broadcast, reduce_sum, wait
from ._comm import DedicatedCommContext
from ._param import DedicatedParam, Role

__all__ = ["DedicatedGroup", "GroupState", "Pack", "PendingReduce", "finish_reduce", "issue_stage2"]


class GroupState(Enum):
    FREED = auto()  # peer packs hold no storage
    BROADCASTING = auto()  # broadcasts issued, not yet waited on
    READY = auto()  # every pack holds the current weight


@dataclass(eq=False)
class Pack:
    """The parameters one owner sends for one boundary, in one contiguous buffer."""

    owner: Owner
    role: Role
    params: list[DedicatedParam]
    buffer: torch.Tensor
    sender: int  # global rank that sends this pack in this rank's row
    owner_rank: int  # global rank of the global owner
    numel: int
    grads_seen: int = 0
    handled: bool = False  # its gradient was dealt with in the current backward
    publish: CollectiveResult | None = None

    @property
    def is_sender(self) -> bool:
        return self.role is not Role.PEER

    @property
    def nbytes(self) -> int:
        return self.numel * self.buffer.element_size()

    def alloc(self) -> None:
        storage = self.buffer.untyped_storage()
        if storage.size() != self.nbytes:
            storage.resize_(self.nbytes)

    def free(self) -> None:
        storage = self.buffer.untyped_storage()
        if storage.size() != 0:
            storage.resize_(0)

    def has_storage(self) -> bool:
        return self.buffer.untyped_storage().size() == self.nbytes


@dataclass(eq=False)
class PendingReduce:
    """One pack's gradient on its way to the global owner."""

    pack: Pack
    stage1: CollectiveResult
    stage2: CollectiveResult | None = None
    needs_stage2: bool = False


@dataclass(eq=False)
class DedicatedGroup:
    """A hook boundary: the module whose forward hooks move the weights of ``packs``."""

    fqn: str
    module: nn.Module
    packs: list[Pack]
    comm: DedicatedCommContext
    state: GroupState = GroupState.FREED
    # Per forward/backward bookkeeping, reset by :meth:`reset_backward`.
    backward_started: bool = False
    needs_backward: bool = False
    _broadcasts: list[CollectiveResult] = field(default_factory=list)

    @classmethod
    def build(
        cls,
        fqn: str,
        module: nn.Module,
        members: list[list[DedicatedParam]],
        comm: DedicatedCommContext,
    ) -> DedicatedGroup:
        """Pack ``members`` (one list per owner, same dtype each) and point every parameter at
        its slice; see [Note: storage of a dedicated parameter] in :mod:`._param`."""
        layout = comm.layout
        packs: list[Pack] = []
        for dps in members:
            owner, role = dps[0].owner, dps[0].role
            first = dps[0].param
            numel = sum(dp.numel for dp in dps)
            buffer = torch.empty(numel, dtype=first.dtype, device=layout.device)
            offset = 0
            for dp in dps:
                view = buffer[offset : offset + dp.numel].view(dp.shape)
                if role is not Role.PEER:
                    with torch.no_grad():
                        view.copy_(dp.param.detach())
                dp.offset = offset
                dp.param.data = view
                if role is Role.OWNER:
                    dp.full = view
                offset += dp.numel
            pack = Pack(
                owner=owner,
                role=role,
                params=dps,
                buffer=buffer,
                sender=layout.rank_of[layout.coord.replicate][owner.shard],
                owner_rank=layout.global_rank(owner),
                numel=numel,
            )
            if role is Role.PEER:
                pack.free()
            packs.append(pack)
        # With more than one shard every pack has peers in every row, so every rank of the row
        # runs the same transitions (senders take part in each broadcast they send).
        state = GroupState.READY if layout.shard_size == 1 else GroupState.FREED
        return cls(fqn, module, packs, comm, state)

    # -- weights -------------------------------------------------------------------------------

    def to_broadcasting(self) -> None:
        assert self.state is GroupState.FREED, f"{self.fqn!r}: broadcast from {self.state}"
        self.wait_publishes()
        comm = self.comm
        stream = comm.broadcast_stream
        for pack in self.packs:
            if stream is not None and not pack.is_sender:
                # Allocate in the comm stream: see [Note: issuing on CPU and on CUDA].
                stream.wait_stream(torch.cuda.current_stream(pack.buffer.device))
                with torch.cuda.stream(stream):
                    pack.alloc()
            else:
                pack.alloc()
            self._broadcasts.append(
                broadcast(
                    pack.buffer, pack.sender, comm.shard_group, stream, comm.counter, Axis.SHARD
                )
            )
        self.state = GroupState.BROADCASTING

    def to_ready(self) -> None:
        assert self.state is GroupState.BROADCASTING, f"{self.fqn!r}: wait from {self.state}"
        for result in self._broadcasts:
            wait(result)
        self._broadcasts.clear()
        self.state = GroupState.READY

    def to_freed(self) -> None:
        assert self.state is GroupState.READY, f"{self.fqn!r}: free from {self.state}"
        if self.comm.layout.shard_size == 1:
            return  # every rank owns everything: nothing to free, nothing to broadcast
        for pack in self.packs:
            if not pack.is_sender:
                pack.free()
        self.state = GroupState.FREED

    def unshard(self) -> None:
        """Make every pack hold the current weight (issue and wait as needed)."""
        if self.state is GroupState.FREED:
            self.to_broadcasting()
        if self.state is GroupState.BROADCASTING:
            self.to_ready()

    def wait_publishes(self) -> None:
        for pack in self.packs:
            if pack.publish is not None:
                wait(pack.publish)
                pack.publish = None

    def publish(self) -> None:
        """HSDP: send the owner's updated packs to its replicate peers (column replicas)."""
        comm = self.comm
        if comm.replicate_group is None or comm.layout.replicate_size == 1:
            return
        self.wait_publishes()
        for pack in self.packs:
            if pack.role is Role.PEER:
                continue  # the publish runs inside the owner's shard column only
            pack.publish = broadcast(
                pack.buffer,
                pack.owner_rank,
                comm.replicate_group,
                comm.publish_stream,
                comm.counter,
                Axis.REPLICATE,
                CommKind.PUBLISH,
            )

    # -- gradients ------------------------------------------------------------------------------

    def reset_backward(self) -> None:
        self.backward_started = False
        self.needs_backward = False
        for pack in self.packs:
            pack.grads_seen = 0
            pack.handled = False

    def pack_grads(self, pack: Pack) -> torch.Tensor:
        """Copy the local gradients of ``pack`` into one flat buffer and drop ``.grad``."""
        stream = self.comm.reduce_stream
        first = pack.params[0].param
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(first.device))
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            flat = torch.empty(pack.numel, dtype=first.dtype, device=first.device)
            for dp in pack.params:
                grad = dp.param.grad
                out = flat[dp.offset : dp.offset + dp.numel]
                if grad is None:
                    out.zero_()
                else:
                    out.copy_(grad.reshape(-1))
                    if stream is not None:
                        grad.record_stream(stream)
                dp.param.grad = None
        return flat

    def keep_local_grads(self, pack: Pack) -> None:
        """A world of one rank: the local gradient is already the average, so it becomes
        ``DedicatedParam.grad`` without a copy (``.grad`` is still dropped)."""
        for dp in pack.params:
            grad = dp.param.grad
            dp.param.grad = None
            if grad is None:
                grad = torch.zeros_like(dp.param)
            if dp.grad is None:
                dp.grad = grad
            else:
                dp.grad.add_(grad)

    def reduce_pack(self, pack: Pack) -> PendingReduce:
        """Stage one of [Note: gradient reduction]: sum over the shard group into the row's
        sender. Stage two is issued by the runtime in FIFO order (:func:`issue_stage2`)."""
        comm = self.comm
        flat = self.pack_grads(pack)
        if comm.layout.shard_size > 1:
            stage1 = reduce_sum(
                flat, pack.sender, comm.shard_group, comm.reduce_stream, comm.counter, Axis.SHARD
            )
        else:
            stage1 = CollectiveResult(flat, None, _event_after(comm.reduce_stream))
        needs_stage2 = comm.layout.replicate_size > 1 and pack.is_sender
        return PendingReduce(pack, stage1, None, needs_stage2)


def issue_stage2(comm: DedicatedCommContext, pending: PendingReduce) -> None:
    """Stage two of [Note: gradient reduction]: sum over the owner's shard column."""
    assert comm.replicate_group is not None
    flat = wait_before_issue(pending.stage1, comm.replicate_reduce_stream)
    pending.stage2 = reduce_sum(
        flat,
        pending.pack.owner_rank,
        comm.replicate_group,
        comm.replicate_reduce_stream,
        comm.counter,
        Axis.REPLICATE,
    )


def finish_reduce(pending: PendingReduce, divisor: int) -> None:
    """Wait for ``pending`` and, on the global owner, store the averaged gradient."""
    result = pending.stage2 if pending.stage2 is not None else pending.stage1
    flat = wait(result)
    pack = pending.pack
    if pack.role is not Role.OWNER:
        return
    flat.div_(divisor)
    for dp in pack.params:
        grad = flat[dp.offset : dp.offset + dp.numel].view(dp.shape)
        if dp.grad is None:
            dp.grad = grad
        else:
            dp.grad.add_(grad)


def wait_before_issue(result: CollectiveResult, stream: torch.cuda.Stream | None) -> torch.Tensor:
    """Order a follow-up collective on ``stream`` after ``result``: a stream wait on CUDA, a
    host wait on CPU (the caller only issues once ``result`` has completed there)."""
    if result.work is not None:
        result.work.wait()
    if result.event is not None and stream is not None:
        stream.wait_event(result.event)
    return result.tensor


def _event_after(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event
