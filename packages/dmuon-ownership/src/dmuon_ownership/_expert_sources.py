"""Which HSDP replica orthogonalises each shard of each expert stack.

[Note: expert sources]

Under HSDP every replica of shard index ``g`` holds the same experts of every stack (FSDP2
splits dim 0 over the shard axis and replicates it over the replicate axis), with the same
averaged gradients, so by default each replica steps them itself and they stay identical with
no byte moved. The expert work is then fixed per shard index and equal on every replica, and
when it dominates a slot's load (a mixture-of-experts model on many ranks) one dense matrix
owned on top of it sets the maximum: Kimi K2 on 8 × 128 ranks holds 3 experts of each of 180
stacks per rank, and its largest dense matrix adds 6 % to the rank that owns it.

An *expert source* moves that work: ``ExpertSource(stack, shard, replicate)`` says that the
``stack``'s experts at ``shard`` are orthogonalised and updated on replica ``replicate`` only,
which then broadcasts its updated shard over the replicate axis (one master-dtype copy of it
received per other replica); every other replica of that shard skips their Newton–Schulz and
update. Momentum is still updated on every replica (elementwise and identical everywhere), so
the optimizer state stays the same on every replica and a checkpoint reads the same from any.

Choosing them (:func:`expert_sources`, after the owners are placed): per shard index, while its
most loaded replica is above ``(1 + tolerance) ×`` the larger of the grid's mean load and its
least loaded replica's load, the next stack shard
(decreasing cost, ties: name) becomes a source on the *least* loaded replica of that shard
index other than the most loaded one, and every other replica of it drops that work. Each move
lowers the maximum or leaves it where it was and never raises a load, so the result is never
worse than the plan without sources. The tolerance trades bytes for balance: a source costs a
broadcast of its shard, to save NS time on the slowest rank; below it nothing moves. The
least loaded replica bounds the limit from below because sources only even out what the owned
matrices add to a shard index: when shard indices hold unequal experts (``torch.chunk`` of 384
experts over 256 shards leaves 64 with none), splitting every replica's experts would cost a
broadcast of nearly all of them each step, and the planner has already put the dense matrices
on the shards without experts.
Everything is computed in one order from exact per-stack costs, so every rank gets the same
sources.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from ._cost import ExpertStack, expert_work

__all__ = ["SOURCE_TOLERANCE", "ExpertSource", "expert_sources"]

#: Load above ``(1 + SOURCE_TOLERANCE) ×`` the limit of [Note: expert sources] (the larger of
#: the grid's mean load and the shard index's least loaded replica's) that makes expert
#: sources worth their bytes.
SOURCE_TOLERANCE = 0.02


class ExpertSource(NamedTuple):
    """``stack``'s experts at shard index ``shard`` are stepped on replica ``replicate`` only
    and broadcast to the other replicas (see [Note: expert sources])."""

    stack: str
    shard: int
    replicate: int


def expert_sources(
    stacks: Sequence[tuple[str, ExpertStack]],
    loads: Sequence[float],
    shard_size: int,
    replicate_size: int,
    *,
    tolerance: float = SOURCE_TOLERANCE,
) -> tuple[ExpertSource, ...]:
    """The expert sources that bring every slot's load (``loads[slot]``, ``slot = replicate *
    shard_size + shard``, expert work included) down to the limit of [Note: expert sources]
    where the experts allow it; sorted. Empty without replicas."""
    if replicate_size < 2 or not stacks or not loads:
        return ()
    mean = math.fsum(loads) / len(loads)
    ordered = sorted(stacks, key=lambda pair: pair[0])
    chosen: list[ExpertSource] = []
    for shard in range(shard_size):
        current = [loads[r * shard_size + shard] for r in range(replicate_size)]
        limit = max(mean, min(current)) * (1.0 + tolerance)
        if max(current) <= limit:
            continue
        work = [(expert_work(stack, shard, shard_size), name) for name, stack in ordered]
        candidates = sorted((w for w in work if w[0] > 0), key=lambda w: (-w[0], w[1]))
        for cost, name in candidates:
            top = max(range(replicate_size), key=lambda r: (current[r], -r))
            if current[top] <= limit:
                break
            source = min(
                (r for r in range(replicate_size) if r != top), key=lambda r: (current[r], r)
            )
            chosen.append(ExpertSource(name, shard, source))
            for r in range(replicate_size):
                if r != source:
                    current[r] -= cost
    return tuple(sorted(chosen))
