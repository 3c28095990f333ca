"""Expert sources under HSDP: one replica steps an expert stack shard for all and broadcasts
it. Training with sources equals training without them bit for bit, the replicas stay
identical, the broadcast bytes are the sourced shards' and nothing else, and a stack sharded
elsewhere than the plan assumed is refused."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _moe import build_moe, moe_predicate
from _reference import Hyper, lm_loss, make_batch, shard
from test_moe import ROWS, SEQ, VOCAB, _steps
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon_ownership._lpt as lpt
from dmuon_fsdp import (
    Axis,
    CommKind,
    Muon,
    dedicate_params,
    dedicated_params_of,
    get_model_state_dict,
)
from dmuon_testing.distributed import run_distributed

HYPER = Hyper()
STEPS = 4
EXPERTS = 4


def _predicate(name: str, param: torch.nn.Parameter) -> bool:
    # The head on Muon too: one dense matrix more than the others, so that the slot owning it
    # stands above its replica and the plan moves expert work off it.
    return moe_predicate(name, param) or name == "head.weight"


def _build(world_size: int, *, experts_mesh: str = "hsdp"):
    model = build_moe(EXPERTS)
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    runtime = dedicate_params(
        model,
        mesh["shard"],
        _predicate,
        replicate_mesh=mesh["replicate"],
        hook_boundary_strict=False,  # the head hooks at the root
    )
    dedicated = dedicated_params_of(model)
    for layer in model.layers:
        if experts_mesh == "flat":
            flat = init_device_mesh("cpu", (world_size,))
            fully_shard(layer.experts, mesh=flat, ignored_params=dedicated)
        fully_shard(layer, mesh=mesh, ignored_params=dedicated)
    fully_shard(model, mesh=mesh, ignored_params=dedicated)
    return model, runtime


def _train(rank: int, world_size: int, sources: bool):
    chosen = lpt.expert_sources
    if not sources:
        lpt.expert_sources = lambda *args, **kwargs: ()
    try:
        model, runtime = _build(world_size)
    finally:
        lpt.expert_sources = chosen
    optimizer = Muon(model, **HYPER.muon_kwargs())
    # What a post-update hook is handed must be the stepped weight: a receiving replica's
    # shard of a sourced stack still holds the old one then (the source's broadcast comes
    # after the hooks), so it is not among that rank's parts.
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    optimizer.register_post_update_hook(
        lambda _, parts: seen.update({n: (p.tensor, p.tensor.clone()) for n, p in parts.items()})
    )
    losses = _steps(model, optimizer, rank, world_size, 0, STEPS)
    stale = [name for name, (now, at_hook) in seen.items() if not torch.equal(now, at_hook)]
    # The bytes the sources broadcast per step, from the plan and this rank's shards.
    params = dict(model.named_parameters())
    mine = runtime.coord.shard
    sourced = [s for s in runtime.plan.expert_sources if s.shard == mine]
    expected = sum(params[s.stack].to_local().numel() * 4 for s in sourced) * STEPS
    published = runtime.counter.bytes(Axis.REPLICATE, CommKind.PUBLISH)
    # Replicas hold the same experts, bit for bit.
    replicas_equal = True
    for name, p in params.items():
        if ".experts." in name:
            local = p.to_local().detach()
            other = torch.empty_like(local)
            peer = runtime.layout.rank_of[1 - runtime.coord.replicate][mine]
            ops = [
                dist.P2POp(dist.isend, local.contiguous(), peer),
                dist.P2POp(dist.irecv, other, peer),
            ]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            replicas_equal &= torch.equal(local, other)
    state = get_model_state_dict(model)
    # An infinity in a gradient of a stack shard that this rank only advances the momentum of
    # (its replica steps it) skips the step on every rank.
    skipped = True
    if sources:
        optimizer.zero_grad()
        lm_loss(model, shard(make_batch(0, ROWS, SEQ, VOCAB), rank, world_size)).backward()
        first = runtime.plan.expert_sources[0]
        if (runtime.coord.shard, runtime.coord.replicate) == (first.shard, 1 - first.replicate):
            params[first.stack].grad.to_local().fill_(float("inf"))
        optimizer.step()
        skipped = bool(optimizer.last_step_stats.skipped)
    return (
        losses,
        state,
        runtime.plan.expert_sources,
        expected,
        published,
        replicas_equal,
        skipped,
        stale,
    )


def _refused(rank: int, world_size: int) -> str:
    model, _ = _build(world_size, experts_mesh="flat")
    try:
        Muon(model, **HYPER.muon_kwargs())
    except ValueError as error:
        return str(error)
    return ""


def _both(rank: int, world_size: int):
    return (
        _train(rank, world_size, True),
        _train(rank, world_size, False),
        _refused(rank, world_size),
    )


@pytest.mark.distributed
def test_expert_sources_train_bit_for_bit_like_every_replica_stepping() -> None:
    results = run_distributed(_both, 4)
    (losses, state, sources, *_), plain, _ = results[0]
    plain_losses, plain_state, plain_sources, *_ = plain
    assert sources and not plain_sources, (sources, plain_sources)
    assert any(result[0][3] > 0 for result in results)
    assert losses == plain_losses
    assert state.keys() == plain_state.keys()
    for key in state:
        assert torch.equal(state[key], plain_state[key]), key
    for (*_, expected, published, equal, skipped, stale), (
        *_,
        plain_published,
        plain_equal,
        _,
        _,
    ), message in results:
        assert not stale, (
            f"a post-update hook was handed a shard before its source's update: {stale}"
        )
        assert equal and plain_equal, "HSDP replicas hold different experts"
        assert skipped, "an infinity in a receiver's expert gradient must skip the step everywhere"
        # What the sources add to the replicate axis is their shards' broadcast, nothing else.
        assert published - plain_published == expected, (published, expected)
        assert "fully_shard the experts' module" in message and ".experts.w" in message, message
