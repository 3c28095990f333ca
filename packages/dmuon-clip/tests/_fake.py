"""A stand-in for dmuon's Muon optimizer: only the clip protocol (ARCHITECTURE.md)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor


class MuonClipGrads(NamedTuple):
    grads: list[Tensor]
    process_group: Any
    device: torch.device
    copies: tuple[Tensor, ...] = ()
    sharded: bool = False


class FakeMuon:
    def __init__(
        self,
        grads: list[Tensor],
        process_group: Any = None,
        device: Any = "cpu",
        copies: tuple[Tensor, ...] = (),
        sharded: bool = False,
    ):
        self.grads = grads
        self.process_group = process_group
        self.device = torch.device(device)
        self.copies = copies
        self.sharded = sharded
        self.calls = 0

    def clip_group_and_device(self, params: str = "muon") -> tuple[Any, torch.device]:
        """What ``muon_grads_for_clip()`` would hand over, without taking (dmuon's Muon has
        it; ``calls`` does not count it)."""
        return self.process_group, self.device

    def muon_grads_for_clip(self) -> MuonClipGrads:
        self.calls += 1
        return MuonClipGrads(self.grads, self.process_group, self.device, self.copies, self.sharded)


class FakeMuonWithoutProbe(FakeMuon):
    """An optimizer of the protocol's required part only: no ``clip_group_and_device``."""

    clip_group_and_device = None  # type: ignore[assignment]
