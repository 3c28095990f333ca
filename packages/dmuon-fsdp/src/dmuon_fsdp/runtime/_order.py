"""The order in which one boundary's gradients leave for their owners.

[Note: reduce points]

Every rank must issue the same collectives in the same order. A boundary's gradients travel
as several collectives: one reduce per pack (a pack per owner, and one per tensor-parallel
matrix) and, on the replicated path, one all-reduce per replicated parameter. Issued in the
order their local gradients complete, they would follow whatever each rank's forward used: a
rank that left a branch or an expert out completes that pack later (or never), and its
collectives would pair with other ranks' collectives of other packs. That stops with a size
mismatch, hangs, or, where two mispaired buffers have the same size (tensor-parallel shards),
sums gradients of different weights without a word.

So each boundary issues its collectives in one fixed order, the same on every rank (the packs,
latest-used first, as backward completes them when every rank uses everything; then, on the
replicated path, one bucket of its replicated parameters: see [Note: replicated parameters a
rank left out] in :mod:`._collectives`), and an item leaves only once all before it have. What
a rank's forward left out is sent (as zeros, with its presence flag at zero: see [Note: a
parameter without a gradient]) at the boundary's **reduce point**, where its backward is over
on every rank: an autograd function on the boundary's forward inputs whose backward runs once
their gradients are computed, as FSDP2's post-backward does. By then the autograd engine has
accumulated every gradient of the boundary's weights (it runs a weight's gradient accumulation
as soon as that gradient is ready, before any node created earlier in forward). A boundary
called k times reaches its point at the last of the k that this backward runs (the autograd
engine says which it runs: a forward whose graph was dropped does not count); under reentrant
checkpointing each recompute runs a backward of its own, so there the first sends and the
other calls' gradients arrive late (below). A boundary whose inputs need no
gradient (the first block after a frozen embedding, a boundary holding the embedding) has no
reduce point: what is left goes at the end of backward, where each rank issues it in the
boundaries' order, which is safe only for the last boundary backward reaches.

So a rank may leave out any weight of a boundary with a reduce point. Skipping a whole
boundary on some ranks only still stops in the forward, where the others wait for its
weights, as under FSDP2; on the replicated path, which broadcasts nothing before a forward,
it mispairs the reduces instead. On the replicated path, too, a replicated parameter outside
every boundary is all-reduced as soon as its gradient is in: a boundary that reads one (a
table the layers share) must not have weights left out by some ranks only.

A gradient can still arrive after its boundary's reduce point, where part of it comes from a
use outside the boundary's forward that backward reaches later (a penalty on the weight taken
before the forward, on the replicated path where every rank holds it). Its item is then sent
once more at the end of backward (a pack again whole, its other gradients as zeros with their
flags at zero), in the boundaries' order and each boundary's: right as long as every rank
uses the weight that way, as every rank runs the same loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

__all__ = ["ReduceOrder"]

Item = TypeVar("Item")


class ReduceOrder(Generic[Item]):
    """The fixed order of one boundary's collectives, and how far this backward got through
    it (see [Note: reduce points]). Items are compared by identity."""

    def __init__(self, items: Sequence[Item]) -> None:
        self.items = list(items)
        self._index = {id(item): index for index, item in enumerate(self.items)}
        self._next = 0
        self._complete: set[int] = set()

    def index(self, item: Item) -> int:
        return self._index[id(item)]

    def passed(self, item: Item) -> bool:
        """Whether ``item`` was sent in this backward already."""
        return self._index[id(item)] < self._next

    def reset(self) -> None:
        self._next = 0
        self._complete.clear()

    def complete(self, item: Item) -> list[Item]:
        """``item``'s local gradient is in: the items that may leave now, in order (``item``
        and those after it that waited for it; none while an earlier one is incomplete)."""
        self._complete.add(id(item))
        start = self._next
        while self._next < len(self.items) and id(self.items[self._next]) in self._complete:
            self._next += 1
        return self.items[start : self._next]

    def rest(self) -> list[Item]:
        """Every item not sent yet, in order: at the boundary's reduce point, or at the end of
        backward."""
        start, self._next = self._next, len(self.items)
        return self.items[start:]
