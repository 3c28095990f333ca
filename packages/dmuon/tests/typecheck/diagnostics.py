"""What a user's ``mypy --strict`` sees of the dicts the diagnostics return: every key, with its
value's type (``nox -s typecheck`` checks this file; it is never run)."""

from __future__ import annotations

from typing import assert_type

from torch import nn

import dmuon
from dmuon.ns import BackendStatus, KernelAvailability
from dmuon.runtime import (
    BoundaryPlan,
    BoundaryUnshard,
    CommPlanSummary,
    ForwardUnshardProfile,
    Hyperparameters,
    Matrices,
    MatrixPiece,
    PackRow,
    ParamGroupSummary,
    ParamRow,
    collect_forward_unshard_profile,
)


def backend_status() -> None:
    status = dmuon.ns.get_backend_status("cpu")
    assert_type(status, BackendStatus)
    assert_type(status["sm"], int | None)
    assert_type(status["auto_candidates"], list[str])
    kernel = status["kernels"]["torch"]
    assert_type(kernel, KernelAvailability)
    assert_type(kernel["available"], bool)
    assert_type(kernel["reason"], str | None)


def param_groups(model: nn.Module, optimizer: dmuon.Muon) -> None:
    groups = dmuon.summarize_param_groups(model, optimizer)
    assert_type(groups, list[ParamGroupSummary])
    group = groups[0]
    assert_type(group["numel"], int)
    assert_type(group["lr_scaling"], str | None)
    assert_type(group["hyperparameters"], Hyperparameters)
    assert_type(group["hyperparameters"]["lr"], float)
    row = group["rows"][0]
    assert_type(row, ParamRow)
    assert_type(row["owner_rank"], int | None)
    assert_type(row["compute_dtype"], str)
    assert_type(row["output_dtype"], str | None)
    assert_type(row["policy_overrides"], list[int] | None)
    assert_type(row.get("role"), str | None)  # dedicated rows only
    matrices = row["matrices"]
    assert_type(matrices, Matrices | None)
    if matrices is not None and matrices["pieces"] is not None:
        assert_type(matrices["pieces"][0], MatrixPiece)
        assert_type(matrices["pieces"][0]["rows"], list[int])


def comm_plan(model: nn.Module, optimizer: dmuon.Muon) -> None:
    plan = dmuon.summarize_comm_plan(model, optimizer)
    assert_type(plan, CommPlanSummary)
    assert_type(plan["loads"], list[float])
    assert_type(plan["tp_ns"], str | None)
    assert_type(plan["payload_bytes_per_step"], dict[str, int])
    boundary = plan["boundaries"][0]
    assert_type(boundary, BoundaryPlan)
    assert_type(boundary["packs"][0], PackRow)
    assert_type(boundary["packs"][0]["bytes"], int)


def forward_unshard_profile(model: nn.Module) -> None:
    profile = collect_forward_unshard_profile(model)
    assert_type(profile, ForwardUnshardProfile)
    assert_type(profile["collectives"], dict[str, dict[str, int]])
    boundary = profile["boundaries"][0]
    assert_type(boundary, BoundaryUnshard)
    assert_type(boundary["forward_wait_ms"], float | None)


def misspelt_key(model: nn.Module) -> None:
    profile = collect_forward_unshard_profile(model)
    profile["bondaries"]  # type: ignore[typeddict-item]
