"""The reduce queue's bookkeeping in one process, its collectives stubbed out."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from dmuon_fsdp.runtime import _collectives
from dmuon_fsdp.runtime._collectives import PendingReduce, ReduceQueue


class _Counted(PendingReduce):
    """A pending reduce that counts the reads of ``needs_replicate_stage``."""

    reads = 0

    @property
    def needs_replicate_stage(self) -> bool:  # type: ignore[override]
        _Counted.reads += 1
        return bool(self[2])


@pytest.mark.parametrize("sender_every", [0, 3], ids=["1d", "hsdp"])
def test_a_backward_reads_the_queue_in_time_linear_in_its_packs(
    monkeypatch: pytest.MonkeyPatch, sender_every: int
) -> None:
    """Each submission issues stage two of the reductions that wait for it, oldest first, but
    the newest; the end of backward issues the rest. Only the queue's end is read: a scan of
    the whole queue at each submission read it n²/2 times in a backward of n packs (about 5 ms
    of host time at 560 packs)."""
    issued: list[Any] = []

    def over_shards(pack: int, comm: object) -> PendingReduce:
        sends = bool(sender_every) and pack % sender_every == 0  # a sender of the HSDP row
        return _Counted(pack, None, sends, ())  # type: ignore[arg-type]

    def over_replicas(pending: PendingReduce, comm: object) -> PendingReduce:
        issued.append(pending.pack)
        return pending._replace(needs_replicate_stage=False)

    monkeypatch.setattr(_collectives, "reduce_over_shards", over_shards)
    monkeypatch.setattr(_collectives, "reduce_over_replicas", over_replicas)
    monkeypatch.setattr(_Counted, "reads", 0)
    queue = ReduceQueue(SimpleNamespace(layout=SimpleNamespace(world_size=2)), None)  # type: ignore[arg-type]
    packs = 200
    senders = [p for p in range(packs) if sender_every and p % sender_every == 0]
    for pack in range(packs):
        queue.submit(pack)  # type: ignore[arg-type]
        assert issued == [p for p in senders if p <= pack][:-1]
    queue.issue_replicate_stages()
    assert issued == senders
    assert _Counted.reads <= 5 * packs  # 1 (1d) or 4 (hsdp) a pack; 20300 before
