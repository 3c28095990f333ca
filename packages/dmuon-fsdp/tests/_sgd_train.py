"""Train the tiny model with plain SGD through the runtime alone (no dmuon optimizer): owners
update ``DedicatedParam.full`` and call ``after_step``; FSDP2 parameters use torch SGD.

Used by the runtime tests to compare topologies (Z2/Z3, 1-D/HSDP, sync/async publish) over
several steps without depending on the Muon optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from _models import batch, build, loss_fn, muon_predicate, shard_layers_then_root
from torch.distributed.device_mesh import init_device_mesh

from dmuon_fsdp import Axis, CommKind, Role, dedicate_params, dedicate_params_ddp, replicate

LR = 0.5
ROWS = 8


@dataclass
class RunResult:
    losses: list[float] = field(default_factory=list)
    # bytes per step: {"shard/broadcast": ..., ...}
    bytes_per_step: list[dict[str, int]] = field(default_factory=list)
    calls_per_step: list[dict[str, int]] = field(default_factory=list)
    owned: dict[str, torch.Tensor] = field(default_factory=dict)  # fqn -> final full weight
    replicas: dict[str, torch.Tensor] = field(default_factory=dict)  # HSDP column copies


def make_mesh(world_size: int, replicate: int, device: str = "cpu"):
    if replicate == 1:
        mesh = init_device_mesh(device, (world_size,))
        return mesh, mesh, None
    hsdp = init_device_mesh(
        device, (replicate, world_size // replicate), mesh_dim_names=("replicate", "shard")
    )
    return hsdp, hsdp["shard"], hsdp["replicate"]


def setup_model(
    world_size: int,
    *,
    replicate: int = 1,
    reshard: bool = True,
    seed: int = 0,
    n_layers: int = 2,
    device: str = "cpu",
    **options: object,
):
    """The tiny model under the dmuon runtime + FSDP2: 1-D over ``world_size`` ranks, or HSDP
    with ``replicate`` replicas of ``world_size // replicate`` shards. ``options`` go to
    ``dedicate_params``."""
    model = build(seed, n_layers).to(device)
    mesh, shard_mesh, replicate_mesh = make_mesh(world_size, replicate, device)
    runtime = dedicate_params(
        model,
        shard_mesh,
        muon_predicate,
        reshard_after_forward=reshard,
        replicate_mesh=replicate_mesh,
        **options,
    )
    shard_layers_then_root(model, mesh)
    return model, runtime


def ddp_model(world_size: int, seed: int = 0):
    """The tiny model on the replicated (DDP) path: every matrix its own pack."""
    model = build(seed)
    mesh = init_device_mesh("cpu", (world_size,))
    runtime = dedicate_params_ddp(model, mesh, muon_predicate, small_param_threshold=0)
    replicate(model, mesh)
    return model, runtime


def sgd_run(
    rank: int,
    world_size: int,
    *,
    steps: int = 3,
    reshard: bool = True,
    replicate: int = 1,
    async_: bool = True,
    process_group_policy: str = "isolated",
    n_layers: int = 2,
    device: str = "cpu",
    debug_fence: bool = False,
    small_param_threshold: int = 0,
) -> RunResult:
    model, runtime = setup_model(
        world_size,
        replicate=replicate,
        reshard=reshard,
        n_layers=n_layers,
        device=device,
        process_group_policy=process_group_policy,
        debug_fence=debug_fence,
        # 0: every matrix is placed on its own, so a boundary has several owners (packs).
        small_param_threshold=small_param_threshold,
    )
    dedicated = {id(dp.param) for dp in runtime.params}
    others = [p for p in model.parameters() if id(p) not in dedicated]
    sgd = torch.optim.SGD(others, lr=LR)
    counter = runtime.counter
    result = RunResult()
    for step in range(steps):
        counter.reset()
        tokens = batch(step, ROWS).chunk(world_size)[rank].to(device)
        loss = loss_fn(model, tokens)
        loss.backward()
        runtime.wait_all_reduces()
        with torch.no_grad():
            for dp in runtime.owned:
                assert dp.full is not None and dp.grad is not None
                dp.full.add_(dp.grad, alpha=-LR)
                dp.grad = None
        sgd.step()
        sgd.zero_grad()
        runtime.after_step(async_=async_)
        total = loss.detach().clone()
        dist.all_reduce(total)
        result.losses.append((total / world_size).item())
        keys = [(a, k) for a in Axis for k in CommKind]
        result.bytes_per_step.append({f"{a}/{k}": counter.bytes(a, k) for a, k in keys})
        result.calls_per_step.append({f"{a}/{k}": counter.calls(a, k) for a, k in keys})
    runtime.drain()
    result.owned = {dp.fqn: dp.full.cpu() for dp in runtime.owned if dp.full is not None}
    result.replicas = {
        dp.fqn: dp.param.detach().cpu() for dp in runtime.params if dp.role is Role.REPLICA
    }
    return result


def merge_owned(results: list[RunResult]) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        for name, value in r.owned.items():
            assert name not in merged, f"{name} owned twice"
            merged[name] = value
    return merged


def reference_sgd(
    steps: int, n_layers: int = 2, device: str = "cpu"
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same training on one process with the full batch."""
    model = build(0, n_layers).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        loss = loss_fn(model, batch(step, ROWS).to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    weights = {n: p.detach().cpu() for n, p in model.named_parameters() if muon_predicate(n, p)}
    return losses, weights
