"""plan_owners(base_loads=...): work already on each slot (a rank's own experts)."""

import dataclasses
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_plan import item_sets

from dmuon_ownership import (
    ExpertStack,
    Plan,
    Route,
    WorkItem,
    ns_cost,
    plan_owners,
    validate_plan,
)
from dmuon_ownership._expert_sources import SOURCE_TOLERANCE


@settings(max_examples=25, deadline=None)
@given(item_sets(), st.integers(1, 5), st.integers(1, 3), st.sampled_from([0, 1_000_000]))
def test_zero_base_loads_plan_as_none(
    items: list[WorkItem], shard: int, replicate: int, threshold: int
) -> None:
    # Starting from zeros is starting from nothing: the same owners and loads; only the record
    # of the base (and so the fingerprint) differs.
    plain = plan_owners(items, shard, replicate, small_param_threshold=threshold)
    zeros = [0.0] * (shard * replicate)
    based = plan_owners(items, shard, replicate, small_param_threshold=threshold, base_loads=zeros)
    assert plain.base_loads == () and "base_loads" not in plain.to_json()
    assert based.base_loads == tuple(zeros)
    assert dataclasses.replace(based, base_loads=()) == plain
    assert based.fingerprint() != plain.fingerprint()


@settings(max_examples=25, deadline=None)
@given(
    item_sets(),
    st.integers(1, 5),
    st.integers(1, 3),
    st.lists(st.integers(0, 10**12), min_size=15, max_size=15),
)
def test_loads_are_base_plus_owned_work(
    items: list[WorkItem], shard: int, replicate: int, base: list[int]
) -> None:
    slots = shard * replicate
    base_loads = [float(b) for b in base[:slots]]
    plan = plan_owners(items, shard, replicate, base_loads=base_loads)
    validate_plan(plan, items)
    expected = list(base_loads)
    for it in items:
        if it.route is not Route.SHARDED_ADAMW:
            owner = plan.owner_of(it.name)
            expected[owner.replicate * shard + owner.shard] += ns_cost(it.shape, it.route)
    assert plan.loads == pytest.approx(expected, rel=1e-15)
    for row, start in zip(plan.tp_loads, base_loads):
        assert min(row) >= start  # every TP rank of a slot carries the slot's base
    assert Plan.from_json(plan.to_json()) == plan


def _first_dim(shape: tuple[int, ...], route: Route) -> float:
    return float(shape[0])


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(1, 1000), min_size=1, max_size=60),
    st.lists(st.integers(0, 5000), min_size=1, max_size=12),
)
def test_list_scheduling_bound_from_a_base(costs: list[int], base: list[int]) -> None:
    # Each item on the then least loaded slot (one boundary per item, no packing): the last
    # item placed on the fullest slot found it at most at the mean, so
    # makespan <= max(max base, (sum base + sum costs) / S + largest).
    items = [WorkItem(f"p{i}", (c, 2), f"b{i}") for i, c in enumerate(costs)]
    plan = plan_owners(items, len(base), small_param_threshold=0, cost=_first_dim, base_loads=base)
    bound = max(max(base), (sum(base) + sum(costs)) / len(base) + max(costs))
    assert max(plan.loads) <= bound + 1e-9
    assert math.fsum(plan.loads) == pytest.approx(sum(base) + sum(costs))


def test_lpt_fills_the_lighter_slots_first() -> None:
    items = [WorkItem(f"l{i}.w", (1000, 1000), f"l{i}") for i in range(6)]
    base = [10 * ns_cost((1000, 1000)), 0.0, 0.0, 0.0]
    plan = plan_owners(items, 4, base_loads=base)
    assert all(plan.owner_of(it.name).shard != 0 for it in items)
    assert sorted(plan.loads[1:]) == [2 * ns_cost((1000, 1000))] * 3
    # Without the base, slot 0 takes its share.
    assert any(plan_owners(items, 4).owner_of(it.name).shard == 0 for it in items)


def test_base_loads_change_the_fingerprint_and_roundtrip() -> None:
    items = [WorkItem(f"l{i % 3}.w{i}", (256 * (1 + i % 4), 512), f"l{i % 3}") for i in range(12)]
    one = plan_owners(items, 2, 2, base_loads=[1.0, 2.0, 3.0, 4.0])
    two = plan_owners(items, 2, 2, base_loads=[1.0, 2.0, 3.0, 5.0])
    assert one.fingerprint() != two.fingerprint()
    assert Plan.from_json(one.to_json()) == one
    assert Plan.from_json(one.to_json()).fingerprint() == one.fingerprint()
    assert '"base_loads":[1.0,2.0,3.0,4.0]' in one.to_json()
    shuffled = list(items)
    random.Random(5).shuffle(shuffled)
    again = plan_owners(shuffled, 2, 2, base_loads=(1, 2, 3, 4))
    assert again.fingerprint() == one.fingerprint()


def test_base_loads_errors() -> None:
    a = WorkItem("a", (4, 4), "b")
    with pytest.raises(ValueError, match=r"base_loads has 3 values for a grid of 4 slots"):
        plan_owners([a], 2, 2, base_loads=[0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match=r"base_loads\[1\] is -1.0; every base load must be"):
        plan_owners([a], 2, base_loads=[0.0, -1.0])
    with pytest.raises(ValueError, match=r"base_loads\[1\] is -1.0"):  # was a TypeError
        plan_owners([a], 2, base_loads=(load for load in [0.0, -1.0]))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"base_loads\[0\] is nan"):
        plan_owners([a], 2, base_loads=[math.nan, 0.0])
    with pytest.raises(ValueError, match=r"base_loads\[1\] is inf"):
        plan_owners([a], 2, base_loads=[0.0, math.inf])
    for bad in ("12", [0.0, "x"], 3.0, [None, 0.0]):
        with pytest.raises(ValueError, match=r"base_loads must be a sequence of numbers"):
            plan_owners([a], 2, base_loads=bad)  # type: ignore[arg-type]
    plan = plan_owners([a], 2, base_loads=[1.0, 1.0])
    with pytest.raises(ValueError, match=r"plan has 1 base loads for a grid of 2 slots"):
        validate_plan(dataclasses.replace(plan, base_loads=(1.0,)), [a])


def _stacks(count: int, experts: int = 8) -> list[tuple[str, ExpertStack]]:
    return [(f"layers.{i}.experts.w", ExpertStack(experts, 64, 128)) for i in range(count)]


def test_expert_sources_even_out_a_dense_matrix_over_the_replicas() -> None:
    # 4 shards x 2 replicas, 8 experts per stack: every slot holds 2 experts of each stack.
    # One dense matrix as costly as 3 stack shards lands on one slot; sources move expert
    # shards off it to its replica, whose own copy then reaches it by broadcast.
    stacks = _stacks(12)
    shard_work = ns_cost((2, 64, 128))
    dense = [WorkItem("big", (180, 180), "layers.0")]
    big = ns_cost((180, 180))
    assert 2.5 * shard_work < big < 3.5 * shard_work
    plan = plan_owners(dense, 4, 2, experts=stacks)
    validate_plan(plan, dense)
    without = plan_owners(dense, 4, 2, base_loads=plan.base_loads)
    assert not without.expert_sources
    owner = plan.owner_of("big")
    assert plan.expert_sources and {s.shard for s in plan.expert_sources} == {owner.shard}
    assert all(s.replicate != owner.replicate for s in plan.expert_sources)
    # Exact loads: each slot's experts minus what other replicas step for it, plus its items.
    for slot, load in enumerate(plan.loads):
        shard, replicate = slot % 4, slot // 4
        stepped = [
            name for name, _ in stacks if plan.expert_source(name, shard) in (None, replicate)
        ]
        expected = len(stepped) * shard_work + (big if slot == plan.slot_of(owner) else 0.0)
        assert load == pytest.approx(expected, rel=1e-12), slot
    assert max(plan.loads) < max(without.loads)
    assert (
        max(plan.loads)
        <= (1 + SOURCE_TOLERANCE)
        * max(sum(plan.loads) / 8, min(plan.loads[s] for s in (owner.shard, owner.shard + 4)))
        + shard_work
    )
    assert Plan.from_json(plan.to_json()) == plan and "expert_sources" in plan.to_json()


def test_no_expert_sources_without_replicas_or_imbalance() -> None:
    stacks = _stacks(12)
    dense = [WorkItem("big", (180, 180), "layers.0")]
    assert not plan_owners(dense, 8, 1, experts=stacks).expert_sources  # no replica to help
    small = [WorkItem("small", (16, 16), "layers.0")]
    assert not plan_owners(small, 4, 2, experts=stacks).expert_sources  # within tolerance
    assert "expert_sources" not in plan_owners(small, 4, 2, experts=stacks).to_json()
    with pytest.raises(ValueError, match="not both"):
        plan_owners(dense, 4, 2, experts=stacks, base_loads=[0.0] * 8)
    with pytest.raises(ValueError, match="ExpertStack"):
        plan_owners(dense, 4, 2, experts=[("a", (8, 64, 128))])  # type: ignore[list-item]
    # Every count of a stack is an int >= 1: a negative, zero, fractional, bool or string
    # count planned with a base load of zero, a fraction of an expert, or a TypeError.
    for bad, field in [
        (ExpertStack(-4, 64, 128), "experts"),
        (ExpertStack(4.5, 64, 128), "experts"),  # type: ignore[arg-type]
        (ExpertStack(True, 64, 128), "experts"),
        (ExpertStack("4", 64, 128), "experts"),  # type: ignore[arg-type]
        (ExpertStack(8, 0, 128), "rows"),
        (ExpertStack(8, 64, 128, per_expert=0), "per_expert"),
    ]:
        with pytest.raises(ValueError, match=f"expert stack 'a': {field} must be an int >= 1"):
            plan_owners(dense, 4, 2, experts=[("a", bad)])
