"""Wrappers that rename parameters: activation checkpointing's ``checkpoint_wrapper`` and
``torch.compile``'s module. The clip finds the gradients by tensor, not by name, and the
optimizer state is keyed as the model state (see [Note: optimizer state keys]), so a
checkpoint taken with a wrapper loads without it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _models import batch, build, loss_fn, muon_predicate, shard_layers_then_root
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from dmuon_fsdp import (
    Muon,
    dedicate_params,
    get_model_state_dict,
    get_optimizer_state_dict,
    load_checkpoint,
    save_checkpoint,
)
from dmuon_testing.distributed import run_distributed

ROWS = 4


def _trained(world_size: int, rank: int, wrap: str) -> tuple[torch.nn.Module, Muon]:
    """Two steps of the tiny model, its layers wrapped before ``dedicate_params`` ("before"),
    after ``fully_shard`` ("after", also "compile": each layer a compiled module), or not."""
    model = build(0)
    mesh = init_device_mesh("cpu", (world_size,))
    if wrap == "before":
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
    dedicate_params(model, mesh, muon_predicate, small_param_threshold=0)
    shard_layers_then_root(model, mesh)
    for i, layer in enumerate(model.layers):
        if wrap == "after":
            model.layers[i] = checkpoint_wrapper(layer)
        elif wrap == "compile":
            model.layers[i] = torch.compile(layer, backend="eager")
    optimizer = Muon(model, lr=0.02, adamw_lr=1e-2)
    for step in range(2):
        optimizer.zero_grad()
        loss_fn(model, batch(step, ROWS * world_size).chunk(world_size)[rank]).backward()
        if step == 0:
            optimizer.step()
    return model, optimizer


def _clip_and_keys(rank: int, world_size: int, root: str) -> None:
    plain_model, plain = _trained(world_size, rank, "none")
    norms = {params: _norm(plain.grads_for_clip(params)) for params in ("muon", "all")}
    for wrap in ("before", "after", "compile"):
        _, optimizer = _trained(world_size, rank, wrap)
        for params, norm in norms.items():
            got = _norm(optimizer.grads_for_clip(params))
            assert torch.equal(got, norm), (wrap, params, got, norm)
    # Activation checkpointing drops its prefix from the state dict, and the optimizer's keys
    # follow: a checkpoint taken with the wrapper loads into the plain model, and back.
    wrapped_model, wrapped = _trained(world_size, rank, "before")
    keys = set(get_optimizer_state_dict(wrapped_model, wrapped)["state"])
    assert keys == set(get_optimizer_state_dict(plain_model, plain)["state"])
    assert keys <= set(get_model_state_dict(wrapped_model)), keys
    save_checkpoint(f"{root}/wrapped", wrapped_model, wrapped)
    load_checkpoint(f"{root}/wrapped", plain_model, plain)
    assert _equal(
        get_optimizer_state_dict(plain_model, plain),
        get_optimizer_state_dict(wrapped_model, wrapped),
    )
    save_checkpoint(f"{root}/plain", plain_model, plain)
    load_checkpoint(f"{root}/plain", wrapped_model, wrapped)


def _norm(clip) -> torch.Tensor:
    """The global norm of the gradients a clip would take: this rank's parts, summed over the
    clip's group, count each element once (copies are counted where they are kept)."""
    local = [g.to_local() if isinstance(g, DTensor) else g for g in clip.grads]
    squares = sum((g.double().square().sum() for g in local), torch.zeros((), dtype=torch.float64))
    dist.all_reduce(squares, group=clip.process_group)
    return squares.sqrt()


def _equal(a: object, b: object) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return a == b


@pytest.mark.distributed
def test_a_wrapper_renames_no_gradient_out_of_the_clip_and_no_key_out_of_a_checkpoint(
    tmp_path,
) -> None:
    run_distributed(_clip_and_keys, 2, str(tmp_path))
