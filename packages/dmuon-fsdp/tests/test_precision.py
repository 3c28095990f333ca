"""Mixed precision (FSDP2's MixedPrecisionPolicy, param_policy dtypes) and meta-device models,
against single-process references."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _models import build, muon_numel, muon_predicate, shard_layers_then_root
from _reference import Hyper, ReferenceMuonAdamW, make_batch, shard
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from dmuon_fsdp import (
    Muon,
    Role,
    StepOptions,
    dedicate_params,
    dedicate_params_ddp,
    dedicated_params_of,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_runtime,
    no_sync,
    replicate,
    set_model_state_dict,
)
from dmuon_testing.distributed import run_distributed

HYPER = Hyper()
STEPS = 8
ROWS, SEQ, VOCAB = 8, 8, 32
BF16 = torch.bfloat16
MP = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on fp32 logits (bf16 logits would round the loss itself to
    three significant digits)."""
    logits = model(tokens[:, :-1]).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _global(loss: torch.Tensor, world_size: int) -> float:
    total = loss.detach().float().clone()
    dist.all_reduce(total)
    return float(total) / world_size


def reference_mixed(
    names: list[str], steps: int, compute_modules: tuple[str, ...] | None = None
) -> list[float]:
    """fp32 master weights stepped with Muon + AdamW; forward and backward on a bf16 copy of
    them (of every module, or of the modules named in ``compute_modules``), the gradients
    turned into fp32."""
    master = build(0)
    twin = build(0)
    if compute_modules is None:
        twin.to(BF16)
    for name in compute_modules or ():
        module = twin.get_submodule(name)
        module.to(BF16)
        # What FSDP2's policy does at that module: its floating inputs are cast to bf16.
        module.register_forward_pre_hook(
            lambda m, args: tuple(a.to(BF16) if a.is_floating_point() else a for a in args)
        )
    optimizer = ReferenceMuonAdamW(master, names, HYPER)
    pairs = list(zip(master.parameters(), twin.parameters()))
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        with torch.no_grad():
            for m, t in pairs:
                t.copy_(m)
                t.grad = None
        loss = lm_loss(twin, make_batch(step, ROWS, SEQ, VOCAB))
        loss.backward()
        for m, t in pairs:
            m.grad = t.grad.float()
        optimizer.step()
        losses.append(float(loss.detach().float()))
    return losses


def _mixed(rank: int, world_size: int, reshard: bool):
    model = build(0)
    mesh = init_device_mesh("cpu", (world_size,))
    runtime = dedicate_params(
        model, mesh, muon_predicate, reshard_after_forward=reshard, small_param_threshold=0
    )
    dedicated = dedicated_params_of(model)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=MP, ignored_params=dedicated)
    fully_shard(model, mesh=mesh, mp_policy=MP, ignored_params=dedicated)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    losses, bytes_per_step = [], []
    for step in range(STEPS):
        runtime.counter.reset()
        optimizer.zero_grad()
        loss = lm_loss(model, shard(make_batch(step, ROWS, SEQ, VOCAB), rank, world_size))
        loss.backward()
        optimizer.step()
        losses.append(_global(loss, world_size))
        bytes_per_step.append(runtime.counter.bytes("shard", "broadcast"))
    # Owners keep fp32 masters and fp32 states; every pack (what is broadcast and computed
    # with) is bf16; a peer holds nothing between steps, and never an fp32 copy.
    for dp in runtime.params:
        assert dp.precision is not None and dp.precision.compute == BF16
        if dp.is_owner:
            assert dp.full is not None and dp.full.dtype == torch.float32
            assert dp.param.dtype == torch.float32  # outside forward: the master
            assert optimizer.state[dp.param]["momentum_buffer"].dtype == torch.float32
            assert dp.grad is None or dp.grad.dtype == torch.float32
        if dp.role is Role.PEER:
            assert dp.full is None and dp.param.untyped_storage().size() == 0
            assert dp.param.dtype == BF16
    assert all(pack.buffer.dtype == BF16 for group in runtime.groups for pack in group.packs)
    return losses, bytes_per_step


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("world_size", "reshard", "rtol"), [(1, True, 1e-4), (4, True, 2e-2), (2, False, 2e-2)]
)
def test_fsdp2_mixed_precision_matches_a_bf16_compute_reference(world_size, reshard, rtol):
    results = run_distributed(_mixed, world_size, reshard)
    losses = results[0][0]
    names = [n for n, p in build(0).named_parameters() if muon_predicate(n, p)]
    ref = reference_mixed(names, STEPS)
    for step, (got, want) in enumerate(zip(losses, ref)):
        assert abs(got - want) <= rtol * abs(want), f"step {step}: {got} vs {want}"
    assert losses[-1] < losses[0]
    # bf16 on the wire: half of fp32's bytes, one element per broadcast round.
    rounds = 2 if reshard else 1
    expected = 0 if world_size == 1 else rounds * muon_numel(build(0)) * 2
    assert all(b == expected for r in results for b in r[1]), results[0][1]


MICRO = 4


def _accumulation_wrap(world_size: int, path: str) -> tuple[nn.Module, Any]:
    """bf16 compute, fp32 reduce: FSDP2's policy (``"z3"``, ``"z2"``), or on the replicated
    path (``"ddp"``) ``param_policy``'s for every weight of the layers."""
    model = build(0)
    mesh = init_device_mesh("cpu", (world_size,))
    if path == "ddp":
        policy = _layer_policy("float32")
        runtime = dedicate_params_ddp(
            model, mesh, _in_layers, small_param_threshold=0, param_policy=policy
        )
        replicate(model, mesh)
        return model, runtime
    reshard = path == "z3"
    runtime = dedicate_params(
        model, mesh, muon_predicate, reshard_after_forward=reshard, small_param_threshold=0
    )
    dedicated = dedicated_params_of(model)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=MP, ignored_params=dedicated)
    fully_shard(model, mesh=mesh, mp_policy=MP, ignored_params=dedicated)
    return model, runtime


def _summed_locally(model: nn.Module, runtime: Any, micro: list[torch.Tensor]) -> dict:
    """Each micro-batch's local gradients (one backward under ``no_sync`` each, then dropped),
    summed in fp32 one after the other, summed over the ranks and averaged: the order dmuon's
    accumulation and reduce take."""
    local: dict[str, list[torch.Tensor]] = {dp.fqn: [] for dp in runtime.params}
    for tokens in micro:
        with no_sync(model):
            lm_loss(model, tokens).backward()
        for dp in runtime.params:
            local[dp.fqn].append(dp.param.grad.clone())
        model.zero_grad()
    summed = {}
    for dp in runtime.params:  # the same order on every rank
        total = local[dp.fqn][0].float()
        for grad in local[dp.fqn][1:]:
            total += grad
        dist.all_reduce(total)
        summed[dp.fqn] = total / dist.get_world_size()
    return summed


def _accumulated(
    model: nn.Module, runtime: Any, micro: list[torch.Tensor], unsynced: bool
) -> tuple[dict, dict]:
    """The owners' gradients and FSDP2's (whole) after a backward per micro-batch, each but
    the last under ``no_sync`` where ``unsynced``."""
    model.zero_grad()
    for k, tokens in enumerate(micro):
        inside = unsynced and k < len(micro) - 1
        with no_sync(model) if inside else nullcontext():
            lm_loss(model, tokens).backward()
        if inside:  # the local sum, kept in the reduce dtype on every rank
            assert all(dp.param.grad.dtype == torch.float32 for dp in runtime.params)
    runtime.wait_all_reduces()
    assert all(dp.param.grad is None for dp in runtime.params)  # it left with the reduce
    owned = {dp.fqn: dp.grad.clone() for dp in runtime.owned}
    fsdp = {
        n: p.grad.full_tensor() for n, p in model.named_parameters() if isinstance(p.grad, DTensor)
    }
    return owned, fsdp


def _accumulation(rank: int, world_size: int) -> None:
    """``MICRO`` micro-batches, each but the last under ``no_sync``, against (a) the local
    micro-batch gradients summed in fp32 (``_summed_locally``): equal bit for bit whatever the
    values; (b) ``MICRO`` synced backwards, each reduced: equal bit for bit here because the
    bf16 gradients' sums are exact in fp32, as FSDP2's own gradients (the yardstick) show."""
    micro = [shard(make_batch(100 + k, ROWS, SEQ, VOCAB), rank, world_size) for k in range(MICRO)]
    for path in ("z3", "z2", "ddp"):
        model, runtime = _accumulation_wrap(world_size, path)
        synced, fsdp_synced = _accumulated(model, runtime, micro, unsynced=False)
        accumulated, fsdp_accumulated = _accumulated(model, runtime, micro, unsynced=True)
        # Last: FSDP2 keeps what a backward under no_sync accumulated through zero_grad.
        summed = _summed_locally(model, runtime, micro)
        assert accumulated
        for name, grad in accumulated.items():
            assert torch.equal(grad, summed[name]), (path, name)
            assert torch.equal(grad, synced[name]), (path, name)
        assert bool(fsdp_synced) == (path != "ddp"), path
        for name, grad in fsdp_accumulated.items():
            assert torch.equal(grad, fsdp_synced[name]), (path, name)


@pytest.mark.distributed
def test_no_sync_accumulates_dedicated_gradients_in_the_reduce_dtype() -> None:
    """bf16 compute, fp32 reduce: the dedicated gradients of micro-batches under ``no_sync``
    add up in fp32, as FSDP2 accumulates its own in its ``reduce_dtype`` (they used to add up
    in bf16 in ``.grad``: 1.5e-3 to 1.9e-3 away from the fp32 sums)."""
    run_distributed(_accumulation, 2)


def _pipeline_stage(dedicated: bool, reshard: bool) -> tuple[nn.Module, Any]:
    """This rank's stage (two bf16 linear layers, fp32 reduce) of a (pp 2, dp 2) mesh, its
    matrices dedicated or FSDP2's, and a 1F1B schedule of ``MICRO`` micro-batches over it."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = mesh["pp"].get_local_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(4)))[2 * stage : 2 * stage + 2]
    if dedicated:
        dedicate_params(
            model,
            mesh["dp"],
            lambda n, p: p.ndim == 2,
            hook_boundary_predicate=lambda m: isinstance(m, nn.Linear),
            pipeline_mesh=mesh["pp"],
            reshard_after_forward=reshard,
            small_param_threshold=0,
        )
    for layer in model:
        fully_shard(layer, mesh=mesh["dp"], mp_policy=MP, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh["dp"], mp_policy=MP, reshard_after_forward=reshard)
    pipe = PipelineStage(model, stage, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(
        pipe, n_microbatches=MICRO, loss_fn=lambda out, y: F.mse_loss(out.float(), y)
    )
    return model, schedule


def _pipeline_accumulation(rank: int, world_size: int) -> None:
    """A pipeline schedule's micro-batches add up in fp32 and its division by their number
    reaches the sum once: the owners' gradients equal FSDP2's of the same matrices bit for bit
    (powers of two divide exactly)."""
    gen = torch.Generator().manual_seed(7)
    x, y = torch.randn(16, 16, generator=gen), torch.randn(16, 16, generator=gen)
    index = rank % 2  # in the data-parallel group
    rows = slice(8 * index, 8 * index + 8)
    for reshard in (False, True):
        grads = []
        for dedicated in (False, True):
            model, schedule = _pipeline_stage(dedicated, reshard)
            if rank < 2:
                schedule.step(x[rows])
            else:
                schedule.step(target=y[rows])
            if dedicated:
                runtime = get_runtime(model)
                runtime.wait_all_reduces()
                grads.append({dp.fqn: dp.grad for dp in runtime.owned})
            else:
                named = model.named_parameters()
                grads.append({n: p.grad.full_tensor() for n, p in named if p.ndim == 2})
        fsdp, owned = grads
        assert owned
        for name, grad in owned.items():
            assert torch.equal(grad, fsdp[name]), (reshard, name)


@pytest.mark.distributed
def test_a_pipeline_schedule_accumulates_dedicated_gradients_in_the_reduce_dtype() -> None:
    """bf16 compute, fp32 reduce under a 1F1B schedule on (pp 2, dp 2): the dedicated
    gradients equal FSDP2's of the same matrices (they used to add up, and be divided by the
    schedule, in bf16: 1.7e-3 to 3.2e-3 away)."""
    run_distributed(_pipeline_accumulation, 4)


def _autocast(rank: int, world_size: int, reshard: bool):
    """Training under ``torch.autocast`` (bf16), the habit of many scripts and of Hugging
    Face's ``bf16=True``: the model stays fp32 and autocast casts per op."""
    model = build(0)
    mesh = init_device_mesh("cpu", (world_size,))
    runtime = dedicate_params(model, mesh, muon_predicate, reshard_after_forward=reshard)
    shard_layers_then_root(model, mesh)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    losses = []
    for step in range(4):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=BF16):
            loss = lm_loss(model, shard(make_batch(step, ROWS, SEQ, VOCAB), rank, world_size))
        loss.backward()
        optimizer.step()
        losses.append(_global(loss, world_size))
    for dp in runtime.params:
        if dp.is_owner:
            assert dp.param.dtype == torch.float32  # autocast casts a copy per op
            assert optimizer.state[dp.param]["momentum_buffer"].dtype == torch.float32
    return losses, get_model_state_dict(model)


@pytest.mark.distributed
def test_autocast_trains_like_an_autocast_reference_and_z2_equals_z3() -> None:
    z3 = run_distributed(_autocast, 2, True)
    z2 = run_distributed(_autocast, 2, False)
    for got, want in zip(z2, z3, strict=True):
        assert got[0] == want[0]
        for name, value in want[1].items():
            assert torch.equal(got[1][name], value), name
            assert value.dtype == torch.float32, name
    names = [n for n, p in build(0).named_parameters() if muon_predicate(n, p)]
    master = build(0)
    optimizer = ReferenceMuonAdamW(master, names, HYPER)
    ref = []
    for step in range(4):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=BF16):
            loss = lm_loss(master, make_batch(step, ROWS, SEQ, VOCAB))
        loss.backward()
        optimizer.step()
        ref.append(float(loss.detach()))
    # The same first loss; then bf16 rounding of two half-batch backwards against one (about
    # 2e-4 of the loss in four steps).
    assert z3[0][0][0] == ref[0]
    for step, (got, want) in enumerate(zip(z3[0][0], ref)):
        assert abs(got - want) <= 1e-3 * abs(want), f"step {step}: {got} vs {want}"
    assert ref[-1] < ref[0]


def _policy_head(rank: int, world_size: int):
    # A bf16 backbone (FSDP2's policy on the layers) with an fp32 head: the root has no
    # policy, and param_policy pins the dedicated head to fp32 explicitly.
    model = build(0)
    mesh = init_device_mesh("cpu", (world_size,))
    runtime = dedicate_params(
        model,
        mesh,
        lambda n, p: p.ndim == 2 and ("proj" in n or n == "lm_head.weight"),
        hook_boundary_strict=False,
        small_param_threshold=0,
        param_policy={
            "overrides": [
                {
                    "name": ["lm_head"],
                    "set": {"param_dtype": "float32", "cast_forward_inputs": False},
                }
            ]
        },
    )
    dedicated = dedicated_params_of(model)
    # A fully_shard of its own inside a bf16 layer computes one MLP matrix in fp32: FSDP2
    # casts that module's inputs to fp32, and dmuon's copy of its weight follows.
    down = model.layers[0].mlp.down_proj
    fully_shard(down, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
    for layer in model.layers:
        fully_shard(
            layer,
            mesh=mesh,
            mp_policy=MixedPrecisionPolicy(param_dtype=BF16),
            ignored_params=dedicated,
        )
    fully_shard(model, mesh=mesh, ignored_params=dedicated)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = lm_loss(model, shard(make_batch(step, ROWS, SEQ, VOCAB), rank, world_size))
        loss.backward()
        optimizer.step()
        losses.append(_global(loss, world_size))
    head = next(dp for dp in runtime.params if dp.fqn == "lm_head.weight")
    assert head.precision is not None and head.precision.compute == torch.float32
    proj = next(dp for dp in runtime.params if "proj" in dp.fqn)
    assert proj.precision is not None and proj.precision.compute == BF16
    down = next(dp for dp in runtime.params if dp.fqn == "layers.0.mlp.down_proj.weight")
    assert down.precision is not None and down.precision.compute == torch.float32
    return losses, [dp.fqn for dp in runtime.params]


@pytest.mark.distributed
def test_per_parameter_dtypes_bf16_backbone_fp32_head() -> None:
    losses, names = run_distributed(_policy_head, 2)[0]
    layers = tuple(f"layers.{i}" for i in range(2))
    ref = reference_mixed(names, STEPS, compute_modules=layers)
    for step, (got, want) in enumerate(zip(losses, ref)):
        assert abs(got - want) <= 2e-2 * abs(want), f"step {step}: {got} vs {want}"


# -- per-parameter dtypes with AdamW-route dedicated weights, sharded and replicated --------------

LAYERS = ("layers.0", "layers.1")


def _in_layers(name: str, param: nn.Parameter) -> bool:
    return name.startswith("layers.")


def _layer_policy(grad_dtype: str | None) -> dict:
    """Every weight of the layers computes in bf16 from an fp32 master; the attention
    projections take the Muon route, the MLP and the norms AdamW."""
    defaults = {"param_dtype": "bfloat16", "master_dtype": "float32"}
    if grad_dtype is not None:
        defaults["grad_dtype"] = grad_dtype
    return {
        "defaults": defaults,
        "overrides": [{"name": ["mlp", "attn_norm", "mlp_norm"], "set": {"route": "adamw"}}],
    }


def _policy_run(rank: int, world_size: int, replicated: bool, grad_dtype: str | None, skip: bool):
    model = build(0)
    mesh = init_device_mesh("cpu", (world_size,))
    policy = _layer_policy(grad_dtype)
    if replicated:
        runtime = dedicate_params_ddp(
            model, mesh, _in_layers, small_param_threshold=0, param_policy=policy
        )
        replicate(model, mesh)
    else:
        runtime = dedicate_params(
            model, mesh, _in_layers, small_param_threshold=0, param_policy=policy
        )
        dedicated = dedicated_params_of(model)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, ignored_params=dedicated)
        fully_shard(model, mesh=mesh, ignored_params=dedicated)
    optimizer = Muon(model, **HYPER.muon_kwargs(), options=StepOptions(skip_nonfinite=skip))
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = lm_loss(model, shard(make_batch(step, ROWS, SEQ, VOCAB), rank, world_size))
        loss.backward()
        optimizer.step()
        losses.append(_global(loss, world_size))
    # fp32 masters and fp32 states on the owners, whatever the route; the gradient kept in
    # the reduce dtype until the step upcasts it.
    reduce = getattr(torch, grad_dtype) if grad_dtype else BF16
    owned_routes = set()
    for dp in runtime.params:
        assert dp.precision == (torch.float32, BF16, reduce, torch.float32), dp.fqn
        if dp.is_owner:
            owned_routes.add(dp.route.value)
            assert dp.full is not None and dp.full.dtype == torch.float32
            state = optimizer.state[dp.param]
            assert state and all(
                v.dtype == torch.float32 for k, v in state.items() if k != "step"
            ), dp.fqn
    assert owned_routes == {"muon", "adamw"}, owned_routes
    if replicated:
        # Every rank computes with the bf16 copy of the owner's master.
        masters = get_model_state_dict(model)
        for name, value in model.state_dict().items():
            if name.startswith("layers."):
                assert value.dtype == BF16, name
                assert torch.equal(value, masters[name].to(BF16)), name
        # model.load_state_dict writes the owners' fp32 masters, not only the bf16 copies.
        loaded = build(123)
        dedicate_params_ddp(loaded, mesh, _in_layers, small_param_threshold=0, param_policy=policy)
        replicate(loaded, mesh)
        loaded.load_state_dict(masters)
        assert all(torch.equal(v, masters[k]) for k, v in get_model_state_dict(loaded).items())
    return losses


def _policy_dtypes(rank: int, world_size: int, replicated: bool):
    return [
        _policy_run(rank, world_size, replicated, grad_dtype, skip)
        for grad_dtype, skip in ((None, True), ("float32", False))
    ]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("replicated", "world_size"),
    # One rank of the replicated path publishes nothing, but the owner's bf16 compute copy
    # must still be cast from its new fp32 master after each step (it used to keep the
    # initial weights: every forward ran the step-0 model while the masters trained).
    [(False, 2), (True, 2), (True, 1)],
    ids=["fsdp2", "ddp", "ddp-one-rank"],
)
def test_adamw_route_bf16_compute_fp32_master_matches_a_bf16_compute_reference(
    replicated, world_size
):
    # bf16 and fp32 reduce dtypes (the AdamW step upcasts a bf16 gradient to its fp32 master),
    # with torch's fused AdamW (the non-finite check) and without it.
    runs = run_distributed(_policy_dtypes, world_size, replicated)[0]
    plain = build(0)
    names = [n for n, p in plain.named_parameters() if ".attn." in n and "proj" in n]
    ref = reference_mixed(names, STEPS, compute_modules=LAYERS)
    for losses in runs:
        # Measured: within 2e-4 of the bf16 reference (an fp32 reference is 3e-4 away).
        for step, (got, want) in enumerate(zip(losses, ref)):
            assert abs(got - want) <= 1e-3 * abs(want), f"step {step}: {got} vs {want}"
        assert losses[-1] < losses[0]


# -- meta-device models --------------------------------------------------------------------------


def _on_meta(world_size: int, reshard: bool) -> nn.Module:
    with torch.device("meta"):
        model = build(0)
    mesh = init_device_mesh("cpu", (world_size,))
    dedicate_params(model, mesh, muon_predicate, reshard_after_forward=reshard)
    shard_layers_then_root(model, mesh)
    model.to_empty(device="cpu")
    return model


def _train(model, rank, world_size, steps=4):
    optimizer = Muon(model, **HYPER.muon_kwargs())
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = lm_loss(model, shard(make_batch(step, ROWS, SEQ, VOCAB), rank, world_size))
        loss.backward()
        optimizer.step()
        losses.append(_global(loss, world_size))
    return losses, get_model_state_dict(model), get_optimizer_state_dict(model, optimizer)


def _meta_load(rank: int, world_size: int, reshard: bool):
    normal = build(0)
    mesh = init_device_mesh("cpu", (world_size,))
    dedicate_params(normal, mesh, muon_predicate, reshard_after_forward=reshard)
    shard_layers_then_root(normal, mesh)
    want = _train(normal, rank, world_size)

    meta = _on_meta(world_size, reshard)
    set_model_state_dict(meta, build(0).state_dict())
    got = _train(meta, rank, world_size)
    same = got[0] == want[0] and all(torch.equal(got[1][k], v) for k, v in want[1].items())
    return same, got[0]


@pytest.mark.distributed
@pytest.mark.parametrize("reshard", [True, False], ids=["z3", "z2"])
def test_meta_model_loaded_with_set_model_state_dict_trains_bit_for_bit(reshard: bool) -> None:
    results = run_distributed(_meta_load, 2, reshard)
    assert all(same for same, _ in results)


def init_weights(model: nn.Module) -> None:
    """A model's own initialisation: the projections first, from one generator state, then
    the rest (what FSDP2's sharded parameters draw does not depend on the projections)."""
    torch.manual_seed(1234)
    named = list(model.named_parameters())
    with torch.no_grad():
        for name, p in named:
            if "proj" in name:
                nn.init.normal_(p, std=0.02)
        for name, p in named:
            if "proj" not in name:
                nn.init.normal_(p, std=0.02) if p.ndim == 2 else nn.init.ones_(p)


def init_weights_reading_back(model: nn.Module) -> None:
    """An initialisation in torchtitan's style, which reads back what it wrote: torch's
    ``trunc_normal_`` (a rejection sampler: it redraws the values outside its bounds, so how
    much it draws depends on them) with bounds tight enough to redraw, and a weight assembled
    from ``new_empty`` pieces and copied in (torchtitan's fused q/k/v)."""
    torch.manual_seed(4321)
    named = list(model.named_parameters())
    with torch.no_grad():
        for name, p in named:
            if "up_proj" in name:
                halves = [p.new_empty(p.shape[0] // 2, *p.shape[1:]) for _ in range(2)]
                for half in halves:
                    nn.init.trunc_normal_(half, std=0.02, a=-0.03, b=0.03)
                p.copy_(torch.cat(halves))
            elif "proj" in name:
                nn.init.trunc_normal_(p, std=0.02, a=-0.03, b=0.03)
        for name, p in named:
            if "proj" not in name:
                nn.init.normal_(p, std=0.02) if p.ndim == 2 else nn.init.ones_(p)


INITS = (init_weights, init_weights_reading_back)


def _meta_init(rank: int, world_size: int):
    results = []
    for init in INITS:
        meta = _on_meta(world_size, True)
        init(meta)  # before packing: a peer's writes run on scratch tensors it drops
        optimizer = Muon(meta, **HYPER.muon_kwargs())  # packs: each weight kept on its owner
        state = {k: v for k, v in get_model_state_dict(meta).items() if "proj" in k}
        optimizer.zero_grad()
        loss = lm_loss(meta, shard(make_batch(0, ROWS, SEQ, VOCAB), rank, world_size))
        loss.backward()
        optimizer.step()
        results.append((state, _global(loss, world_size)))
    return results


@pytest.mark.distributed
def test_init_weights_on_a_meta_model_initialises_dedicated_weights_as_a_normal_model() -> None:
    # The documented result (note "meta-device models"): a model's own initialisation run on
    # every rank gives the dedicated weights the values it gives a normally built model with
    # the same generator state (a peer draws on scratch tensors, so the generators advance as
    # on the owner, also where the draws depend on the values), and packing keeps the owners'.
    # It holds up to the first draw into an FSDP2 shard (a DTensor draws otherwise): INITS
    # draw the dedicated projections first.
    results = run_distributed(_meta_init, 2)
    for i, init in enumerate(INITS):
        plain = build(0)
        init(plain)
        want = {k: v for k, v in plain.state_dict().items() if "proj" in k}
        for rank_results in results:
            state, loss = rank_results[i]
            assert state.keys() == want.keys()
            assert all(torch.equal(state[k], v) for k, v in want.items()), init.__name__
            assert loss == loss and loss > 0  # the model trains after packing


class _ScaledLayer(nn.Module):
    """A layer with a keyword input; it records the dtypes its forward sees."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)
        self.seen: tuple[torch.dtype, torch.dtype] | None = None

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        self.seen = (x.dtype, scale.dtype)
        return self.proj(x) * scale


def _dtypes_a_layer_sees(rank: int, world_size: int) -> list[tuple[torch.dtype, torch.dtype]]:
    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleList(_ScaledLayer() for _ in range(2))
    mesh = init_device_mesh("cpu", (world_size,))
    policy = {"overrides": [{"name": ["proj"], "set": {"param_dtype": "bfloat16"}}]}
    dedicate_params(
        model, mesh, lambda n, p: "proj" in n, small_param_threshold=0, param_policy=policy
    )
    x = torch.randn(4, 8)
    for layer in model.layers:
        x = layer(x, scale=torch.full((8,), 0.5))
    return [layer.seen for layer in model.layers]


@pytest.mark.distributed
def test_keyword_inputs_are_cast_as_positional_ones() -> None:
    """A boundary whose weights compute in bf16 gets its floating inputs cast to bf16, keyword
    ones too, as FSDP2's ``cast_forward_inputs`` casts both."""
    for seen in run_distributed(_dtypes_a_layer_sees, 2):
        assert seen == [(torch.bfloat16, torch.bfloat16)] * 2
