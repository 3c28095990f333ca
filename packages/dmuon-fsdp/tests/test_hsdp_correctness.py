"""HSDP (2 shards × 2 replicas) against the 1-D mesh of 4 over 10 SGD steps, async publish ==
sync publish, Z2 == Z3, replicas equal to their owner, and bytes per axis as ARCHITECTURE.md counts them."""

from __future__ import annotations

import pytest
import torch
from _models import build, muon_numel, reduce_numel
from _sgd_train import RunResult, merge_owned, sgd_run

from dmuon_testing.distributed import run_distributed

STEPS = 10


def _runs(rank: int, world_size: int) -> dict[str, RunResult]:
    return {
        "1d": sgd_run(rank, world_size, steps=STEPS),
        "hsdp_async": sgd_run(rank, world_size, steps=STEPS, replicate=2, async_=True),
        "hsdp_sync": sgd_run(rank, world_size, steps=STEPS, replicate=2, async_=False),
        "hsdp_z2": sgd_run(rank, world_size, steps=STEPS, replicate=2, reshard=False),
        "hsdp_shared": sgd_run(
            rank, world_size, steps=STEPS, replicate=2, process_group_policy="shared"
        ),
        "hsdp_fence": sgd_run(rank, world_size, steps=STEPS, replicate=2, debug_fence=True),
        # One shard, four replicas: nothing moves on the shard axis, everything on the other.
        "hsdp_1x4": sgd_run(rank, world_size, steps=STEPS, replicate=4),
    }


@pytest.mark.distributed
def test_hsdp_matches_1d_async_sync_z2_z3_and_bytes() -> None:
    per_rank = run_distributed(_runs, 4)
    runs = {key: [r[key] for r in per_rank] for key in per_rank[0]}
    weights = {key: merge_owned(results) for key, results in runs.items()}

    # Bit for bit: the publish mode, Z2/Z3 and the group policy change when bytes move, never
    # which values are summed in which order.
    base = runs["hsdp_async"][0].losses
    for key in ("hsdp_sync", "hsdp_z2", "hsdp_shared", "hsdp_fence"):
        assert runs[key][0].losses == base, key
        for name, value in weights["hsdp_async"].items():
            assert torch.equal(weights[key][name], value), (key, name)

    # HSDP vs 1-D: the gradient sum is associated differently ((a+b)+(c+d) over two reduce
    # stages vs one 4-rank reduce, and FSDP2's HSDP reduce-scatter + all-reduce likewise), so
    # the trajectories agree to rounding, not bit for bit.
    for key in ("hsdp_async", "hsdp_1x4"):
        torch.testing.assert_close(
            torch.tensor(runs[key][0].losses), torch.tensor(runs["1d"][0].losses), rtol=1e-5, atol=0
        )
        for name, value in weights["1d"].items():
            torch.testing.assert_close(weights[key][name], value, rtol=1e-5, atol=1e-6)
    assert base[-1] < base[0]

    # Every HSDP owner is the only one that stepped; its column replica holds the same bits.
    for key in ("hsdp_async", "hsdp_sync", "hsdp_z2", "hsdp_1x4"):
        assert len(weights[key]) == len(weights["1d"])
        for result in runs[key]:
            for name, value in result.replicas.items():
                assert torch.equal(value, weights[key][name]), (key, name)

    # Bytes (ARCHITECTURE.md, bytes per step): each replicate row runs the shard-axis rounds (rows 0 and 1 are
    # ranks {0, 1} and {2, 3}); the replicate axis adds one reduce and one publish round, each
    # summing to P_M over the G replicate groups (the ranks of one row together).
    p_m = muon_numel(build(0)) * 4
    reduced = reduce_numel(build(0)) * 4  # and a presence flag per matrix
    for key, broadcast_rounds in (("hsdp_async", 2), ("hsdp_z2", 1)):
        results = runs[key]
        for step in range(STEPS):
            for result in results:
                step_bytes = result.bytes_per_step[step]
                assert step_bytes["shard/broadcast"] == broadcast_rounds * p_m
                assert step_bytes["shard/reduce"] == reduced
            for row in ((0, 1), (2, 3)):
                for kind, want in (("reduce", reduced), ("publish", p_m)):
                    total = sum(results[r].bytes_per_step[step][f"replicate/{kind}"] for r in row)
                    assert total == want, (key, step, row, kind)
    for result in runs["hsdp_1x4"]:  # G = 1: every rank is its own row, and in every column
        for step_bytes in result.bytes_per_step:
            assert step_bytes["shard/broadcast"] == step_bytes["shard/reduce"] == 0
            assert step_bytes["replicate/reduce"] == reduced
            assert step_bytes["replicate/publish"] == p_m
