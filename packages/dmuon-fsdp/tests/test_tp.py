"""Tensor parallelism: dedicated TP shards on 2-D (dp, tp) and 3-D (replicate, shard, tp) meshes
against the single-process reference, NS counted, bytes per axis, and checkpoints (full-state and
DCP) across TP degrees."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
from _models import build, muon_numel, muon_predicate, shard_layers_then_root, tensor_parallel
from _reference import Hyper, lm_loss, make_batch, shard, train_reference
from test_training import CountingNS
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.utils import parameters_to_vector

from dmuon_fsdp import (
    EMA,
    Muon,
    NotHeldError,
    Role,
    StepOptions,
    dedicate_params,
    get_model_state_dict,
    get_optimizer_state_dict,
    load_checkpoint,
    save_checkpoint,
    set_model_state_dict,
    set_optimizer_state_dict,
    summarize_param_groups,
)
from dmuon_testing.distributed import run_distributed

HYPER = Hyper()
STEPS = 8
ROWS, SEQ, VOCAB = 8, 8, 32


def _tp_model(shape: tuple[int, ...], *, reshard: bool = True):
    """The tiny model with tensor parallelism of degree shape[-1] and dmuon + FSDP2 on the
    rest of the mesh: (dp, tp), or (replicate, shard, tp)."""
    names = ("dp", "tp") if len(shape) == 2 else ("replicate", "shard", "tp")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = build(0)
    tensor_parallel(model, mesh["tp"])
    if len(shape) == 2:
        dp_mesh, replicate_mesh = mesh["dp"], None
        fsdp_mesh = mesh["dp"]
    else:
        dp_mesh, replicate_mesh = mesh["shard"], mesh["replicate"]
        fsdp_mesh = mesh["replicate", "shard"]
    runtime = dedicate_params(
        model,
        dp_mesh,
        muon_predicate,
        replicate_mesh=replicate_mesh,
        reshard_after_forward=reshard,
        small_param_threshold=0,
    )
    shard_layers_then_root(model, fsdp_mesh)
    # The data-parallel index of this rank: which rows of the global batch it trains on.
    dp_index = runtime.layout.coord.replicate * runtime.layout.shard_size + runtime.coord.shard
    return model, runtime, dp_index


def _train(model, optimizer, dp_index, dp_size, steps, start=0):
    losses = []
    for step in range(start, start + steps):
        optimizer.zero_grad()
        loss = lm_loss(model, shard(make_batch(step, ROWS, SEQ, VOCAB), dp_index, dp_size))
        loss.backward()
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    return losses


class ScatterWatch(CountingNS):
    """Counts the matrices, and notes the TP scatter bytes issued so far at each call."""

    def __init__(self, steps: int) -> None:
        super().__init__(steps)
        self.counter = None
        self.seen: list[int] = []

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        if self.counter is not None:
            self.seen.append(self.counter.snapshot().get("tp/scatter", {"bytes": 0})["bytes"])
        return super().__call__(batch)


def _two_d(rank: int, world_size: int, tp_ns: str):
    out = {}
    # (reshard, NS batch cap): gather mode also runs one TP matrix at a time (a 1-byte cap).
    runs = [(True, None), (False, None)] + ([(True, 1)] if tp_ns == "gather" else [])
    for reshard, cap in runs:
        model, runtime, dp_index = _tp_model((2, 2), reshard=reshard)
        counting = ScatterWatch(HYPER.ns_steps)
        counting.counter = runtime.counter
        kwargs = {k: v for k, v in HYPER.muon_kwargs().items() if k != "ns_steps"}
        if tp_ns == "gram":
            counting = None
            kwargs["ns_steps"] = HYPER.ns_steps
        options = StepOptions(tp_ns=tp_ns, **({} if cap is None else {"ns_batch_bytes": cap}))
        optimizer = Muon(model, **kwargs, ns_backend=counting or "gram", options=options)
        runtime.counter.reset()
        losses = _train(model, optimizer, dp_index, 2, STEPS)
        counts = runtime.counter.snapshot()
        seen = counting.seen if counting else None
        weights = get_model_state_dict(model)
        out[reshard if cap is None else "alone"] = (losses, seen, counts, weights)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("tp_ns", ["gather", "gram"])
def test_two_d_tensor_parallel_matches_the_reference(tp_ns: str) -> None:
    results = run_distributed(_two_d, 4, tp_ns)
    z3, z2 = results[0][True], results[0][False]
    assert z3[0] == z2[0], "Z2 and Z3 differ"
    plain = build(0)
    names = [n for n, p in plain.named_parameters() if muon_predicate(n, p)]
    ref = train_reference(plain, names, HYPER, STEPS, ROWS, SEQ, VOCAB)
    for step, (got, want) in enumerate(zip(z3[0], ref)):
        assert abs(got - want) <= 2e-3 * abs(want), f"step {step}: {got} vs {want}"
    p_m = muon_numel(build(0)) * 4
    for r in results:
        for reshard, (_, _, counts, _) in r.items():
            # Each grid moves its ranks' TP shards: P_M / TP per round.
            rounds = 1 if reshard is False else 2
            assert counts["shard/broadcast"]["bytes"] == STEPS * rounds * p_m // 2
    if tp_ns == "gather":
        # NS runs once per matrix per step in the whole world, on the matrix's TP owner.
        n_matrices = len(names)
        for reshard in (True, False):
            assert sum(len(r[reshard][1]) for r in results) == n_matrices * STEPS
        # Each TP owner runs its matrices' NS before any of the step's scatters is issued (a
        # multiple of one step's scatter bytes), so the group's owners compute side by side;
        # one matrix at a time, an owner's second NS came after the first one's scatter. The
        # same bits either way.
        for r in results:
            per_step = r[True][2]["tp/scatter"]["bytes"] // STEPS
            assert per_step and all(seen % per_step == 0 for seen in r[True][1])
            assert r["alone"][0] == r[True][0]
            alone, windowed = r["alone"][3], r[True][3]
            assert all(torch.equal(alone[k], v) for k, v in windowed.items())
        assert any(seen % per_step for r in results for seen in r["alone"][1])
        # Per grid and step, the gathers (and the scatters) carry every matrix once: P_M,
        # recorded by each of the TP ranks that take part (T = 2 grids).
        for reshard in (True, False):
            for kind in ("tp/gather", "tp/scatter"):
                total = sum(r[reshard][2].get(kind, {"bytes": 0})["bytes"] for r in results)
                assert total == 2 * STEPS * p_m, (kind, total)


def _three_d(rank: int, world_size: int):
    out = {}
    for async_ in (True, False):
        model, _, dp_index = _tp_model((2, 2, 2))
        optimizer = Muon(model, **HYPER.muon_kwargs(), options=StepOptions(replicate_async=async_))
        out[async_] = _train(model, optimizer, dp_index, 4, STEPS)
    return out


# Extended: eight ranks on CI's two cores. Its parts run in CI: HSDP (test_hsdp_correctness),
# tensor parallelism (above) and the 3-D mesh's gradients and skip (test_tp_global).
@pytest.mark.extended
@pytest.mark.distributed
def test_three_d_hsdp_with_tensor_parallelism_matches_the_reference() -> None:
    results = run_distributed(_three_d, 8)
    assert results[0][True] == results[0][False], "async and sync publish differ"
    plain = build(0)
    names = [n for n, p in plain.named_parameters() if muon_predicate(n, p)]
    ref = train_reference(plain, names, HYPER, STEPS, ROWS, SEQ, VOCAB)
    for step, (got, want) in enumerate(zip(results[0][True], ref)):
        assert abs(got - want) <= 2e-3 * abs(want), f"step {step}: {got} vs {want}"


def _resume_and_change_degree(rank: int, world_size: int, root: str):
    split = STEPS // 2
    model, _, dp_index = _tp_model((2, 2))
    optimizer = Muon(model, **HYPER.muon_kwargs())
    uninterrupted = _train(model, optimizer, dp_index, 2, STEPS)

    model, _, dp_index = _tp_model((2, 2))
    optimizer = Muon(model, **HYPER.muon_kwargs())
    first = _train(model, optimizer, dp_index, 2, split)
    model_sd = get_model_state_dict(model)
    optim_sd = get_optimizer_state_dict(model, optimizer)
    save_checkpoint(os.path.join(root, "tp"), model, optimizer)

    def load(fmt: str, target, target_opt) -> None:
        if fmt == "full":
            set_model_state_dict(target, model_sd)
            set_optimizer_state_dict(target, target_opt, optim_sd)
        else:
            load_checkpoint(os.path.join(root, "tp"), target, target_opt)

    out = {}
    for fmt in ("full", "dcp"):
        resumed, _, dp_index = _tp_model((2, 2))
        resumed_opt = Muon(resumed, **HYPER.muon_kwargs())
        load(fmt, resumed, resumed_opt)
        same = _equal(get_model_state_dict(resumed), model_sd)
        second = _train(resumed, resumed_opt, dp_index, 2, STEPS - split, start=split)

        # The (2, 2) checkpoint on a 1-D mesh of 4 without tensor parallelism.
        mesh = init_device_mesh("cpu", (world_size,))
        flat = build(5)
        dedicate_params(flat, mesh, muon_predicate)
        shard_layers_then_root(flat, mesh)
        flat_opt = Muon(flat, **HYPER.muon_kwargs())
        load(fmt, flat, flat_opt)
        loaded = _equal(get_model_state_dict(flat), model_sd)
        if fmt == "dcp":
            # And back: the 1-D checkpoint into tensor parallelism (2, 2).
            save_checkpoint(os.path.join(root, "flat"), flat, flat_opt)
            again, _, _ = _tp_model((2, 2))
            again_opt = Muon(again, **HYPER.muon_kwargs())
            load_checkpoint(os.path.join(root, "flat"), again, again_opt)
            loaded = loaded and _equal(get_model_state_dict(again), model_sd)
            loaded = loaded and _equal_state(get_optimizer_state_dict(again, again_opt), optim_sd)
        continued = _train(flat, flat_opt, rank, world_size, STEPS - split, start=split)
        out[fmt] = (first + second, same and loaded, uninterrupted[:split] + continued)
    return uninterrupted, out


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _equal_state(a: dict, b: dict) -> bool:
    return a["state"].keys() == b["state"].keys() and all(
        _equal(a["state"][k], b["state"][k]) for k in a["state"]
    )


@pytest.mark.distributed
def test_tensor_parallel_checkpoints_resume_bit_for_bit_and_load_without_tp(tmp_path) -> None:
    results = run_distributed(_resume_and_change_degree, 4, str(tmp_path))
    uninterrupted, by_format = results[0]
    for fmt, (resumed, _, on_flat) in by_format.items():
        assert resumed == uninterrupted, f"{fmt}: the resumed TP run differs from the uninterrupted"
        assert all(r[1][fmt][1] for r in results), f"{fmt}: a loaded state differs from the saved"
        # On another topology the reduction order differs: the same trajectory within rounding.
        for got, want in zip(on_flat, uninterrupted):
            assert abs(got - want) <= 1e-4 * abs(want), (fmt, on_flat, uninterrupted)


def _ddp_tp(rank: int, world_size: int):
    from dmuon_fsdp import dedicate_params_ddp, replicate

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = build(0)
    tensor_parallel(model, mesh["tp"])
    runtime = dedicate_params_ddp(model, mesh["dp"], muon_predicate, small_param_threshold=0)
    # The TP dimension, as many ranks as mesh['dp'] but others: refused (it was taken and
    # ignored), and the refusal changes nothing (the run below matches the reference).
    with pytest.raises(
        ValueError,
        match=r"replicate\(\): the mesh holds ranks \(\d, \d\) but dedicate_params_ddp's grid "
        r"holds ranks \(\d, \d\); pass the same mesh .*mesh\['dp'\], not mesh\['tp'\]",
    ):
        replicate(model, mesh["tp"])
    replicate(model, mesh["dp"])
    optimizer = Muon(model, **HYPER.muon_kwargs())
    return _train(model, optimizer, runtime.coord.shard, 2, STEPS)


def _tp_peer_reads(rank: int, world_size: int) -> list[str]:
    model, runtime, dp_index = _tp_model((2, 2))
    optimizer = Muon(model, **HYPER.muon_kwargs())
    # Conversions that change nothing go through, on TP peers too; one that would convert a
    # dedicated weight is refused before anything changes.
    model.to("cpu")
    model.float()
    with pytest.raises(ValueError, match="would convert dedicated parameter"):
        model.half()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    _train(model, optimizer, dp_index, 2, 1)
    peer = next(dp for dp in runtime.params if dp.role is Role.PEER)
    owned = next(dp for dp in runtime.params if dp.is_owner)
    # summarize_param_groups counts whole parameters (a dedicated TP matrix too, as an FSDP2
    # one), and this rank's TP shards of the matrices it owns as what it holds.
    whole = dict(build(0).named_parameters())
    groups = summarize_param_groups(model, optimizer)
    for group in groups:
        assert group["numel"] == sum(whole[n].numel() for n in group["params"]), group
        assert group["stepped_numel_here"] == sum(whole[n].numel() for n in group["stepped_here"])
    muon = next(g for g in groups if g["optimizer"] == "muon")
    assert muon["local_numel_here"] == sum(dp.numel for dp in runtime.owned), muon
    p = peer.param
    assert isinstance(p, DTensor) and peer.tp_dim is not None
    refused = []
    reads = {
        "norm": lambda: p.norm(),
        "sum": lambda: p.sum(),
        "data": lambda: p.data.sum(),
        "ema": lambda: torch.zeros(peer.local_shape).lerp_(p.to_local(), 0.1),
        "to_local": lambda: p.to_local(),
        # Collective over the TP mesh: the TP partner at this data-parallel index is a peer
        # too (one plan per grid), so every rank of the TP group refuses alike.
        "full_tensor": lambda: p.full_tensor(),
        "redistribute": lambda: p.redistribute(placements=[Replicate()]),
        "parameters_to_vector": lambda: parameters_to_vector(model.parameters()),
    }
    for label, read in reads.items():
        with pytest.raises(NotHeldError, match=f"{peer.fqn!r}|owner: rank") as caught:
            read()
        assert "dmuon.get_model_state_dict(model)" in str(caught.value)
        refused.append(label)
    text = repr(p)
    assert "not held on this rank" in text and peer.fqn in text, text
    # Metadata stays readable; the owner reads its own shard, and its TP group the whole.
    assert p.shape == peer.shape and p.requires_grad and p.numel() == math.prod(peer.shape)
    assert torch.equal(owned.param.to_local(), owned.full)
    assert owned.param.full_tensor().shape == owned.shape
    full = get_model_state_dict(model)
    assert full[peer.fqn].shape == peer.shape
    # Inside forward the weight is held: training goes on after the refused reads.
    losses = _train(model, optimizer, dp_index, 2, 1, start=1)
    assert all(math.isfinite(x) for x in losses)
    return refused


@pytest.mark.distributed
def test_tensor_parallel_reads_on_a_peer_raise_a_clear_error_and_never_crash() -> None:
    # Before GuardedDTensor these crashed every rank with SIGSEGV (the peer's local shard has
    # no storage between uses).
    for refused in run_distributed(_tp_peer_reads, 4):
        assert refused == [
            "norm",
            "sum",
            "data",
            "ema",
            "to_local",
            "full_tensor",
            "redistribute",
            "parameters_to_vector",
        ]


def _meta_tp(rank: int, world_size: int):
    model, _, dp_index = _tp_model((2, 2))
    want = _train(model, Muon(model, **HYPER.muon_kwargs()), dp_index, 2, 3)
    want_state = get_model_state_dict(model)
    # torchtitan's order: build on meta, parallelize, dedicate, shard, materialise, load.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        meta = build(0)
    tensor_parallel(meta, mesh["tp"])
    runtime = dedicate_params(meta, mesh["dp"], muon_predicate, small_param_threshold=0)
    shard_layers_then_root(meta, mesh["dp"])
    meta.to_empty(device="cpu")
    set_model_state_dict(meta, build(0).state_dict())
    got = _train(meta, Muon(meta, **HYPER.muon_kwargs()), dp_index, 2, 3)
    got_state = get_model_state_dict(meta)
    peer = next(dp for dp in runtime.params if dp.role is Role.PEER)
    with pytest.raises(NotHeldError):  # the materialised parameters are guarded too
        peer.param.norm()
    return got == want and all(torch.equal(got_state[k], v) for k, v in want_state.items())


@pytest.mark.distributed
def test_meta_device_tensor_parallel_model_trains_bit_for_bit() -> None:
    assert all(run_distributed(_meta_tp, 4))


def _tp_compiled(rank: int, world_size: int):
    import torch._dynamo.utils as dynamo_utils

    out = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        dynamo_utils.counters.clear()
        model, _, dp_index = _tp_model((2, 2))
        if compiled:
            for layer in model.layers:
                layer.compile()  # torchtitan's per-block compile, TP inside the block
        optimizer = Muon(model, **HYPER.muon_kwargs())
        losses, graphs = [], []
        for step in range(4):
            losses += _train(model, optimizer, dp_index, 2, 1, start=step)
            graphs.append(dynamo_utils.counters["stats"]["unique_graphs"])
        out[compiled] = (losses, graphs)
    return out


# Extended: compiles under tensor parallelism for half a minute. Its parts run in CI:
# compiled blocks (test_compile) and tensor parallelism (above).
@pytest.mark.extended
@pytest.mark.distributed
def test_compiled_tensor_parallel_blocks_match_eager_and_compile_once() -> None:
    # Needs one pack per TP matrix and a plain DTensor while held (see [Note: reads on a
    # peer] and [Note: packs]); before, dynamo failed to fake the packed local shards.
    for result in run_distributed(_tp_compiled, 4):
        (eager, _), (losses, graphs) = result[False], result[True]
        for got, want in zip(losses, eager):
            assert abs(got - want) <= 1e-4 * abs(want), (losses, eager)
        assert graphs[0] >= 1 and graphs[1] == graphs[-1], f"recompiled after step 2: {graphs}"


@pytest.mark.distributed
def test_ddp_path_with_tensor_parallelism_matches_the_reference() -> None:
    losses = run_distributed(_ddp_tp, 4)[0]
    plain = build(0)
    names = [n for n, p in plain.named_parameters() if muon_predicate(n, p)]
    ref = train_reference(plain, names, HYPER, STEPS, ROWS, SEQ, VOCAB)
    for step, (got, want) in enumerate(zip(losses, ref)):
        assert abs(got - want) <= 2e-3 * abs(want), f"step {step}: {got} vs {want}"


def _ema_tp(rank: int, world_size: int) -> None:
    """The weight EMA with tensor parallelism: kept beside each TP shard where it is stepped."""
    model, _, dp_index = _tp_model((2, 2))
    optimizer = Muon(model, **HYPER.muon_kwargs())
    ema = EMA(optimizer, decay=0.75)
    names = {name for name, _ in model.named_parameters()}

    def weights() -> dict[str, torch.Tensor]:
        return {k: v for k, v in get_model_state_dict(model).items() if k in names}

    reference = {k: v.float() for k, v in weights().items()}
    for step in range(3):
        optimizer.zero_grad()
        loss = lm_loss(model, shard(make_batch(step, ROWS, SEQ, VOCAB), dp_index, 2))
        (loss * float("nan") if step == 1 else loss).backward()  # the second step is skipped
        optimizer.step()
        factor = torch.zeros(()) if step == 1 else torch.tensor(0.25)
        now = weights()
        torch._foreach_lerp_(list(reference.values()), [now[k] for k in reference], factor)
    averaged = ema.state_dict()["weights"]
    assert set(averaged) == set(reference)
    assert all(torch.equal(averaged[k], reference[k].to(averaged[k].dtype)) for k in reference)

    other, _, _ = _tp_model((2, 2))
    set_model_state_dict(other, averaged)
    tokens = shard(make_batch(9, ROWS, SEQ, VOCAB), dp_index, 2)
    before = get_model_state_dict(model)
    with torch.no_grad(), ema.applied():
        loss = lm_loss(model, tokens)
    assert torch.equal(loss, lm_loss(other, tokens).detach())
    after = get_model_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.distributed
def test_the_weight_ema_under_tensor_parallelism_is_the_recurrence_and_applies() -> None:
    run_distributed(_ema_tp, 4)
