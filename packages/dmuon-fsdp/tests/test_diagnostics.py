"""Diagnostics: per-parameter dtypes (master, compute, reduce, optimizer state, output) and the
``param_policy`` overrides that matched in ``summarize_param_groups``; the row limit of
``summarize_comm_plan``; ``collect_forward_unshard_profile(clear=True)``.

One world-2 call: a bf16 FSDP2 policy on every module (the root's with an fp32 output), and a
``param_policy`` whose overrides change one dtype each, so every dtype of every row has one
expected value, written out here by hand.
"""

from __future__ import annotations

import json

import pytest
import torch
from _models import build, muon_predicate
from _reference import make_batch, shard
from test_precision import lm_loss
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from dmuon_fsdp import (
    Muon,
    StepOptions,
    collect_forward_unshard_profile,
    dedicate_params,
    dedicated_params_of,
    get_runtime,
    summarize_comm_plan,
    summarize_param_groups,
)
from dmuon_testing.distributed import run_distributed

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
    return groups, unknown, held, plans, profiles, errors


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
    for _, _, _, plans, _, _ in diagnosed:
        assert plans[64]["payload_bytes_per_step"] == plans["moved"]
    assert (
        diagnosed[0][3][64]["payload_bytes_per_step"]
        == diagnosed[1][3][64]["payload_bytes_per_step"]
    )


@pytest.mark.distributed
def test_comm_plan_row_limit_says_how_many_rows_were_left_out(diagnosed):
    for *_, plans, _, _ in diagnosed:
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
    for *_, profiles, _ in diagnosed:
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
    for *_, errors in diagnosed:
        policy, rows, clear = errors
        # The first dedicated name in order whose resolution differs, and how.
        assert policy.startswith(
            "summarize_param_groups: param_policy resolves 'layers.0.attn.k_proj.weight'"
            " otherwise than dedicate_params did (output_dtype None here, 'float32' there)"
        ), policy
        assert "pass the param_policy that dedicate_params was given" in policy
        assert rows == "max_rows must be an int >= 0, got -1"
        assert clear == "clear must be True or False, got 'yes'"
