"""Several SGD steps through the 1-D runtime: matches a single process, Z2 == Z3 bit for bit,
and the bytes issued per step equal the formulas of ARCHITECTURE.md (bytes per step)."""

from __future__ import annotations

import pytest
import torch
from _models import build, muon_numel, reduce_numel, shard_layers_then_root
from _sgd_train import RunResult, ddp_model, merge_owned, reference_sgd, sgd_run

from dmuon_testing.distributed import run_distributed

STEPS = 3


def _z2_and_z3(rank: int, world_size: int) -> tuple[RunResult, RunResult]:
    return (
        sgd_run(rank, world_size, steps=STEPS, reshard=False),
        sgd_run(rank, world_size, steps=STEPS, reshard=True),
    )


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_steps_match_reference_z2_equals_z3_and_bytes(world_size: int) -> None:
    results = run_distributed(_z2_and_z3, world_size)
    z2 = [r[0] for r in results]
    z3 = [r[1] for r in results]
    ref_losses, ref_weights = reference_sgd(STEPS)

    # Z2 and Z3 move the same values through the same reductions: bit-identical.
    assert z2[0].losses == z3[0].losses
    z2_w, z3_w = merge_owned(z2), merge_owned(z3)
    assert z2_w.keys() == z3_w.keys() == ref_weights.keys()
    for name in z2_w:
        assert torch.equal(z2_w[name], z3_w[name]), name
        torch.testing.assert_close(z3_w[name], ref_weights[name], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        torch.tensor(z3[0].losses), torch.tensor(ref_losses), rtol=1e-5, atol=0
    )
    assert ref_losses[-1] < ref_losses[0]

    # Per step, every Muon element travels once per round (ARCHITECTURE.md, bytes per step).
    p_m = muon_numel(build(0)) * 4  # float32 bytes
    reduced = reduce_numel(build(0)) * 4  # and a presence flag per matrix
    n = world_size
    for rank_result in results:
        for run, broadcast_rounds in ((rank_result[0], 1), (rank_result[1], 2)):
            for step_bytes in run.bytes_per_step:
                if n == 1:
                    assert sum(step_bytes.values()) == 0  # (N-1)/N = 0: nothing is sent
                    continue
                assert step_bytes["shard/broadcast"] == broadcast_rounds * p_m
                assert step_bytes["shard/reduce"] == reduced
                assert step_bytes["replicate/reduce"] == 0
                assert step_bytes["replicate/publish"] == 0
                # Wire cost per rank: dmuon-Z2
                # 2(N-1)/N · P_M, dmuon-Z3 3(N-1)/N · P_M (and the flags).
                wire = (step_bytes["shard/broadcast"] + step_bytes["shard/reduce"]) * (n - 1) / n
                rounds = broadcast_rounds * p_m + reduced
                assert wire == pytest.approx(rounds * (n - 1) / n)


def _model_is_freed(rank: int, world_size: int, shard: bool, train: bool) -> bool:
    import gc
    import weakref

    from _models import batch, loss_fn, muon_predicate
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon_fsdp import dedicate_params

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
    model = build(0)
    dedicate_params(model, mesh, muon_predicate)
    if shard:
        shard_layers_then_root(model, mesh)
    if train:
        loss_fn(model, batch(0, rows=2)).backward()
    alive = weakref.ref(model)
    del model
    gc.collect()
    return alive() is None


@pytest.mark.distributed
@pytest.mark.parametrize(("shard", "train"), [(True, False), (False, True)])
def test_deleted_model_is_freed(shard: bool, train: bool) -> None:
    # dmuon's hooks must not keep a deleted model (and its weights) alive. FSDP2 itself keeps a
    # model that ran a forward alive in torch 2.13, with or without dmuon, so the two halves
    # (wrapped by FSDP2; trained) are checked separately.
    assert run_distributed(_model_is_freed, 2, shard, train) == [True, True]


def _points_kept(rank: int, world_size: int) -> tuple[list[int], int]:
    from _models import batch, loss_fn

    model, runtime = ddp_model(world_size)
    kept = []
    for step in range(4):
        loss_fn(model, batch(step, rows=2)).item()  # no backward: the graph is dropped here
        kept.append(sum(len(group.points) for group in runtime.hooks.groups))
    return kept, len(runtime.hooks.groups)


@pytest.mark.distributed
def test_forwards_without_a_backward_keep_no_reduce_point_per_forward() -> None:
    # Forwards with gradients enabled and no backward (an evaluation without no_grad, rollouts)
    # kept a dead reference per boundary per forward until the next backward: one boundary's
    # reduce points are those of the graphs still alive.
    ((kept, boundaries),) = run_distributed(_points_kept, 1)
    assert kept == [boundaries] * 4
