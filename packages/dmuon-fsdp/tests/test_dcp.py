"""Sharded DCP checkpoints: a world-4 Z3 checkpoint resumes bit for bit at world size 4 and
loads at world sizes 2 and 1 and as HSDP 2x2 with every optimizer state intact; each rank
writes only what it owns; ``dcp.async_save`` overlaps with training; a damaged checkpoint
raises before anything changes; a plain FSDP2 run's checkpoint and a model without dmuon are
refused, naming the way to the weights.

The world-4 call saves into a temporary directory that the world-2 and world-1 calls read:
one pool per world size, so loading on another topology takes another call.
"""

from __future__ import annotations

import os
import re
import threading
from collections import defaultdict

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _models import batch, build, loss_fn, muon_predicate, shard_layers_then_root
from test_checkpoint import HYPER, _equal
from test_training import setup_model, train_steps
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from dmuon_fsdp import (
    CHECKPOINT_KEY,
    AppState,
    Muon,
    dedicate_params,
    get_model_state_dict,
    get_optimizer_state_dict,
    load_checkpoint,
    save_checkpoint,
    set_model_state_dict,
)
from dmuon_fsdp.checkpoint._state_layout import STATE_FIELDS
from dmuon_testing.distributed import run_distributed

TOTAL, SPLIT = 8, 4
# The saving run places every matrix on its own (owners spread over all four ranks); the loads
# at other topologies use the default plan, which keeps each layer's matrices on one owner.
ALONE = {"small_param_threshold": 0}


def _full_state(model, optimizer):
    """Model and optimizer state through the full-state getters, on rank 0 (``{}`` elsewhere)."""
    return (
        get_model_state_dict(model, rank0_only=True),
        get_optimizer_state_dict(model, optimizer, rank0_only=True),
    )


def _resume(rank: int, world_size: int, root: str, replicate: int = 1, **options):
    """Load the world-4 checkpoint into a fresh model with other weights on this topology:
    whether the full state right after the load equals the saved one (rank 0; True
    elsewhere), and the losses of the remaining steps."""
    model, runtime = setup_model(world_size, replicate=replicate, seed=123, **options)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    owned = {dp.fqn for dp in runtime.owned}
    asked = set(AppState(model, optimizer).state_dict()["model"])
    load_checkpoint(os.path.join(root, "ckpt"), model, optimizer)
    # This rank asked for the full weights of exactly the matrices it owns now, and holds
    # optimizer state for exactly those.
    stepped = {dp.fqn for dp in runtime.params if optimizer.state.get(dp.param)}
    assert {dp.fqn for dp in runtime.params} & asked == owned == stepped, (asked, owned, stepped)
    after = _full_state(model, optimizer)
    same = True
    if rank == 0:
        saved = torch.load(os.path.join(root, "full.pt"), weights_only=True)
        same = _equal(after, saved)
    losses = train_steps(model, optimizer, rank, world_size, TOTAL - SPLIT, start=SPLIT)
    return same, losses


def _share(runtime, model, optimizer) -> int:
    """Elements of the non-scalar tensors this rank holds: owned dedicated weights and their
    states, and its FSDP2 shards with their AdamW moments."""
    dedicated = {id(dp.param) for dp in runtime.params}
    total = 0
    for dp in runtime.owned:
        total += dp.numel * (1 + sum(f != "step" for f in STATE_FIELDS[dp.route]))
    for p in model.parameters():
        if id(p) not in dedicated:
            assert isinstance(p, DTensor)
            total += p.to_local().numel() * 3
    return total


def _save_at_four(rank: int, world_size: int, root: str):
    model, _ = setup_model(world_size, **ALONE)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    uninterrupted = train_steps(model, optimizer, rank, world_size, TOTAL)

    model, runtime = setup_model(world_size, **ALONE)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    train_steps(model, optimizer, rank, world_size, SPLIT)
    save_checkpoint(os.path.join(root, "ckpt"), model, optimizer)
    full = _full_state(model, optimizer)
    if rank == 0:
        torch.save(full, os.path.join(root, "full.pt"))
    owned = [dp.fqn for dp in runtime.owned]
    share = _share(runtime, model, optimizer)
    resumed = _resume(rank, world_size, root, **ALONE)
    hsdp = _resume(rank, world_size, root, replicate=2)
    return uninterrupted, owned, share, resumed, hsdp


@pytest.fixture(scope="module")
def saved_at_four(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    return str(root), run_distributed(_save_at_four, 4, str(root))


@pytest.mark.distributed
def test_world_four_resume_is_bit_exact_and_hsdp_loads(saved_at_four):
    _, results = saved_at_four
    uninterrupted = results[0][0]
    assert all(r[0] == uninterrupted for r in results)
    same, resumed = results[0][3]
    assert same, "the state after load differs from the state saved"
    assert resumed == uninterrupted[SPLIT:], "resume at the same topology must be bit-exact"
    same, hsdp = results[0][4]
    assert same, "HSDP 2x2: the state after load differs from the state saved"
    for step, (got, want) in enumerate(zip(hsdp, uninterrupted[SPLIT:]), start=SPLIT):
        assert abs(got - want) <= 1e-4 * abs(want), f"HSDP step {step}: {got} vs {want}"


@pytest.mark.distributed
def test_each_rank_writes_only_what_it_holds(saved_at_four):
    root, results = saved_at_four
    owner = {fqn: rank for rank, r in enumerate(results) for fqn in r[1]}
    metadata = FileSystemReader(os.path.join(root, "ckpt")).read_metadata()
    prefix = f"{CHECKPOINT_KEY}."
    written: dict[int, int] = defaultdict(int)
    dedicated_keys = 0
    for index, info in metadata.storage_data.items():
        md = metadata.state_dict_metadata[index.fqn]
        if not hasattr(md, "chunks"):
            continue  # the param groups: one small pickled value
        writer = int(info.relative_path.split("_")[2])
        (sizes,) = [c.sizes for c in md.chunks if c.offsets == index.offset]
        numel = sizes.numel()
        if len(md.size) == 0:
            continue  # an AdamW step: a scalar that DCP keeps from one of its holders
        written[writer] += numel
        name = index.fqn.removeprefix(f"{prefix}model.").removeprefix(f"{prefix}optim.state.")
        fqn = next((f for f in owner if name == f or name.startswith(f"{f}.")), None)
        if fqn is not None:
            dedicated_keys += 1
            assert writer == owner[fqn], f"{index.fqn} written by rank {writer}, not its owner"
            assert md.chunks == [ChunkStorageMetadata(torch.Size([0] * len(md.size)), md.size)]
        else:
            # An FSDP2 shard: 1-D Shard(0) over 4 ranks, so rank r writes rows [r*n/4, ...).
            assert len(md.chunks) == 4, index.fqn
            assert index.offset[0] == writer * md.size[0] // 4, (index.fqn, writer)
    # Every dedicated weight and its momentum, each written once by its owner.
    assert dedicated_keys == 2 * len(owner)
    assert dict(written) == {rank: r[2] for rank, r in enumerate(results)}


def _load_elsewhere(rank: int, world_size: int, root: str):
    return _resume(rank, world_size, root)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 1])
def test_world_four_checkpoint_loads_at_another_world_size(saved_at_four, world_size):
    root, saved = saved_at_four
    uninterrupted = saved[0][0]
    same, losses = run_distributed(_load_elsewhere, world_size, root)[0]
    assert same, "the state after load differs from the state saved"
    for step, (got, want) in enumerate(zip(losses, uninterrupted[SPLIT:]), start=SPLIT):
        assert abs(got - want) <= 1e-4 * abs(want), f"step {step}: {got} vs {want}"


class _GatedWriter(FileSystemWriter):
    """Writes only once ``gate`` is set: a save that blocked the caller could never finish."""

    def __init__(self, path: str, gate: threading.Event) -> None:
        super().__init__(path)
        self.gate = gate

    def write_data(self, plan, planner):
        if not self.gate.wait(timeout=60):
            raise RuntimeError("the training steps did not run while the save was pending")
        return super().write_data(plan, planner)


def _async_save(rank: int, world_size: int, root: str):
    total, split = 6, 2
    model, _ = setup_model(world_size)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    uninterrupted = train_steps(model, optimizer, rank, world_size, total)

    model, _ = setup_model(world_size)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    train_steps(model, optimizer, rank, world_size, split)
    path = os.path.join(root, "async")
    gate = threading.Event()
    # DCP's collectives run in a background thread: give them their own process group.
    group = dist.new_group(backend="gloo")
    future = dcp.async_save(
        {CHECKPOINT_KEY: AppState(model, optimizer)},
        storage_writer=_GatedWriter(path, gate),
        process_group=group,
    )
    overlapped = train_steps(model, optimizer, rank, world_size, 2, start=split)
    pending = not future.done()
    gate.set()
    future.result()

    resumed_model, _ = setup_model(world_size, seed=123)
    resumed_opt = Muon(resumed_model, **HYPER.muon_kwargs())
    load_checkpoint(path, resumed_model, resumed_opt)
    resumed = train_steps(resumed_model, resumed_opt, rank, world_size, total - split, start=split)
    return uninterrupted, overlapped, pending, resumed


@pytest.mark.distributed
def test_async_save_overlaps_training_and_resumes_bit_exact(tmp_path):
    uninterrupted, overlapped, pending, resumed = run_distributed(_async_save, 2, str(tmp_path))[0]
    assert pending, "the save finished before the overlapping steps ended"
    assert overlapped == uninterrupted[2:4]
    assert resumed == uninterrupted[2:], "resume from the async checkpoint must be bit-exact"


def _damaged(app: AppState, model) -> dict:
    """A copy of ``app.state_dict()`` with other values (so that a partial load would show)."""

    def bump(value):
        if isinstance(value, torch.Tensor):
            return value.detach() + 1 if value.is_floating_point() else value.clone()
        if isinstance(value, dict):
            return {k: bump(v) for k, v in value.items()}
        return value

    return bump(app.state_dict())


def _bad_dcp_checkpoints(rank: int, world_size: int, root: str):
    model, runtime = setup_model(world_size)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    train_steps(model, optimizer, rank, world_size, 2)
    before = (
        get_model_state_dict(model),
        get_optimizer_state_dict(model, optimizer),
    )
    app = AppState(model, optimizer)
    proj = runtime.params[0]
    norm = "layers.0.attn_norm.weight"

    def write(name: str, damage) -> str:
        state = _damaged(app, model)
        damage(state)
        path = os.path.join(root, name)
        dcp.save({CHECKPOINT_KEY: state}, checkpoint_id=path)
        return path

    def drop_momentum(state):
        state["optim"]["state"].pop(proj.fqn, None)

    def norm_shape(state):
        state["model"][norm] = torch.zeros(3)

    def moment_shape(state):
        state["optim"]["state"][norm]["exp_avg"] = torch.zeros(5)

    def weight_dtype(state):
        if proj.is_owner:
            state["model"][proj.fqn] = state["model"][proj.fqn].double()

    def momentum_dtype(state):
        # As saved by an optimizer whose param_policy kept its state in another optim_dtype.
        if proj.is_owner:
            entry = state["optim"]["state"][proj.fqn]
            entry["momentum_buffer"] = entry["momentum_buffer"].bfloat16()

    cases = {
        "truncated": (drop_momentum, f"no optimizer state for 1 of .*{proj.fqn}.*strict=False"),
        "model_shape": (norm_shape, f"{norm}.*shape \\(3,\\).*expects \\(16,\\)"),
        "state_shape": (moment_shape, f"{norm}.*'exp_avg'.*shape \\(5,\\).*expects \\(16,\\)"),
        "dtype": (
            weight_dtype,
            f"{proj.fqn}.*torch.float64.*keeps torch.float32.*master_dtype.*dtypes it was saved"
            " with.*set_model_state_dict",
        ),
        # A sharded checkpoint cannot be cast before the load: the fix names what can be done.
        "state_dtype": (
            momentum_dtype,
            f"{proj.fqn}.*'momentum_buffer'.*torch.bfloat16.*keeps torch.float32.*optim_dtype"
            ".*dtypes it was saved with.*load_checkpoint\\(path, model, None\\)",
        ),
    }
    errors = {}
    for name, (damage, match) in cases.items():
        path = write(name, damage)
        with pytest.raises(ValueError, match=match) as info:
            load_checkpoint(path, model, optimizer)
        errors[name] = str(info.value)
    # DCP's own planner refuses the truncated checkpoint before reading, too.
    with pytest.raises(CheckpointException, match=f"(?s)Missing key.*{proj.fqn}.momentum_buffer"):
        dcp.load(
            {CHECKPOINT_KEY: AppState(model, optimizer)},
            checkpoint_id=os.path.join(root, "truncated"),
        )
    unchanged = _equal(
        (get_model_state_dict(model), get_optimizer_state_dict(model, optimizer)), before
    )

    # strict=False loads the truncated checkpoint and starts that matrix from fresh momentum.
    load_checkpoint(os.path.join(root, "truncated"), model, optimizer, strict=False)
    after_model, after_optim = (
        get_model_state_dict(model),
        get_optimizer_state_dict(model, optimizer),
    )
    bumped = all(torch.equal(after_model[k], v + 1) for k, v in before[0].items())
    fresh = not after_optim["state"][proj.fqn]["momentum_buffer"].any()
    others = all(
        torch.equal(after_optim["state"][fqn][field], value + 1)
        for fqn, entry in before[1]["state"].items()
        if fqn != proj.fqn
        for field, value in entry.items()
    )
    return errors, unchanged, bumped, fresh, others


@pytest.mark.distributed
def test_damaged_dcp_checkpoints_raise_before_anything_changes(tmp_path):
    results = run_distributed(_bad_dcp_checkpoints, 2, str(tmp_path))
    for _, unchanged, bumped, fresh, others in results:
        assert unchanged, "a failed load modified the model or the optimizer"
        assert bumped and others, "strict=False must still load every entry the checkpoint has"
        assert fresh, "strict=False starts the missing matrix from fresh momentum"
    # Every rank checks the whole checkpoint and reaches the same verdict.
    assert all(r[0] == results[0][0] for r in results)


_O_PROJ_ON_ADAMW = {"overrides": [{"name": ["*o_proj*"], "set": {"route": "adamw"}}]}


def _model_only(rank: int, world_size: int, root: str):
    """A checkpoint's weights into a model whose o_proj matrices moved from Muon to AdamW
    since the save: the optimizer's state cannot follow (refused), the weights alone can."""
    mesh = init_device_mesh("cpu", (world_size,))

    def trained(seed: int, policy):
        model = build(seed)
        dedicate_params(model, mesh, muon_predicate, param_policy=policy)
        shard_layers_then_root(model, mesh)
        optimizer = Muon(model)
        loss_fn(model, batch(seed, 8)).backward()
        optimizer.step()
        optimizer.zero_grad()
        return model, optimizer

    path = os.path.join(root, "ckpt")
    saved_model, saved_optimizer = trained(0, None)
    save_checkpoint(path, saved_model, saved_optimizer)
    saved = get_model_state_dict(saved_model)
    model, optimizer = trained(1, _O_PROJ_ON_ADAMW)
    state_before = get_optimizer_state_dict(model, optimizer)
    with pytest.raises(ValueError, match=r"another predicate or param_policy.*load_checkpoint"):
        load_checkpoint(path, model, optimizer)
    with pytest.raises(ValueError, match=r"strict=False applies to the optimizer state"):
        load_checkpoint(path, model, None, strict=False)
    load_checkpoint(path, model, None)
    weights = _equal(get_model_state_dict(model), saved)
    state_kept = _equal(get_optimizer_state_dict(model, optimizer), state_before)
    loss = loss_fn(model, batch(2, 8))
    loss.backward()
    optimizer.step()
    return weights, state_kept, bool(torch.isfinite(loss))


@pytest.mark.distributed
def test_load_checkpoint_without_the_optimizer_takes_the_weights_alone(tmp_path) -> None:
    for weights, state_kept, trains in run_distributed(_model_only, 2, str(tmp_path)):
        assert weights, "the loaded weights are not the saved ones"
        assert state_kept, "a model-only load changed the optimizer's state"
        assert trains


def _from_plain_fsdp2(rank: int, world_size: int, root: str):
    """A plain FSDP2 run's checkpoint (torch's DCP tutorial's keys, ``model.<fqn>``, and
    torchtitan's top-level ones) into a dmuon model: ``load_checkpoint`` refuses it before
    anything changes, naming the prefix and the way in; that way loads its weights bit for
    bit."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict as torch_get

    mesh = init_device_mesh("cpu", (world_size,))
    plain = build(0)
    shard_layers_then_root(plain, mesh)
    paths = {"model.": os.path.join(root, "plain"), "": os.path.join(root, "titan")}
    dcp.save({"model": torch_get(plain)}, checkpoint_id=paths["model."])
    dcp.save(torch_get(plain), checkpoint_id=paths[""])
    saved = torch_get(plain, options=StateDictOptions(full_state_dict=True))
    model = build(1)
    dedicate_params(model, mesh, muon_predicate)
    shard_layers_then_root(model, mesh)
    before = get_model_state_dict(model)
    for prefix, path in paths.items():
        nested = "{'model': full}" if prefix else "full"
        with pytest.raises(
            ValueError, match=rf"under '{prefix}<fqn>'.*dcp\.load\({re.escape(nested)}, .*no_dist"
        ):
            load_checkpoint(path, model, None)
    unchanged = _equal(get_model_state_dict(model), before)
    full = {}
    if rank == 0:
        full = {
            k: torch.empty(v.shape, dtype=v.dtype)
            for k, v in model.state_dict(keep_vars=True).items()
        }
        dcp.load({"model": full}, checkpoint_id=paths["model."], no_dist=True)
    set_model_state_dict(model, full, broadcast_from_rank0=True)
    return unchanged, _equal(get_model_state_dict(model), saved)


@pytest.mark.distributed
def test_a_plain_fsdp2_checkpoint_is_refused_naming_the_way_to_its_weights(tmp_path) -> None:
    assert run_distributed(_from_plain_fsdp2, 2, str(tmp_path)) == [(True, True)] * 2


def test_load_checkpoint_into_a_plain_model_names_the_way_without_dmuon(tmp_path) -> None:
    # One process, no process group: evaluation on a laptop. The refusal names DCP's own read.
    with pytest.raises(ValueError, match=r"has no dmuon runtime.*'dmuon': \{'model': weights\}"):
        load_checkpoint(str(tmp_path), build(0), None)
