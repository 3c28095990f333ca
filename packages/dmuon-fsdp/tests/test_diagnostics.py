"""Diagnostics: per-parameter dtypes (master, compute, reduce, optimizer state, output) and the
``param_policy`` overrides that matched in ``summarize_param_groups``; the row limit of
``summarize_comm_plan``; ``collect_forward_unshard_profile(clear=True)``; the bytes per step of
``summarize_comm_plan`` against those dmuon's collectives carry in a step, counted at
``torch.distributed`` on every process group.

One world-2 call: a bf16 FSDP2 policy on every module (the root's with an fp32 output), and a
``param_policy`` whose overrides change one dtype each, so every dtype of every row has one
expected value, written out here by hand.
"""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from _models import build, muon_predicate, shard_layers_then_root, tensor_parallel
from _reference import make_batch, shard
from test_expert_sources import _build as _expert_sources_model
from test_precision import lm_loss
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from dmuon_fsdp import (
    Muon,
    StepOptions,
    collect_forward_unshard_profile,
    dedicate_params,
    dedicate_params_ddp,
    dedicated_params_of,
    get_runtime,
    replicate,
    summarize_comm_plan,
    summarize_param_groups,
)
from dmuon_testing.distributed import run_distributed
from dmuon_testing.typed_dicts import check_returns

BF16, FP32 = torch.bfloat16, torch.float32
POLICY = {
    "overrides": [
        {"name": ["q_proj"], "set": {"optim_dtype": "bf16"}},
        {"name": ["layers.1"], "set": {"grad_dtype": "bf16"}},
        {"name": ["layers.0"], "set": {"output_dtype": "fp32"}},
        # Matches the embedding's name, which the predicate does not select: listed, no effect.
        {"contains": ["embed"], "set": {"route": "sharded_adamw"}},
    ]
}


def _expected_dtypes(name: str) -> dict[str, str | None]:
    if "proj" in name:  # dedicated: the FSDP2 policy's dtypes unless an override sets one
        return {
            "master_dtype": "float32",
            "compute_dtype": "bfloat16",
            "reduce_dtype": "bfloat16" if name.startswith("layers.1.") else "float32",
            "optim_dtype": "bfloat16" if ".q_proj." in name else "float32",
            "output_dtype": "float32" if name.startswith("layers.0.") else None,
        }
    return {  # FSDP2: its nearest fully_shard's policy; only the root's casts its output
        "master_dtype": "float32",
        "compute_dtype": "bfloat16",
        "reduce_dtype": "float32",
        "optim_dtype": "float32",
        "output_dtype": None if name.startswith("layers.") else "float32",
    }


def _expected_overrides(name: str) -> list[int]:
    checks = [
        ".q_proj." in name,
        name.startswith("layers.1."),
        name.startswith("layers.0."),
        "embed" in name,
    ]
    return [index for index, hit in enumerate(checks) if hit]


def _step(model, optimizer, rank: int, world_size: int, step: int) -> None:
    optimizer.zero_grad()
    lm_loss(model, shard(make_batch(step, 8, 8, 32), rank, world_size)).backward()
    optimizer.step()


def _diagnose(rank: int, world_size: int):
    model = build(0)
    mesh = init_device_mesh("cpu", (world_size,))
    dedicate_params(model, mesh, muon_predicate, small_param_threshold=0, param_policy=POLICY)
    dedicated = dedicated_params_of(model)
    for layer in model.layers:
        fully_shard(
            layer, mesh=mesh, mp_policy=MixedPrecisionPolicy(BF16, FP32), ignored_params=dedicated
        )
    fully_shard(
        model,
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(BF16, FP32, output_dtype=FP32),
        ignored_params=dedicated,
    )
    optimizer = Muon(model, lr=0.02, adamw_lr=1e-3, options=StepOptions(profile=True))
    before = summarize_param_groups(model, optimizer)  # before the first forward

    # The counter and the wait times: cleared after a snapshot, counted afresh by the next step.
    profiles = []
    _step(model, optimizer, rank, world_size, 0)
    profiles.append(collect_forward_unshard_profile(model, clear=True))
    profiles.append(collect_forward_unshard_profile(model))
    _step(model, optimizer, rank, world_size, 1)
    profiles.append(collect_forward_unshard_profile(model, clear=True))
    _step(model, optimizer, rank, world_size, 2)
    profiles.append(collect_forward_unshard_profile(model))
    _step(model, optimizer, rank, world_size, 3)
    profiles.append(collect_forward_unshard_profile(model))

    groups = summarize_param_groups(model, optimizer, max_rows=100, param_policy=POLICY)
    unknown = summarize_param_groups(model, optimizer, max_rows=100)
    # The optimizer states this rank holds, in the dtype they are kept in.
    names = {id(p): n for n, p in model.named_parameters()}
    dedicated = {id(dp.param): dp for dp in get_runtime(model).params}
    held = {}
    for p, state in optimizer.state.items():
        field = "momentum_buffer" if "momentum_buffer" in state else "exp_avg"
        held[dedicated[id(p)].fqn if id(p) in dedicated else names[id(p)]] = str(
            state[field].dtype
        ).removeprefix("torch.")

    plans = {rows: summarize_comm_plan(model, max_rows=rows) for rows in (0, 1, 64)}
    json.dumps([groups, plans, profiles])  # JSON-friendly
    # What one step moves, as the runtime counts it.
    counter = get_runtime(model).comm_ctx.counter
    counter.reset()
    _step(model, optimizer, rank, world_size, 4)
    moved = {key: entry["bytes"] for key, entry in counter.snapshot().items()}
    plans["moved"] = moved

    errors = []
    for call in (
        lambda: summarize_param_groups(model, optimizer, param_policy={"overrides": []}),
        lambda: summarize_comm_plan(model, max_rows=-1),
        lambda: collect_forward_unshard_profile(model, clear="yes"),
    ):
        with pytest.raises(ValueError) as info:
            call()
        errors.append(str(info.value))
    return groups, unknown, held, plans, profiles, errors, before


@pytest.fixture(scope="module")
def diagnosed():
    return run_distributed(_diagnose, 2)


@pytest.mark.distributed
def test_rows_report_every_dtype_and_the_overrides_that_matched(diagnosed):
    all_names = [n for n, _ in build(0).named_parameters()]
    for groups, unknown, held, *_ in diagnosed:
        rows = {row["name"]: row for group in groups for row in group["rows"]}
        assert sorted(rows) == sorted(all_names)
        for name, row in rows.items():
            dtypes = {k: row[k] for k in _expected_dtypes(name)}
            assert dtypes == _expected_dtypes(name), name
            assert row["dtype"] == row["master_dtype"]
            assert row["route"] == ("muon" if "proj" in name else "fsdp2"), name
            assert row["policy_overrides"] == _expected_overrides(name), name
        # The reported optimizer dtype is the one the states on this rank are kept in.
        assert held and all(rows[name]["optim_dtype"] == dtype for name, dtype in held.items())
        # Without the policy argument the runtime's own (dedicate_params') is used: the same.
        for group in unknown:
            for row in group["rows"]:
                assert row == rows[row["name"]]


@pytest.mark.distributed
def test_comm_plan_payload_is_what_a_step_moves(diagnosed):
    # Weights broadcast in bf16, gradients reduced in fp32 (bf16 for layers.1), whichever
    # rank owns them: the same plan on every rank, equal to the runtime's own count.
    for _, _, _, plans, _, _, _ in diagnosed:
        assert plans[64]["payload_bytes_per_step"] == plans["moved"]
    assert (
        diagnosed[0][3][64]["payload_bytes_per_step"]
        == diagnosed[1][3][64]["payload_bytes_per_step"]
    )


@pytest.mark.distributed
def test_comm_plan_row_limit_says_how_many_rows_were_left_out(diagnosed):
    for *_, plans, _, _, _ in diagnosed:
        full = plans[64]
        packs = [pack for b in full["boundaries"] for pack in b["packs"]]
        total = sum(b["num_packs"] for b in full["boundaries"])
        assert len(packs) == total >= 2 and full["rows_omitted"] == 0
        for rows in (0, 1):
            plan = plans[rows]
            listed = [pack for b in plan["boundaries"] for pack in b["packs"]]
            assert listed == packs[:rows]
            assert plan["rows_omitted"] == total - rows
            assert [b["num_packs"] for b in plan["boundaries"]] == [
                b["num_packs"] for b in full["boundaries"]
            ]
            assert sum(b["packs_omitted"] for b in plan["boundaries"]) == total - rows
            assert {k: v for k, v in plan.items() if k not in ("boundaries", "rows_omitted")} == {
                k: v for k, v in full.items() if k not in ("boundaries", "rows_omitted")
            }


@pytest.mark.distributed
def test_forward_unshard_profile_clears(diagnosed):
    for *_, profiles, _, _ in diagnosed:
        first, cleared, second, third, accumulated = profiles
        assert first["collectives"] and second["collectives"]
        # Right after a clear: no collective counted, no wait recorded.
        assert cleared["collectives"] == {}
        assert all(b["forward_wait_ms"] is None for b in cleared["boundaries"])
        for profile in (first, second, third):
            assert all(b["forward_wait_ms"] is not None for b in profile["boundaries"])
        # A step's traffic, counted from a clear, is the same each step; without a clear
        # the counts add up.
        assert third["collectives"] == second["collectives"]
        assert accumulated["collectives"] == {
            key: {k: 2 * v for k, v in counts.items()}
            for key, counts in third["collectives"].items()
        }


@pytest.mark.distributed
def test_diagnostics_errors_name_the_argument(diagnosed):
    for *_, errors, _ in diagnosed:
        policy, rows, clear = errors
        # The first dedicated name in order whose resolution differs, and how.
        assert policy.startswith(
            "summarize_param_groups: param_policy resolves 'layers.0.attn.k_proj.weight'"
            " otherwise than dedicate_params did (output_dtype None here, 'float32' there)"
        ), policy
        assert "pass the param_policy that dedicate_params was given" in policy
        assert rows == "max_rows must be an int >= 0, got -1"
        assert clear == "clear must be True or False, got 'yes'"


@pytest.mark.distributed
def test_diagnostics_are_of_their_declared_types(diagnosed, counted_on_two, counted_on_four):
    # Each declares a TypedDict (what a user's mypy reads): the dicts hold exactly its keys,
    # of its value types, before the first forward, after steps, and on every layout.
    for groups, unknown, _, plans, profiles, _, before in diagnosed:
        for summary in (groups, unknown, before):
            check_returns(summarize_param_groups, summary)
        for rows in (0, 1, 64):
            check_returns(summarize_comm_plan, plans[rows])
        for profile in profiles:
            check_returns(collect_forward_unshard_profile, profile)
    for counted in (*counted_on_two, *counted_on_four):
        for case in counted.values():
            check_returns(summarize_comm_plan, case["plan"])
            check_returns(summarize_comm_plan, case["without"])


# -- bytes per step, counted where they cross a process group -------------------------------------

_COLLECTIVES = (
    "broadcast",
    "reduce",
    "all_reduce",
    "gather",
    "scatter",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
)
# The counter's kind -> the torch.distributed collective that carries it.
_OP_OF = {
    "broadcast": "broadcast",
    "publish": "broadcast",
    "reduce": "reduce",
    "all_reduce": "all_reduce",
    "gather": "gather",
    "scatter": "scatter",
}


@contextmanager
def _collectives_of_dmuon(runtime) -> Iterator[Counter]:
    """Count, per (axis, collective), the payload of every collective dmuon's code issues:
    the tensor's bytes, the whole list's for a gather or a scatter (each rank's part times the
    group's size). Collectives over every rank (the step's global flags) are left out."""
    comm = runtime.comm_ctx
    axes = [("shard", comm.shard_group), ("replicate", comm.replicate_group), ("tp", comm.tp_group)]
    moved: Counter = Counter()
    originals = {name: getattr(dist, name) for name in _COLLECTIVES}

    def counting(name: str, call: Callable) -> Callable:
        # Any signature: torch's own callers (FSDP2's reduce-scatter on torch 2.11) pass
        # their tensors by keyword; dmuon passes the tensor first.
        def wrapper(*args, **kwargs):
            if sys._getframe(1).f_globals.get("__name__", "").startswith("dmuon"):
                tensor = args[0]
                group = kwargs.get("group")
                axis = next((a for a, g in axes if g is not None and g is group), None)
                if group not in (comm.world_group, comm.global_group) or axis is not None:
                    nbytes = tensor.numel() * tensor.element_size()
                    if name in ("gather", "scatter"):
                        nbytes *= dist.get_world_size(group)
                    moved[(axis or repr(group), name)] += nbytes
            return call(*args, **kwargs)

        return wrapper

    for name, call in originals.items():
        setattr(dist, name, counting(name, call))
    try:
        yield moved
    finally:
        for name, call in originals.items():
            setattr(dist, name, call)


def _build_case(case: str):
    """The model, its runtime and the data-parallel (index, size) of this rank for ``case``:
    ``"1d"``, ``"ddp"`` (the replicated path), ``"hsdp"`` (2 x 2), ``"moe"`` (HSDP 2 x 2
    with expert sources) or ``"tp-<dp>x<tp>-<tp_ns>"``."""
    world = dist.get_world_size()
    if case.startswith("tp-"):
        shape, tp_ns = case.removeprefix("tp-").split("-")
        *dims, tp = (int(x) for x in shape.split("x"))
        if len(dims) == 2:  # HSDP with TP: each replica's TP groups run their own matrices
            mesh = init_device_mesh("cpu", (*dims, tp), mesh_dim_names=("rep", "dp", "tp"))
            hsdp = {"replicate_mesh": mesh["rep"]}
        else:
            mesh = init_device_mesh("cpu", (*dims, tp), mesh_dim_names=("dp", "tp"))
            hsdp = {}
        dp = math.prod(dims)
        # Wide MLPs under "auto": gram for them, gather for the square attention matrices.
        model = build(0, hidden=96 if tp_ns == "auto" else 24)
        tensor_parallel(model, mesh["tp"])
        # q_proj's optimizer states in bf16: its NS input travels in bf16.
        policy = {"overrides": [{"name": ["q_proj"], "set": {"optim_dtype": "bf16"}}]}
        runtime = dedicate_params(
            model, mesh["dp"], muon_predicate, small_param_threshold=0, param_policy=policy, **hsdp
        )
        shard_layers_then_root(model, mesh["rep", "dp"] if hsdp else mesh["dp"])
        optimizer = Muon(model, lr=0.02, ns_backend="gram", options=StepOptions(tp_ns=tp_ns))
        coord = runtime.layout.coord
        return (
            model,
            optimizer,
            runtime,
            (coord.replicate * runtime.layout.shard_size + coord.shard, dp),
        )
    if case == "moe":
        model, runtime = _expert_sources_model(world)
        assert runtime.plan.expert_sources, "a case with expert sources"
        return model, Muon(model, lr=0.02), runtime, (dist.get_rank(), world)
    model = build(0)
    if case == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        runtime = dedicate_params(
            model, mesh["shard"], muon_predicate, replicate_mesh=mesh["replicate"]
        )
    elif case == "ddp":
        mesh = init_device_mesh("cpu", (world,))
        runtime = dedicate_params_ddp(model, mesh, muon_predicate)
        replicate(model, mesh)
        return model, Muon(model, lr=0.02), runtime, (dist.get_rank(), world)
    else:
        mesh = init_device_mesh("cpu", (world,))
        runtime = dedicate_params(model, mesh, muon_predicate, reshard_after_forward=False)
    shard_layers_then_root(model, mesh)
    return model, Muon(model, lr=0.02), runtime, (dist.get_rank(), world)


def _count_cases(rank: int, world_size: int, cases: list[str]):
    out = {}
    for case in cases:
        model, optimizer, runtime, (index, size) = _build_case(case)
        _step(model, optimizer, index, size, 0)
        plan = summarize_comm_plan(model, optimizer)
        without = summarize_comm_plan(model)
        runtime.counter.reset()
        with _collectives_of_dmuon(runtime) as moved:
            _step(model, optimizer, index, size, 1)
        layout = runtime.layout
        out[case] = {
            "tp_index": layout.tp_index,
            "replicate_size": layout.replicate_size,
            "plan": plan,
            "without": without,
            "counter": {k: v["bytes"] for k, v in runtime.counter.snapshot().items()},
            "moved": dict(moved),
        }
    return out


def _check_counts(results: list[dict], case: str) -> None:
    """``payload_bytes_per_step`` on every rank is what the step's collectives carried, each
    once: on the shard axis those of the rank's shard group (every member joins all of them),
    on the replicate and TP axes those the ranks of its grid (its TP index's) take part in: a
    replicate group's every member counted, a TP group has one in each grid; its keys are the
    runtime counter's."""
    ranks = [r[case] for r in results]
    keys = set().union(*(got["counter"] for got in ranks))
    grids: dict[int, Counter] = {}
    for got in ranks:
        grid = grids.setdefault(got["tp_index"], Counter())
        grid.update({k: v for k, v in got["moved"].items() if k[0] != "shard"})
    for got in ranks:
        grid = grids[got["tp_index"]]
        replicas = got["replicate_size"]
        assert all(v % replicas == 0 for k, v in grid.items() if k[0] == "replicate")
        moved = Counter({k: v // replicas if k[0] == "replicate" else v for k, v in grid.items()})
        moved.update({k: v for k, v in got["moved"].items() if k[0] == "shard"})
        payload = got["plan"]["payload_bytes_per_step"]
        by_op: Counter = Counter()
        for key, nbytes in payload.items():
            axis, kind = key.split("/")
            by_op[(axis, _OP_OF[kind])] += nbytes
        assert dict(by_op) == dict(moved), (case, payload, dict(moved))
        assert set(payload) == keys, (case, sorted(payload), sorted(keys))


ON_TWO = ["1d", "ddp", "tp-1x2-gather", "tp-1x2-gram", "tp-1x2-auto"]
ON_FOUR = ["hsdp", "moe", "tp-2x2-gather", "tp-2x2-gram", "tp-2x1x2-gather"]


@pytest.fixture(scope="module")
def counted_on_two():
    return run_distributed(_count_cases, 2, ON_TWO)


@pytest.fixture(scope="module")
def counted_on_four():
    return run_distributed(_count_cases, 4, ON_FOUR)


@pytest.mark.distributed
@pytest.mark.parametrize("case", ON_TWO)
def test_comm_plan_is_what_crosses_each_group_on_two_ranks(counted_on_two, case):
    _check_counts(counted_on_two, case)


@pytest.mark.distributed
@pytest.mark.parametrize("case", ON_FOUR)
def test_comm_plan_is_what_crosses_each_group_on_four_ranks(counted_on_four, case):
    _check_counts(counted_on_four, case)


@pytest.mark.distributed
def test_comm_plan_without_the_optimizer_leaves_out_tp_ns(counted_on_two):
    for r in counted_on_two:
        gather, gram = r["tp-1x2-gather"], r["tp-1x2-gram"]
        assert gather["plan"]["tp_ns"] == "gather" and gram["plan"]["tp_ns"] == "gram"
        for got in (gather, gram):
            assert got["without"]["tp_ns"] is None
            assert not any(k.startswith("tp/") for k in got["without"]["payload_bytes_per_step"])
        # "auto" took both ways here: gram for the wide MLPs, gather for the rest.
        auto = r["tp-1x2-auto"]["plan"]["payload_bytes_per_step"]
        assert {"tp/gather", "tp/all_reduce"} <= set(auto)
