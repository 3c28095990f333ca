"""Loading state a step cannot use is refused on every rank before anything changes, and a
loaded state dict's hyperparameters reach the step (each case failed before its fix)."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from _models import build, muon_predicate, shard_layers_then_root
from _reference import lm_loss, make_batch, shard
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.optim.lr_scheduler import LambdaLR

from dmuon_fsdp import (
    Muon,
    dedicate_params,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from dmuon_testing.distributed import run_distributed

pytestmark = pytest.mark.distributed
ROWS, SEQ, VOCAB = 8, 8, 32


def _trained(world_size: int) -> tuple[nn.Module, Muon]:
    model = build(0)
    mesh = init_device_mesh("cpu", (world_size,))
    dedicate_params(model, mesh, muon_predicate, small_param_threshold=0)
    shard_layers_then_root(model, mesh)
    optimizer = Muon(model, lr=0.02, adamw_lr=1e-3)
    _step(model, optimizer, 0)
    return model, optimizer


def _step(model: nn.Module, optimizer: Muon, step: int) -> None:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    optimizer.zero_grad()
    lm_loss(model, shard(make_batch(step, ROWS, SEQ, VOCAB), rank, world)).backward()
    optimizer.step()


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in get_model_state_dict(model).items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _round_trip(value: object) -> object:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _loaded_groups_reach_the_step(rank: int, world_size: int) -> list[int]:
    # torch's load makes new group dicts; the step read the ones it was built on, so a
    # scheduler (or a loaded lr) after optimizer.load_state_dict changed nothing.
    model, optimizer = _trained(world_size)
    optimizer.load_state_dict(_round_trip(optimizer.state_dict()))
    scheduler = LambdaLR(optimizer, lambda step: 0.0)
    before = _weights(model)
    _step(model, optimizer, 1)
    scheduler.step()
    moved = [sum(not torch.equal(before[k], v) for k, v in _weights(model).items())]
    state = optimizer.state_dict()
    for group in state["param_groups"]:
        group["lr"] = 0.0
    model, optimizer = _trained(world_size)
    optimizer.load_state_dict(state)
    before = _weights(model)
    _step(model, optimizer, 1)
    moved.append(sum(not torch.equal(before[k], v) for k, v in _weights(model).items()))
    return moved


def test_a_loaded_state_dicts_groups_reach_the_step() -> None:
    assert run_distributed(_loaded_groups_reach_the_step, 2) == [[0, 0], [0, 0]]


def _bad_loads(rank: int, world_size: int) -> dict[str, str]:
    model, optimizer = _trained(world_size)
    weights, full = _weights(model), get_optimizer_state_dict(model, optimizer)
    own = optimizer.state_dict()
    messages: dict[str, str] = {}

    def refused(case: str, call, *args: object) -> None:
        with pytest.raises(ValueError) as info:
            call(*args)
        messages[case] = str(info.value)
        assert _same(_weights(model), weights), case
        after = get_optimizer_state_dict(model, optimizer)
        assert after["param_groups"] == full["param_groups"], case
        assert all(_same(after["state"][k], v) for k, v in full["state"].items()), case

    for key, value in (("lr", math.nan), ("betas", (0.9, 0.9, 0.9)), ("betas", 0.9)):
        bad = copy.deepcopy(full)
        group = next(g for g in bad["param_groups"].values() if key in g or key == "lr")
        group[key] = value
        refused(f"set {key}={value}", set_optimizer_state_dict, model, optimizer, bad)
        bad_own = copy.deepcopy(own)
        adamw = next(g for g in bad_own["param_groups"] if g["optimizer"] == "adamw")
        adamw[key] = value
        refused(f"load {key}={value}", optimizer.load_state_dict, bad_own)

    # An AdamW entry without exp_avg, a momentum buffer without data.
    bad_own = copy.deepcopy(own)
    adamw_ids = next(g["params"] for g in bad_own["param_groups"] if g["optimizer"] == "adamw")
    del bad_own["state"][next(i for i in adamw_ids if i in bad_own["state"])]["exp_avg"]
    refused("load without exp_avg", optimizer.load_state_dict, bad_own)
    bad_own = copy.deepcopy(own)
    muon_ids = next(g["params"] for g in bad_own["param_groups"] if g["optimizer"] == "muon")
    muon_id = next((i for i in muon_ids if i in bad_own["state"]), None)
    if muon_id is not None:
        buffer = bad_own["state"][muon_id]["momentum_buffer"]
        bad_own["state"][muon_id]["momentum_buffer"] = torch.empty_like(buffer, device="meta")
        refused("load a meta momentum", optimizer.load_state_dict, bad_own)

    # A weight without data: every rank passes its own dictionary, and only the last one's
    # is bad; every rank raises, and no rank wrote anything.
    sd = {k: v.clone() for k, v in weights.items()}
    if rank == world_size - 1:
        sd["lm_head.weight"] = torch.empty_like(sd["lm_head.weight"], device="meta")
    refused("model, one rank's dict", set_model_state_dict, model, sd)
    _step(model, optimizer, 1)  # the refused calls left a usable optimizer
    return messages


def test_state_that_does_not_fit_is_refused_on_every_rank_before_any_change() -> None:
    results = run_distributed(_bad_loads, 2)
    for rank, messages in enumerate(results):
        assert "lr must be a finite number" in messages["set lr=nan"]
        assert "adamw_betas must be a pair" in messages["load betas=0.9"]
        assert "no 'exp_avg'" in messages["load without exp_avg"]
        if "load a meta momentum" in messages:
            assert "meta device" in messages["load a meta momentum"]
        model = messages["model, one rank's dict"]
        assert ("meta device" in model) if rank == 1 else ("rank(s) [1]" in model), model


def test_a_default_group_name_taken_by_another_group_is_refused() -> None:
    run_distributed(_group_names, 1)


def _group_names(rank: int, world_size: int) -> None:
    model = build(0)
    mesh = init_device_mesh("cpu", (world_size,))
    dedicate_params(model, mesh, muon_predicate)
    shard_layers_then_root(model, mesh)
    params = list(model.parameters())
    groups = [{"params": params[:3], "group_name": "group1"}, {"params": params[3:]}]
    with pytest.raises(ValueError, match=r"default name 'group1' is another group's"):
        Muon(model, param_groups=groups)


def _misuses(rank: int, world_size: int, directory: str) -> None:
    import os

    from dmuon_fsdp import QKClip, load_checkpoint, save_checkpoint

    model, optimizer = _trained(world_size)
    weights = _weights(model)
    with pytest.raises(TypeError, match="closure must be None or a callable"):
        optimizer.step(closure=42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="state_dict must be a dict"):
        optimizer.load_state_dict(None)  # type: ignore[arg-type]
    full = get_optimizer_state_dict(model, optimizer)
    with pytest.raises(ValueError, match=r"full optimizer state dict.*set_optimizer_state_dict"):
        optimizer.load_state_dict(full)
    swapped = copy.deepcopy(full)
    group = next(iter(swapped["param_groups"].values()))
    group["params"] = group["params"][::-1]
    with pytest.raises(ValueError, match="lists this group's parameters in another order"):
        set_optimizer_state_dict(model, optimizer, swapped)
    with pytest.raises(TypeError, match="cpu_offload must be a bool"):
        get_model_state_dict(model, cpu_offload="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="strict must be a bool"):
        set_optimizer_state_dict(model, optimizer, full, strict="no")  # type: ignore[arg-type]
    a_file = os.path.join(directory, "a_file")
    open(a_file, "w").close()
    for call in (save_checkpoint, load_checkpoint):
        with pytest.raises(ValueError, match="is a file; a checkpoint is a directory"):
            call(a_file, model, optimizer)
        # the directory last, as some libraries take it: named, with the order
        with pytest.raises(
            TypeError, match=r"got FSDPTinyLlama; the directory comes first: \w+_checkpoint\(path,"
        ):
            call(model, optimizer, directory)  # type: ignore[arg-type]
    q = "layers.0.attn.q_proj.weight"
    clip = QKClip()
    clip.add(q, "layers.0.attn.k_proj.weight", 2)
    with pytest.raises(TypeError, match=r"QKClip\.attach takes dmuon's Muon"):
        clip.attach(torch.optim.AdamW(model.parameters()))
    norm = QKClip()
    norm.add(q, "layers.0.attn_norm.weight", 2)
    with pytest.raises(ValueError, match=r"'layers.0.attn_norm.weight' has shape \(16,\)"):
        norm.attach(optimizer)
    clip.attach(optimizer)
    with pytest.raises(TypeError, match="max_logits must be a 1-D tensor"):
        clip.observe(q, [1.0, 2.0])  # type: ignore[arg-type]
    assert _same(_weights(model), weights)
    _step(model, optimizer, 1)


def test_misuses_raise_a_clear_error_and_change_nothing(tmp_path) -> None:
    run_distributed(_misuses, 1, str(tmp_path))
