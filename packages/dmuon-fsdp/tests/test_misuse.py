"""Misuse on several ranks: each raises one clear error on every rank, naming the fix, within
the test's timeout (no hang, and no rank that goes on alone while another stopped)."""

from __future__ import annotations

import copy
import functools
import os
import re
import warnings
from collections.abc import Callable

import pytest
import torch
from _models import batch, build, loss_fn, muon_predicate, shard_layers_then_root
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    FullyShardedDataParallel,
    fully_shard,
)

from dmuon_fsdp import (
    Muon,
    dedicate_params,
    dedicate_params_ddp,
    get_model_state_dict,
    load_checkpoint,
    replicate,
    save_checkpoint,
    uninstall_patch,
)
from dmuon_testing.distributed import run_distributed

ROWS = 8
_O_PROJ_ON_ADAMW = {"overrides": [{"name": ["*o_proj*"], "set": {"route": "adamw"}}]}


def _built(mesh: DeviceMesh) -> tuple[nn.Module, Muon]:
    """The test model dedicated over ``mesh``, its layers and root sharded, and its Muon."""
    model = build(0)
    dedicate_params(model, mesh, muon_predicate)
    shard_layers_then_root(model, mesh)
    return model, Muon(model)


def _plain_fully_shard_without_the_patch(mesh: DeviceMesh, root: str) -> None:
    """The first public DMuon's script with the patch turned off: most ranks find out inside
    fully_shard, the others at Muon(model)."""
    uninstall_patch()
    model = build(0)
    dedicate_params(model, mesh, muon_predicate, patch_fully_shard=False)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    Muon(model)


def _no_root_fully_shard(mesh: DeviceMesh, root: str) -> None:
    model = build(0)
    dedicate_params(model, mesh, muon_predicate)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    Muon(model)


def _dedicated_twice(mesh: DeviceMesh, root: str) -> None:
    model = build(0)
    dedicate_params(model, mesh, muon_predicate)
    dedicate_params(model, mesh, muon_predicate)


def _changed_after_muon(mesh: DeviceMesh, root: str) -> None:
    model, optimizer = _built(mesh)
    model.layers[1].mlp.up_proj.weight = nn.Parameter(torch.zeros(24, 16))
    loss_fn(model, batch(0, ROWS)).backward()
    optimizer.step()


def _checkpoint_with_other_routes(mesh: DeviceMesh, root: str) -> None:
    """A checkpoint whose o_proj matrices were AdamW's, loaded strictly where they are Muon's:
    its AdamW moments do not belong to this model."""

    def trained(policy: dict | None) -> tuple[nn.Module, Muon]:
        model = build(0)
        dedicate_params(model, mesh, muon_predicate, param_policy=policy)
        shard_layers_then_root(model, mesh)
        optimizer = Muon(model)
        loss_fn(model, batch(0, ROWS)).backward()
        optimizer.step()
        return model, optimizer

    path = os.path.join(root, "adamw_o_proj")
    save_checkpoint(path, *trained(_O_PROJ_ON_ADAMW))
    load_checkpoint(path, *trained(None), strict=True)


def _torch_optimizer(mesh: DeviceMesh, root: str) -> None:
    """torch's AdamW over every parameter: it would never change the dedicated ones."""
    model = build(0)
    dedicate_params(model, mesh, muon_predicate)
    shard_layers_then_root(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    loss_fn(model, batch(0, ROWS)).backward()
    optimizer.step()


def _torch_clip(mesh: DeviceMesh, root: str, how: str) -> None:
    """torch's clip over model.parameters(), an FSDP2 script's line: it took the norm of the
    FSDP2 gradients alone and left the Muon ones unclipped, without a word. ``how``:
    ``"norm"``, ``"value"``, or ``"bound early"``: torch's own clip_grad_norm_, as a script
    that imported it before dedicate_params holds it. Nothing is clipped."""
    model, optimizer = _built(mesh)
    loss_fn(model, batch(0, ROWS)).backward()
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    clip_norm = torch.nn.utils.clip_grad_norm_
    try:
        if how == "value":
            torch.nn.utils.clip_grad_value_(model.parameters(), 1e-6)
        elif how == "norm":
            clip_norm(model.parameters(), 1e-6)
        else:
            getattr(clip_norm, "__wrapped__", clip_norm)(model.parameters(), 1e-6)
    finally:
        after = [p.grad for p in model.parameters() if p.grad is not None]
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
        optimizer.zero_grad()


def _fsdp1(mesh: DeviceMesh, root: str, after: bool) -> None:
    """torch's FSDP1 around a layer before dedicate_params (the predicate saw its flat shards:
    "owner plan differs across ranks"), or around the model after it (a peer's weight read,
    with the advice of reading weights)."""
    model = build(0)
    if after:
        dedicate_params(model, mesh, muon_predicate)
    else:
        model.layers[0] = FullyShardedDataParallel(
            model.layers[0], device_id=torch.device("cpu"), device_mesh=mesh, use_orig_params=True
        )
    if after:
        FullyShardedDataParallel(model, device_id=torch.device("cpu"), device_mesh=mesh)
    else:
        dedicate_params(model, mesh, muon_predicate)


def _torch_optimizer_beside_muon(mesh: DeviceMesh, root: str) -> None:
    """modded-nanogpt's two optimizers: dmuon.Muon(model) and torch's Adam over the other
    parameters, which Muon already steps with AdamW (Adam stepped them a second time, without a
    word). Adam checked once before Muon was built is checked again."""
    model = build(0)
    dedicate_params(model, mesh, muon_predicate)
    shard_layers_then_root(model, mesh)
    rest = [p for n, p in model.named_parameters() if not muon_predicate(n, p)]
    adam = torch.optim.Adam(rest, lr=0.1)
    adam.step()  # no gradient yet: changes nothing, but runs the check
    optimizer = Muon(model)
    loss_fn(model, batch(0, ROWS)).backward()
    before = [p.detach().clone() for p in rest]
    try:
        adam.step()
    finally:
        assert all(torch.equal(p, b) for p, b in zip(rest, before, strict=True))
        optimizer.step()


class _OptimizersContainer(torch.optim.Optimizer):
    """torchtitan's ``OptimizersContainer``: an optimizer whose ``step()`` steps each of its
    ``optimizers`` and whose own groups hold all of their parameters (``Optimizer.__init__``
    over them, for the step hooks torchtitan registers on it)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers
        params = [p for o in optimizers for group in o.param_groups for p in group["params"]]
        super().__init__(params, {})

    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for optimizer in self.optimizers:
            optimizer.step()


def _two_muons_on_one_model(mesh: DeviceMesh, root: str) -> None:
    """Two dmuon.Muon on one model, both stepped after a backward: each steps every trainable
    parameter, so every weight moved twice per backward, without a word. One optimizer stepped
    twice on the same gradients (as torch allows), and one built later that takes over on a
    backward of its own while the first still lives, are not refused."""
    model, first = _built(mesh)
    loss_fn(model, batch(0, ROWS)).backward()
    first.step()
    first.step()
    second = Muon(model)
    second.zero_grad()
    loss_fn(model, batch(1, ROWS)).backward()
    second.step()
    before = {
        (id(p), key): value.clone()
        for p, state in first.state.items()
        for key, value in state.items()
        if isinstance(value, torch.Tensor)
    }
    try:
        first.step()
    finally:
        after = {
            (id(p), key): value
            for p, state in first.state.items()
            for key, value in state.items()
            if isinstance(value, torch.Tensor)
        }
        assert after.keys() == before.keys() and before, "the refused step changed the states"
        assert all(torch.equal(after[k], v) for k, v in before.items()), "it changed a state"


def _torch_optimizer_beside_muon_in_a_container(mesh: DeviceMesh, root: str) -> None:
    """torchtitan's optimizer container: around dmuon.Muon alone it steps (its own groups hold
    Muon's parameters, which it steps through Muon); around torch's Adam beside Muon the Adam
    raises at its own step."""
    model, optimizer = _built(mesh)
    loss_fn(model, batch(0, ROWS)).backward()
    _OptimizersContainer([optimizer]).step()
    rest = [p for n, p in model.named_parameters() if not muon_predicate(n, p)]
    _OptimizersContainer([torch.optim.Adam(rest, lr=0.1)]).step()


def _grad_scaler(mesh: DeviceMesh, root: str) -> None:
    """torch's GradScaler: its unscale_ and inf check read param.grad only."""
    model, optimizer = _built(mesh)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(loss_fn(model, batch(0, ROWS))).backward()
    scaler.step(optimizer)


def _unfrozen_after_muon(mesh: DeviceMesh, root: str) -> None:
    """A parameter frozen when Muon was built, trainable later (staged fine-tuning)."""
    model = build(0)
    model.norm.requires_grad_(False)
    dedicate_params(model, mesh, muon_predicate)
    shard_layers_then_root(model, mesh)
    optimizer = Muon(model)
    model.norm.requires_grad_(True)
    loss_fn(model, batch(0, ROWS)).backward()
    optimizer.step()


class _ConvBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(4, 4, 3)


class _BilinearBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bilinear = nn.Bilinear(4, 4, 2)


class _Stacked(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList([block])


def _conv_kernel_selected(mesh: DeviceMesh, root: str) -> None:
    """A predicate that takes every parameter of two or more dims takes a ConvTranspose1d
    kernel (a Conv1d's is one matrix)."""
    dedicate_params(_Stacked(_ConvBlock()), mesh, lambda n, p: p.ndim >= 2)


def _bilinear_weight_selected(mesh: DeviceMesh, root: str) -> None:
    """The same predicate takes a Bilinear's (out, in1, in2) weight."""
    dedicate_params(_Stacked(_BilinearBlock()), mesh, lambda n, p: p.ndim >= 2)


def _untied_after_dedicate(mesh: DeviceMesh, root: str) -> None:
    """A tied embedding and head, dedicated on the meta device (to_empty keeps them tied),
    then the head given a parameter of its own."""
    with torch.device("meta"):
        model = build(0, tie=True)
    dedicate_params(model, mesh, lambda n, p: p.ndim == 2)
    shard_layers_then_root(model, mesh)
    model.to_empty(device="cpu")
    model.lm_head.weight = nn.Parameter(torch.zeros(model.lm_head.weight.shape))
    Muon(model)


def _tied_after_dedicate(mesh: DeviceMesh, root: str, after_shard: bool = False) -> None:
    """An embedding dedicated untied, then the head tied to it (HF's tie_weights() does this
    assignment) before or after fully_shard: the head's module had none of the refusals (its
    state_dict() went on alone on the owner) or FSDP2's forward failed on '_local_tensor'."""
    model = build(0)
    predicate = lambda n, p: muon_predicate(n, p) or n == "embed_tokens.weight"  # noqa: E731
    dedicate_params(model, mesh, predicate, hook_boundary_strict=False)
    if not after_shard:
        model.lm_head.weight = model.embed_tokens.weight
    shard_layers_then_root(model, mesh)
    if after_shard:
        model.lm_head.weight = model.embed_tokens.weight
    Muon(model)


def _deepcopy_after_dedicate(mesh: DeviceMesh, root: str) -> None:
    """AveragedModel's deepcopy, built after dedicate_params (before fully_shard): a rank
    would reach a weight it does not hold, another rank another one."""
    model = build(0)
    dedicate_params(model, mesh, muon_predicate)
    copy.deepcopy(model)


def _averaged_model_after_fully_shard(mesh: DeviceMesh, root: str) -> None:
    """torch's SWA recipe, AveragedModel(model), once the model is wrapped: FSDP2's own
    refusal of a copy would come first, pointing at state dicts."""
    model = build(0)
    dedicate_params(model, mesh, muon_predicate)
    shard_layers_then_root(model, mesh)
    torch.optim.swa_utils.AveragedModel(model)


def _deepcopy_on_the_replicated_path(mesh: DeviceMesh, root: str) -> None:
    """There every rank holds every weight, and the copy reaches the runtime."""
    model = build(0)
    dedicate_params_ddp(model, mesh, muon_predicate)
    copy.deepcopy(model)


def _replicate_on_the_meta_device(mesh: DeviceMesh, root: str) -> None:
    """replicate() before to_empty: to_empty would replace the parameters it took."""
    with torch.device("meta"):
        model = build(0)
    dedicate_params_ddp(model, mesh, muon_predicate)
    replicate(model, mesh)


def _torch_load_of_a_full_state_dict(mesh: DeviceMesh, root: str) -> None:
    """model.load_state_dict of another model's full state dict: refused before any dedicated
    weight (on its owner) took a value, so dmuon's full state dict is the one it had."""

    def trained(seed: int) -> tuple[nn.Module, dict[str, torch.Tensor]]:
        model = build(seed)
        dedicate_params(model, mesh, muon_predicate)
        shard_layers_then_root(model, mesh)
        Muon(model)
        return model, get_model_state_dict(model)

    _, other = trained(1)
    model, before = trained(0)
    try:
        model.load_state_dict(other)
    finally:
        after = get_model_state_dict(model)
        changed = [k for k in before if not torch.equal(before[k], after[k])]
        assert not changed, f"the refused load changed {changed}"


def _autograd_grad_over_the_parameters(mesh: DeviceMesh, root: str) -> None:
    """A gradient taken with torch.autograd.grad over the model's parameters (a gradient
    penalty, a per-parameter norm): refused before the backward runs, on every rank (each is
    a peer of some dedicated weight)."""
    model = build(0)
    dedicate_params(model, mesh, muon_predicate)
    shard_layers_then_root(model, mesh)
    Muon(model)
    loss = loss_fn(model, batch(0, 4))
    torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)


def _grads_set_by_hand(model: nn.Module) -> None:
    """``torch.autograd.grad`` over the parameters, each gradient then written into ``.grad``
    by hand, and a step."""
    optimizer = Muon(model)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss_fn(model, batch(0, 4)), params, allow_unused=True)
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad
    optimizer.step()


def _grads_set_by_hand_replicated(mesh: DeviceMesh, root: str) -> None:
    """On the replicated path every rank holds every weight, so the writes go through: the step
    left every dedicated matrix as it was, without a word."""
    model = build(0)
    dedicate_params_ddp(model, mesh, muon_predicate)
    replicate(model, mesh)
    _grads_set_by_hand(model)


def _grads_set_by_hand_z2(mesh: DeviceMesh, root: str) -> None:
    """Z2: the weights are held when autograd.grad runs; a peer's write is refused after the
    backward freed them, with the reason."""
    model = build(0)
    dedicate_params(model, mesh, muon_predicate, reshard_after_forward=False)
    shard_layers_then_root(model, mesh)
    _grads_set_by_hand(model)


def _cpu_offload(mesh: DeviceMesh, root: str) -> None:
    """FSDP2's CPU offloading on one layer: its shards, gradients and AdamW states would live
    on the CPU beside dedicated matrices stepped on the device (on a GPU the first step
    raised a device mismatch; refused on every device alike)."""
    model = build(0)
    dedicate_params(model, mesh, muon_predicate)
    fully_shard(model.layers[0], mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(model.layers[1], mesh=mesh)
    fully_shard(model, mesh=mesh)
    Muon(model)


def _all_reduce_hook(mesh: DeviceMesh, root: str) -> None:
    """FSDP2's set_all_reduce_hook (a user's own reduce across replicas): FSDP2 ran it on its
    gradients only, and the dedicated matrices trained on gradients it never saw (a hook that
    halves them: the norms' gradients halved, the q_proj gradient on its owner not)."""
    model = build(0)
    dedicate_params(model, mesh, muon_predicate)
    shard_layers_then_root(model, mesh)
    model.layers[1].set_all_reduce_hook(lambda grad: grad.mul_(0.5))
    Muon(model)


def _all_reduce_hook_after_muon(mesh: DeviceMesh, root: str) -> None:
    """The same hook set after Muon(model): refused at the step, before anything changes."""
    model, optimizer = _built(mesh)
    model.set_all_reduce_hook(lambda grad: grad.mul_(0.5))
    loss_fn(model, batch(0, 4)).backward()
    optimizer.step()


def _state_lookups_of_an_iteration(rank: int, world_size: int) -> list[int]:
    """How often the second and third iterations (forward, backward, step, zero_grad) look
    FSDP2's state up (``FSDPModule._get_fsdp_state``; the first finds each pack's gradient
    divide factor): the check for an all-reduce hook at each step, and backward's read of
    FSDP2's gradient sync flags, read the parameter groups found once (before, each looked
    every fully_shard module up again: 3 look-ups each here, about 0.8 µs apiece)."""
    mesh = init_device_mesh("cpu", (world_size,))
    model, optimizer = _built(mesh)
    original = FSDPModule._get_fsdp_state
    lookups = []
    for step in range(3):
        calls = 0

        def counted(self: FSDPModule) -> object:
            nonlocal calls
            calls += 1
            return original(self)

        FSDPModule._get_fsdp_state = counted  # type: ignore[method-assign]
        try:
            loss_fn(model, batch(step, 4)).backward()
            optimizer.step()
            optimizer.zero_grad()
        finally:
            FSDPModule._get_fsdp_state = original  # type: ignore[method-assign]
        lookups.append(calls)
    uninstall_patch()
    return lookups[1:]


@pytest.mark.distributed
def test_an_iteration_looks_no_fsdp2_state_up() -> None:
    # A hook set after Muon(model) is still refused (the scenario above), and FSDP2's
    # set_requires_gradient_sync still reaches dmuon's reduces (test_no_sync).
    assert run_distributed(_state_lookups_of_an_iteration, 2) == [[0, 0], [0, 0]]


def _optimizer_for_the_model(mesh: DeviceMesh, root: str) -> None:
    """The optimizer passed where the model goes (it raised AttributeError: 'Muon' object has
    no attribute 'parameters')."""
    model = build(0)
    dedicate_params(model, mesh, muon_predicate)
    shard_layers_then_root(model, mesh)
    get_model_state_dict(Muon(model))  # type: ignore[arg-type]


def _fully_shard_on_the_replicated_path(mesh: DeviceMesh, root: str) -> None:
    """fully_shard over a model of dedicate_params_ddp (the message gave the sharded path's
    fixes: the patch, ignored_params)."""
    uninstall_patch()
    model = build(0)
    dedicate_params_ddp(model, mesh, muon_predicate)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    Muon(model)


def _optimizer_copied(mesh: DeviceMesh, root: str) -> None:
    """copy.deepcopy of the optimizer after a step (it raised 'Attempted to call copy_() on an
    invalid python storage')."""
    model, optimizer = _built(mesh)
    loss_fn(model, batch(0, ROWS)).backward()
    optimizer.step()
    copy.deepcopy(optimizer)


def _optimizer_saved_whole(mesh: DeviceMesh, root: str) -> None:
    """torch.save of the optimizer object, not its state dict (it raised NotHeldError for a
    weight with 'operation: getset_descriptor.__get__' and the model's reads as the fix)."""
    model = build(0)
    dedicate_params(model, mesh, muon_predicate)
    shard_layers_then_root(model, mesh)
    torch.save(Muon(model), os.path.join(root, "optimizer.pt"))


SCENARIOS: dict[str, tuple[Callable[[DeviceMesh, str], None], str]] = {
    "plain fully_shard, patch off": (
        _plain_fully_shard_without_the_patch,
        r"RuntimeError: dedicated parameter '[\w.]+' \(owner: rank \d; this rank \d is its "
        r"\w+\) was taken by fully_shard .*patch_fully_shard=True.*"
        r"ignored_params=dmuon\.dedicated_params_of\(model\)",
    ),
    "no fully_shard on the root": (
        _no_root_fully_shard,
        r"ValueError: \d+ trainable parameter\(s\) are neither dedicated nor managed by FSDP2.*"
        r"fully_shard\(model\) on the root",
    ),
    "dedicate_params twice": (
        _dedicated_twice,
        r"RuntimeError: dedicate_params was already called on this TinyLlama; call it once",
    ),
    "a dedicated parameter replaced after Muon(model)": (
        _changed_after_muon,
        r"RuntimeError: dedicated parameter 'layers\.1\.mlp\.up_proj\.weight' is no longer "
        r"registered on its module.*do not reassign dedicated parameters",
    ),
    "torch's AdamW over model.parameters()": (
        _torch_optimizer,
        r"ValueError: AdamW\.step\(\): its param_groups hold the dedicated parameter "
        r"'layers\.\d\.\w+\.\w+_proj\.weight'.*never reaches \.grad.*dmuon\.Muon\(model",
    ),
    **{
        f"torch.nn.utils.clip_grad_{how}": (
            functools.partial(_torch_clip, how=how),
            rf"ValueError: torch\.nn\.utils\.clip_grad_{how.split()[0]}_: its parameters hold the "
            r"dedicated parameter 'layers\.0\.attn\.q_proj\.weight'.*leave it (out of the norm "
            r"and unclipped|unclamped).*dmuon\.clip(_grad_norm_|\.clip_grad_value_)\(optimizer, \w+, "
            r"params='all'\).*Nothing was clipped",
        )
        for how in ("norm", "value")
    },
    "torch.nn.utils.clip_grad_norm_ imported before dedicate_params": (
        functools.partial(_torch_clip, how="bound early"),
        r"ValueError: torch\.nn\.utils\.clip_grad_norm_: its parameters hold the dedicated "
        r"parameter 'layers\.0\.attn\.q_proj\.weight'.*Nothing was clipped",
    ),
    "FSDP1 around a layer before dedicate_params": (
        functools.partial(_fsdp1, after=False),
        r"RuntimeError: FullyShardedDataParallel \(FSDP1\) already wraps 'layers\.0' of the.*"
        r"dmuon works with FSDP2's fully_shard.*dmuon\.dedicate_params\(model, mesh, "
        r"predicate\) -> fully_shard\(layer, mesh=mesh\)",
    ),
    "FSDP1 around the model after dedicate_params": (
        functools.partial(_fsdp1, after=True),
        r"NotHeldError: dedicated parameter '[\w.]+' .* is not held on this rank right now.*"
        r"torch's FSDP1 \(FullyShardedDataParallel\) flattens every weight.*Replace "
        r"FullyShardedDataParallel\(model, \.\.\.\) by fully_shard\(layer, mesh=mesh\)",
    ),
    "torch's Adam beside dmuon.Muon over the other parameters": (
        _torch_optimizer_beside_muon,
        r"ValueError: Adam\.step\(\): its param_groups hold '[\w.]+', which dmuon\.Muon steps "
        r"already.*Adam would step it a second time.*replaces both optimizers.*adamw_lr=.*"
        r"nothing was stepped",
    ),
    "torch's Adam beside dmuon.Muon, both in torchtitan's optimizer container": (
        _torch_optimizer_beside_muon_in_a_container,
        r"ValueError: Adam\.step\(\): its param_groups hold '[\w.]+', which dmuon\.Muon steps "
        r"already.*Adam would step it a second time",
    ),
    "two dmuon.Muon on one model, both stepped": (
        _two_muons_on_one_model,
        r"RuntimeError: Muon\.step\(\): another dmuon\.Muon on this FSDPTinyLlama already "
        r"stepped the gradients of its last backward.*'[\w.]+' among them.*nothing was "
        r"stepped.*Step one dmuon\.Muon per model.*del optimizer",
    ),
    "model.load_state_dict of a full state dict": (
        _torch_load_of_a_full_state_dict,
        r"RuntimeError: load_state_dict: 'layers\.0\.attn\.q_proj\.weight' is the dedicated "
        r"parameter .*nothing of dmuon's weights was changed.*dmuon\.set_model_state_dict",
    ),
    "a GradScaler": (
        _grad_scaler,
        r"RuntimeError: Muon\.step\(\) was called by a GradScaler: loss scaling does not reach.*"
        r"Train in bfloat16",
    ),
    "a parameter unfrozen after Muon(model)": (
        _unfrozen_after_muon,
        r"ValueError: 1 parameter\(s\) require grad but were frozen when Muon\(model\) was built"
        r".*'norm\.weight'.*before dedicate_params and Muon\(model\)",
    ),
    "a ConvTranspose1d kernel selected": (
        _conv_kernel_selected,
        r"ValueError: 'layers\.0\.conv\.weight' \(shape \(4, 4, 3\)\) is the kernel of a "
        r"ConvTranspose1d, not"
        r" a stack of experts.*route it to 'adamw'",
    ),
    "a Bilinear weight selected": (
        _bilinear_weight_selected,
        r"ValueError: 'layers\.0\.bilinear\.weight' \(shape \(2, 4, 4\)\) is the weight of a "
        r"Bilinear, not a stack of experts",
    ),
    "a tied weight untied after dedicate_params": (
        _untied_after_dedicate,
        r"ValueError: 'lm_head\.weight' was tied to the dedicated weight 'embed_tokens\.weight'"
        r".*Tie it again, as for any model: model\.lm_head\.weight = model\.embed_tokens\.weight",
    ),
    **{
        f"a weight tied after dedicate_params{where}": (
            functools.partial(_tied_after_dedicate, after_shard=bool(where)),
            r"RuntimeError: dedicated parameter 'embed_tokens\.weight' is registered as "
            r"'lm_head\.weight' too \(on module 'lm_head'\).*Tie the weights first",
        )
        for where in ("", " and fully_shard")
    },
    "copy.deepcopy after dedicate_params": (
        _deepcopy_after_dedicate,
        r"TypeError: copy\.deepcopy cannot copy a model after dedicate_params.*nothing was"
        r" copied.*dmuon\.EMA\(optimizer\)",
    ),
    "AveragedModel after fully_shard": (
        _averaged_model_after_fully_shard,
        r"TypeError: copy\.deepcopy cannot copy a model after dedicate_params \(torch\.optim"
        r"\.swa_utils\.AveragedModel copies its model so\).*dmuon\.EMA\(optimizer\)",
    ),
    "copy.deepcopy on the replicated path": (
        _deepcopy_on_the_replicated_path,
        r"TypeError: copy\.deepcopy cannot copy a model after dedicate_params.*dmuon\.EMA.*"
        r"load dmuon\.get_model_state_dict\(model\) into it.*copy the model before "
        r"dedicate_params",
    ),
    "replicate() on the meta device": (
        _replicate_on_the_meta_device,
        r"ValueError: replicate\(\): 'embed_tokens\.weight' is still on the meta device; "
        r"replicate broadcasts rank 0's values.*dedicate_params_ddp -> to_empty -> init",
    ),
    "torch.autograd.grad over the parameters": (
        _autograd_grad_over_the_parameters,
        r"NotHeldError: .*\(operation: grad\).*torch\.autograd\.grad and backward\(inputs=\.\.\.\) "
        r"cannot take a dedicated weight.*Call loss\.backward\(\) without inputs",
    ),
    "p.grad set by hand on the replicated path": (
        _grads_set_by_hand_replicated,
        r"RuntimeError: Muon\.step\(\): dedicated parameter '[\w.]+' has a \.grad that no "
        r"backward sent to its owner.*Compute the gradients with loss\.backward\(\)",
    ),
    "p.grad set by hand under Z2": (
        _grads_set_by_hand_z2,
        r"NotHeldError: .*\(operation: set \.grad\).*A \.grad written by hand.*never reaches "
        r"the owner.*loss\.backward\(\) on every rank",
    ),
    "CPU offloading": (
        _cpu_offload,
        r"ValueError: fully_shard\('layers\.0'\) was given offload_policy=CPUOffloadPolicy\(\),"
        r" which dmuon does not support.*Call fully_shard without offload_policy",
    ),
    "FSDP2's all-reduce hook": (
        _all_reduce_hook,
        r"ValueError: fully_shard\('layers\.1'\) has an all-reduce hook \(set_all_reduce_hook\),"
        r" which dmuon does not support.*Remove the hook; for replicas use HSDP.*"
        r"replicate_mesh=hsdp\['replicate'\]\)",
    ),
    "FSDP2's all-reduce hook set after Muon(model)": (
        _all_reduce_hook_after_muon,
        r"ValueError: fully_shard\('model'\) has an all-reduce hook",
    ),
    "the optimizer for the model": (
        _optimizer_for_the_model,
        r"TypeError: model must be the nn\.Module given to dmuon\.dedicate_params, got Muon "
        r"\(pass optimizer\.model, not the optimizer\)",
    ),
    "fully_shard on the replicated path": (
        _fully_shard_on_the_replicated_path,
        r"RuntimeError: dedicated parameter '[\w.]+' .* was taken by fully_shard .*"
        r"dedicate_params_ddp, the replicated path.*dmuon\.replicate\(model, mesh\) for the "
        r"other parameters instead of fully_shard",
    ),
    "copy.deepcopy of the optimizer": (
        _optimizer_copied,
        r"TypeError: dmuon\.Muon cannot be copied or pickled .*optimizer\.state_dict\(\).*"
        r"build another dmuon\.Muon\(model, \.\.\.\) and load_state_dict",
    ),
    "torch.save of the optimizer": (
        _optimizer_saved_whole,
        r"TypeError: dmuon\.Muon cannot be copied or pickled .*torch\.save\(optimizer\."
        r"state_dict\(\), path\)",
    ),
    "a checkpoint with other routes, strict": (
        _checkpoint_with_other_routes,
        r"ValueError: load_checkpoint: the checkpoint holds .layers\.0\.attn\.o_proj\.weight"
        r"\.exp_avg.*optimizer state of another route.*another predicate or param_policy",
    ),
}


def _every_misuse(rank: int, world_size: int, root: str) -> dict[str, str]:
    mesh = init_device_mesh("cpu", (world_size,))
    seen: dict[str, str] = {}
    for name, (scenario, _) in SCENARIOS.items():
        try:
            scenario(mesh, root)
        except Exception as exc:
            seen[name] = f"{type(exc).__name__}: {exc}"
        else:
            seen[name] = "no error"
    uninstall_patch()
    return seen


@pytest.mark.distributed
def test_each_misuse_raises_the_same_clear_error_on_every_rank(tmp_path) -> None:
    per_rank = run_distributed(_every_misuse, 2, str(tmp_path))
    for name, (_, expected) in SCENARIOS.items():
        for rank, seen in enumerate(per_rank):
            assert re.match(expected, seen[name], re.DOTALL), (name, rank, seen[name][:400])


def _z2_in_fully_shard_only(rank: int, world_size: int) -> list[list[str]]:
    """``reshard_after_forward=False`` on every layer's fully_shard: a warning while
    dedicate_params keeps its default (Z3), also where the model is wrapped (Lightning), none
    once it is given False too, nor for torchtitan's habit of keeping only the last layer (the
    others reshard)."""
    mesh = init_device_mesh("cpu", (world_size,))
    seen = []
    cases = ((True, (False, False)), (False, (False, False)), (True, (True, False)))
    for wrapped, (dedicated, kept) in [(False, case) for case in cases] + [(True, cases[0])]:
        model = build(0)
        # Lightning's layout: the module given to dmuon holds the one fully_shard takes.
        outer = nn.ModuleDict({"model": model}) if wrapped else model
        dedicate_params(outer, mesh, muon_predicate, reshard_after_forward=dedicated)
        for layer, reshard in zip(model.layers, kept, strict=True):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Muon(outer)
        seen.append([str(w.message) for w in caught if "reshard_after_forward" in str(w.message)])
    uninstall_patch()
    return seen


@pytest.mark.distributed
def test_z2_asked_of_fully_shard_alone_is_warned() -> None:
    for seen in run_distributed(_z2_in_fully_shard_only, 2):
        warned, both_z2, last_layer_only, wrapped = seen
        for warning in (warned, wrapped):
            assert len(warning) == 1 and re.search(
                r"every fully_shard below the root was given reshard_after_forward=False \(Z2\),"
                r" but dedicate_params was not.*pass reshard_after_forward=False to"
                r" dedicate_params",
                warning[0],
            ), warning
        assert both_z2 == [] and last_layer_only == []


def _frozen_after_dedicate(rank: int, world_size: int) -> list[tuple[str, str]]:
    """A dedicated matrix frozen between dedicate_params and Muon(model) (a LoRA base frozen
    late): it stays dedicated, gathered for every forward and never stepped; warned at the
    line that built the optimizer (message, file)."""
    mesh = init_device_mesh("cpu", (world_size,))
    model = build(0)
    dedicate_params(model, mesh, muon_predicate)
    model.layers[0].attn.q_proj.weight.requires_grad_(False)
    shard_layers_then_root(model, mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Muon(model)
    uninstall_patch()
    return [
        (str(w.message), w.filename)
        for w in caught
        if "frozen between dedicate_params" in str(w.message)
    ]


@pytest.mark.distributed
def test_a_matrix_frozen_after_dedicate_params_is_warned() -> None:
    for seen in run_distributed(_frozen_after_dedicate, 2):
        assert len(seen) == 1 and re.search(
            r"1 dedicated parameter\(s\) were frozen between dedicate_params and Muon\(model\)"
            r" \(first: \['layers\.0\.attn\.q_proj\.weight'\]\): it is still kept whole.*"
            r"freeze it before dedicate_params.*freeze it after Muon\(model\)",
            seen[0][0],
        ), seen
        assert seen[0][1] == __file__, seen  # the caller's line, not dmuon's
