"""How much optimizer work one parameter puts on its owner.

[Note: the cost model]

The planner balances the time owners spend in ``optimizer.step()``. For a Muon matrix that time
is dominated by Newton–Schulz (NS); for an AdamW parameter it is an elementwise pass. Both are
expressed in one unit, *FLOP-equivalents*, so that one plan can mix routes.

NS on an (m, n) matrix, transposed so that m <= n (the NS front end does this), ``s`` steps:

* direct NS, per step: ``A = X Xᵀ`` (2m²n), ``B = bA + cA²`` (2m³), ``X = aX + BX`` (2m²n)::

      direct(m, n) = s · (4m²n + 2m³)

* Gram NS iterates on the m × m Gram matrix instead of the m × n iterate: form ``R = X Xᵀ``
  once (2m²n), run every step on m × m (``R²``, ``Q ← QZ``, ``R ← ZRZ``: about 8m³), then
  apply ``X ← QX`` at the end (2m²n). Each restart (default: one, at iteration 2) applies
  ``QX`` and forms ``XXᵀ`` again (4m²n)::

      gram(m, n) = 4m²n · (1 + restarts) + 8m³ · s

The runtime uses direct NS for square matrices (no Gram gain there: 30m³ against 48m³ at
s = 5) and Gram NS otherwise, so :func:`ns_cost` charges the variant that actually runs. Leading
dimensions beyond the last two multiply the cost (a batch of matrices).

GEMM FLOPs are an honest proxy of NS time because every term is a large matmul on tensor cores;
the exact constant does not matter for the plan, only the *ratios* between shapes, which
follow m²n and m³ as above (a 14336 × 4096 MLP matrix costs 2.3× a 4096 × 4096 one, not the
3.5× its element count suggests).

Elementwise work (Muon's momentum and update; AdamW's whole step) is memory bound. It is
converted to FLOP-equivalents with a machine balance of 256 FLOP per HBM byte (A100: ~156,
H100: ~295 fp16 tensor-core FLOP/byte): AdamW touches ~28 bytes per element (read param,
grad, two moments; write param, two moments, all fp32), Muon's elementwise part ~20 bytes.
For a 4096 × 4096 Muon matrix that elementwise part is ~4 % of its NS cost; for AdamW items it
is the whole cost, which is therefore proportional to the element count.

[Note: gathered or Gram NS of a tensor-parallel matrix]

A tensor-parallel matrix (``short × long``, split over ``T`` ranks on its long side) can be
orthogonalised two ways (``StepOptions(tp_ns=...)`` in dmuon_fsdp). *Gathered*: one TP owner
per matrix, spread over the group, gathers it, runs NS whole and scatters the result; the
group's owners run their matrices at the same time, so each rank does ``1/T`` of the NS work,
and per matrix each rank's link carries ``2(T−1)/T² · short · long`` elements of the NS input
one way (as owner ``1/T`` of the time, as a sender the rest). *Distributed Gram NS*: every
rank forms the Gram matrix of its block, and each of ``1 + restarts`` ring all-reduces carries
``2(T−1)/T · short²`` fp32 elements one way; the ``long/T`` side is split, but every rank
repeats the iterations on the ``short × short`` Gram matrix, ``8 short³ · steps`` FLOPs
(:func:`ns_flops`), ``(T−1)/T`` of them more than its share of the gathered NS.
:func:`tp_gram_pays` takes Gram NS where the bytes it saves on the link outweigh that extra
work at :data:`TP_LINK_BALANCE` FLOP per byte: TP groups sit inside a node, where an H100 or
H200 sustains about 600 TFLOP/s of NS products against about 400 GB/s one way over NVLink.
Only very wide matrices of modest width pass (a 1024 × 50304 head at ``T = 2``); a 70B model's
8192 × 28672 MLP at ``T = 8`` moves 4.6 × more under Gram NS, and a 4096 × 128256 head would
save 225 MB per rank for 2.4 TFLOP more.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from ._route import Route, parse_route

__all__ = [
    "CostFn",
    "ExpertStack",
    "elementwise_cost",
    "expert_base_loads",
    "expert_work",
    "experts_held",
    "ns_cost",
    "ns_flops",
    "tp_gram_pays",
]

#: ``cost(shape, route) -> float``: the work one item puts on its owner (any consistent unit).
CostFn = Callable[[tuple[int, ...], Route], float]

_MACHINE_BALANCE = 256  # FLOP per HBM byte, see [Note: the cost model]
_BYTES_PER_ELEMENT = {Route.MUON: 20, Route.ADAMW: 28, Route.SHARDED_ADAMW: 28}
#: FLOP per byte of a TP link; see [Note: gathered or Gram NS of a tensor-parallel matrix].
TP_LINK_BALANCE = 1500


def ns_flops(m: int, n: int, steps: int = 5, *, restarts: int = 1) -> int:
    """FLOPs of one Newton–Schulz orthogonalisation of an (m, n) matrix; see the module Note."""
    if steps < 1 or restarts < 0:
        raise ValueError(f"ns_flops: need steps >= 1 and restarts >= 0, got {steps}, {restarts}")
    m, n = min(m, n), max(m, n)
    if m == n:
        return steps * (4 * m * m * n + 2 * m**3)
    return 4 * m * m * n * (1 + restarts) + 8 * m**3 * steps


def tp_gram_pays(
    short: int, long: int, tp: int, *, itemsize: int, steps: int = 5, restarts: int = 1
) -> bool:
    """Whether distributed Gram NS of a ``short × long`` matrix split over ``tp`` ranks on its
    long side beats gathering it (NS input elements of ``itemsize`` bytes); see [Note: gathered
    or Gram NS of a tensor-parallel matrix]."""
    if tp < 2:
        return False
    gathered = 2 * (tp - 1) * short * long * itemsize / tp**2
    gram = (1 + restarts) * 2 * (tp - 1) * short * short * 4 / tp
    extra = 8 * short**3 * steps * (tp - 1) / tp
    return (gathered - gram) * TP_LINK_BALANCE > extra


def elementwise_cost(numel: int, route: Route) -> int:
    """FLOP-equivalents of the elementwise optimizer pass over ``numel`` elements."""
    return _BYTES_PER_ELEMENT[route] * _MACHINE_BALANCE * numel


def ns_cost(
    shape: Sequence[int], route: str = Route.MUON, *, steps: int = 5, restarts: int = 1
) -> float:
    """Optimizer work of one parameter on its owner, in FLOP-equivalents.

    ``"muon"``: Newton–Schulz FLOPs of the matrix (batch × :func:`ns_flops` over the last two
    dims) plus the elementwise momentum/update pass. ``"adamw"`` / ``"sharded_adamw"``: the
    elementwise AdamW pass only, proportional to the element count.
    The result is an integer held in a float, so it is exact and identical on every rank.
    """
    resolved = parse_route(route, "ns_cost: route")
    numel = math.prod(shape)
    total = elementwise_cost(numel, resolved)
    if resolved is Route.MUON:
        if len(shape) < 2:
            raise ValueError(f"ns_cost: route 'muon' needs a matrix, got shape {tuple(shape)}")
        batch = math.prod(shape[:-2])
        total += batch * ns_flops(shape[-2], shape[-1], steps, restarts=restarts)
    return float(total)


class ExpertStack(NamedTuple):
    """A stack of experts that FSDP2 shards on its expert dim and each rank steps where it
    lies (not an owner item): ``experts`` experts of ``per_expert`` matrices of ``rows × cols``
    each (2 for fused gate and up orthogonalised apart)."""

    experts: int
    rows: int
    cols: int
    per_expert: int = 1


def experts_held(experts: int, shard: int, shard_size: int) -> int:
    """Experts of a stack of ``experts`` that shard index ``shard`` of ``shard_size`` holds
    under ``torch.chunk`` (FSDP2's dim-0 split): ``ceil(experts / shard_size)`` each, the last
    shards fewer or none."""
    chunk = -(-experts // shard_size)
    return max(0, min(chunk, experts - shard * chunk))


def expert_work(stack: ExpertStack, shard: int, shard_size: int) -> float:
    """The NS work of the experts of ``stack`` that shard index ``shard`` holds."""
    held = experts_held(stack.experts, shard, shard_size)
    if not held:
        return 0.0
    return ns_cost((held * stack.per_expert, stack.rows, stack.cols))


def expert_base_loads(
    stacks: Iterable[ExpertStack], shard_size: int, replicate_size: int = 1
) -> list[float]:
    """The optimizer work the expert stacks put on each slot (``replicate * shard_size +
    shard``, the planner's order): the NS cost of the experts its shard index holds, the same
    on every replica. ``plan_owners(..., base_loads=...)`` then puts owned matrices on the
    lighter slots."""
    stacks = list(stacks)
    per_shard = [
        math.fsum(expert_work(stack, shard, shard_size) for stack in stacks)
        for shard in range(shard_size)
    ]
    return [per_shard[slot % shard_size] for slot in range(shard_size * replicate_size)]
