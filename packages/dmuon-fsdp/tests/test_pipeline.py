"""Pipeline parallelism (``torch.distributed.pipelining``) × FSDP2: pp=2 × dp=2 on 4 ranks, each
stage module ``fully_shard``-ed over its data-parallel mesh, trained by torch's schedules. Held
to an independent reference: the whole model trained in one process on the whole batch with
the same Muon + AdamW math (``_reference``). Also: the non-finite skip and the clip norm are
global over both stages, and what dmuon refuses under a pipeline. An interleaved schedule
(two model parts per rank, four stages, one ``Muon`` each tied by ``MuonParts``) is held to the
same reference, with its checkpoint resume, its one clip norm and its one skip over every part,
also with HSDP or tensor parallelism inside each stage; and HSDP with TP inside each stage on 8
ranks (extended)."""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from _reference import Hyper, ReferenceMuonAdamW
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.pipelining.schedules import (
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dmuon_fsdp import (
    EMA,
    Muon,
    MuonParts,
    QKClip,
    dedicate_params,
    get_model_state_dict,
    get_optimizer_state_dict,
    load_checkpoint,
    no_sync,
    save_checkpoint,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from dmuon_fsdp._torch_internals import pipeline_warmup_sends_to_self
from dmuon_ns.testing import relative_error
from dmuon_testing.distributed import run_distributed

HYPER = Hyper()
STEPS = 3
ROWS, IN, WIDTH, OUT = 8, 8, 16, 4
LAYERS = 4  # two per stage
SCHEDULES = {"gpipe": (ScheduleGPipe, 2), "1f1b": (Schedule1F1B, 4)}
# Whether the V schedules (ScheduleDualPipeV, ScheduleZBVZeroBubble) run here over gloo: torch
# 2.11's schedules warm their last position's two neighbouring stages up with a send from the
# rank to itself, which gloo refuses ("Pair is not connected"), and MuonParts refuses them
# there (see [Note: V schedules over gloo] in dmuon_fsdp/optim/_parts).
V_ON_GLOO = not pipeline_warmup_sends_to_self()
V_SKIP = "torch 2.11's pipeline warm-up sends from a rank to itself, which gloo refuses"


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class _Net(nn.Module):
    """The whole model; a stage keeps its layers (torchtitan's way: the others are deleted,
    the names stay) and the first or the last projection."""

    def __init__(self) -> None:
        super().__init__()
        self.inp: nn.Module | None = nn.Linear(IN, WIDTH)
        self.layers = nn.ModuleDict({str(i): _Block() for i in range(LAYERS)})
        self.out: nn.Module | None = nn.Linear(WIDTH, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inp is not None:
            x = self.inp(x)
        for layer in self.layers.values():
            x = layer(x)
        return x if self.out is None else self.out(x)


def _muon(name: str, p: torch.Tensor) -> bool:
    return name.startswith("layers.") and p.ndim == 2


def _net() -> _Net:
    torch.manual_seed(0)
    return _Net()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, IN, generator=gen), torch.randn(ROWS, OUT, generator=gen)


def _stage_module(pp: int) -> _Net:
    model = _net()
    mine = range(pp * LAYERS // 2, (pp + 1) * LAYERS // 2)
    for i in range(LAYERS):
        if i not in mine:
            del model.layers[str(i)]
    if pp == 0:
        model.out = None
    else:
        model.inp = None
    return model


class _Place(NamedTuple):
    """This rank's place: its pipeline mesh, and its index among the data-parallel ranks."""

    pp: DeviceMesh
    dp_index: int
    dp_size: int


class _Meshes(NamedTuple):
    """This rank's meshes: the stage's data-parallel shard mesh (``dedicate_params``' mesh), its
    replicate mesh (HSDP), the mesh ``fully_shard`` takes, the TP mesh, and this rank's place."""

    dp: DeviceMesh
    replicas: DeviceMesh | None
    fsdp: DeviceMesh
    tp: DeviceMesh | None
    place: _Place


def _meshes(*, hsdp: bool = False, tp: bool = False) -> _Meshes:
    """The (pp 2, dp 2) mesh, with ``hsdp`` the (pp 2, replicate 2, shard 1) one, with ``tp``
    the (pp 2, dp 1, tp 2) one, with both the (pp 2, replicate 2, shard 1, tp 2) one (8
    ranks)."""
    if hsdp:
        names = ("pp", "dp_replicate", "dp_shard", "tp")[: 4 if tp else 3]
        mesh = init_device_mesh("cpu", (2, 2, 1, 2)[: len(names)], mesh_dim_names=names)
        replicas = mesh["dp_replicate"]
        place = _Place(mesh["pp"], replicas.get_local_rank(), replicas.size())
        fsdp = mesh["dp_replicate", "dp_shard"]
        return _Meshes(mesh["dp_shard"], replicas, fsdp, mesh["tp"] if tp else None, place)
    if tp:
        mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
        return _Meshes(mesh["dp"], None, mesh["dp"], mesh["tp"], _Place(mesh["pp"], 0, 1))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    place = _Place(mesh["pp"], mesh["dp"].get_local_rank(), mesh["dp"].size())
    return _Meshes(mesh["dp"], None, mesh["dp"], None, place)


def _shard(
    model: _Net,
    meshes: _Meshes,
    reshard: bool,
    *,
    root: bool = True,
):
    """Dedicate and shard a stage module (or a model part) over its stage's meshes: each
    block's up column-wise and down row-wise over the TP mesh if any (and the last projection
    column-wise, its output replicated, as torchtitan's head), ``fully_shard`` per layer and
    (``root``) of the module too; its runtime."""
    if meshes.tp is not None:
        plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        for layer in model.layers.values():
            parallelize_module(layer, meshes.tp, plan)
        if model.out is not None:
            parallelize_module(model.out, meshes.tp, ColwiseParallel(output_layouts=Replicate()))
    runtime = dedicate_params(
        model,
        meshes.dp,
        _muon,
        replicate_mesh=meshes.replicas,
        pipeline_mesh=meshes.place.pp,
        reshard_after_forward=reshard,
        small_param_threshold=0,
    )
    for layer in model.layers.values():
        fully_shard(layer, mesh=meshes.fsdp, reshard_after_forward=reshard)
    if root:
        fully_shard(model, mesh=meshes.fsdp, reshard_after_forward=reshard)
    return runtime


def _stage(reshard: bool, *, root: bool = True, hsdp: bool = False, tp: bool = False):
    """This rank's stage module of :func:`_meshes`' mesh (``hsdp``, ``tp``), dedicated and
    sharded (``root``: the stage module too, not only its layers)."""
    meshes = _meshes(hsdp=hsdp, tp=tp)
    model = _stage_module(meshes.place.pp.get_local_rank())
    return model, _shard(model, meshes, reshard, root=root), meshes.place


def _schedule(model, place: _Place, name: str):
    kind, microbatches = SCHEDULES[name]
    pp = place.pp.get_local_rank()
    stage = PipelineStage(model, pp, 2, torch.device("cpu"), group=place.pp.get_group())
    return kind(stage, n_microbatches=microbatches, loss_fn=nn.functional.mse_loss)


def _run(schedule, place: _Place, step: int) -> None:
    """One schedule step on this rank's share of the batch (the data-parallel split)."""
    x, y = _batch(step)
    per = ROWS // place.dp_size
    rows = slice(place.dp_index * per, (place.dp_index + 1) * per)
    if place.pp.get_local_rank() == 0:
        schedule.step(x[rows])
    else:
        schedule.step(target=y[rows])


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in get_model_state_dict(model).items()}


def _train(
    name: str, reshard: bool, hsdp: bool = False, path: str | None = None, tp: bool = False
) -> dict[str, torch.Tensor]:
    """``STEPS`` steps, the last one resumed on a new stage module (whose first optimizer lives
    on and steps no more: not two stages per rank): with ``path`` from a DCP checkpoint of the
    first (``save_checkpoint``, ``load_checkpoint``), else from its full state dicts. A lost
    momentum shows in the reference check."""
    model, _, mesh = _stage(reshard, hsdp=hsdp, tp=tp)
    schedule = _schedule(model, mesh, name)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    for step in range(STEPS):
        if step == STEPS - 1:
            if path is not None:
                save_checkpoint(path, model, optimizer)
            else:
                weights = get_model_state_dict(model)
                state = get_optimizer_state_dict(model, optimizer)
            model, _, mesh = _stage(reshard, hsdp=hsdp, tp=tp)
            schedule = _schedule(model, mesh, name)
            optimizer = Muon(model, **HYPER.muon_kwargs())
            if path is not None:
                load_checkpoint(path, model, optimizer)
            else:
                set_model_state_dict(model, weights)
                set_optimizer_state_dict(model, optimizer, state)
        optimizer.zero_grad()
        _run(schedule, mesh, step)
        optimizer.step()
    return _state(model)


def _without_pipeline(path: str) -> dict[str, torch.Tensor]:
    """The whole model on 4 data-parallel ranks, no pipeline, resumed from the stages'
    checkpoint at ``path`` for the last step (the stages' param groups merged)."""
    mesh = init_device_mesh("cpu", (4,))
    model = _net()
    dedicate_params(model, mesh, _muon, small_param_threshold=0)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    load_checkpoint(path, model, optimizer)
    x, y = _batch(STEPS - 1)
    rows = slice(dist.get_rank() * ROWS // 4, (dist.get_rank() + 1) * ROWS // 4)
    nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
    optimizer.step()
    return _state(model)


def _global_checks(hsdp: bool = False, tp: bool = False) -> dict:
    """The non-finite skip and the clip norm, over both stages (of the (pp, dp) mesh, or the
    ``hsdp`` or ``tp`` one of :func:`_stage`)."""
    model, runtime, mesh = _stage(True, hsdp=hsdp, tp=tp)
    schedule = _schedule(model, mesh, "gpipe")
    optimizer = Muon(model, **HYPER.muon_kwargs())
    out: dict = {}
    # The clip's group sums this rank's gradients, each element counted once in the world.
    _run(schedule, mesh, 0)
    out["norm"] = _clip_norm(optimizer)
    optimizer.zero_grad()
    # A NaN in one owner's dedicated gradient, on one rank of stage 1 only: every rank skips.
    before = _state(model)
    _run(schedule, mesh, 1)
    # The last rank (of stage 1) that holds an owned gradient: rank 3 on the (pp, dp) mesh.
    _nan_in_last_owned_gradient(runtime)
    optimizer.step()
    out["nan_skipped"] = bool(optimizer.last_step_stats.skipped)
    out["nan_unchanged"] = all(torch.equal(v, before[k]) for k, v in _state(model).items())
    optimizer.zero_grad()
    # An infinity in an FSDP2 shard's gradient on rank 0 (stage 0).
    _run(schedule, mesh, 2)
    _inf_in_a_projection_gradient([model])
    optimizer.step()
    out["inf_skipped"] = bool(optimizer.last_step_stats.skipped)
    out["inf_unchanged"] = all(torch.equal(v, before[k]) for k, v in _state(model).items())
    # A backward of the user's own under no_sync, which no schedule's end of backward
    # followed: the step is still refused.
    optimizer.zero_grad()
    x = torch.randn(2, IN if model.inp is not None else WIDTH)
    with no_sync(model):
        model(x).sum().backward()
    out["no_sync"] = _error(optimizer.step)
    return out


def _inf_in_a_projection_gradient(models: list[_Net]) -> None:
    """Put an infinity into the FSDP2 shard of the first or the last projection's weight
    gradient (of the first of ``models`` that holds one), on rank 0 only."""
    model = next(m for m in models if m.inp is not None or m.out is not None)
    grad = model.inp.weight.grad if model.inp is not None else model.out.weight.grad
    if dist.get_rank() == 0:
        (grad.to_local() if isinstance(grad, DTensor) else grad).view(-1)[0] = math.inf


def _same(a, b) -> bool:
    """``a`` and ``b`` (state dicts) hold equal values, tensors bit for bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _error(call, *args, **kwargs) -> str:
    try:
        call(*args, **kwargs)
    except (RuntimeError, TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "nothing raised"


def _refusals() -> dict[str, str]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp = mesh["pp"].get_local_rank()
    out = {
        # A stage's mesh without pipeline_mesh covers half the world.
        "no_pipeline_mesh": _error(dedicate_params, _stage_module(pp), mesh["dp"], _muon),
        # The pipeline dimension given for both: two ranks sit at one coordinate of a stage.
        "mismatch": _error(
            dedicate_params, _stage_module(pp), mesh["dp"], _muon, pipeline_mesh=mesh["dp"]
        ),
    }
    # A stage module that fully_shard did not wrap itself: the schedule would not defer the
    # reduce to its end, and the division by the micro-batches would miss the dedicated ones.
    model, _, _ = _stage(True, root=False)
    out["not_fsdp"] = _error(Muon, model, **HYPER.muon_kwargs())
    # Two stage modules per rank whose optimizers step in turn (an interleaved schedule's).
    first, second = _stage(True)[0], _stage(True)[0]
    optimizers = Muon(first, **HYPER.muon_kwargs()), Muon(second, **HYPER.muon_kwargs())
    optimizers[0].step()
    out["second"] = _error(optimizers[1].step)
    out.update(_interleaved())
    out["split_under_zero3"] = _split_under_zero3()
    # What names one rank of the world (see [Note: checkpoints of pipeline stages]).
    out["rank0_only"] = _error(get_model_state_dict, model, rank0_only=True)
    # Stage 1 forgets pipeline_mesh: stage 0, whose meshes cover the world, raises too.
    out["one_stage_forgot"] = _error(
        dedicate_params,
        _stage_module(pp),
        mesh["dp"],
        _muon,
        pipeline_mesh=mesh["pp"] if pp == 0 else None,
    )
    return out


def _part(
    meshes: _Meshes,
    index: int,
    reshard: bool = True,
    head_apart: bool = False,
) -> _Net:
    """Model part ``index`` of an interleaved schedule's four stages: layer ``index``, with
    the first projection on stage 0 and the last on stage 3, dedicated and sharded over the
    stage's meshes (:func:`_shard`); with ``head_apart`` stage 3 holds the last projection
    alone (no Muon matrix: torchtitan's part of the norm and the head) and stage 2 the last
    two layers."""
    mine = {index}
    if head_apart:
        mine = {LAYERS - 2: {LAYERS - 2, LAYERS - 1}, LAYERS - 1: set()}.get(index, mine)
    part = _net()
    for i in range(LAYERS):
        if i not in mine:
            del part.layers[str(i)]
    part.inp = part.inp if index == 0 else None
    part.out = part.out if index == LAYERS - 1 else None
    _shard(part, meshes, reshard)
    return part


def _parts(meshes: _Meshes, reshard: bool = True, head_apart: bool = False):
    """This rank's model parts of an interleaved schedule (stages ``pp`` and ``pp + 2`` of 4,
    torch's "loop" order; ``head_apart`` as :func:`_part`), their schedule, and this rank's
    place."""
    pp = meshes.place.pp.get_local_rank()
    parts = [_part(meshes, index, reshard, head_apart=head_apart) for index in (pp, pp + 2)]
    group = meshes.place.pp.get_group()
    stages = [
        PipelineStage(part, index, LAYERS, torch.device("cpu"), group=group)
        for part, index in zip(parts, (pp, pp + 2), strict=True)
    ]
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=4, loss_fn=nn.functional.mse_loss)
    return parts, schedule, meshes.place


def _parts_state(parts) -> dict[str, torch.Tensor]:
    return {k: v for part in parts for k, v in _state(part).items()}


def _trained_parts(
    meshes: _Meshes, steps: range, reshard: bool = False, load=None, head_apart: bool = False
):
    """This rank's parts of :func:`_parts` on ``meshes`` (``head_apart``), one ``Muon`` per
    part tied by one ``MuonParts``, given ``load(parts, optimizer)`` first if any, trained on
    the batches of ``steps``; the parts and their ``MuonParts``."""
    parts, schedule, place = _parts(meshes, reshard, head_apart)
    optimizer = MuonParts([Muon(part, **HYPER.muon_kwargs()) for part in parts])
    if load is not None:
        load(parts, optimizer)
    for step in steps:
        optimizer.zero_grad()
        _run(schedule, place, step)
        optimizer.step()
    return parts, optimizer


def _train_parts(path: str, stages_path: str) -> dict:
    """``STEPS`` steps of the interleaved schedule, one ``Muon`` per part stepped by one
    ``MuonParts`` (Z2), the last step resumed on new parts from a DCP checkpoint of the first;
    the param groups it saved (the whole model's); and the last step resumed on new parts by a
    plain ``dcp.load`` of an ``AppState`` of the parts from the checkpoint at ``stages_path``
    (one stage per rank, step 2 of 3)."""
    import torch.distributed.checkpoint as dcp

    from dmuon_fsdp import CHECKPOINT_KEY, AppState

    def last_step(load) -> dict[str, torch.Tensor]:
        return _parts_state(_trained_parts(meshes, range(STEPS - 1, STEPS), False, load)[0])

    meshes = _meshes()
    parts, optimizer = _trained_parts(meshes, range(STEPS - 1), reshard=False)
    save_checkpoint(path, parts, optimizer)
    groups = AppState(parts, optimizer).state_dict()["optim"]["param_groups"]
    # The parts' own state dict (torch.save per rank): a second part that refuses its state
    # leaves the first as it was; with the state fit, every part takes its saved state.
    saved = optimizer.state_dict()
    fresh = MuonParts([Muon(part, **HYPER.muon_kwargs()) for part in _parts(meshes, False)[0]])
    own = [o.state_dict()["state"] for o in fresh.optimizers]
    # A part's state dict hooks run where its own methods are called (as torch's, once per
    # call), not when MuonParts keeps and gives back its state around a refused load.
    calls: list[str] = []
    first = fresh.optimizers[0]
    first.register_state_dict_pre_hook(lambda o: calls.append("state_dict"))
    first.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load_state_dict"))
    first.register_load_state_dict_post_hook(lambda o: calls.append("loaded"))
    second = saved["parts"][1]
    lacking_lr = [{k: v for k, v in g.items() if k != "lr"} for g in second["param_groups"]]
    unfit_part = {**saved, "parts": [saved["parts"][0], {**second, "param_groups": lacking_lr}]}
    part_refused = _error(fresh.load_state_dict, unfit_part)
    first_kept = _same(fresh.optimizers[0].state_dict()["state"], own[0])
    other_stages = _error(fresh.load_state_dict, {**saved, "stage_indices": [0, 0]})
    fresh.load_state_dict(saved)
    round_trip = _same(fresh.state_dict()["parts"], saved["parts"])
    # Each: the refused load's first part, first_kept's state_dict(), the load, the round trip.
    hooks = calls == ["load_state_dict", "loaded", "state_dict"] * 2
    # The second part's groups do not fit (another group name): refused on every rank before
    # either part changes.
    parts, _, _ = _parts(meshes, reshard=False)
    optimizers = [Muon(part, **HYPER.muon_kwargs()) for part in parts]
    optimizers[1].param_groups[0]["group_name"] = "renamed"
    before = _parts_state(parts)
    unfit = _error(load_checkpoint, path, parts, MuonParts(optimizers))
    # Two parts with the same FQNs (one stage built twice): one dictionary cannot hold both.
    twins = [_part(meshes, meshes.place.pp.get_local_rank(), reshard=False) for _ in range(2)]
    twin_parts = MuonParts([Muon(part, **HYPER.muon_kwargs()) for part in twins])
    return {
        "part_refused": part_refused,
        "first_kept": first_kept,
        "other_stages": other_stages,
        "round_trip": round_trip,
        "hooks": (hooks, calls),
        "twins": _error(save_checkpoint, f"{path}_twins", twins, twin_parts),
        "unfit": unfit,
        "unfit_unchanged": all(torch.equal(v, before[k]) for k, v in _parts_state(parts).items()),
        "train": last_step(lambda parts, o: load_checkpoint(path, parts, o)),
        "groups": [(name, group["params"]) for name, group in groups],
        "from_stages": last_step(
            lambda parts, o: dcp.load(
                {CHECKPOINT_KEY: AppState(parts, o)}, checkpoint_id=stages_path
            )
        ),
    }


def _nan_in_last_owned_gradient(runtime) -> None:
    """Reduce the gradients, then put a NaN into one owned gradient of the last rank that holds
    one (of ``runtime``'s model), on that rank only."""
    runtime.wait_all_reduces()
    owned = [dp for dp in runtime.owned if dp.grad is not None]
    holds = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(holds, torch.tensor([float(bool(owned))]))
    if dist.get_rank() == max(r for r, held in enumerate(holds) if held.item()):
        owned[0].grad.view(-1)[0] = math.nan


def _clip_norm(optimizer: Muon | MuonParts) -> float:
    """The norm ``dmuon.clip_grad_norm_`` takes of every gradient, summed here in float64 over
    the clip's group (each element counted once in the world)."""
    clip = optimizer.grads_for_clip("all")
    squares = torch.zeros((), dtype=torch.float64)
    for g in clip.grads:
        squares += g.double().square().sum()
    dist.all_reduce(squares, group=clip.process_group)
    return math.sqrt(float(squares))


def _parts_global(hsdp: bool = False, tp: bool = False) -> dict:
    """The clip norm and the non-finite skip of an interleaved schedule: one over every part
    of every rank (of the (pp, dp) mesh, or the ``hsdp`` or ``tp`` one of :func:`_meshes`)."""
    parts, schedule, place = _parts(_meshes(hsdp=hsdp, tp=tp))
    optimizers = [Muon(part, **HYPER.muon_kwargs()) for part in parts]
    optimizer = MuonParts(optimizers)
    out: dict = {}
    before = _parts_state(parts)
    _run(schedule, place, 0)
    out["norm"] = _clip_norm(optimizer)
    if not (hsdp or tp):
        # A per-matrix clip is refused naming the first parameter of the first part whose
        # gradient ranks split: an FSDP2 shard (every DTensor here); none of "muon"'s.
        first = next(
            name
            for part, o in zip(parts, optimizers, strict=True)
            for group in o.param_groups
            for name in group["param_names"]
            if isinstance(part.get_parameter(name), DTensor)
        )
        named = (optimizer.param_split_over_ranks("all"), optimizer.param_split_over_ranks())
        out["split_named"] = named == (first, None), named, first
    # A part stepped (or clipped) alone would decide over the parts at its position only.
    out["alone_step"] = _error(optimizers[0].step)
    out["alone_clip"] = _error(optimizers[1].grads_for_clip)
    # An infinity in an FSDP2 shard's gradient of the first part of rank 0: every part of
    # every rank skips.
    _inf_in_a_projection_gradient(parts)
    optimizer.step()
    out["inf_skipped"] = bool(optimizer.last_step_stats.skipped)
    out["inf_unchanged"] = all(torch.equal(v, before[k]) for k, v in _parts_state(parts).items())
    optimizer.zero_grad()
    # An LR scheduler and a torch step post-hook per part: the MuonParts' step goes through
    # each part's step(), so the hooks run and the schedulers count the steps.
    hooked: list[int] = []
    for k, part_optimizer in enumerate(optimizers):
        part_optimizer.register_step_post_hook(lambda o, args, kwargs, k=k: hooked.append(k))
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5**s) for o in optimizers]
    lrs = [group["lr"] for o in optimizers for group in o.param_groups]
    # A NaN in one owned gradient of the second part of one rank: every part of every rank
    # skips.
    _run(schedule, place, 1)
    runtime = optimizers[1].runtime
    _nan_in_last_owned_gradient(runtime)
    optimizer.step()
    out["nan_skipped"] = [bool(o.last_step_stats.skipped) for o in (optimizer, *optimizers)]
    out["nan_unchanged"] = all(torch.equal(v, before[k]) for k, v in _parts_state(parts).items())
    optimizer.zero_grad()
    # The next step, finite, changes every part.
    _run(schedule, place, 2)
    optimizer.step()
    out["finite_stepped"] = not bool(optimizer.last_step_stats.skipped) and all(
        not torch.equal(v, before[k]) for k, v in _parts_state(parts).items()
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for scheduler in schedulers:
            scheduler.step()
    out["scheduler_warnings"] = [str(w.message) for w in caught]
    out["hooked"] = hooked
    out["lrs_halved"] = [g["lr"] for o in optimizers for g in o.param_groups] == [
        lr / 2 for lr in lrs
    ]
    return out


def _interleaved() -> dict[str, str]:
    """An interleaved schedule's run with one Muon per part and no ``MuonParts``: the first
    part's clip and step are refused, before either part changes."""
    parts, schedule, place = _parts(_meshes())
    optimizers = [Muon(part, **HYPER.muon_kwargs()) for part in parts]
    _run(schedule, place, 0)
    before = _parts_state(parts)
    out = {
        "interleaved_clip": _error(optimizers[0].grads_for_clip),
        "interleaved_step": _error(optimizers[0].step),
    }
    unchanged = all(torch.equal(v, before[k]) for k, v in _parts_state(parts).items())
    out["interleaved_unchanged"] = str(unchanged)
    out["parts_of_one_model"] = _error(MuonParts, [optimizers[0], optimizers[0]])
    out["parts_empty"] = _error(MuonParts, [])
    # Stage indices that are not each stage once over the positions (every rank passes its
    # position twice): refused on every rank.
    pp = place.pp.get_local_rank()
    out["stage_indices_twice"] = _error(MuonParts, optimizers, stage_indices=(pp, pp))
    # An EMA or a QKClip takes one part's Muon, not the MuonParts: the error names the fix.
    tied = MuonParts(optimizers)
    out["ema_of_parts"] = _error(EMA, tied)
    clip = QKClip()
    clip.add(f"layers.{pp}.up.weight", f"layers.{pp}.down.weight", num_heads=1)
    out["qk_clip_of_parts"] = _error(clip.attach, tied)
    return out


SPLIT_SCHEDULES = {
    "dual_pipe_v": ScheduleDualPipeV,
    "zbv": ScheduleZBVZeroBubble,
    "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
}


def _train_split(name: str, path: str | None = None, **inside: bool) -> dict[str, torch.Tensor]:
    """``STEPS`` steps of a schedule that splits each backward into the inputs' gradients and
    the weights' (written to ``.grad`` by hand; see [Note: weight gradients a schedule
    writes]), on two model parts per rank under ZeRO-2, one ``MuonParts`` given the parts'
    stage indices: the V schedules hold stages ``pp`` and ``3 - pp``, the interleaved one
    ``pp`` and ``pp + 2``. With ``path``, a DCP checkpoint there before the last step. On :func:`_meshes`' ``hsdp`` or ``tp`` mesh with
    ``inside``."""
    meshes = _meshes(**inside)
    place = meshes.place
    pp = place.pp.get_local_rank()
    v_shaped = name != "interleaved_zero_bubble"
    indices = (pp, LAYERS - 1 - pp) if v_shaped else (pp, pp + 2)
    parts = [_part(meshes, index, reshard=False) for index in indices]
    group = place.pp.get_group()
    stages = [
        PipelineStage(part, index, LAYERS, torch.device("cpu"), group=group)
        for part, index in zip(parts, indices, strict=True)
    ]
    schedule = SPLIT_SCHEDULES[name](stages, n_microbatches=4, loss_fn=nn.functional.mse_loss)
    optimizers = [Muon(part, **HYPER.muon_kwargs()) for part in parts]
    optimizer = MuonParts(optimizers, stage_indices=indices)
    for step in range(STEPS):
        if path is not None and step == STEPS - 1:
            save_checkpoint(path, parts, optimizer)
        optimizer.zero_grad()
        if v_shaped and pp == 0:  # the first and the last stage
            x, y = _batch(step)
            per = ROWS // place.dp_size
            rows = slice(place.dp_index * per, (place.dp_index + 1) * per)
            schedule.step(x[rows], target=y[rows])
        elif v_shaped:
            schedule.step()
        else:
            _run(schedule, place, step)
        optimizer.step()
    return _parts_state(parts)


def _v_refusal() -> str:
    """``MuonParts`` of a V schedule's parts over gloo on a torch whose schedules warm them up
    with a send to itself (this torch, or one as if it were): refused on every rank, before the
    schedule's first step."""
    meshes = _meshes()
    pp = meshes.place.pp.get_local_rank()
    indices = (pp, LAYERS - 1 - pp)
    parts = [_part(meshes, index, reshard=False) for index in indices]
    optimizers = [Muon(part, **HYPER.muon_kwargs()) for part in parts]
    with mock.patch("dmuon_fsdp.optim._parts.pipeline_warmup_sends_to_self", return_value=True):
        return _error(MuonParts, optimizers, stage_indices=indices)


def _split_under_zero3() -> str:
    """What a split backward's first look-up of a weight's gradient accumulator finds on a
    ZeRO-3 peer: the weight is not held, and the error names the fix."""
    _model, runtime, _ = _stage(True)  # the model holds its runtime
    peer = next(dp.param for dp in runtime.params if not dp.is_owner)
    return _error(peer.view_as, peer)


def _pipeline(rank: int, world_size: int, path: str) -> dict:
    out: dict = {
        ("gpipe", True): _train("gpipe", True, path=path),
        ("1f1b", False): _train("1f1b", False),
        "without_pipeline": _without_pipeline(path),
        "global": _global_checks(),
        "refusals": _refusals(),
        "interleaved": _train_parts(f"{path}_parts", path),
        "interleaved_into_whole": _without_pipeline(f"{path}_parts"),
        "parts_global": _parts_global(),
        "v_refused": _v_refusal(),
    }
    if V_ON_GLOO:
        out["dual_pipe_v"] = _train_split("dual_pipe_v", path=f"{path}_v")
        out["v_into_whole"] = _without_pipeline(f"{path}_v")
    return out


def _reference(steps: int) -> tuple[dict[str, torch.Tensor], float]:
    """The whole model trained in one process on the whole batch; and step 0's gradient norm."""
    model = _net()
    names = [n for n, p in model.named_parameters() if _muon(n, p)]
    optimizer = ReferenceMuonAdamW(model, names, HYPER)
    norm = 0.0
    for step in range(steps):
        optimizer.zero_grad()
        x, y = _batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        if step == 0:
            norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))
        optimizer.step()
    return {n: p.detach() for n, p in model.named_parameters()}, norm


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory) -> list[dict]:
    path = str(tmp_path_factory.mktemp("pipeline") / "checkpoint")
    return run_distributed(_pipeline, 4, path)


def _check_against_reference(per_rank: list[dict[str, torch.Tensor]], peer_of=1) -> None:
    want, _ = _reference(STEPS)
    seen: set[str] = set()
    for rank, got in enumerate(per_rank):
        peer = per_rank[rank ^ peer_of]  # another data-parallel rank of the stage
        assert got.keys() == peer.keys()
        for name, value in got.items():
            assert torch.equal(value, peer[name]), f"rank {rank}: {name} differs in its stage"
            err = relative_error(value, want[name])
            assert err < 1e-4, f"rank {rank}: {name} is {err:.1e} away from the reference"
            seen.add(name)
    assert seen == set(want), "the stages together hold every parameter"


@pytest.mark.distributed
@pytest.mark.parametrize("variant", [("gpipe", True), ("1f1b", False)], ids=["gpipe-z3", "1f1b-z2"])
def test_pipeline_stages_train_like_the_whole_model(pipeline_runs, variant):
    _check_against_reference([result[variant] for result in pipeline_runs])


@pytest.mark.distributed
def test_a_checkpoint_of_the_stages_loads_without_a_pipeline(pipeline_runs):
    """The DCP checkpoint the stages wrote (step 2 of 3), loaded into the whole model on 4
    data-parallel ranks, trains the last step like the reference."""
    _check_against_reference([result["without_pipeline"] for result in pipeline_runs], 2)


def _hsdp(rank: int, world_size: int) -> dict:
    # Resumed from the full state dicts.
    return {"train": _train("1f1b", True, hsdp=True), "global": _global_checks(hsdp=True)}


def _tp(rank: int, world_size: int) -> dict:
    # Resumed from the full state dicts.
    return {"train": _train("gpipe", False, tp=True), "global": _global_checks(tp=True)}


@pytest.mark.distributed
@pytest.mark.extended
def test_hsdp_stages_train_like_the_whole_model():
    """pp 2 x (replicate 2 x shard 1): each stage's owners publish to its replica; the skip
    and the clip norm cover every rank."""
    results = run_distributed(_hsdp, 4)
    _check_against_reference([result["train"] for result in results])
    _check_global(results)


@pytest.mark.distributed
def test_nonfinite_skip_and_clip_norm_cover_every_stage(pipeline_runs):
    _check_global(pipeline_runs)


def _check_global(results: list[dict]) -> None:
    _, norm = _reference(1)
    for result in results:
        got = result["global"]
        assert got["norm"] == pytest.approx(norm, rel=1e-5)
        assert got["nan_skipped"] and got["nan_unchanged"]
        assert got["inf_skipped"] and got["inf_unchanged"]


@pytest.mark.distributed
def test_what_a_pipeline_refuses(pipeline_runs):
    for result in pipeline_runs:
        got = result["refusals"]
        assert "mesh sizes do not multiply to the world size" in got["no_pipeline_mesh"]
        assert "pipeline_mesh=mesh['pp']" in got["no_pipeline_mesh"]
        assert got["mismatch"].startswith("ValueError: pipeline_mesh does not match mesh")
        assert got["not_fsdp"].startswith("ValueError: dedicate_params(pipeline_mesh=...) was")
        assert "dmuon.MuonParts" in got["second"], got["second"]
        call = "get_model_state_dict(rank0_only=True)"
        assert got["rank0_only"].startswith(f"RuntimeError: {call} is not supported under")
        assert "the last backward ran inside dmuon.no_sync" in result["global"]["no_sync"]
        for call in ("clip", "step"):
            assert "dmuon.MuonParts" in got[f"interleaved_{call}"], (call, got)
        assert got["interleaved_unchanged"] == "True"
        assert got["parts_of_one_model"].startswith("ValueError: MuonParts: optimizers 0 and 1")
        assert got["parts_empty"].startswith("ValueError: MuonParts takes"), got["parts_empty"]
        assert "[dmuon.EMA(o, decay) for o in optimizer.optimizers]" in got["ema_of_parts"]
        assert "to each part's Muon in optimizer.optimizers" in got["qk_clip_of_parts"]
        v_refused = result["v_refused"]
        assert v_refused.startswith("RuntimeError: MuonParts: pipeline position 1 holds"), v_refused
        assert "neighbouring stages 1 and 2 (a V schedule: ScheduleDualPipeV" in v_refused
        assert "Upgrade torch to 2.13 or newer" in v_refused, v_refused
        twice = got["stage_indices_twice"]
        assert "stage indices by pipeline position, {0: [0, 0], 1: [1, 1]}" in twice, twice
        zero3 = got["split_under_zero3"]
        assert "A zero-bubble or V pipeline schedule" in zero3, zero3
        assert "dedicate_params(..., reshard_after_forward=False)" in zero3, zero3
        forgot = got["one_stage_forgot"]
        assert forgot.startswith("ValueError: mesh sizes do not multiply to the world size"), forgot


@pytest.mark.distributed
@pytest.mark.extended
def test_tensor_parallel_stages_train_like_the_whole_model():
    """pp 2 x dp 1 x tp 2: each stage's TP grids, with their TP groups, inside the stage; the
    skip and the clip norm cover every rank."""
    results = run_distributed(_tp, 4)
    _check_against_reference([result["train"] for result in results])
    _check_global(results)


def _hsdp_tp(rank: int, world_size: int) -> dict:
    return {
        "train": _train("1f1b", False, hsdp=True, tp=True),
        "global": _global_checks(hsdp=True, tp=True),
    }


@pytest.mark.distributed
@pytest.mark.extended
def test_hsdp_and_tensor_parallel_stages_train_like_the_whole_model():
    """pp 2 x (replicate 2 x shard 1) x tp 2 on 8 ranks: HSDP and TP together inside each
    stage; the skip and the clip norm cover every rank."""
    results = run_distributed(_hsdp_tp, 8)
    # Rank (pp, replicate, shard, tp): its other replica is rank ^ 2.
    _check_against_reference([result["train"] for result in results], 2)
    _check_global(results)


# -- a plain dcp.load of an AppState on another pipeline layout ---------------------------------
# (see [Note: checkpoints of pipeline stages]): the layouts of the 4 ranks are the whole model on
# 4 data-parallel ranks (1 stage), (pp 2, dp 2), and (pp 4, dp 1) with one layer per stage.


def _stage_of(index: int, stages: int) -> _Net:
    """Stage ``index`` of ``stages``: its ``LAYERS // stages`` layers, and the first or the last
    projection."""
    model = _net()
    per = LAYERS // stages
    for i in range(LAYERS):
        if not index * per <= i < (index + 1) * per:
            del model.layers[str(i)]
    if index > 0:
        model.inp = None
    if index < stages - 1:
        model.out = None
    return model


def _laid_out(stages: int):
    """This rank's model of the layout of ``stages`` stages, dedicated, sharded and with its
    ``Muon``; and a function that trains it one step (the step's batch, split as in
    :func:`_run`)."""
    if stages == 1:
        dp = init_device_mesh("cpu", (4,))
        model, pp_mesh, index = _net(), None, 0
    else:
        mesh = init_device_mesh("cpu", (stages, 4 // stages), mesh_dim_names=("pp", "dp"))
        dp, pp_mesh = mesh["dp"], mesh["pp"]
        index = pp_mesh.get_local_rank()
        model = _stage_of(index, stages)
    dedicate_params(model, dp, _muon, pipeline_mesh=pp_mesh, small_param_threshold=0)
    for layer in model.layers.values():
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    schedule = None
    if pp_mesh is not None:
        stage = PipelineStage(model, index, stages, torch.device("cpu"), group=pp_mesh.get_group())
        schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=nn.functional.mse_loss)

    def train(step: int) -> None:
        optimizer.zero_grad()
        x, y = _batch(step)
        per = ROWS // dp.size()
        rows = slice(dp.get_local_rank() * per, (dp.get_local_rank() + 1) * per)
        if schedule is None:
            nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        elif index == 0:
            schedule.step(x[rows])
        elif index == stages - 1:
            schedule.step(target=y[rows])
        else:
            schedule.step()
        optimizer.step()

    return model, optimizer, train


def _relayouts(rank: int, world_size: int, root: str) -> dict:
    """Checkpoints of ``STEPS - 1`` steps written by a plain ``dcp.save`` of an ``AppState``
    (pp 2, and the whole model), each read by a plain ``dcp.load`` on another layout, which
    trains the last step; the format an earlier dmuon wrote for stages (each stage's param
    groups under a key of its own), which ``load_checkpoint`` reads on any layout; and stages
    whose groups of one name hold different hyperparameters."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException

    from dmuon_fsdp import CHECKPOINT_KEY, AppState
    from dmuon_fsdp.checkpoint._checkpoint import group_state

    def load_plainly(path: str, model, optimizer) -> str:
        """A plain ``dcp.load``'s error (DCP raises a ``CheckpointException``, a
        ``BaseException``, for one raised while it reads)."""
        try:
            dcp.load({CHECKPOINT_KEY: AppState(model, optimizer)}, checkpoint_id=path)
        except (CheckpointException, ValueError) as e:
            return f"{type(e).__name__}: {e}"
        return "nothing raised"

    class _PerStageKeys(AppState):
        """``AppState`` as an earlier dmuon wrote stages: the first stage's param groups under
        ``optim.param_groups``, stage ``p``'s under ``optim.param_groups_<p>``."""

        def state_dict(self) -> dict:
            out = super().state_dict()
            p = self.runtime.layout.pp_index
            del out["optim"]["param_groups"]
            key = "param_groups" if p == 0 else f"param_groups_{p}"
            out["optim"][key] = tuple(group_state(self.optimizer).items())
            return out

    def save(stages: int, path: str, app=AppState) -> dict[str, torch.Tensor]:
        """Save after ``STEPS - 1`` steps; the uninterrupted run's weights after the last."""
        model, optimizer, train = _laid_out(stages)
        for step in range(STEPS - 1):
            train(step)
        dcp.save({CHECKPOINT_KEY: app(model, optimizer)}, checkpoint_id=path)
        train(STEPS - 1)
        return _state(model)

    def resume(stages: int, path: str, load=None) -> dict[str, torch.Tensor]:
        model, optimizer, train = _laid_out(stages)
        if load is None:
            dcp.load({CHECKPOINT_KEY: AppState(model, optimizer)}, checkpoint_id=path)
        else:
            load(path, model, optimizer)
        train(STEPS - 1)
        return _state(model)

    pp2, whole, old = f"{root}/pp2", f"{root}/whole", f"{root}/per-stage-keys"
    out: dict = {"pp2_uninterrupted": save(2, pp2), "pp2_into_pp2": resume(2, pp2)}
    save(1, whole)
    out |= {
        "pp2_into_pp4": resume(4, pp2),
        "pp2_into_whole": resume(1, pp2),
        "whole_into_pp2": resume(2, whole),
    }
    save(2, old, _PerStageKeys)
    out["per_stage_keys_into_pp4"] = resume(4, old, load_checkpoint)
    out["per_stage_keys_into_whole"] = resume(1, old, load_checkpoint)
    # Without a pipeline the format is as before: the groups under one key, as they are.
    model, optimizer, _ = _laid_out(1)
    optim = AppState(model, optimizer).state_dict()["optim"]
    out["whole_format"] = set(optim) == {"state", "param_groups"} and optim["param_groups"] == (
        tuple(group_state(optimizer).items())
    )
    # The earlier format, plainly loaded on its own layout: stage 1 finds the first stage's
    # groups only, as DCP reads them, before its tensors; every rank raises.
    model, optimizer, _ = _laid_out(2)
    before = _state(model)
    out["per_stage_keys_plain"] = load_plainly(old, model, optimizer)
    out["per_stage_keys_unchanged"] = all(
        torch.equal(v, before[k]) for k, v in _state(model).items()
    )
    # The stages' groups merged: one entry per group name, every stage's parameters.
    model, optimizer, _ = _laid_out(2)
    merged = AppState(model, optimizer).state_dict()["optim"]["param_groups"]
    out["merged"] = [(name, len(group["params"])) for name, group in merged]
    # Stage 1's groups with another lr than stage 0's of the same names: an entry each.
    index = model.out is not None
    for group in optimizer.param_groups:
        group["lr"] = 0.5 if index else 0.25
    merged = AppState(model, optimizer).state_dict()["optim"]["param_groups"]
    out["merged_two_lrs"] = [(name, group["lr"]) for name, group in merged]
    dcp.save({CHECKPOINT_KEY: AppState(model, optimizer)}, checkpoint_id=f"{root}/two_lrs")
    model, optimizer, _ = _laid_out(2)  # its own layout: each stage gets its own lr back
    dcp.load({CHECKPOINT_KEY: AppState(model, optimizer)}, checkpoint_id=f"{root}/two_lrs")
    out["two_lrs_pp2"] = [group["lr"] for group in optimizer.param_groups]
    model, optimizer, _ = _laid_out(1)  # one group would hold both: refused, nothing changed
    before = _state(model)
    out["two_lrs_whole"] = _error(load_checkpoint, f"{root}/two_lrs", model, optimizer)
    out["two_lrs_plain"] = load_plainly(f"{root}/two_lrs", model, optimizer)
    out["two_lrs_unchanged"] = all(torch.equal(v, before[k]) for k, v in _state(model).items())
    # save_checkpoint's checksums cover the merged groups, one chunk written by one rank: the
    # checkpoint loads into pp 4 with every chunk checked, and a changed byte in that chunk
    # is refused, nothing changed.
    model, optimizer, _ = _laid_out(2)
    save_checkpoint(f"{root}/checked", model, optimizer)
    model, optimizer, train = _laid_out(4)
    load_checkpoint(f"{root}/checked", model, optimizer)
    train(0)  # weights the damaged checkpoint's would change
    if rank == 0:
        shutil.copytree(f"{root}/checked", f"{root}/flipped")
        metadata = FileSystemReader(f"{root}/flipped").read_metadata()
        (info,) = [
            info
            for index, info in metadata.storage_data.items()
            if index.fqn == f"{CHECKPOINT_KEY}.optim.param_groups"
        ]
        with open(f"{root}/flipped/{info.relative_path}", "r+b") as f:
            f.seek(info.offset + info.length // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    before = _state(model)
    out["flipped_groups"] = _error(load_checkpoint, f"{root}/flipped", model, optimizer)
    out["flipped_unchanged"] = all(torch.equal(v, before[k]) for k, v in _state(model).items())
    # An lr tensor, the same on both stages: one group of the whole model takes it.
    model, optimizer, _ = _laid_out(2)
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(0.125)
    dcp.save({CHECKPOINT_KEY: AppState(model, optimizer)}, checkpoint_id=f"{root}/lr_tensor")
    model, optimizer, _ = _laid_out(1)
    dcp.load({CHECKPOINT_KEY: AppState(model, optimizer)}, checkpoint_id=f"{root}/lr_tensor")
    out["lr_tensor_whole"] = [group["lr"] for group in optimizer.param_groups]
    return out


@pytest.mark.distributed
def test_a_plain_dcp_load_of_an_app_state_reads_any_pipeline_layout(tmp_path):
    """pp 2 -> pp 4, pp 2 -> the whole model, the whole model -> pp 2, each by a plain
    ``dcp.load``, train the last step like the reference (and alike on the ranks that hold a
    parameter), pp 2 -> pp 2 bit for bit like the uninterrupted run; so does the per-stage
    format of an earlier dmuon, through load_checkpoint."""
    results = run_distributed(_relayouts, 4, str(tmp_path))
    want, _ = _reference(STEPS)
    for case in (
        "pp2_into_pp2",
        "pp2_into_pp4",
        "pp2_into_whole",
        "whole_into_pp2",
        "per_stage_keys_into_pp4",
        "per_stage_keys_into_whole",
    ):
        seen: dict[str, torch.Tensor] = {}
        for rank, result in enumerate(results):
            for name, value in result[case].items():
                if name in seen:
                    assert torch.equal(value, seen[name]), f"{case}, rank {rank}: {name} differs"
                seen[name] = value
                err = relative_error(value, want[name])
                assert err < 1e-4, f"{case}, rank {rank}: {name} is {err:.1e} away"
        assert set(seen) == set(want), case
    for rank, result in enumerate(results):
        # On its own layout the merged groups resume bit for bit.
        uninterrupted = result["pp2_uninterrupted"]
        assert result["pp2_into_pp2"].keys() == uninterrupted.keys()
        for name, value in result["pp2_into_pp2"].items():
            assert torch.equal(value, uninterrupted[name]), f"rank {rank}: {name}"
        assert result["whole_format"]
        plain = result["per_stage_keys_plain"]
        assert plain.startswith("CheckpointException"), plain
        assert "param_groups['muon']['params']: missing key(s)" in plain, plain
        assert "dmuon.load_checkpoint" in plain, plain
        if rank >= 2:  # stage 1 stopped at the param groups
            assert result["per_stage_keys_unchanged"]
        # 8 matrices of the 4 blocks; 8 biases and the 2 projections' weights and biases.
        assert result["merged"] == [("muon", 8), ("adamw", 12)], result["merged"]
        two_lrs = [("muon", 0.25), ("adamw", 0.25), ("muon", 0.5), ("adamw", 0.5)]
        assert result["merged_two_lrs"] == two_lrs, result["merged_two_lrs"]
        lr = 0.5 if rank >= 2 else 0.25
        assert result["two_lrs_pp2"] == [lr, lr], result["two_lrs_pp2"]
        for call in ("two_lrs_whole", "two_lrs_plain"):
            got = result[call]
            assert "param_groups['muon'] holds parameters saved with different" in got, got
            assert "lr: 0.25 and 0.5" in got, got
        assert result["two_lrs_whole"].startswith("ValueError: load_checkpoint: ")
        assert result["two_lrs_plain"].startswith("CheckpointException")
        assert result["two_lrs_unchanged"]  # after both
        flipped = result["flipped_groups"]
        assert "checksum mismatch in dmuon.optim.param_groups" in flipped, flipped
        assert result["flipped_unchanged"]
        for lr in result["lr_tensor_whole"]:
            assert isinstance(lr, torch.Tensor) and lr.item() == 0.125, lr


@pytest.mark.distributed
def test_an_interleaved_schedule_trains_like_the_whole_model(pipeline_runs):
    """ScheduleInterleaved1F1B: 4 stages on pp 2 x dp 2, two parts per rank, one Muon each,
    stepped by one MuonParts; the last step resumed from a DCP checkpoint of the parts. Its
    param groups are the whole model's, so it loads into the whole model (load_checkpoint), and
    a plain dcp.load of the parts reads the checkpoint of one stage per rank."""
    _check_against_reference([result["interleaved"]["train"] for result in pipeline_runs])
    _check_against_reference([result["interleaved"]["from_stages"] for result in pipeline_runs])
    _check_against_reference([result["interleaved_into_whole"] for result in pipeline_runs], 2)
    names = [name for name, _ in _net().named_parameters()]
    muon = [name for name, p in _net().named_parameters() if _muon(name, p)]
    whole = [("muon", muon), ("adamw", [name for name in names if name not in muon])]
    for result in pipeline_runs:
        got = result["interleaved"]
        assert got["groups"] == whole, got["groups"]
        # The second part's groups do not fit: no part changed.
        assert "param_groups: missing key(s) ['renamed']" in got["unfit"], got["unfit"]
        assert got["unfit_unchanged"]
        # MuonParts.state_dict / load_state_dict: all parts or none.
        assert got["round_trip"]
        assert got["hooks"][0], got["hooks"][1]
        assert got["first_kept"], got["part_refused"]
        assert "lacks ['lr']" in got["part_refused"], got["part_refused"]
        assert "these parts are stages" in got["other_stages"], got["other_stages"]
        assert got["twins"].startswith("ValueError: model parts 0 and 1 both hold '"), got["twins"]
        assert "the parts' state-dict keys must be apart" in got["twins"], got["twins"]


@pytest.mark.distributed
@pytest.mark.skipif(not V_ON_GLOO, reason=V_SKIP)
def test_a_v_schedule_trains_like_the_whole_model(pipeline_runs):
    """ScheduleDualPipeV splits each backward into the inputs' gradients and the weights'
    (written to .grad by hand), which the step's reduce takes wherever they came from. Its
    parts are stages p and 3 - p, given to MuonParts: the checkpoint's param groups list the
    stages in order, so it loads into the whole model (which refuses another order)."""
    _check_against_reference([result["dual_pipe_v"] for result in pipeline_runs])
    _check_against_reference([result["v_into_whole"] for result in pipeline_runs], 2)


ZERO_BUBBLE = ("zbv", "interleaved_zero_bubble") if V_ON_GLOO else ("interleaved_zero_bubble",)


def _zero_bubble(rank: int, world_size: int) -> dict:
    return {name: _train_split(name) for name in ZERO_BUBBLE}


@pytest.mark.distributed
@pytest.mark.extended
def test_zero_bubble_schedules_train_like_the_whole_model():
    """ScheduleZBVZeroBubble (where V_ON_GLOO) and ScheduleInterleavedZeroBubble."""
    results = run_distributed(_zero_bubble, 4)
    for name in ZERO_BUBBLE:
        _check_against_reference([result[name] for result in results])


@pytest.mark.distributed
def test_muon_parts_clip_and_skip_cover_every_part(pipeline_runs):
    _check_parts_global(pipeline_runs)


def _parts_inside_stages(rank: int, world_size: int, path: str, **inside: bool) -> dict:
    """``MuonParts`` of the interleaved schedule on :func:`_meshes`' ``hsdp`` or ``tp`` mesh
    (``inside``), under ZeRO-2: ``STEPS`` steps; the last step resumed on new parts from a DCP
    checkpoint of the first, and on the whole model without a pipeline; ``STEPS`` steps of the
    parts with the head apart (a part without Muon matrices), and of the zero-bubble V
    schedule; the clip norm and the non-finite skip (under ZeRO-3)."""
    meshes = _meshes(**inside)
    parts, optimizer = _trained_parts(meshes, range(STEPS - 1))
    save_checkpoint(path, parts, optimizer)
    resumed, _ = _trained_parts(
        meshes, range(STEPS - 1, STEPS), load=lambda parts, o: load_checkpoint(path, parts, o)
    )
    out = {
        "train": _parts_state(_trained_parts(meshes, range(STEPS))[0]),
        "resumed": _parts_state(resumed),
        "into_whole": _without_pipeline(path),
        "head_apart": _parts_state(_trained_parts(meshes, range(STEPS), head_apart=True)[0]),
    }
    if V_ON_GLOO:
        out["zbv"] = _train_split("zbv", **inside)
    out["parts_global"] = _parts_global(**inside)
    return out


@pytest.mark.distributed
@pytest.mark.extended
@pytest.mark.parametrize("inside", ["hsdp", "tp"])
def test_muon_parts_train_like_the_whole_model_with_hsdp_or_tp_in_each_stage(tmp_path, inside):
    """Two parts per rank on pp 2 x (replicate 2 x shard 1), where each part's owners publish
    to its replica, and on pp 2 x dp 1 x tp 2, each part's TP grids inside its stage: trained,
    and resumed from a DCP checkpoint (into new parts, and into the whole model on 4
    data-parallel ranks), like the reference, and so do parts whose last holds the head alone
    (under TP its grids come from the head's TP weight) and ScheduleZBVZeroBubble (its weight
    gradients written by hand; where V_ON_GLOO); one clip norm and one skip over every part of every rank."""
    path = str(tmp_path / "checkpoint")
    results = run_distributed(_parts_inside_stages, 4, path, **{inside: True})
    _check_against_reference([result["train"] for result in results])
    _check_against_reference([result["resumed"] for result in results])
    _check_against_reference([result["into_whole"] for result in results], 2)
    _check_against_reference([result["head_apart"] for result in results])
    if V_ON_GLOO:  # else torch 2.11 over gloo: see V_SKIP
        _check_against_reference([result["zbv"] for result in results])
    _check_parts_global(results)


def _check_parts_global(results: list[dict]) -> None:
    _, norm = _reference(1)
    for result in results:
        got = result["parts_global"]
        assert got["norm"] == pytest.approx(norm, rel=1e-5)
        assert got["nan_skipped"] == [True, True, True], got["nan_skipped"]
        assert got["nan_unchanged"]
        assert got["inf_skipped"] and got["inf_unchanged"]
        assert got["finite_stepped"]
        assert got.get("split_named", (True,))[0], got["split_named"]
        # Two steps: each part's post-hook ran in each (the last part's step returns first),
        # and its LR scheduler took them as its optimizer's, without a warning.
        assert got["hooked"] == [1, 0, 1, 0], got["hooked"]
        assert got["scheduler_warnings"] == [], got["scheduler_warnings"]
        assert got["lrs_halved"]
        for call in ("step", "clip"):
            assert "Call the MuonParts' own" in got[f"alone_{call}"], (call, got)


class _Attention(nn.Module):
    """Reports to ``clip``, as its one head's largest logit, how far the rows of its input lie
    from ``rows`` (the real batch's, by hand): the real micro-batches give 0 (up to rounding), a
    stand-in input of zeros, NaN or garbage more."""

    def __init__(self, clip: QKClip, name: str) -> None:
        super().__init__()
        self.q = nn.Linear(WIDTH, WIDTH, bias=False)
        self.k = nn.Linear(WIDTH, WIDTH, bias=False)
        self.clip, self.name = clip, name
        self.rows = torch.zeros(0, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clip.observe(self.name, torch.cdist(x.detach(), self.rows).amin(1).amax()[None])
        return x + torch.tanh(self.q(x) * self.k(x))


class _AttentionStage(nn.Module):
    """Stage ``p`` of two: the attention ``layers.p`` (``checkpointed``: under activation
    checkpointing), with the first projection on stage 0 and the last on stage 1."""

    def __init__(self, p: int, inp: nn.Module, attention: _Attention, checkpointed: bool) -> None:
        super().__init__()
        self.inp = inp if p == 0 else None
        self.layers = nn.ModuleDict({str(p): attention})
        self.out = nn.Linear(WIDTH, OUT) if p == 1 else None
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = x if self.inp is None else self.inp(x)
        for layer in self.layers.values():
            x = checkpoint(layer, x, use_reentrant=False) if self.checkpointed else layer(x)
        return x if self.out is None else self.out(x)


def _qk_clip_stages(rank: int, world_size: int) -> list[list[float]]:
    return [_qk_clip_stage(checkpointed) for checkpointed in (False, True)]


def _qk_clip_stage(checkpointed: bool) -> list[float]:
    """pp 2 x dp 1, each stage's QKClip recording only (τ = inf): the maximum after one GPipe
    step (``checkpointed``: the recompute of backward observes too)."""
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
    pp = mesh["pp"].get_local_rank()
    clip = QKClip(tau=math.inf)
    name = f"layers.{pp}.q.weight"
    torch.manual_seed(0)
    inp, attentions = nn.Linear(IN, WIDTH), [_Attention(clip, name) for _ in range(2)]
    x, y = _batch(0)
    with torch.no_grad():
        attentions[0].rows = inp(x)
        attentions[1].rows = attentions[0](attentions[0].rows)
    model = _AttentionStage(pp, inp, attentions[pp], checkpointed)
    clip.add(name, f"layers.{pp}.k.weight", num_heads=1)
    dedicate_params(model, mesh["dp"], _muon, pipeline_mesh=mesh["pp"], small_param_threshold=0)
    fully_shard(model, mesh=mesh["dp"])
    optimizer = Muon(model, **HYPER.muon_kwargs())
    clip.attach(optimizer)
    stage = PipelineStage(model, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=nn.functional.mse_loss)
    if pp == 0:
        schedule.step(x)
    else:
        schedule.step(target=y)
    optimizer.step()
    return clip.last_max_logits().flatten().tolist()


@pytest.mark.distributed
def test_qk_clip_ignores_the_stages_metadata_inference():
    """Before its first micro-batch each stage runs its module once on stand-in inputs (torch's
    metadata inference: ``torch.empty`` on every stage but the first), forward and backward;
    what its attention reports there, also from an activation checkpoint's recompute, is not
    recorded (see [Note: a pipeline stage's metadata inference]): each stage's maximum is that
    of the real batch."""
    for plain, checkpointed in run_distributed(_qk_clip_stages, 2):
        assert plain == pytest.approx([0.0], abs=1e-5), plain
        assert checkpointed == pytest.approx([0.0], abs=1e-5), checkpointed
