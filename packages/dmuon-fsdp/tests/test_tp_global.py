"""Tensor parallelism across every rank: the clip norm of the Muon gradients and the non-finite
skip are global quantities (each element counted once, one decision for the step on every
rank), distributed Gram NS is right for every shard direction and aspect ratio, and mesh
dimensions of one rank behave as if absent. Each is held to an independent reference: the
full-batch gradients of a single-process model, float64 NS of the gathered matrix, the
single-process model trained with the same math."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from _models import build, muon_predicate, shard_layers_then_root, tensor_parallel
from _reference import Hyper, lm_loss, make_batch, shard, train_reference
from test_safety import _same, _snapshot
from test_tp import _train
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from dmuon_fsdp import (
    Muon,
    StepOptions,
    dedicate_params,
    dedicate_params_ddp,
    get_model_state_dict,
    replicate,
)
from dmuon_fsdp.holder._tp_ns import TensorParallelNS, TPMode, choose, gram_of_shards
from dmuon_fsdp.topology._comm import Axis, CommCounter, CommKind
from dmuon_ns import NewtonSchulz
from dmuon_ns.testing import reference_newton_schulz, relative_error
from dmuon_testing.distributed import run_distributed

HYPER = Hyper()
STEPS = 8
ROWS, SEQ, VOCAB = 8, 8, 32
# A whole (not tensor-parallel) Muon matrix: every TP grid keeps one copy of it.
HEAD = "lm_head.weight"
TOPOLOGIES = ("tp", "hsdp_tp", "ddp_tp")
NS = NewtonSchulz(backend="gram", steps=HYPER.ns_steps)
SHAPES = {"square": (32, 32), "wide": (16, 48), "tall": (48, 16)}
SHARD_DIMS = {"colwise_shard0": 0, "rowwise_shard1": 1}


def _with_head(name: str, p: torch.Tensor) -> bool:
    return muon_predicate(name, p) or name == HEAD


def _build(topology: str, *, predicate=muon_predicate, hidden: int = 24):
    """The tiny model with TP degree 2 on 4 ranks: (dp 2, tp 2) under FSDP2 ("tp"),
    (replicate 2, shard 1, tp 2) under HSDP ("hsdp_tp"), or (dp 2, tp 2) on the replicated path
    ("ddp_tp"). Returns the model, its runtime and this rank's data-parallel index (of 2)."""
    model = build(0, hidden=hidden)
    strict = predicate is muon_predicate  # the head has no layer boundary: the root hooks it
    options = {"small_param_threshold": 0, "hook_boundary_strict": strict}
    if topology in ("hsdp_tp", "hsdp_tp_2x2x2"):
        shards = 2 if topology == "hsdp_tp_2x2x2" else 1
        mesh = init_device_mesh("cpu", (2, shards, 2), mesh_dim_names=("replicate", "shard", "tp"))
        tensor_parallel(model, mesh["tp"])
        runtime = dedicate_params(
            model, mesh["shard"], predicate, replicate_mesh=mesh["replicate"], **options
        )
        shard_layers_then_root(model, mesh["replicate", "shard"])
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tensor_parallel(model, mesh["tp"])
        if topology == "ddp_tp":
            runtime = dedicate_params_ddp(model, mesh["dp"], predicate, **options)
            replicate(model, mesh["dp"])
        else:
            runtime = dedicate_params(model, mesh["dp"], predicate, **options)
            shard_layers_then_root(model, mesh["dp"])
    coord = runtime.coord
    return model, runtime, coord.replicate * runtime.layout.shard_size + coord.shard


def _backward(model, optimizer, runtime, dp_index: int, step: int) -> None:
    optimizer.zero_grad()
    dp_size = runtime.layout.world_size  # the data-parallel ranks of one TP grid
    lm_loss(model, shard(make_batch(step, ROWS, SEQ, VOCAB), dp_index, dp_size)).backward()
    runtime.wait_all_reduces()  # the owners' gradients are final


def _skipped_and_unchanged(model, optimizer) -> tuple[bool, bool]:
    before = _snapshot(model, optimizer)
    optimizer.step()
    return bool(optimizer.last_step_stats.skipped), _same(_snapshot(model, optimizer), before)


def _global_quantities(model, runtime, dp_index: int) -> dict:
    optimizer = Muon(model, **HYPER.muon_kwargs())
    _backward(model, optimizer, runtime, dp_index, 0)
    clip = optimizer.muon_grads_for_clip()
    squares = torch.zeros((), dtype=torch.float64)
    for g in clip.grads:
        squares += g.double().square().sum()
    dist.all_reduce(squares, group=clip.process_group)
    grads = {dp.fqn: dp.grad.clone() for dp in runtime.owned if dp.route == "muon"}
    copies = sorted(dp.fqn for dp in runtime.owned if any(c is dp.grad for c in clip.copies))
    optimizer.step()

    # An infinity in one TP shard's gradient, on its owner in TP grid 1 only.
    _backward(model, optimizer, runtime, dp_index, 1)
    target = next(dp for dp in runtime.params if dp.tp_dim is not None)  # same on every rank
    if dist.get_rank() == runtime.layout.tp_ranks(target.owner)[1]:
        target.grad[0, 0] = math.inf
    tp_shard = _skipped_and_unchanged(model, optimizer)

    # A NaN in one rank's local gradient of an FSDP2-sharded (or replicated) AdamW parameter.
    _backward(model, optimizer, runtime, dp_index, 2)
    grad = model.norm.weight.grad
    if dist.get_rank() == 1:
        (grad.to_local() if isinstance(grad, DTensor) else grad)[0] = math.nan
    adamw_shard = _skipped_and_unchanged(model, optimizer)

    _backward(model, optimizer, runtime, dp_index, 3)
    optimizer.step()
    stats = optimizer.last_step_stats
    weights = get_model_state_dict(model)
    return {
        "norm": math.sqrt(float(squares)),
        "grads": grads,
        "tp_dims": {dp.fqn: dp.tp_dim for dp in runtime.owned},
        "tp_index": runtime.layout.tp_index,
        "copies": copies,
        "sharded": clip.sharded,
        "tp_shard": tp_shard,
        "adamw_shard": adamw_shard,
        "after": (bool(stats.skipped), int(stats.skipped_steps)),
        "finite": all(bool(torch.isfinite(t).all()) for t in weights.values()),
    }


def _gram_on_world(rank: int, world_size: int) -> dict:
    """Distributed Gram NS through ``TensorParallelNS`` on real process groups: every rank of
    the world holds one shard of each test matrix."""
    out = {}
    for name, shape in SHAPES.items():
        full = _matrix(shape)
        for direction, tp_dim in SHARD_DIMS.items():
            counter = CommCounter()
            tp_ns = TensorParallelNS(
                NS,
                shape=shape,
                tp_dim=tp_dim,
                mode=TPMode.GRAM,
                group=dist.group.WORLD,
                tp_owner=0,
                counter=counter,
            )
            local = full.chunk(world_size, dim=tp_dim)[rank]
            out[(name, direction)] = (
                tp_ns(local.unsqueeze(0))[0],
                counter.bytes(Axis.TP, CommKind.ALL_REDUCE),
            )
    return out


def _global_checks(rank: int, world_size: int) -> dict:
    out: dict = {"gram": _gram_on_world(rank, world_size)}
    for topology in TOPOLOGIES:
        model, runtime, dp_index = _build(topology, predicate=_with_head)
        out[topology] = _global_quantities(model, runtime, dp_index)
    return out


@pytest.fixture(scope="module")
def global_checks() -> list[dict]:
    return run_distributed(_global_checks, 4)


def _reference_grads() -> dict[str, torch.Tensor]:
    """The full-batch gradients of step 0 in one process (the mean over the global batch,
    which the data-parallel ranks split)."""
    model = build(0)
    lm_loss(model, make_batch(0, ROWS, SEQ, VOCAB)).backward()
    return {n: p.grad.double() for n, p in model.named_parameters() if _with_head(n, p)}


@pytest.mark.distributed
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_clip_norm_counts_every_element_of_every_muon_matrix_once(global_checks, topology):
    reference = _reference_grads()
    want = math.sqrt(sum(float(g.square().sum()) for g in reference.values()))
    held: dict[str, list[int]] = {}
    for r in global_checks:
        got = r[topology]
        # Summed over the optimizer's group, each rank's counted gradients make the true norm.
        assert got["norm"] == pytest.approx(want, rel=1e-5), (got["norm"], want)
        assert got["sharded"]
        for fqn, grad in got["grads"].items():
            tp_dim = got["tp_dims"][fqn]
            full = reference[fqn]
            if tp_dim is not None:
                size = grad.shape[tp_dim]
                full = full.narrow(tp_dim, got["tp_index"] * size, size)
            torch.testing.assert_close(grad.double(), full, rtol=1e-5, atol=1e-7)
            held.setdefault(fqn, []).append(got["tp_index"])
        # The head is whole on its owner in both TP grids; grid 1 hands it over as a copy.
        assert got["copies"] == ([HEAD] if got["tp_index"] == 1 and HEAD in got["grads"] else [])
    # Every Muon matrix is held by exactly one owner per TP grid (its shard, or the whole head).
    assert {fqn: sorted(t) for fqn, t in held.items()} == {fqn: [0, 1] for fqn in reference}


@pytest.mark.distributed
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_a_nonfinite_gradient_on_one_rank_skips_the_step_on_every_rank(global_checks, topology):
    for r in global_checks:
        got = r[topology]
        assert got["tp_shard"] == (True, True), "an inf in one TP shard: skipped, unchanged"
        assert got["adamw_shard"] == (True, True), "a NaN in one AdamW shard: skipped, unchanged"
        assert got["after"] == (False, 2), "the next finite step runs"
        assert got["finite"]


def _three_d(rank: int, world_size: int) -> dict:
    model, runtime, dp_index = _build("hsdp_tp_2x2x2", predicate=_with_head)
    return _global_quantities(model, runtime, dp_index)


@pytest.mark.distributed
def test_three_d_mesh_2x2x2_clips_and_skips_as_one_process() -> None:
    """(replicate 2, shard 2, tp 2) on 8 ranks: the true norm on every rank, and one rank's
    non-finite gradient skips the step everywhere."""
    reference = _reference_grads()
    want = math.sqrt(sum(float(g.square().sum()) for g in reference.values()))
    for got in run_distributed(_three_d, 8):
        assert got["norm"] == pytest.approx(want, rel=1e-5), (got["norm"], want)
        for fqn, grad in got["grads"].items():
            tp_dim, full = got["tp_dims"][fqn], reference[fqn]
            if tp_dim is not None:
                size = grad.shape[tp_dim]
                full = full.narrow(tp_dim, got["tp_index"] * size, size)
            torch.testing.assert_close(grad.double(), full, rtol=1e-5, atol=1e-7)
        assert got["tp_shard"] == (True, True) and got["adamw_shard"] == (True, True)
        assert got["after"] == (False, 2) and got["finite"]


@pytest.mark.distributed
def test_distributed_gram_ns_over_real_process_groups(global_checks):
    for (name, direction), _ in global_checks[0]["gram"].items():
        shape, tp_dim = SHAPES[name], SHARD_DIMS[direction]
        got = torch.cat([r["gram"][(name, direction)][0] for r in global_checks], dim=tp_dim)
        want = reference_newton_schulz(_matrix(shape), steps=HYPER.ns_steps)
        one_block = gram_of_shards(_matrix(shape), tp_dim, lambda t: None, NS)
        err = relative_error(got, want)
        assert err <= 2 * relative_error(one_block, want) and err < 5e-4, (name, direction, err)
        # Each all-reduce carries the Gram matrix of the dimension the shards do not split.
        side = shape[1 - tp_dim]
        calls = 1 + len(NS.restarts)
        assert global_checks[0]["gram"][(name, direction)][1] == calls * side * side * 4


# -- distributed Gram NS of TP shards, simulated in one process ----------------------------------


def _matrix(shape: tuple[int, int]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))


@pytest.mark.parametrize("direction", SHARD_DIMS)
@pytest.mark.parametrize("aspect", SHAPES)
def test_gram_ns_of_tp_shards_matches_float64_ns_of_the_gathered_matrix(aspect, direction):
    shape, tp_dim, ranks = SHAPES[aspect], SHARD_DIMS[direction], 4
    full = _matrix(shape)
    # The T ranks' shards as one batch; the all-reduce sums over it in place, as
    # dist.all_reduce sums over the TP group, and hands every "rank" the sum.
    shards = torch.stack(full.chunk(ranks, dim=tp_dim))
    reduced = []

    def all_reduce(t: torch.Tensor) -> None:
        reduced.append(tuple(t.shape))
        t.copy_(t.sum(0, keepdim=True).expand_as(t))

    got = torch.cat(gram_of_shards(shards, tp_dim, all_reduce, NS).unbind(0), dim=tp_dim)
    want = reference_newton_schulz(full, steps=HYPER.ns_steps)
    # The same form with one rank holding the whole matrix: the error of the iteration itself.
    one_block = gram_of_shards(full, tp_dim, lambda t: None, NS)
    err = relative_error(got, want)
    assert err <= 2 * relative_error(one_block, want) and err < 5e-4, err
    side = shape[1 - tp_dim]
    assert reduced == [(ranks, side, side)] * (1 + len(NS.restarts))


def test_gram_is_chosen_only_where_the_shards_split_the_long_side() -> None:
    gram, gather, auto = TPMode.GRAM, TPMode.GATHER, TPMode.AUTO
    # (shape, tp_dim, T): (tp_ns="gram", tp_ns="auto") with a Gram NewtonSchulz, fp32 inputs
    expected = {
        ((32, 32), 0, 2): (gram, gather),  # square: either side; auto gathers (no saving)
        ((32, 32), 1, 2): (gram, gather),
        ((16, 96), 1, 2): (gram, gram),  # wide, column shards: the long side
        ((16, 96), 0, 2): (gather, gather),  # wide, row shards: the short side
        ((96, 16), 0, 2): (gram, gram),  # tall, row shards: the long side
        ((96, 16), 1, 2): (gather, gather),  # tall, column shards: the short side
        # The long side split, but gathering 16 x 48 moves 384 bytes a rank, two fp32 16 x 16
        # all-reduces 2048.
        ((16, 48), 1, 2): (gram, gather),
        # 16 x 96 saves 1024 bytes at T = 2; at T = 4 each rank's share of the gather
        # shrinks, and the all-reduces do not: gram pays only from 16 x 192 there.
        ((16, 96), 1, 4): (gram, gather),
        ((16, 192), 1, 4): (gram, gram),
    }
    for (shape, tp_dim, tp), (as_gram, as_auto) in expected.items():
        case = (shape, tp_dim, tp)
        assert choose(gram, shape, tp_dim, NS, tp, 4) is as_gram, case
        assert choose(auto, shape, tp_dim, NS, tp, 4) is as_auto, case
        assert choose(gather, shape, tp_dim, NS, tp, 4) is gather
        # Distributed Gram NS is a Gram iteration: any other NS gathers.
        direct = NewtonSchulz(backend="direct", steps=HYPER.ns_steps)
        assert choose(gram, shape, tp_dim, direct, tp, 4) is gather
    # bf16 momentum halves what gathering moves: 16 x 96 at T = 2 gathers then.
    assert choose(auto, (16, 96), 1, NS, 2, 2) is gather


# -- every tp_ns mode trains like the single-process reference ----------------------------------

WIDE_MLP = 96  # gate/up 96x16 (row shards), down 16x96 (column shards): auto takes gram there


def _ns_modes(rank: int, world_size: int, modes: tuple[str, ...]) -> dict:
    out = {}
    for mode in modes:
        model, runtime, dp_index = _build("tp", hidden=WIDE_MLP)
        optimizer = Muon(model, **HYPER.muon_kwargs(), options=StepOptions(tp_ns=mode))
        runtime.counter.reset()
        losses = _train(model, optimizer, dp_index, 2, STEPS)
        counts = runtime.counter.snapshot()
        weights = get_model_state_dict(model)
        out[mode] = (losses, set(counts), weights if rank == 0 else None)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize(
    "modes",
    [
        # 'auto' runs distributed Gram NS (the MLP) and the gather (attention) in one model.
        pytest.param(("auto",), id="auto"),
        # Extended: each mode forced on every matrix. Their parts run in CI: 'auto' above,
        # Gram NS of every aspect and shard direction against float64 NS (the two Gram tests
        # above), and each mode trained against the reference (test_tp's 2-D test).
        pytest.param(("gram", "gather"), id="gram-gather", marks=pytest.mark.extended),
    ],
)
def test_every_tp_ns_mode_trains_like_the_reference(modes: tuple[str, ...]) -> None:
    results = run_distributed(_ns_modes, 4, modes)
    plain = build(0, hidden=WIDE_MLP)
    names = [n for n, p in plain.named_parameters() if muon_predicate(n, p)]
    ref = train_reference(plain, names, HYPER, STEPS, ROWS, SEQ, VOCAB)
    for mode, (losses, kinds, weights) in results[0].items():
        for step, (got, want) in enumerate(zip(losses, ref)):
            assert abs(got - want) <= 2e-3 * abs(want), f"{mode} step {step}: {got} vs {want}"
        # The loss of a tiny model hides a wrong NS output; the weights do not.
        for name, p in plain.named_parameters():
            err = relative_error(weights[name], p.detach())
            assert err < 1e-4, f"{mode}: {name} is {err:.1e} away from the reference"
        used = {k for k in kinds if k in ("tp/all_reduce", "tp/gather")}
        assert (
            used
            == {
                "gram": {"tp/all_reduce"},
                "gather": {"tp/gather"},
                "auto": {"tp/all_reduce", "tp/gather"},  # gram for the MLP, gather for attention
            }[mode]
        ), (mode, kinds)


# -- mesh dimensions of one rank -----------------------------------------------------------------


def _degree_one(rank: int, world_size: int) -> dict:
    out = {}
    # torchtitan's mesh with TP off: ('dp', 'tp') with tp = 1, the model parallelized on it.
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "tp"))
    model = build(0)
    tensor_parallel(model, mesh["tp"])
    runtime = dedicate_params(model, mesh["dp"], muon_predicate, small_param_threshold=0)
    shard_layers_then_root(model, mesh["dp"])
    losses = _train(model, Muon(model, **HYPER.muon_kwargs()), rank, world_size, STEPS)
    dtensors = all(isinstance(dp.param, DTensor) for dp in runtime.params)
    as_1d = runtime.layout.tp_size == 1 and all(dp.tp_dim is None for dp in runtime.params)
    out["tp"] = (losses, dtensors and as_1d and runtime.comm_ctx.tp_group is None)
    tp_weights = get_model_state_dict(model)

    # HSDP with one replica.
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard"))
    model = build(0)
    runtime = dedicate_params(
        model, mesh["shard"], muon_predicate, replicate_mesh=mesh["replicate"]
    )
    shard_layers_then_root(model, mesh)
    losses = _train(model, Muon(model, **HYPER.muon_kwargs()), rank, world_size, STEPS)
    out["replicate"] = (losses, not runtime.layout.is_hsdp)

    # The 1-D run the two should be.
    mesh = init_device_mesh("cpu", (world_size,))
    model = build(0)
    dedicate_params(model, mesh, muon_predicate, small_param_threshold=0)
    shard_layers_then_root(model, mesh)
    out["flat"] = _train(model, Muon(model, **HYPER.muon_kwargs()), rank, world_size, STEPS)
    flat_weights = get_model_state_dict(model)
    out["same_weights"] = all(torch.equal(tp_weights[k], v) for k, v in flat_weights.items())
    return out


@pytest.mark.distributed
def test_mesh_dimensions_of_one_rank_behave_as_if_absent() -> None:
    results = run_distributed(_degree_one, 2)
    plain = build(0)
    names = [n for n, p in plain.named_parameters() if muon_predicate(n, p)]
    ref = train_reference(plain, names, HYPER, STEPS, ROWS, SEQ, VOCAB)
    for r in results:
        for dim in ("tp", "replicate"):
            losses, absent = r[dim]
            assert absent, f"the {dim} dimension of one rank is still in the layout"
            assert losses == r["flat"], f"{dim}: {losses} vs the 1-D run {r['flat']}"
            for step, (got, want) in enumerate(zip(losses, ref)):
                assert abs(got - want) <= 2e-3 * abs(want), f"{dim} step {step}: {got} vs {want}"
        assert r["same_weights"], "TP degree 1 trained other weights than the 1-D run"
