"""The frozen result of planning (:class:`Plan`) and its validation against the work items."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ._expert_sources import ExpertSource
from ._items import Owner, WorkItem
from ._route import Route

__all__ = ["Plan", "Unit", "UnknownParamError", "validate_plan"]

_FORMAT_VERSION = 1


class Unit(NamedTuple):
    """What one owner packs for one hook boundary: the names it broadcasts together, in order."""

    owner: Owner
    boundary: str
    names: tuple[str, ...]


class UnknownParamError(KeyError):
    """``Plan.owner_of`` / ``Plan.tp_owner_of`` for a name the plan does not own."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


@dataclass(frozen=True)
class Plan:
    """Which rank owns each parameter; identical on every rank for identical inputs.

    ``loads[slot]`` is the optimizer work (in the cost function's unit) of the owner at
    ``slot = replicate * shard_size + shard``. ``sharded`` lists the ``"sharded_adamw"``
    parameters, which have no owner. ``tp_owners`` holds ``(name, tp_rank)`` for the items with
    ``tp > 1``; ``tp_loads[slot][tp_rank]`` is the work of each tensor-parallel rank of a slot
    (empty when ``tp_size == 1``). ``base_loads[slot]`` is the work that was on each slot before
    planning (``plan_owners(base_loads=...)`` or the work of ``plan_owners(experts=...)``,
    empty when neither is given); ``loads`` and ``tp_loads`` include it. ``expert_sources``
    lists the expert stack shards that one replica steps for all (see [Note: expert sources]
    in ``_expert_sources``); ``loads`` and ``tp_loads`` count their work on the source only.
    """

    shard_size: int
    replicate_size: int
    units: tuple[Unit, ...]
    loads: tuple[float, ...]
    sharded: tuple[str, ...] = ()
    tp_size: int = 1
    tp_owners: tuple[tuple[str, int], ...] = ()
    tp_loads: tuple[tuple[float, ...], ...] = ()
    base_loads: tuple[float, ...] = ()
    expert_sources: tuple[ExpertSource, ...] = ()
    _owner_index: dict[str, Owner] = field(init=False, repr=False, compare=False)
    _tp_index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index: dict[str, Owner] = {}
        for unit in self.units:
            for name in unit.names:
                index.setdefault(name, unit.owner)
        object.__setattr__(self, "_owner_index", index)
        object.__setattr__(self, "_tp_index", dict(self.tp_owners))

    def __hash__(self) -> int:
        return hash(self.fingerprint())

    @property
    def world_size(self) -> int:
        return self.shard_size * self.replicate_size

    @property
    def names(self) -> tuple[str, ...]:
        """Every owned parameter, in unit order."""
        return tuple(name for unit in self.units for name in unit.names)

    def expert_source(self, stack: str, shard: int) -> int | None:
        """The replica that steps ``stack``'s experts at shard index ``shard`` for all of them,
        or ``None`` when every replica steps its own (see [Note: expert sources] in
        ``_expert_sources``)."""
        for source in self.expert_sources:
            if source.stack == stack and source.shard == shard:
                return source.replicate
        return None

    def slot_of(self, owner: Owner) -> int:
        return owner.replicate * self.shard_size + owner.shard

    def owner_of(self, name: str) -> Owner:
        owner = self._owner_index.get(name)
        if owner is None:
            raise UnknownParamError(self._missing(name))
        return owner

    def tp_owner_of(self, name: str) -> int:
        """The tensor-parallel rank that gathers ``name``'s full gradient and runs its step."""
        if name not in self._owner_index:
            raise UnknownParamError(self._missing(name))
        rank = self._tp_index.get(name)
        if rank is None:
            raise UnknownParamError(
                f"parameter {name!r} is not tensor-parallel (its WorkItem has tp=1), so it has "
                "no TP owner; every TP rank of its owner holds it whole"
            )
        return rank

    def _missing(self, name: str) -> str:
        if name in self.sharded:
            return (
                f"parameter {name!r} uses route 'sharded_adamw': it stays sharded over all ranks "
                "and has no owner"
            )
        return f"parameter {name!r} is not in this plan (it was not among the planned WorkItems)"

    @property
    def imbalance(self) -> float:
        """``max(loads) / mean(loads) - 1`` (0 for an empty plan)."""
        total = sum(self.loads)
        if total <= 0:
            return 0.0
        return max(self.loads) * len(self.loads) / total - 1.0

    def summary(self) -> str:
        """One line for the setup log."""
        shown = ", ".join(f"{load:.3g}" for load in self.loads[:16])
        if len(self.loads) > 16:
            shown += f", ... ({len(self.loads) - 16} more)"
        text = (
            f"{len(self._owner_index)} params assigned to {self.world_size} ranks, "
            f"imbalance={self.imbalance:.1%}, loads=[{shown}]"
        )
        if self.sharded:
            text += f", {len(self.sharded)} sharded_adamw params unowned"
        return text

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no whitespace): equal plans give equal strings."""
        payload: dict[str, Any] = {
            "version": _FORMAT_VERSION,
            "shard_size": self.shard_size,
            "replicate_size": self.replicate_size,
            "tp_size": self.tp_size,
            "units": [
                [u.owner.shard, u.owner.replicate, u.boundary, list(u.names)] for u in self.units
            ],
            "loads": list(self.loads),
            "sharded": list(self.sharded),
            "tp_owners": [list(pair) for pair in self.tp_owners],
            "tp_loads": [list(row) for row in self.tp_loads],
        }
        if self.base_loads:
            payload["base_loads"] = list(self.base_loads)
        if self.expert_sources:
            payload["expert_sources"] = [list(source) for source in self.expert_sources]
        return json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        if data.get("version") != _FORMAT_VERSION:
            raise ValueError(
                f"Plan.from_json: format version {data.get('version')!r} is not "
                f"{_FORMAT_VERSION}; re-plan with this version of dmuon-ownership"
            )
        return cls(
            shard_size=data["shard_size"],
            replicate_size=data["replicate_size"],
            units=tuple(
                Unit(Owner(s, r), boundary, tuple(names)) for s, r, boundary, names in data["units"]
            ),
            loads=tuple(float(x) for x in data["loads"]),
            sharded=tuple(data["sharded"]),
            tp_size=data["tp_size"],
            tp_owners=tuple((name, rank) for name, rank in data["tp_owners"]),
            tp_loads=tuple(tuple(float(x) for x in row) for row in data["tp_loads"]),
            base_loads=tuple(float(x) for x in data.get("base_loads", ())),
            expert_sources=tuple(
                ExpertSource(stack, shard, replicate)
                for stack, shard, replicate in data.get("expert_sources", ())
            ),
        )

    def fingerprint(self) -> str:
        """sha256 of :meth:`to_json`: compare it across ranks at setup."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()


def validate_plan(plan: Plan, items: Iterable[WorkItem]) -> None:
    """Check that ``plan`` owns every item exactly once, inside its grid.

    ``"sharded_adamw"`` items must be listed in ``plan.sharded`` and owned by nobody; items
    with ``tp > 1`` need a TP owner in ``range(tp)``. Raises ``ValueError`` naming the first
    offending parameter.
    """
    by_name: dict[str, WorkItem] = {}
    for item in items:
        if item.name in by_name:
            raise ValueError(f"validate_plan: duplicate WorkItem name {item.name!r}")
        by_name[item.name] = item
    _check_grid(plan)
    owners = _check_units(plan, by_name)
    _check_items(plan, by_name, owners)


def _inside(plan: Plan, shard: int, replicate: int) -> bool:
    return 0 <= shard < plan.shard_size and 0 <= replicate < plan.replicate_size


def _check_grid(plan: Plan) -> None:
    """The plan's per-slot loads and its expert sources fit its grid."""
    if len(plan.loads) != plan.world_size:
        raise ValueError(
            f"validate_plan: plan has {len(plan.loads)} loads for a "
            f"{plan.shard_size} x {plan.replicate_size} grid of {plan.world_size} slots"
        )
    if plan.base_loads and len(plan.base_loads) != plan.world_size:
        raise ValueError(
            f"validate_plan: plan has {len(plan.base_loads)} base loads for a grid of "
            f"{plan.world_size} slots"
        )
    for source in plan.expert_sources:
        if not _inside(plan, source.shard, source.replicate):
            raise ValueError(
                f"validate_plan: expert source {source} lies outside the {plan.shard_size} x "
                f"{plan.replicate_size} (shard x replicate) grid"
            )


def _check_units(plan: Plan, by_name: dict[str, WorkItem]) -> dict[str, Owner]:
    """Each owned name's owner: every unit inside the grid, every name an owned WorkItem of
    the unit's boundary, owned once."""
    owners: dict[str, Owner] = {}
    for unit in plan.units:
        if not _inside(plan, *unit.owner):
            raise ValueError(
                f"validate_plan: parameter {unit.names[0] if unit.names else '?'!r} is owned by "
                f"{unit.owner}, outside the {plan.shard_size} x {plan.replicate_size} "
                "(shard x replicate) grid"
            )
        for name in unit.names:
            if name not in by_name:
                raise ValueError(f"validate_plan: plan owns {name!r}, which is not a WorkItem")
            if name in owners:
                raise ValueError(
                    f"validate_plan: parameter {name!r} is owned twice ({owners[name]} and "
                    f"{unit.owner})"
                )
            if by_name[name].route is Route.SHARDED_ADAMW:
                raise ValueError(
                    f"validate_plan: parameter {name!r} uses route 'sharded_adamw' but the "
                    "plan gives it an owner"
                )
            if by_name[name].boundary != unit.boundary:
                raise ValueError(
                    f"validate_plan: parameter {name!r} has boundary "
                    f"{by_name[name].boundary!r} but sits in a unit of {unit.boundary!r}"
                )
            owners[name] = unit.owner
    return owners


def _check_items(plan: Plan, by_name: dict[str, WorkItem], owners: dict[str, Owner]) -> None:
    """Every item has its place: ``"sharded_adamw"`` ones in ``plan.sharded`` (and only
    items there), the others an owner and, with ``tp > 1``, a TP owner."""
    sharded = set(plan.sharded)
    tp_owners = dict(plan.tp_owners)
    for name, item in by_name.items():
        if item.route is Route.SHARDED_ADAMW:
            if name not in sharded:
                raise ValueError(
                    f"validate_plan: 'sharded_adamw' parameter {name!r} is missing from "
                    "plan.sharded"
                )
            continue
        if name not in owners:
            raise ValueError(f"validate_plan: parameter {name!r} has no owner in the plan")
        if item.tp > 1:
            rank = tp_owners.get(name)
            if rank is None or not 0 <= rank < item.tp:
                raise ValueError(
                    f"validate_plan: tensor-parallel parameter {name!r} (tp={item.tp}) has TP "
                    f"owner {rank!r}; it needs one in range({item.tp})"
                )
    for name in sharded:
        if name not in by_name:
            raise ValueError(f"validate_plan: plan lists {name!r} as sharded but it is no WorkItem")
