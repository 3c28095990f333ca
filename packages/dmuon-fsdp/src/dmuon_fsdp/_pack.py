"""One pack: the dedicated parameters one owner sends for one hook boundary, in one buffer.

[Note: packs]

The parameters of a boundary are split by owner (and dtype) into packs; a pack is one
contiguous buffer and travels in one collective, so a boundary with k owners issues k
broadcasts that run concurrently on different senders' links. In row ``r`` of the grid the
sender of a pack owned by ``(s, r_o)`` is ``(s, r)``: the owner itself in its own row, and in
the other rows of an HSDP grid the owner's column replica, which holds a published copy of the
weight (see [Note: the grid] in :mod:`._mesh`).

Only a peer pack (this rank neither owns nor replicates it) changes storage: it is allocated
before a broadcast fills it and resized to zero afterwards. A sender's pack always holds the
weight. Every parameter's ``.data`` is a view into its pack's buffer; see [Note: storage of a
dedicated parameter] in :mod:`._param`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dmuon_ownership import Owner

from ._guard import set_held
from ._mesh import MeshLayout
from ._param import DedicatedParam, Role

__all__ = ["Pack"]


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

    @classmethod
    def build(cls, params: list[DedicatedParam], layout: MeshLayout) -> Pack:
        """Copy ``params`` (one owner, one dtype) into a new buffer on the layout's device and
        point each parameter at its slice; a peer's buffer is then freed."""
        owner, role = params[0].owner, params[0].role
        numel = sum(dp.numel for dp in params)
        buffer = torch.empty(numel, dtype=params[0].dtype, device=layout.device)
        offset = 0
        for dp in params:
            view = buffer[offset : offset + dp.numel].view(dp.shape)
            if role is not Role.PEER:
                with torch.no_grad():
                    view.copy_(dp.param.detach())
            dp.offset = offset
            dp.param.data = view
            if role is Role.OWNER:
                dp.full = view
            offset += dp.numel
        pack = cls(
            owner=owner,
            role=role,
            params=params,
            buffer=buffer,
            sender=layout.rank_of[layout.coord.replicate][owner.shard],
            owner_rank=layout.global_rank(owner),
            numel=numel,
        )
        if role is Role.PEER:
            pack.free()
        return pack

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
        for dp in self.params:
            set_held(dp.param, True)

    def free(self) -> None:
        for dp in self.params:
            set_held(dp.param, False)
        storage = self.buffer.untyped_storage()
        if storage.size() != 0:
            storage.resize_(0)

    def has_storage(self) -> bool:
        return self.buffer.untyped_storage().size() == self.nbytes
