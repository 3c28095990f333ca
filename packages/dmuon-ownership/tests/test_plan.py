"""plan_owners: properties over random item sets, the LPT bound, validation and errors."""

import dataclasses
import itertools
import random
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dmuon_ownership import (
    Owner,
    Plan,
    Route,
    Unit,
    UnknownParamError,
    WorkItem,
    ns_cost,
    plan_owners,
    validate_plan,
)

_ROUTES = (Route.MUON, Route.MUON, Route.ADAMW, Route.SHARDED_ADAMW)


@st.composite
def item_sets(draw: st.DrawFn) -> list[WorkItem]:
    count = draw(st.integers(0, 40))
    boundaries = draw(st.integers(1, 6))
    tp = draw(st.sampled_from([1, 2, 4]))  # one TP degree per model; tp=1 items mix in
    items = []
    for i in range(count):
        route = draw(st.sampled_from(_ROUTES))
        rows = draw(st.integers(1, 3000))
        cols = draw(st.integers(1, 3000))
        shape = (rows, cols) if route is Route.MUON or draw(st.booleans()) else (rows,)
        boundary = f"layers.{draw(st.integers(0, boundaries - 1))}"
        item_tp = tp if draw(st.booleans()) else 1
        items.append(WorkItem(f"{boundary}.p{i}.weight", shape, boundary, route, tp=item_tp))
    return items


def _atoms_per_boundary(items: list[WorkItem], threshold: int) -> dict[str, int]:
    """Independent count of what the planner places as a whole per boundary."""
    large: dict[str, int] = defaultdict(int)
    small: set[str] = set()
    for it in items:
        if it.route is Route.SHARDED_ADAMW:
            continue
        if it.numel < threshold:
            small.add(it.boundary)
        else:
            large[it.boundary] += 1
    return {b: large[b] + (b in small) for b in set(large) | small}


@settings(max_examples=60, deadline=None)
@given(
    item_sets(),
    st.integers(1, 6),
    st.integers(1, 3),
    st.sampled_from([0, 1_000_000, 5_000_000]),
    st.randoms(use_true_random=False),
)
def test_plan_properties(
    items: list[WorkItem], shard: int, replicate: int, threshold: int, rng: random.Random
) -> None:
    plan = plan_owners(items, shard, replicate, small_param_threshold=threshold)
    validate_plan(plan, items)

    # Every owned item exactly once; sharded ones nowhere.
    owned = [it for it in items if it.route is not Route.SHARDED_ADAMW]
    assert sorted(plan.names) == sorted(it.name for it in owned)
    assert set(plan.sharded) == {it.name for it in items if it.route is Route.SHARDED_ADAMW}

    # Loads are the per-slot sums of the item costs.
    expected = [0.0] * (shard * replicate)
    for it in owned:
        owner = plan.owner_of(it.name)
        expected[owner.replicate * shard + owner.shard] += ns_cost(it.shape, it.route)
    assert plan.loads == pytest.approx(expected, rel=1e-15)

    # TP owners: exactly the owned tp > 1 items, each inside its TP group.
    assert {name for name, _ in plan.tp_owners} == {it.name for it in owned if it.tp > 1}
    for it in owned:
        if it.tp > 1:
            assert 0 <= plan.tp_owner_of(it.name) < it.tp

    # Small items of one boundary share one owner.
    small_owner: dict[str, set[Owner]] = defaultdict(set)
    for it in owned:
        if it.numel < threshold:
            small_owner[it.boundary].add(plan.owner_of(it.name))
    assert all(len(owners) == 1 for owners in small_owner.values())

    # Spread: a boundary's atoms use as many distinct shard indices and slots as the grid allows.
    atoms = _atoms_per_boundary(items, threshold)
    for boundary, count in atoms.items():
        owners = {u.owner for u in plan.units if u.boundary == boundary}
        assert len(owners) == min(count, shard * replicate), boundary
        assert len({o.shard for o in owners}) == min(count, shard), boundary

    # Units are (owner, boundary) groups: no two share both.
    keys = [(u.owner, u.boundary) for u in plan.units]
    assert len(keys) == len(set(keys))

    # Input order is irrelevant.
    shuffled = list(items)
    rng.shuffle(shuffled)
    again = plan_owners(shuffled, shard, replicate, small_param_threshold=threshold)
    assert again.fingerprint() == plan.fingerprint()
    assert again == plan


def _optimum(costs: list[int], slots: int) -> int:
    """Exact minimum makespan by branch and bound (small inputs only)."""
    costs = sorted(costs, reverse=True)
    best = sum(costs)
    loads = [0] * slots

    def search(i: int) -> None:
        nonlocal best
        if i == len(costs):
            best = min(best, max(loads))
            return
        tried = set()
        for s in range(slots):
            if loads[s] in tried or loads[s] + costs[i] >= best:
                continue  # equal loads are symmetric
            tried.add(loads[s])
            loads[s] += costs[i]
            search(i + 1)
            loads[s] -= costs[i]

    search(0)
    return best


def _first_dim(shape: tuple[int, ...], route: Route) -> float:
    return float(shape[0])


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=9), st.integers(1, 4))
def test_lpt_bound_against_exact_optimum(costs: list[int], slots: int) -> None:
    # The theorem's setting: every item its own boundary, no packing, so only LPT decides.
    items = [WorkItem(f"p{i}", (c, 2), f"b{i}") for i, c in enumerate(costs)]
    plan = plan_owners(items, slots, small_param_threshold=0, cost=_first_dim)
    makespan = max(plan.loads)
    optimum = _optimum(costs, slots)
    assert makespan <= (4 / 3 - 1 / (3 * slots)) * optimum + 1e-9
    assert makespan >= optimum


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=300), st.integers(1, 64))
def test_lpt_list_bound_on_larger_sets(costs: list[int], slots: int) -> None:
    # Graham's list-scheduling bound, which LPT meets: makespan <= mean + (1 - 1/S) * largest.
    items = [WorkItem(f"p{i}", (c, 2), f"b{i}") for i, c in enumerate(costs)]
    plan = plan_owners(items, slots, small_param_threshold=0, cost=_first_dim)
    bound = sum(costs) / slots + (1 - 1 / slots) * max(costs)
    assert max(plan.loads) <= bound + 1e-9
    assert max(plan.loads) >= max(sum(costs) / slots, max(costs)) - 1e-9


def test_bound_is_relative_to_the_optimum_not_to_max_mean_largest() -> None:
    # Three equal items on two slots: max(mean, largest) = 1.5 but every schedule needs 2, so
    # no algorithm stays within (4/3 - 1/6) x 1.5 = 1.75; the 4/3 bound is about the optimum.
    items = [WorkItem(f"p{i}", (1, 2), f"b{i}") for i in range(3)]
    plan = plan_owners(items, 2, small_param_threshold=0, cost=_first_dim)
    assert max(plan.loads) == _optimum([1, 1, 1], 2) == 2


def test_boundary_spread_prefers_distinct_shards_then_owners() -> None:
    items = [WorkItem(f"l.p{i}", (1000, 1000), "l") for i in range(6)]
    plan = plan_owners(items, 4, 2, small_param_threshold=0)
    owners = [plan.owner_of(it.name) for it in items]
    assert len(set(owners)) == 6
    assert {o.shard for o in owners} == {0, 1, 2, 3}
    # More atoms than slots: every slot used, then shared.
    many = [WorkItem(f"l.q{i}", (1000, 1000), "l") for i in range(11)]
    plan = plan_owners(many, 4, 2, small_param_threshold=0)
    assert len({plan.owner_of(it.name) for it in many}) == 8


def test_packing_threshold_and_units() -> None:
    items = [
        WorkItem("l0.norm.weight", (64,), "l0", Route.ADAMW),
        WorkItem("l0.a_proj.weight", (16, 64), "l0"),
        WorkItem("l0.big.weight", (4096, 4096), "l0"),
        WorkItem("l1.a_proj.weight", (16, 64), "l1"),
        WorkItem("embed.weight", (1000, 64), "", Route.SHARDED_ADAMW),
    ]
    plan = plan_owners(items, 4)
    assert plan.owner_of("l0.norm.weight") == plan.owner_of("l0.a_proj.weight")
    assert plan.owner_of("l0.big.weight") != plan.owner_of("l0.a_proj.weight")
    assert plan.sharded == ("embed.weight",)
    assert {u.boundary: u.names for u in plan.units if u.boundary == "l1"} == {
        "l1": ("l1.a_proj.weight",)
    }
    with pytest.raises(UnknownParamError, match=r"'embed.weight' uses route 'sharded_adamw'"):
        plan.owner_of("embed.weight")
    with pytest.raises(KeyError, match=r"parameter 'nope' is not in this plan"):
        plan.owner_of("nope")
    with pytest.raises(KeyError, match=r"'l0.big.weight' is not tensor-parallel"):
        plan.tp_owner_of("l0.big.weight")
    assert str(UnknownParamError("x y")) == "x y"
    # Threshold 0 disables packing.
    unpacked = plan_owners(items, 4, small_param_threshold=0)
    assert unpacked.owner_of("l0.norm.weight") != unpacked.owner_of("l0.a_proj.weight")


def test_tensor_parallel_owners_balance_per_slot() -> None:
    items = [
        WorkItem(f"l{i // 4}.m{i}", (512 * (1 + i % 5), 1024), f"l{i // 4}", tp=4)
        for i in range(40)
    ]
    items += [WorkItem(f"l{i}.norm", (1024,), f"l{i}", Route.ADAMW) for i in range(10)]
    plan = plan_owners(items, 2, small_param_threshold=0)
    validate_plan(plan, items)
    assert plan.tp_size == 4
    assert len(plan.tp_loads) == 2
    costs = {it.name: ns_cost(it.shape, it.route) for it in items}
    for slot in range(2):
        row = plan.tp_loads[slot]
        on_slot = [it for it in items if plan.slot_of(plan.owner_of(it.name)) == slot]
        shared = sum(costs[it.name] for it in on_slot if it.tp == 1)
        tp_items = [it for it in on_slot if it.tp > 1]
        for rank in range(4):
            mine = sum(costs[it.name] for it in tp_items if plan.tp_owner_of(it.name) == rank)
            assert row[rank] == pytest.approx(shared + mine)
        # List scheduling: the spread within a slot is at most the largest item there.
        assert max(row) - min(row) <= max(costs[it.name] for it in tp_items) + 1e-6
    with pytest.raises(ValueError, match=r"disagree on the tensor-parallel degree"):
        plan_owners([*items, WorkItem("x", (4, 4), "x", tp=2)], 2)


def test_plan_json_roundtrip_and_summary() -> None:
    items = [WorkItem(f"l{i}.w", (256 * (i + 1), 512), f"l{i % 3}", tp=2) for i in range(9)]
    plan = plan_owners(items, 2, 2)
    text = plan.to_json()
    assert Plan.from_json(text) == plan
    assert Plan.from_json(text).fingerprint() == plan.fingerprint()
    assert len(plan.fingerprint()) == 64
    assert hash(plan) == hash(Plan.from_json(text))
    assert plan.summary().startswith("9 params assigned to 4 ranks, imbalance=")
    with pytest.raises(ValueError, match=r"Plan.from_json: format version 0 is not 1"):
        Plan.from_json(text.replace('"version":1', '"version":0'))
    other = plan_owners(items, 4)
    assert other.fingerprint() != plan.fingerprint()


def test_plan_owners_errors() -> None:
    a = WorkItem("a", (4, 4), "b")
    with pytest.raises(ValueError, match=r"plan_owners: shard_size must be an int >= 1, got 0"):
        plan_owners([a], 0)
    with pytest.raises(ValueError, match=r"plan_owners: replicate_size must be an int >= 1"):
        plan_owners([a], 2, 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"small_param_threshold must be an int >= 0 \(elements"):
        plan_owners([a], 2, small_param_threshold=-1)
    with pytest.raises(ValueError, match=r"two WorkItems are named 'a'; names must be unique"):
        plan_owners([a, a], 2)
    with pytest.raises(ValueError, match=r"items must be WorkItem, got tuple"):
        plan_owners([("a", (4, 4), "b")], 2)  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"for 'a' returned nan; the cost function must return"):
        plan_owners([a], 2, cost=lambda shape, route: float("nan"))
    with pytest.raises(ValueError, match=r"for 'a' returned -1.0"):
        plan_owners([a], 2, cost=lambda shape, route: -1.0)


def _corrupt(plan: Plan, units: tuple[Unit, ...]) -> Plan:
    return dataclasses.replace(plan, units=units)


def test_validate_plan_errors() -> None:
    items = [
        WorkItem("a", (64, 64), "l0"),
        WorkItem("b", (64, 64), "l1"),
        WorkItem("e", (64, 8), "", Route.SHARDED_ADAMW),
        WorkItem("t", (64, 64), "l1", tp=2),
    ]
    plan = plan_owners(items, 2, small_param_threshold=0)
    validate_plan(plan, items)
    ua = next(u for u in plan.units if "a" in u.names)
    rest = tuple(u for u in plan.units if u is not ua)
    cases = [
        (
            _corrupt(plan, (*rest, ua._replace(owner=Owner(2, 0)))),
            r"'a' is owned by Owner\(shard=2, replicate=0\), outside the 2 x 1",
        ),
        (
            _corrupt(plan, (*rest, ua._replace(owner=Owner(0, 1)))),
            r"outside the 2 x 1 \(shard x replicate\) grid",
        ),
        (_corrupt(plan, rest), r"parameter 'a' has no owner in the plan"),
        (
            _corrupt(plan, (*plan.units, ua._replace(owner=Owner(1 - ua.owner.shard, 0)))),
            r"parameter 'a' is owned twice",
        ),
        (
            _corrupt(plan, (*plan.units, Unit(Owner(0, 0), "x", ("zz",)))),
            r"plan owns 'zz', which is not a WorkItem",
        ),
        (
            _corrupt(plan, (*plan.units, Unit(Owner(0, 0), "", ("e",)))),
            r"'e' uses route 'sharded_adamw' but the plan gives it an owner",
        ),
        (
            _corrupt(plan, (*rest, ua._replace(boundary="l9"))),
            r"'a' has boundary 'l0' but sits in a unit of 'l9'",
        ),
        (
            dataclasses.replace(plan, sharded=()),
            r"'sharded_adamw' parameter 'e' is missing from plan.sharded",
        ),
        (
            dataclasses.replace(plan, sharded=("e", "f")),
            r"plan lists 'f' as sharded but it is no WorkItem",
        ),
        (
            dataclasses.replace(plan, tp_owners=(("t", 2),)),
            r"parameter 't' \(tp=2\) has TP owner 2; it needs one in range\(2\)",
        ),
        (dataclasses.replace(plan, loads=(0.0,)), r"plan has 1 loads for a 2 x 1 grid of 2 slots"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            validate_plan(bad, items)
    with pytest.raises(ValueError, match=r"validate_plan: duplicate WorkItem name 'a'"):
        validate_plan(plan, [*items, items[0]])


def test_empty_and_single_slot() -> None:
    empty = plan_owners([], 3)
    assert empty.units == () and empty.loads == (0.0, 0.0, 0.0) and empty.imbalance == 0.0
    items = [WorkItem(f"p{i}", (64, 32 + i), f"b{i % 2}") for i in range(5)]
    one = plan_owners(items, 1)
    assert {one.owner_of(it.name) for it in items} == {Owner(0, 0)}
    # Units in (boundary, slot) order, names sorted inside each unit.
    assert list(itertools.chain.from_iterable(u.names for u in one.units)) == [
        "p0", "p2", "p4", "p1", "p3"
    ]  # fmt: skip
