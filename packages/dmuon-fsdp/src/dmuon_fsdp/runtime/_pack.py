"""One pack: the dedicated parameters one owner sends for one hook boundary, in one buffer.

[Note: packs]

The parameters of a boundary are split by owner (and dtype) into packs; a pack is one
contiguous buffer and travels in one collective, so a boundary with k owners issues k
broadcasts that run concurrently on different senders' links. In row ``r`` of the grid the
sender of a pack owned by ``(s, r_o)`` is ``(s, r)``: the owner itself in its own row, and in
the other rows of an HSDP grid the owner's column replica, which holds a published copy of the
weight (see [Note: the grid] in :mod:`._mesh`).

A kind whose ``packs_alone`` is set (a tensor-parallel matrix: see ``TensorParallelParam``)
gets a pack of its own.

Only a peer pack (this rank neither owns nor replicates it) changes storage: it is allocated
before a broadcast fills it and resized to zero afterwards, and its holders ``hold`` and
``release`` their weights with it. A sender's pack always holds the weight. Every parameter's
``.data`` is a view into its pack's buffer (its holder's ``place``); see [Note: storage of a
dedicated parameter] in ``holder/_dedicated``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dmuon_ownership import Owner

from ..holder import DedicatedParam, Role
from ..topology import MeshLayout

__all__ = ["Pack", "without_storage"]


def without_storage(
    shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A contiguous tensor of ``shape`` whose storage holds zero bytes: what a peer's pack
    buffer or dedicated parameter is between uses, made without ever allocating it (a
    ``storage.resize_`` gives it its bytes when a broadcast needs them)."""
    stride = torch.empty(shape, device="meta").stride()
    storage = torch.UntypedStorage(0, device=device)
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, shape, stride)


@dataclass(eq=False)
class Pack:
    """The parameters one owner sends for one boundary, in one contiguous buffer in their
    compute dtype."""

    owner: Owner
    role: Role
    params: list[DedicatedParam]
    buffer: torch.Tensor
    sender: int  # global rank that sends this pack in this rank's row
    owner_rank: int  # global rank of the global owner
    numel: int
    # The owner's master weights when they are kept apart from the buffer (mixed precision).
    masters: list[torch.Tensor] | None = None
    # Every rank keeps the weight (the replicated path): a peer's buffer is never freed.
    resident: bool = False

    @classmethod
    def build(cls, params: list[DedicatedParam], layout: MeshLayout, resident: bool) -> Pack:
        """Copy ``params`` (one owner, one precision, materialised on the layout's device) into
        a new buffer and point each parameter at its slice; see [Note: mixed precision] for the
        owner's master. A peer's buffer is then freed, unless ``resident``."""
        owner, role = params[0].owner, params[0].role
        precision = params[0].precision
        assert precision is not None, "resolve the precision before packing"
        numel = sum(dp.numel for dp in params)
        keeps = role is not Role.PEER or resident  # this rank keeps the weights
        if keeps:
            buffer = torch.empty(numel, dtype=precision.compute, device=layout.device)
        else:
            # Freed at once below: never allocate it (see [Note: meta-device models]).
            buffer = without_storage((numel,), precision.compute, layout.device)
        masters: list[torch.Tensor] | None = [] if role is Role.OWNER and precision.mixed else None
        offset = 0
        for dp in params:
            view = buffer[offset : offset + dp.numel].view(dp.local_shape)
            master = dp.place(view, offset, keeps=keeps, resident=resident)
            if masters is not None:
                assert master is not None
                masters.append(master)
            offset += dp.numel
        pack = cls(
            owner=owner,
            role=role,
            params=params,
            buffer=buffer,
            sender=layout.rank_of[layout.coord.replicate][owner.shard],
            owner_rank=layout.global_rank(owner),
            numel=numel,
            masters=masters,
            resident=resident,
        )
        if pack.transient:
            pack.free()
        return pack

    @property
    def is_sender(self) -> bool:
        return self.role is not Role.PEER

    @property
    def transient(self) -> bool:
        """Whether the buffer is freed between uses (a peer's, or an owner's compute copy;
        neither on the replicated path, where every rank computes with its resident copy)."""
        return not self.resident and (self.role is Role.PEER or self.masters is not None)

    @property
    def nbytes(self) -> int:
        return self.numel * self.buffer.element_size()

    def views(self) -> list[torch.Tensor]:
        return [
            self.buffer[dp.offset : dp.offset + dp.numel].view(dp.local_shape) for dp in self.params
        ]

    def alloc(self) -> None:
        """Give the buffer its storage; an owner's compute copy is cast from the masters and
        its parameters point at it."""
        storage = self.buffer.untyped_storage()
        if storage.size() != self.nbytes:
            storage.resize_(self.nbytes)
        if self.masters is not None:
            with torch.no_grad():
                for dp, view, master in zip(self.params, self.views(), self.masters):
                    view.copy_(master)
                    dp.tensor.data = view
        for dp in self.params:
            dp.hold()

    def free(self) -> None:
        """Drop the buffer's storage; an owner's parameters point back at the masters."""
        if self.masters is not None:
            for dp, master in zip(self.params, self.masters):
                dp.tensor.data = master
        else:
            for dp in self.params:
                dp.release()
        storage = self.buffer.untyped_storage()
        if storage.size() != 0:
            storage.resize_(0)

    def adopt_writes(self) -> None:
        """On the replicated path, the owner's masters take what was written in place into
        their resident compute copies since (see [Note: writes into a resident compute copy]
        in ``runtime/_runtime``)."""
        if self.masters is not None and self.resident:
            for dp in self.params:
                dp.adopt_written_copy()

    def has_storage(self) -> bool:
        return self.buffer.untyped_storage().size() == self.nbytes
