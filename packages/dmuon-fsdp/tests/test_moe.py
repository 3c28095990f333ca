"""Mixture-of-experts: 3-D expert stacks selected for Muon are stepped per expert where FSDP2
holds them (no dmuon bytes), against a single-process reference that orthogonalises every
expert matrix on its own; uneven and empty expert shards; HSDP; the errors."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _moe import ReferenceMoE, build_moe, moe_predicate
from _reference import Hyper, lm_loss, make_batch, shard
from test_checkpoint import _equal
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

from dmuon_fsdp import (
    Axis,
    CommKind,
    Muon,
    dedicate_params,
    dedicated_params_of,
    get_model_state_dict,
    get_optimizer_state_dict,
    load_checkpoint,
    save_checkpoint,
)
from dmuon_fsdp._matrix import Glu
from dmuon_testing.distributed import run_distributed

HYPER = Hyper()
STEPS, ROWS, SEQ, VOCAB = 6, 8, 8, 32


def _reference(experts: int, layout: str, *, float64: bool = False) -> list[float]:
    model = build_moe(experts, layout)
    names = {n for n, p in model.named_parameters() if moe_predicate(n, p)}
    opt = ReferenceMoE(model, names, HYPER, float64=float64)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = lm_loss(model, make_batch(step, ROWS, SEQ, VOCAB))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _train(rank: int, world_size: int, experts: int, layout: str, replicate: int = 1):
    model = build_moe(experts, layout)
    if replicate > 1:
        mesh = init_device_mesh(
            "cpu", (replicate, world_size // replicate), mesh_dim_names=("replicate", "shard")
        )
        runtime = dedicate_params(
            model, mesh["shard"], moe_predicate, replicate_mesh=mesh["replicate"]
        )
    else:
        mesh = init_device_mesh("cpu", (world_size,))
        runtime = dedicate_params(model, mesh, moe_predicate)
    dedicated = dedicated_params_of(model)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=dedicated)
    fully_shard(model, mesh=mesh, ignored_params=dedicated)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    local_experts = {
        name: p.to_local().shape[0] for name, p in model.named_parameters() if ".experts." in name
    }
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = lm_loss(model, shard(make_batch(step, ROWS, SEQ, VOCAB), rank, world_size))
        loss.backward()
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world_size)
    # What dmuon moved: the dense dedicated matrices' rounds only (fp32, Z3: two broadcasts
    # and one reduce per step); no expert byte goes through dmuon.
    dense = sum(p.numel() for p in dedicated) * 4 * (world_size // replicate > 1)
    flags = len(dedicated) * 4 * (world_size // replicate > 1)  # one per matrix per reduce
    counter = runtime.counter
    moved = (
        counter.bytes(Axis.SHARD, CommKind.BROADCAST),
        counter.bytes(Axis.SHARD, CommKind.REDUCE),
    )
    assert moved == (2 * STEPS * dense, STEPS * (dense + flags)), (moved, dense)
    state = get_model_state_dict(model)
    return losses, local_experts, {k: v for k, v in state.items() if "experts" in k}


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("world_size", "experts"),
    [(2, 4), (2, 3), (4, 4), (4, 3), (4, 2)],
    ids=["N2-E4", "N2-E3-uneven", "N4-E4", "N4-E3-uneven", "N4-E2-fewer"],
)
def test_expert_stacks_train_like_the_per_expert_reference(world_size, experts) -> None:
    reference = _reference(experts, "torchtitan")
    results = run_distributed(_train, world_size, experts, "torchtitan")
    losses = results[0][0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=0, atol=2e-3)
    # torch.chunk's placement: ceil(E/N) experts per rank, the last ranks fewer or none.
    chunk = -(-experts // world_size)
    for rank, (_, local, _) in enumerate(results):
        assert set(local.values()) == {max(0, min(chunk, experts - rank * chunk))}


def _hf_model(family: str):
    from transformers import GptOssConfig, GptOssForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts_per_tok=2,
    )
    if family == "qwen3_moe":
        config = Qwen3MoeConfig(
            **common, intermediate_size=32, moe_intermediate_size=8, num_experts=4
        )
        return Qwen3MoeForCausalLM(config).float()
    config = GptOssConfig(
        **common, intermediate_size=8, num_local_experts=4, layer_types=["full_attention"] * 2
    )
    return GptOssForCausalLM(config).float()


def hf_predicate(name: str, param: torch.nn.Parameter) -> bool:
    """Every matrix and expert stack but the embedding and the head; biases stay on AdamW."""
    return param.ndim >= 2 and "embed" not in name and "lm_head" not in name and "bias" not in name


def _hf_logits(model):
    return lambda tokens: model(tokens).logits


def _hf_reference(family: str) -> list[float]:
    model = _hf_model(family)
    names = {n for n, p in model.named_parameters() if hf_predicate(n, p)}
    opt = ReferenceMoE(model, names, HYPER, interleaved=family == "gpt_oss")
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = lm_loss(_hf_logits(model), make_batch(step, ROWS, SEQ, VOCAB))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _hf_train(rank: int, world_size: int, family: str):
    model = _hf_model(family)
    mesh = init_device_mesh("cpu", (world_size,))
    dedicate_params(model, mesh, hf_predicate)
    dedicated = dedicated_params_of(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=dedicated)
    fully_shard(model, mesh=mesh, ignored_params=dedicated)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    views = {
        entry.fqn: (entry.view.glu, entry.view.matrix_shape, entry.matrices)
        for entry in optimizer._plan.muon
        if not entry.holder.dedicated
    }
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        tokens = shard(make_batch(step, ROWS, SEQ, VOCAB), rank, world_size)
        loss = lm_loss(_hf_logits(model), tokens)
        loss.backward()
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world_size)
    return losses, views


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_hf_moe_trains_with_gate_and_up_orthogonalised_apart(family) -> None:
    reference = _hf_reference(family)
    results = run_distributed(_hf_train, 2, family)
    losses = results[0][0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=0, atol=2e-3)
    # Each rank holds 2 of the 4 experts: 4 gate/up matrices and 2 down matrices per layer.
    glu = Glu.CONCAT if family == "qwen3_moe" else Glu.INTERLEAVED
    gate_up = (8, 16) if family == "qwen3_moe" else (16, 8)
    for rank_views in (r[1] for r in results):
        assert rank_views["model.layers.0.mlp.experts.gate_up_proj"] == (glu, gate_up, 4)
        assert rank_views["model.layers.0.mlp.experts.down_proj"][2] == 2


class _OwnExperts(nn.Module):
    """A user's own experts module named like Qwen's, without Hugging Face's flags."""

    def __init__(self, gate_up_rows: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(4, gate_up_rows, 16))
        self.down_proj = nn.Parameter(torch.randn(4, 16, 8))


def _own_experts_views(rank: int, world_size: int) -> dict[str, object]:
    """How Muon cuts each user-defined gate_up_proj: one matrix per expert unless its shape
    is the gate and up of its down_proj (2 x 8 rows), or param_policy declares it."""
    mesh = init_device_mesh("cpu", (world_size,))
    model = nn.Module()
    model.layers = nn.ModuleList(  # type: ignore[assignment]
        [_OwnExperts(rows) for rows in (8, 16, 16, 8)]
    )
    policy = {
        "overrides": [
            {"name": ["layers.2.gate_up_proj"], "set": {"glu": "joint"}},
            {"name": ["layers.3.gate_up_proj"], "set": {"glu": "split"}},
        ]
    }
    runtime = dedicate_params(model, mesh, lambda n, p: "gate_up" in n, param_policy=policy)
    return {stack.fqn: (stack.view.batch, stack.view.split) for stack in runtime.local_muon}


def test_only_a_fused_or_declared_gate_up_stack_is_split() -> None:
    (views,) = run_distributed(_own_experts_views, 1)
    concat = "gate and up apart (rows [gate; up])"
    assert views == {
        "layers.0.gate_up_proj": (4, None),  # (4, 8, 16) beside a (4, 16, 8) down: not fused
        "layers.1.gate_up_proj": (8, concat),  # (4, 16, 16): the gate and up of that down
        "layers.2.gate_up_proj": (4, None),  # declared joint
        "layers.3.gate_up_proj": (8, concat),  # declared split
    }


# -- checkpoints, HSDP, one rank and the refused layout ----------------------------------------

SPLIT = 3


def _sharded_moe(world_size: int, experts: int, *, seed: int = 0, replicate: int = 1, **fsdp):
    model = build_moe(experts, seed=seed)
    if replicate > 1:
        mesh = init_device_mesh(
            "cpu", (replicate, world_size // replicate), mesh_dim_names=("replicate", "shard")
        )
        dedicate_params(model, mesh["shard"], moe_predicate, replicate_mesh=mesh["replicate"])
    else:
        mesh = init_device_mesh("cpu", (world_size,))
        dedicate_params(model, mesh, moe_predicate)
    dedicated = dedicated_params_of(model)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=dedicated, **fsdp)
    fully_shard(model, mesh=mesh, ignored_params=dedicated)
    return model, Muon(model, **HYPER.muon_kwargs())


def _steps(model, optimizer, rank: int, world_size: int, start: int, stop: int) -> list[float]:
    losses = []
    for step in range(start, stop):
        optimizer.zero_grad()
        loss = lm_loss(model, shard(make_batch(step, ROWS, SEQ, VOCAB), rank, world_size))
        loss.backward()
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world_size)
    return losses


def _full(model, optimizer):
    return (
        get_model_state_dict(model, rank0_only=True),
        get_optimizer_state_dict(model, optimizer, rank0_only=True),
    )


def _save_at_two(rank: int, world_size: int, root: str):
    model, optimizer = _sharded_moe(world_size, 3)
    uninterrupted = _steps(model, optimizer, rank, world_size, 0, STEPS)
    model, optimizer = _sharded_moe(world_size, 3)
    _steps(model, optimizer, rank, world_size, 0, SPLIT)
    save_checkpoint(os.path.join(root, "ckpt"), model, optimizer)
    saved = _full(model, optimizer)
    if rank == 0:
        torch.save(saved, os.path.join(root, "full.pt"))
    model, optimizer = _sharded_moe(world_size, 3, seed=7)
    load_checkpoint(os.path.join(root, "ckpt"), model, optimizer)
    after = _full(model, optimizer)  # collective: every rank takes part
    same = _equal(after, saved) if rank == 0 else True
    resumed = _steps(model, optimizer, rank, world_size, SPLIT, STEPS)
    # FSDP2 asked to split the experts on dim 1: refused, naming the fix.
    refused = ""
    try:
        _sharded_moe(world_size, 3, shard_placement_fn=lambda p: Shard(p.ndim - 2))
    except ValueError as error:
        refused = str(error)
    return uninterrupted, same, resumed, refused


def _load_at_four(rank: int, world_size: int, root: str):
    model, optimizer = _sharded_moe(world_size, 3, seed=7)
    load_checkpoint(os.path.join(root, "ckpt"), model, optimizer)
    after = _full(model, optimizer)
    same = rank != 0 or _equal(after, torch.load(os.path.join(root, "full.pt")))
    resumed = _steps(model, optimizer, rank, world_size, SPLIT, STEPS)
    model, optimizer = _sharded_moe(world_size, 3, replicate=2)
    hsdp = _steps(model, optimizer, rank, world_size, 0, STEPS)
    return same, resumed, hsdp, _clip_norm(rank, world_size, replicate=2)


def _clip_norm(rank: int, world_size: int, replicate: int) -> float:
    """The global norm of the Muon gradients after one backward, through the clip protocol:
    each rank's counted gradients, summed over the group (HSDP replicas hold the same expert
    shards; they must be counted once)."""
    model, optimizer = _sharded_moe(world_size, 3, replicate=replicate)
    lm_loss(model, shard(make_batch(0, ROWS, SEQ, VOCAB), rank, world_size)).backward()
    clip = optimizer.muon_grads_for_clip()
    total = torch.zeros(())
    for grad in clip.grads:
        total += grad.float().pow(2).sum()
    dist.all_reduce(total, group=clip.process_group)
    return float(total.sqrt())


def _reference_norm(experts: int = 3) -> float:
    model = build_moe(experts)
    lm_loss(model, make_batch(0, ROWS, SEQ, VOCAB)).backward()
    squares = [p.grad.pow(2).sum() for n, p in model.named_parameters() if moe_predicate(n, p)]
    return float(torch.stack(squares).sum().sqrt())


@pytest.mark.distributed
def test_expert_checkpoints_resume_across_world_sizes_and_hsdp_trains(tmp_path) -> None:
    root = str(tmp_path)
    uninterrupted, same, resumed, refused = run_distributed(_save_at_two, 2, root)[0]
    assert same, "the state after a load on 2 ranks differs from the state saved"
    assert resumed == uninterrupted[SPLIT:], "resume on the same ranks must be bit-exact"
    assert "shard it on dim 0" in refused and "experts.w" in refused, refused
    results = run_distributed(_load_at_four, 4, root)
    same, resumed, hsdp, _ = results[0]
    # The clip norm over experts and dense matrices: every rank the true norm, no expert
    # counted twice over the HSDP replicas.
    reference_norm = _reference_norm()
    for *_, norm in results:
        assert abs(norm - reference_norm) <= 1e-5 * reference_norm, (norm, reference_norm)
    assert same, "the state after a load on 4 ranks differs from the state saved on 2"
    torch.testing.assert_close(
        torch.tensor(resumed), torch.tensor(uninterrupted[SPLIT:]), rtol=1e-4, atol=0
    )
    reference = _reference(3, "torchtitan")
    torch.testing.assert_close(torch.tensor(hsdp), torch.tensor(reference), rtol=0, atol=2e-3)


def _one_rank(rank: int, world_size: int):
    model, optimizer = _sharded_moe(world_size, 3)
    return _steps(model, optimizer, rank, world_size, 0, STEPS)


@pytest.mark.distributed
def test_expert_stacks_on_one_rank() -> None:
    losses = run_distributed(_one_rank, 1)[0]
    reference = _reference(3, "torchtitan")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=0, atol=2e-3)


# -- expert parallelism ---------------------------------------------------------------------------


def _ep_model(world_size: int):
    """torchtitan's layout on 4 ranks: experts sharded on dim 0 by an EP mesh of 2, then by
    FSDP2 over the expert-FSDP mesh of 2 (one whole expert per rank), everything else FSDP2 over
    all 4; the experts' gradient divided by the 4 data-parallel ranks, not by the 2 of their
    FSDP2 mesh (the EP backward has summed over the other 2)."""
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    dense = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    model = build_moe(4)
    for layer in model.layers:
        experts = layer.experts
        for name in ("w1", "w3", "w2"):
            stack = getattr(experts, name)
            shard = distribute_tensor(stack.detach(), mesh["ep"], [Shard(0)])
            setattr(experts, name, torch.nn.Parameter(shard))
    dedicate_params(model, dense, moe_predicate)
    dedicated = dedicated_params_of(model)
    for layer in model.layers:
        fully_shard(layer.experts, mesh=mesh["efsdp"])
        layer.experts.set_gradient_divide_factor(world_size)
        layer.experts.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        fully_shard(layer, mesh=dense, ignored_params=dedicated)
    fully_shard(model, mesh=dense, ignored_params=dedicated)
    return model, Muon(model, **HYPER.muon_kwargs())


def _ep_train(rank: int, world_size: int):
    model, optimizer = _ep_model(world_size)
    # The gradients' scale, which Muon's update cannot show (NS normalises it): the global norm
    # through the clip protocol after one backward.
    lm_loss(model, shard(make_batch(0, ROWS, SEQ, VOCAB), rank, world_size)).backward()
    clip = optimizer.muon_grads_for_clip()
    total = torch.stack([g.float().pow(2).sum() for g in clip.grads] or [torch.zeros(())]).sum()
    dist.all_reduce(total, group=clip.process_group)
    model, optimizer = _ep_model(world_size)
    held = {
        n: (tuple(p.placements), p.to_local().shape[0])
        for n, p in model.named_parameters()
        if ".experts." in n
    }
    losses = _steps(model, optimizer, rank, world_size, 0, STEPS)
    return losses, held, float(total.sqrt())


@pytest.mark.distributed
def test_expert_parallel_by_fsdp_trains_like_the_reference() -> None:
    results = run_distributed(_ep_train, 4)
    reference = _reference(4, "torchtitan")
    torch.testing.assert_close(
        torch.tensor(results[0][0]), torch.tensor(reference), rtol=0, atol=2e-3
    )
    norm = _reference_norm(experts=4)
    for _, held, got in results:
        # Every stack split on dim 0 over both meshes: one whole expert per rank.
        assert {count for _, count in held.values()} == {1}, held
        assert abs(got - norm) <= 1e-5 * norm, (got, norm)
