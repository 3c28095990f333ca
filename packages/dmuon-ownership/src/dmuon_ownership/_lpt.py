"""Global owner assignment: packing, LPT with boundary spread, a swap pass, TP owners.

[Note: the assignment]

Inputs are sorted by name first, so nothing below depends on the order the caller passed.

1. *Packing.* Per hook boundary, every owned item with fewer than ``small_param_threshold``
   elements joins one pack; a pack is placed as a whole, so a boundary costs at most one extra
   small broadcast instead of one per norm / bias / tiny projection. Larger items are placed
   one by one. Each placed thing is an *atom*.
2. *LPT with spread.* Atoms are placed in order of decreasing cost (ties: name), each on the
   least-loaded slot (ties: lowest slot index) among the slots its boundary may still use:
   first a slot whose *shard index* no atom of the boundary uses yet, then a slot the boundary
   does not use yet, then any slot. Shard indices come first because the forward broadcasts of
   a boundary run on the shard axis inside every replicate row (the row's copy of the owner
   broadcasts), so only distinct shard indices make them concurrent; distinct slots still
   spread the owner step and the replicate-axis traffic. A binary heap over ``(load, slot)``
   finds the slot; a candidate that the boundary already uses is popped and pushed back, so
   the search costs O(log S) per atom plus the boundary's own atom count.
3. *Swap pass.* The spread rule can cost LPT balance (an atom may not go to the lightest slot).
   A local search then repeatedly takes the most loaded slot and applies the single move of one
   of its atoms to one of the 16 least loaded slots, or swap with an atom there, that lowers
   the larger of the two loads the most, keeping every boundary's number of distinct shard
   indices and of distinct slots (the spread is never undone). It stops when no move lowers the
   maximum, or after 2·S rounds; the maximum never rises, so LPT's guarantees still hold.
   Everything is counted in rounds, never timed, so every rank stops at the same point.
4. *TP owners.* For items with ``tp > 1`` the owner slot's TP ranks share the work: per slot,
   those items (decreasing cost, ties: name) go to the least-loaded TP rank. Items with
   ``tp == 1`` are held whole by every TP rank of the slot and do not affect the choice.
   Balancing per slot keeps the DP plan independent of TP, and the DP balance bounds each TP
   rank's load by its slot's load.

"sharded_adamw" items take no part: nobody owns them, and the plan lists them in
``Plan.sharded``.

[Note: base loads]

Work a slot has before any owned item lands on it (``base_loads``, one number per slot) is
work the planner cannot move: a mixture-of-experts layer's expert stacks stay sharded by FSDP2
on dim 0 and each rank steps its own experts, so a rank's share of them is fixed by its shard
index. LPT starts from those loads instead of zeros, so it fills the lighter slots first, and
the swap pass compares the same totals; ``Plan.loads`` are base plus owned work, and
``Plan.base_loads`` keeps the base (it is part of the fingerprint). Without ``base_loads`` LPT
starts from zero loads and the plan's JSON has no ``base_loads`` key.

For the pure-LPT bound (4/3 − 1/(3S)) of the optimum, see the tests: it holds when no packing
and no spread constraint bind (each atom its own boundary), which is the configuration the
theorem is about.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ._checks import int_at_least
from ._cost import CostFn, ExpertStack, expert_base_loads, expert_work, ns_cost
from ._expert_sources import ExpertSource, expert_sources
from ._items import Owner, WorkItem
from ._plan import Plan, Unit
from ._route import Route

__all__ = ["plan_owners"]

# Swap-pass budget: rounds per slot (each round improves the current maximum strictly).
_SWAP_ROUNDS_PER_SLOT = 2
# Swap-pass partners of the most loaded slot: this many least loaded slots.
_SWAP_CANDIDATES = 16


@dataclass
class _Atom:
    key: str  # first name: stable tie-break
    boundary: str
    names: tuple[str, ...]
    cost: float
    slot: int = -1
    members: tuple[WorkItem, ...] = field(default=(), repr=False)


def _check_size(name: str, value: object) -> int:
    if not int_at_least(value, 1):
        raise ValueError(f"plan_owners: {name} must be an int >= 1, got {value!r}")
    return value


def plan_owners(
    items: Iterable[WorkItem],
    shard_size: int,
    replicate_size: int = 1,
    *,
    small_param_threshold: int = 5_000_000,
    cost: CostFn = ns_cost,
    base_loads: Sequence[float] | None = None,
    experts: Sequence[tuple[str, ExpertStack]] | None = None,
) -> Plan:
    """Assign every owned item to one slot of the ``shard_size × replicate_size`` grid.

    ``cost(shape, route)`` gives an item's optimizer work (default :func:`ns_cost`); an item
    with a declared split (``WorkItem.matrices``) costs the sum over its pieces' stacks.
    ``base_loads[slot]`` is work already on each slot, in the cost's unit (see [Note: base
    loads]; ``slot = replicate * shard_size + shard``). ``experts`` names the expert stacks
    FSDP2 splits over the shard axis (and replicates over the replicate axis): their work is
    the base load, and with replicas the plan also picks ``expert_sources`` (see [Note: expert
    sources] in ``_expert_sources``); give ``experts`` or ``base_loads``, not both. See [Note:
    the assignment] for the algorithm. Raises ``ValueError`` for duplicate names, mixed
    tensor-parallel degrees, a cost that is not a finite number >= 0, or ``base_loads`` of the
    wrong length or with a value that is not a finite number >= 0.
    """
    shard_size = _check_size("shard_size", shard_size)
    replicate_size = _check_size("replicate_size", replicate_size)
    if not int_at_least(small_param_threshold, 0):
        raise ValueError(
            "plan_owners: small_param_threshold must be an int >= 0 (elements; 0 disables "
            f"packing), got {small_param_threshold!r}"
        )
    ordered = _by_name(items)
    tp_size = _tp_size(ordered)
    slots = shard_size * replicate_size
    if experts is not None and base_loads is not None:
        raise ValueError(
            "plan_owners: give experts (stacks whose work the planner derives) or base_loads "
            "(work already on each slot), not both"
        )
    stacks = _check_experts(experts)
    if stacks:
        base_loads = expert_base_loads([stack for _, stack in stacks], shard_size, replicate_size)
    base = _check_base_loads(base_loads, slots)

    owned = [it for it in ordered if it.route is not Route.SHARDED_ADAMW]
    sharded = tuple(it.name for it in ordered if it.route is Route.SHARDED_ADAMW)
    costs = _item_costs(owned, cost)

    atoms = _make_atoms(owned, costs, small_param_threshold)
    loads = _place(atoms, shard_size, base or [0.0] * slots)
    _swap_pass(atoms, loads, shard_size)
    sources = expert_sources(stacks, loads, shard_size, replicate_size)
    done = _expert_work_done(stacks, sources, shard_size, replicate_size) if sources else base
    tp_owners, tp_loads = _tp_assign(atoms, costs, done or [0.0] * slots, tp_size)
    return Plan(
        shard_size=shard_size,
        replicate_size=replicate_size,
        units=_units(atoms, shard_size, slots),
        loads=_exact_loads(atoms, done, slots),
        sharded=sharded,
        tp_size=tp_size,
        tp_owners=tp_owners,
        tp_loads=tp_loads,
        base_loads=tuple(base),
        expert_sources=sources,
    )


def _by_name(items: Iterable[WorkItem]) -> list[WorkItem]:
    """``items`` sorted by name (nothing below depends on the caller's order); raises for
    anything but a ``WorkItem`` and for a name given twice."""
    by_name: dict[str, WorkItem] = {}
    for item in items:
        if not isinstance(item, WorkItem):
            raise ValueError(f"plan_owners: items must be WorkItem, got {type(item).__name__}")
        if item.name in by_name:
            raise ValueError(
                f"plan_owners: two WorkItems are named {item.name!r}; names must be unique"
            )
        by_name[item.name] = item
    return [by_name[name] for name in sorted(by_name)]


def _item_costs(owned: list[WorkItem], cost: CostFn) -> dict[str, float]:
    """Each owned item's work; layers repeat shapes, so the cost is evaluated once per
    (shape, route, split)."""
    by_shape: dict[tuple[tuple[int, ...], Route, tuple[tuple[int, int, int], ...]], float] = {}
    costs: dict[str, float] = {}
    for it in owned:
        key = (it.shape, it.route, it.matrices)
        if key not in by_shape:
            by_shape[key] = _cost_of(it, cost)
        costs[it.name] = by_shape[key]
    return costs


def _exact_loads(atoms: list[_Atom], base: list[float], slots: int) -> tuple[float, ...]:
    """Each slot's ``base`` (none: zero) plus its atoms' costs, summed exactly: the passes
    update loads incrementally, and the plan's loads must not depend on the move history."""
    per_slot: list[list[float]] = [[] for _ in range(slots)] if not base else [[b] for b in base]
    for atom in atoms:
        per_slot[atom.slot].append(atom.cost)
    return tuple(math.fsum(costs_here) for costs_here in per_slot)


def _units(atoms: list[_Atom], shard_size: int, slots: int) -> tuple[Unit, ...]:
    """One unit per (boundary, slot) that holds atoms, its names sorted, in that order."""
    grouped: dict[tuple[str, int], list[str]] = defaultdict(list)
    for atom in atoms:
        grouped[(atom.boundary, atom.slot)].extend(atom.names)
    owners = [Owner(slot % shard_size, slot // shard_size) for slot in range(slots)]
    return tuple(
        Unit(owners[slot], boundary, tuple(sorted(names)) if len(names) > 1 else tuple(names))
        for (boundary, slot), names in sorted(grouped.items())
    )


def _check_experts(
    experts: Sequence[tuple[str, ExpertStack]] | None,
) -> list[tuple[str, ExpertStack]]:
    if experts is None:
        return []
    stacks = list(experts)
    names = [pair[0] if isinstance(pair, tuple) and len(pair) == 2 else None for pair in stacks]
    for pair, name in zip(stacks, names):
        if not isinstance(name, str) or not isinstance(pair[1], ExpertStack):
            raise ValueError(
                f"plan_owners: experts must be (name, ExpertStack) pairs, got {pair!r}"
            )
    if len(set(names)) != len(names):
        raise ValueError("plan_owners: two expert stacks share a name; names must be unique")
    for name, stack in stacks:
        for field_name, value in zip(stack._fields, stack, strict=True):
            if not int_at_least(value, 1):
                raise ValueError(
                    f"plan_owners: expert stack {name!r}: {field_name} must be an int >= 1, got "
                    f"{value!r} (ExpertStack(experts, rows, cols, per_expert) counts experts "
                    "and their matrices' rows and columns)"
                )
    return sorted(stacks, key=lambda pair: pair[0])


def _expert_work_done(
    stacks: list[tuple[str, ExpertStack]],
    sources: tuple[ExpertSource, ...],
    shard_size: int,
    replicate_size: int,
) -> list[float]:
    """Each slot's expert work once the sources are chosen: a stack shard with a source is
    worked on its source replica only."""
    source_of = {(s.stack, s.shard): s.replicate for s in sources}
    work = [
        [expert_work(stack, shard, shard_size) for _, stack in stacks]
        for shard in range(shard_size)
    ]
    done = []
    for slot in range(shard_size * replicate_size):
        shard, replicate = slot % shard_size, slot // shard_size
        done.append(
            math.fsum(
                cost
                for (name, _), cost in zip(stacks, work[shard])
                if source_of.get((name, shard), replicate) == replicate
            )
        )
    return done


def _check_base_loads(base_loads: Sequence[float] | None, slots: int) -> list[float]:
    """``base_loads`` as floats (empty when not given), checked against the grid."""
    if base_loads is None:
        return []
    try:
        if isinstance(base_loads, str | bytes):
            raise TypeError
        values = [float(value) for value in base_loads]
    except (TypeError, ValueError):
        raise ValueError(
            "plan_owners: base_loads must be a sequence of numbers, one per slot (slot = "
            f"replicate * shard_size + shard), got {base_loads!r}"
        ) from None
    if len(values) != slots:
        raise ValueError(
            f"plan_owners: base_loads has {len(values)} values for a grid of {slots} slots; "
            "give one per slot (slot = replicate * shard_size + shard)"
        )
    for slot, value in enumerate(values):
        if not math.isfinite(value) or value < 0:
            raise ValueError(
                f"plan_owners: base_loads[{slot}] is {value!r}; every base load "
                "must be a finite number >= 0 (work already on that slot, in the cost's unit)"
            )
    return values


def _tp_size(items: list[WorkItem]) -> int:
    first: WorkItem | None = None
    for item in items:
        if item.tp > 1 and item.route is not Route.SHARDED_ADAMW:
            if first is None:
                first = item
            elif item.tp != first.tp:
                raise ValueError(
                    f"plan_owners: WorkItems {first.name!r} (tp={first.tp}) and {item.name!r} "
                    f"(tp={item.tp}) disagree on the tensor-parallel degree; one TP mesh "
                    "dimension means one degree (use tp=1 for TP-replicated params)"
                )
    return 1 if first is None else first.tp


def _cost_of(item: WorkItem, cost: CostFn) -> float:
    """The item's work: the sum over its stacks (one, or a declared split's pieces, see
    [Note: declared splits] in ``_split``)."""
    numbers = []
    for shape in item.stacks:
        value = cost(shape, item.route)
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number) or number < 0:
            raise ValueError(
                f"plan_owners: cost({shape}, {item.route.value!r}) for {item.name!r} returned "
                f"{value!r}; the cost function must return a finite number >= 0"
            )
        numbers.append(number)
    return math.fsum(numbers)


def _make_atoms(owned: list[WorkItem], costs: dict[str, float], threshold: int) -> list[_Atom]:
    atoms: list[_Atom] = []
    small: dict[str, list[WorkItem]] = defaultdict(list)
    for item in owned:
        if item.numel < threshold:
            small[item.boundary].append(item)
        else:
            atoms.append(
                _Atom(item.name, item.boundary, (item.name,), costs[item.name], members=(item,))
            )
    for boundary, members in small.items():
        names = tuple(it.name for it in members)
        # Sum in name order (members are sorted), so the float result is the same everywhere.
        total = math.fsum(costs[name] for name in names)
        atoms.append(_Atom(names[0], boundary, names, total, members=tuple(members)))
    atoms.sort(key=lambda a: (-a.cost, a.key))
    return atoms


def _place(atoms: list[_Atom], shard_size: int, base: list[float]) -> list[float]:
    slots = len(base)
    loads = list(base)
    heap = [(load, s) for s, load in enumerate(base)]
    heapq.heapify(heap)
    pop, push = heapq.heappop, heapq.heappush
    used_shards: dict[str, set[int]] = defaultdict(set)
    used_slots: dict[str, set[int]] = defaultdict(set)
    for atom in atoms:
        shards, taken = used_shards[atom.boundary], used_slots[atom.boundary]
        load, slot = pop(heap)
        if taken:
            skipped = []
            if len(shards) < shard_size:
                while slot % shard_size in shards:
                    skipped.append((load, slot))
                    load, slot = pop(heap)
            elif len(taken) < slots:
                while slot in taken:
                    skipped.append((load, slot))
                    load, slot = pop(heap)
            for entry in skipped:
                push(heap, entry)
        atom.slot = slot
        loads[slot] = load = load + atom.cost
        push(heap, (load, slot))
        shards.add(slot % shard_size)
        taken.add(slot)
    return loads


class _Spread:
    """Per-boundary counts of atoms per shard index and per slot, for the swap pass."""

    def __init__(self, atoms: list[_Atom], shard_size: int) -> None:
        self.shard_size = shard_size
        self.shard_count: Counter[tuple[str, int]] = Counter(
            (a.boundary, a.slot % shard_size) for a in atoms
        )
        self.slot_count: Counter[tuple[str, int]] = Counter((a.boundary, a.slot) for a in atoms)

    def add(self, boundary: str, slot: int, delta: int) -> None:
        self.shard_count[(boundary, slot % self.shard_size)] += delta
        self.slot_count[(boundary, slot)] += delta

    def move_keeps(self, boundary: str, src: int, dst: int) -> bool:
        """Moving one atom of ``boundary`` from ``src`` to ``dst`` loses no distinct shard/slot."""
        if src == dst:
            return True
        g = self.shard_size
        if src % g != dst % g and (
            self.shard_count[(boundary, src % g)] == 1 and self.shard_count[(boundary, dst % g)] > 0
        ):
            return False
        return not (self.slot_count[(boundary, src)] == 1 and self.slot_count[(boundary, dst)] > 0)


def _swap_pass(atoms: list[_Atom], loads: list[float], shard_size: int) -> None:
    slots = len(loads)
    if slots < 2 or not atoms:
        return
    spread = _Spread(atoms, shard_size)
    on_slot: list[list[_Atom]] = [[] for _ in range(slots)]
    for atom in atoms:
        on_slot[atom.slot].append(atom)
    order = range(slots)
    for _ in range(_SWAP_ROUNDS_PER_SLOT * slots):
        top = max(order, key=lambda s: (loads[s], -s))
        light = heapq.nsmallest(_SWAP_CANDIDATES, order, key=lambda s: (loads[s], s))
        best = _best_move(top, light, on_slot, loads, spread)
        if best is None:
            return
        a, dst, b = best
        _apply(a, top, dst, on_slot, loads, spread)
        if b is not None:
            _apply(b, dst, top, on_slot, loads, spread)


def _best_move(
    top: int,
    light: list[int],
    on_slot: list[list[_Atom]],
    loads: list[float],
    spread: _Spread,
) -> tuple[_Atom, int, _Atom | None] | None:
    """The move or swap between ``top`` and one of the ``light`` slots that lowers the larger
    of the two loads the most (``None`` if none lowers it).

    Exchanging ``a`` (on top) for ``b`` (on dst, or nothing: cost 0) shifts
    ``delta = a - b``; the new pair maximum is ``mean + |delta - gap / 2|`` with
    ``gap = load[top] - load[dst]``, so per ``a`` the best ``b`` is the one whose cost is
    nearest ``a - gap / 2``: found by bisection, then walking outward past blocked partners.
    """
    peak = loads[top]
    best: tuple[float, _Atom, int, _Atom | None] | None = None
    for dst in light:
        gap = peak - loads[dst]
        if gap <= 0 or (best is not None and (peak + loads[dst]) / 2 >= best[0]):
            break  # light is ascending: no later dst can do better
        partners: list[tuple[float, str, _Atom | None]] = sorted(
            [(b.cost, b.key, b) for b in on_slot[dst]] + [(0.0, "", None)],
            key=lambda entry: (entry[0], entry[1]),
        )
        costs = [entry[0] for entry in partners]
        for a in sorted(on_slot[top], key=lambda x: (-x.cost, x.key)):
            target = a.cost - gap / 2
            right = bisect.bisect_left(costs, target)
            left = right - 1
            while left >= 0 or right < len(partners):
                # Take the partner whose cost is nearer the target (ties: the lower cost).
                if right >= len(partners) or (
                    left >= 0 and target - costs[left] <= costs[right] - target
                ):
                    index, left = left, left - 1
                else:
                    index, right = right, right + 1
                cost, _, b = partners[index]
                delta = a.cost - cost
                after = max(peak - delta, loads[dst] + delta)
                if best is not None and after >= best[0]:
                    break  # partners only get worse from here on
                if not 0 < delta < gap:
                    continue
                if b is None:
                    ok = spread.move_keeps(a.boundary, top, dst)
                else:
                    ok = _swap_keeps(spread, a, b, top, dst)
                if ok:
                    best = (after, a, dst, b)
                    break
    if best is None:
        return None
    _, a, dst, b = best
    return a, dst, b


def _swap_keeps(spread: _Spread, a: _Atom, b: _Atom, src: int, dst: int) -> bool:
    if a.boundary == b.boundary:
        return True  # the boundary's multiset of slots does not change
    return spread.move_keeps(a.boundary, src, dst) and spread.move_keeps(b.boundary, dst, src)


def _apply(
    atom: _Atom,
    src: int,
    dst: int,
    on_slot: list[list[_Atom]],
    loads: list[float],
    spread: _Spread,
) -> None:
    on_slot[src].remove(atom)
    on_slot[dst].append(atom)
    loads[src] -= atom.cost
    loads[dst] += atom.cost
    spread.add(atom.boundary, src, -1)
    spread.add(atom.boundary, dst, 1)
    atom.slot = dst


def _tp_assign(
    atoms: list[_Atom], costs: dict[str, float], base: list[float], tp_size: int
) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[float, ...], ...]]:
    if tp_size == 1:
        return (), ()
    # Base work (a rank's own experts) sits on every TP rank of its slot alike.
    tp_loads = [[load] * tp_size for load in base]
    per_slot: dict[int, list[WorkItem]] = defaultdict(list)
    for atom in atoms:
        for item in atom.members:
            if item.tp > 1:
                per_slot[atom.slot].append(item)
            else:
                for rank in range(tp_size):
                    tp_loads[atom.slot][rank] += costs[item.name]
    owners: list[tuple[str, int]] = []
    for slot, members in per_slot.items():
        row = tp_loads[slot]
        for item in sorted(members, key=lambda it: (-costs[it.name], it.name)):
            rank = min(range(tp_size), key=lambda r: (row[r], r))
            row[rank] += costs[item.name]
            owners.append((item.name, rank))
    owners.sort()
    return tuple(owners), tuple(tuple(row) for row in tp_loads)
