"""A meta-device model holds each dedicated weight only where it is kept: ``to_empty``,
packing and loading (from a checkpoint, or from a dictionary on rank 0 alone) never give a
peer a weight it does not keep (see [Note: meta-device models] and [Note: loading from rank
0]), and ``init_dedicated_`` gives the same values at every world size."""

from __future__ import annotations

import gc
import hashlib
import math
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from _models import (
    TinyLlama,
    batch,
    build,
    loss_fn,
    muon_predicate,
    shard_layers_then_root,
    tensor_parallel,
)
from _sgd_train import setup_model
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

from dmuon_fsdp import (
    Muon,
    Role,
    dedicate_params,
    dedicate_params_ddp,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_runtime,
    init_dedicated_,
    load_checkpoint,
    replicate,
    save_checkpoint,
    set_model_state_dict,
)
from dmuon_fsdp.holder import is_dedicated
from dmuon_testing.distributed import run_distributed

DIM, HIDDEN = 64, 192  # dedicated weights 64x the rest, so a copy of them shows
SEED = 7


def _tiny() -> TinyLlama:
    torch.manual_seed(0)
    return TinyLlama(n_layers=8, dim=DIM, hidden=HIDDEN)


@contextmanager
def _held() -> Iterator[list[int]]:
    """``[peak]`` once the block is done: the most bytes of CPU tensors allocated inside the
    block and not freed yet, at any moment of it (see [Note: measuring what a rank holds]).

    [Note: measuring what a rank holds]
    What a call costs a rank is the peak of what it holds during the call: what it keeps
    afterwards misses the scratch copies freed before the end, and the resident set size adds
    what the C allocator keeps of freed memory (glibc keeps freed heap chunks: a rank whose RSS
    grew by 1.45x the dedicated weights over a load held 1.19x in live allocations) and counts
    ``to_empty``'s pages only once they are written. The profiler reports every allocation and
    free of torch's CPU allocator on this thread, where the weights, the optimizer states, the
    scratch copies and the tensors DCP deserialises live. A collective's buffer can be freed on
    gloo's worker thread, which the profiler does not see; its address coming back in a later
    allocation shows that it was freed, so allocations are matched by address. Python objects
    are not counted: DCP's plans (about a megabyte, whatever the model) and the bytes of the one
    chunk being read."""
    gc.collect()
    out = [0]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield out
    events: list[tuple[int, int, int]] = []
    nodes = list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children)
        if node.name == "[memory]":
            fields = node.extra_fields
            events.append((node.start_time_ns, fields.alloc_size, fields.ptr))
    live: dict[int, int] = {}
    held = 0
    for _, nbytes, ptr in sorted(events, key=lambda e: e[0]):
        # A free of what the block did not allocate is left out: never below the start.
        held -= live.pop(ptr, 0)
        if nbytes > 0:
            live[ptr] = nbytes
            held += nbytes
        out[0] = max(out[0], held)


def _on_meta(world_size: int) -> tuple[nn.Module, int]:
    """The model on meta, dedicated and sharded; and its dedicated weights' bytes."""
    with torch.device("meta"):
        model = _tiny()
    mesh = init_device_mesh("cpu", (world_size,))
    runtime = dedicate_params(model, mesh, muon_predicate)
    shard_layers_then_root(model, mesh)
    total = sum(math.prod(dp.shape) * dp.dtype.itemsize for dp in runtime.params)
    return model, total


def _normal(name: str, weight: Tensor, generator: torch.Generator) -> None:
    weight.normal_(0.0, 0.02, generator=generator)


def _dedicated_state(model: nn.Module) -> dict[str, Tensor]:
    return {k: v for k, v in get_model_state_dict(model).items() if "proj" in k}


def _equal_optimizer(got: dict, want: dict) -> bool:
    return got["param_groups"] == want["param_groups"] and all(
        got["state"][fqn].keys() == entry.keys()
        and all(torch.equal(got["state"][fqn][k], v) for k, v in entry.items())
        for fqn, entry in want["state"].items()
    )


def _load_and_init(rank: int, world_size: int, path: str):
    # A normal run, one step in (so that the momentum is not zero), saves the checkpoint.
    saved = _tiny()
    mesh = init_device_mesh("cpu", (world_size,))
    dedicate_params(saved, mesh, muon_predicate)
    shard_layers_then_root(saved, mesh)
    optimizer = Muon(saved)
    loss_fn(saved, batch(0, 2)).backward()
    optimizer.step()
    save_checkpoint(path, saved, optimizer)
    want = get_model_state_dict(saved), get_optimizer_state_dict(saved, optimizer)
    del saved, optimizer

    # The scale guide's route, from the meta device to the loaded checkpoint.
    growth = {}
    model, total = _on_meta(world_size)
    with _held() as held:
        model.to_empty(device="cpu")
        optimizer = Muon(model)
        load_checkpoint(path, model, optimizer)
    growth["load_checkpoint"] = held[0] / total
    loaded = _equal(get_model_state_dict(model), want[0]) and _equal_optimizer(
        get_optimizer_state_dict(model, optimizer), want[1]
    )
    del model, optimizer

    model, total = _on_meta(world_size)
    with _held() as held:
        model.to_empty(device="cpu")
        init_dedicated_(model, _normal, seed=SEED)
    growth["init_dedicated_"] = held[0] / total
    return growth, loaded, _dedicated_state(model)


def _init_only(rank: int, world_size: int):
    model, _ = _on_meta(world_size)
    model.to_empty(device="cpu")
    init_dedicated_(model, _normal, seed=SEED)
    return _dedicated_state(model)


@pytest.mark.distributed
def test_meta_model_holds_dedicated_weights_only_where_kept(tmp_path) -> None:
    results = run_distributed(_load_and_init, 4, str(tmp_path / "ckpt"))
    for growth, loaded, _ in results:
        # The most a rank holds at once (see [Note: measuring what a rank holds]), in units of
        # all the dedicated weights; one rank holding every weight would be >= 1.0. Loading:
        # its owned quarter, the copy the all-or-nothing read puts beside it and the momentum
        # it reads (3/4), its FSDP2 share and one chunk in flight (measured 0.78; with a
        # scratch copy of the momentum too and DCP's own reader, 1.04). Initialising: its
        # quarter and, while packing, one pack (one of its two layers: 0.38).
        assert growth["load_checkpoint"] <= 0.85, growth
        assert growth["init_dedicated_"] <= 0.5, growth
        assert loaded
    inits = [state for *_, state in results]
    inits += run_distributed(_init_only, 1) + run_distributed(_init_only, 2)
    assert all(state.keys() == inits[0].keys() for state in inits)
    assert all(torch.equal(state[k], v) for state in inits for k, v in inits[0].items())
    # Each weight from its own name and the seed, independently of the runtime.
    for fqn, value in inits[0].items():
        digest = hashlib.sha256(f"{SEED}:{fqn}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        assert torch.equal(value, torch.empty(value.shape).normal_(0.0, 0.02, generator=g))


def _tied_from_meta(rank: int, world_size: int) -> dict[str, bool]:
    """An embedding tied to the head, dedicated on the meta device: ``to_empty`` keeps the
    two names on one parameter (as FSDP2 keeps its own tied parameters), which holds no
    storage on a peer, and the model trains as the same model built normally, bit for bit."""
    mesh = init_device_mesh("cpu", (world_size,))

    def every_matrix(name: str, param: Tensor) -> bool:
        return param.ndim == 2

    normal = build(0, tie=True)
    start = {k: v.clone() for k, v in normal.state_dict().items()}
    dedicate_params(normal, mesh, every_matrix)
    shard_layers_then_root(normal, mesh)
    with torch.device("meta"):
        model = build(0, tie=True)
    runtime = dedicate_params(model, mesh, every_matrix)
    shard_layers_then_root(model, mesh)
    model.to_empty(device="cpu")
    (embedding,) = (dp for dp in runtime.params if dp.fqn == "embed_tokens.weight")
    weight = model.embed_tokens.weight
    result = {
        "tied": model.lm_head.weight is weight,
        "storage where kept": (weight.untyped_storage().nbytes() > 0)
        == (embedding.role is not Role.PEER),
    }
    set_model_state_dict(model, start)
    trained = []
    for m in (normal, model):
        optimizer = Muon(m, lr=0.05)
        for step in range(2):
            optimizer.zero_grad()
            loss_fn(m, batch(step, 4).chunk(world_size)[rank]).backward()
            optimizer.step()
        trained.append(get_model_state_dict(m))
    result["still tied"] = model.lm_head.weight is model.embed_tokens.weight
    result["trains as built normally"] = _equal(trained[1], trained[0])
    # Gathered once from its owner (one broadcast per dedicated weight), given under both keys
    # as two tensors, as a dictionary of separate tensors holds them.
    with mock.patch.object(dist, "broadcast", wraps=dist.broadcast) as spy:
        full = get_model_state_dict(model)
    result["each weight gathered once"] = spy.call_count == len(runtime.params)
    result["both keys, apart"] = _equal(full, trained[1]) and (
        full["lm_head.weight"] is not full["embed_tokens.weight"]
    )

    # Tied and left to FSDP2 (muon_predicate takes neither name): rank 0 broadcasts each
    # tensor once, not once per key (the embedding went twice, the largest tensor of a model).
    with torch.device("meta"):
        fsdp_tied = build(0, tie=True)
    dedicate_params(fsdp_tied, mesh, muon_predicate)
    shard_layers_then_root(fsdp_tied, mesh)
    fsdp_tied.to_empty(device="cpu")
    broadcast = {
        id(t) for t in fsdp_tied.state_dict(keep_vars=True).values() if not is_dedicated(t)
    }
    with mock.patch.object(dist, "broadcast", wraps=dist.broadcast) as spy:
        set_model_state_dict(fsdp_tied, start if rank == 0 else {}, broadcast_from_rank0=True)
    result["each tensor broadcast once"] = spy.call_count == len(broadcast)
    result["loaded"] = _equal(get_model_state_dict(fsdp_tied), start)
    return result


@pytest.mark.distributed
def test_a_tied_dedicated_weight_stays_tied_through_to_empty() -> None:
    for result in run_distributed(_tied_from_meta, 2):
        assert all(result.values()), str(result)


# -- set_model_state_dict(..., broadcast_from_rank0=True) -----------------------------------------


def _equal(got: dict[str, Tensor], want: dict[str, Tensor]) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())


def _holders_have(runtime, want: dict[str, Tensor]) -> bool:
    """Every rank that keeps a dedicated weight (owner, HSDP replica, or any rank on the
    replicated path) holds ``want``'s values; a sharded path's peers hold no storage."""
    for dp in runtime.params:
        kept = dp.role is not Role.PEER or runtime.config.replicated
        if not kept:
            if dp.tensor.untyped_storage().nbytes() != 0:
                return False
        elif not torch.equal(dp.tensor, dp.local_part(want[dp.fqn])):
            return False
    return True


def _bad_dicts(want: dict[str, Tensor], proj: str, live: Tensor) -> dict[str, tuple[object, str]]:
    """Rank 0's bad dictionaries and the error each must raise, with values unlike the model's
    so that a partial write would show."""
    other = {k: v + 1.0 for k, v in want.items()}
    norm = "layers.0.attn_norm.weight"
    return {
        "missing": ({k: v for k, v in other.items() if k != proj}, f"missing key.*{proj}"),
        "shape": ({**other, proj: torch.zeros(2, 2)}, f"{proj}.*shape \\(2, 2\\)"),
        "shape_fsdp": ({**other, norm: torch.zeros(3)}, f"{norm}.*shape \\(3,\\)"),
        "dtype": ({**other, norm: other[norm].double()}, f"{norm}.*torch.float64"),
        "not_a_mapping": ([1, 2], "state_dict must be a mapping"),
        # What torch's set_model_state_dict(..., broadcast_from_rank0=True) leaves in rank 0's
        # dictionary after dmuon refused it: the model's own FSDP2 parameters.
        "dtensor": ({**other, norm: live}, f"{norm}.*is a DTensor"),
    }


def _rank0_load(rank: int, world_size: int):
    out: dict[str, object] = {}
    # 1-D, Z3, built on meta: rank 0 reads the dictionary before the measure, so what every
    # rank holds at the peak is what the route itself gives it.
    sd = _tiny().state_dict() if rank == 0 else {}
    model, total = _on_meta(world_size)
    with _held() as held:
        model.to_empty(device="cpu")
        optimizer = Muon(model)
        set_model_state_dict(model, sd, broadcast_from_rank0=True)
    out["growth"] = held[0] / total
    del sd
    want = _tiny().state_dict()
    runtime = get_runtime(model)
    out["flat"] = _equal(get_model_state_dict(model), want) and _holders_have(runtime, want)

    # A bad dictionary on rank 0 raises its error on every rank and writes nothing; what the
    # other ranks pass is ignored.
    proj = runtime.params[0].fqn
    errors = {}
    live = model.layers[0].attn_norm.weight
    for label, (bad, match) in _bad_dicts(want, proj, live).items():
        with pytest.raises(ValueError, match=match) as info:
            set_model_state_dict(model, bad if rank == 0 else None, broadcast_from_rank0=True)  # type: ignore[arg-type]
        errors[label] = str(info.value)
    out["errors"] = errors
    out["unchanged"] = _equal(get_model_state_dict(model), want) and _holders_have(runtime, want)
    with pytest.raises(TypeError, match="broadcast_from_rank0 must be a bool"):
        set_model_state_dict(model, {}, broadcast_from_rank0=1)  # type: ignore[arg-type]
    del model, optimizer

    # HSDP 2 x 2 with Z2: the peers' copies of the first forward are dropped, the replicas get
    # the owners' bytes, and the next forward matches a twin loaded the every-rank way.
    want = build(0).state_dict()
    tokens = batch(0, 2)
    hsdp, runtime = setup_model(world_size, replicate=2, reshard=False, seed=5)
    Muon(hsdp)
    with torch.no_grad():
        loss_fn(hsdp, tokens)  # Z2 keeps the seed-5 weights on the peers
    set_model_state_dict(hsdp, want if rank == 0 else {}, broadcast_from_rank0=True)
    loaded = _equal(get_model_state_dict(hsdp), want) and _holders_have(runtime, want)
    twin, _ = setup_model(world_size, replicate=2, reshard=False, seed=6)
    set_model_state_dict(twin, want)
    with torch.no_grad():
        out["hsdp"] = loaded and torch.equal(loss_fn(hsdp, tokens), loss_fn(twin, tokens))
    del hsdp, twin

    # Tensor parallelism on a 2 x 2 (dp, tp) mesh, built on meta: each TP owner gets its shard.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        tp = build(0)
    tensor_parallel(tp, mesh["tp"])
    runtime = dedicate_params(tp, mesh["dp"], muon_predicate, small_param_threshold=0)
    shard_layers_then_root(tp, mesh["dp"])
    tp.to_empty(device="cpu")
    Muon(tp)
    set_model_state_dict(tp, want if rank == 0 else {}, broadcast_from_rank0=True)
    out["tp"] = _equal(get_model_state_dict(tp), want) and _holders_have(runtime, want)
    del tp

    # The replicated (DDP) path: the owners' masters are loaded and published to every rank.
    ddp = build(rank + 3)
    ddp_mesh = init_device_mesh("cpu", (world_size,))
    runtime = dedicate_params_ddp(ddp, ddp_mesh, muon_predicate, small_param_threshold=0)
    replicate(ddp, ddp_mesh)
    set_model_state_dict(ddp, want if rank == 0 else {}, broadcast_from_rank0=True)
    out["ddp"] = (
        _equal(get_model_state_dict(ddp), want)
        and _equal(ddp.state_dict(), want)
        and _holders_have(runtime, want)
    )
    return out


@pytest.mark.distributed
def test_set_model_state_dict_from_rank0_loads_bit_for_bit_into_owners_only() -> None:
    results = run_distributed(_rank0_load, 4)
    for rank, out in enumerate(results):
        # The owned quarter of the dedicated weights and, while packing, one pack (measured
        # 0.38 on every rank, rank 0's dictionary excluded); a rank that kept every weight it
        # passed on, or a copy of the dictionary, would hold 1.0 or more.
        assert out["growth"] <= 0.5, (rank, out["growth"])
        assert out["flat"] and out["unchanged"], rank
        assert out["hsdp"] and out["tp"] and out["ddp"], (rank, out)
        # Every rank raised rank 0's error, word for word, the others naming rank 0.
        for label, text in results[0]["errors"].items():
            want = text if rank == 0 else f"{text} [set_model_state_dict failed on rank(s) [0];"
            assert out["errors"][label].startswith(want), (rank, label)


def _rank0_load_nccl(rank: int, world_size: int, init_file: str) -> None:
    """The rank-0 load on CUDA with NCCL, where the allocator's peak shows what a rank held
    at any moment of the load, not only what it kept."""
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=120),
        device_id=torch.device("cuda", rank),
    )
    try:
        want = _tiny().state_dict()  # on the CPU, as a Hugging Face file is read
        with torch.device("meta"):
            model = _tiny()
        mesh = init_device_mesh("cuda", (world_size,))
        runtime = dedicate_params(model, mesh, muon_predicate)
        shard_layers_then_root(model, mesh)
        model.to_empty(device="cuda")
        Muon(model)
        dedicated = {dp.fqn for dp in runtime.params}
        largest = max(v.nbytes for k, v in want.items() if k not in dedicated)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        set_model_state_dict(model, want if rank == 0 else {}, broadcast_from_rank0=True)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        got = get_model_state_dict(model)
        assert _equal(got, want), rank
        assert _holders_have(runtime, {k: v.cuda() for k, v in want.items()}), rank
        if rank != 0:
            # One broadcast full tensor and its shard (plus the verdict's few bytes); a
            # received copy of an MLP weight this rank does not own (48 KiB) would not fit.
            assert peak <= 2 * largest + 2048, (rank, peak, largest)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_set_model_state_dict_from_rank0_on_nccl_peaks_at_one_full_tensor() -> None:
    world_size = min(torch.cuda.device_count(), 4)
    if world_size < 2:
        pytest.skip("needs two CUDA devices")
    import torch.multiprocessing as mp

    tests_dir = os.path.dirname(__file__)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [
            tests_dir,
            os.path.join(tests_dir, "..", "..", "..", "testing"),
            *os.environ.get("PYTHONPATH", "").split(os.pathsep),
        ]
    )
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank0_load_nccl, args=(world_size, os.path.join(tmp, "init")), nprocs=world_size)
