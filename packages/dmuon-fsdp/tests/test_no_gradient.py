"""A parameter without a gradient is left alone, as ``torch.optim`` leaves it: a dedicated
matrix frozen mid-run (``requires_grad_(False)``) and the matrices of a block the step's
forward skipped keep their weight and momentum bit for bit, with weight decay on, on every
path (1-D, HSDP, tensor parallelism, the replicated path, expert stacks); made trainable
again, the frozen matrix trains. A matrix only some ranks' forwards used trains on the
gradients those ranks gave, also when its owner is among the ranks that left it out."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import pytest
import torch
from _models import (
    batch,
    build,
    loss_fn,
    muon_predicate,
    shard_layers_then_root,
    tensor_parallel,
)
from _moe import build_moe, moe_predicate
from _sgd_train import ddp_model, make_mesh, setup_model
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from dmuon_fsdp import (
    Muon,
    StepOptions,
    dedicate_params,
    dedicate_params_ddp,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_runtime,
    no_sync,
    replicate,
)
from dmuon_fsdp.holder import Role
from dmuon_testing.distributed import run_distributed

ROWS = 8
FROZEN = "layers.0.mlp.up_proj.weight"
# Matrices of the block whose MLP the second step's forward skips.
UNUSED = ("layers.1.mlp.gate_proj.weight", "layers.1.mlp.up_proj.weight")
STACK = "layers.1.experts.w1"  # an expert stack the second step's forward skips


def _skip(module: nn.Module) -> None:
    """Make the forward not use ``module`` (its parameters get no gradient)."""
    module.forward = lambda x, *args: torch.zeros_like(x)  # type: ignore[method-assign]


def _model(path: str, world_size: int) -> nn.Module:
    if path == "moe":
        model = build_moe(4)
        mesh = init_device_mesh("cpu", (world_size,))
        dedicate_params(model, mesh, moe_predicate)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if path == "ddp":
        return ddp_model(world_size)[0]
    if path == "tp":
        mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
        model = build(0)
        tensor_parallel(model, mesh["tp"])
        dedicate_params(model, mesh["dp"], muon_predicate, small_param_threshold=0)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model
    model, _ = setup_model(world_size, replicate=2 if path == "hsdp" else 1, reshard=path != "z2")
    return model


def _step(model: nn.Module, optimizer: Muon, step: int, rank: int, world_size: int) -> None:
    optimizer.zero_grad()
    loss_fn(model, batch(step, ROWS).chunk(world_size)[rank]).backward()
    optimizer.step()


def _momenta(model: nn.Module, optimizer: Muon) -> dict[str, Tensor]:
    state = get_optimizer_state_dict(model, optimizer)["state"]
    return {k: v["momentum_buffer"] for k, v in state.items() if "momentum_buffer" in v}


def _frozen_and_unused(rank: int, world_size: int, path: str) -> dict[str, object]:
    model = _model(path, world_size)
    optimizer = Muon(model, lr=0.05, weight_decay=0.1)
    _step(model, optimizer, 0, rank, world_size)  # momentum exists for every matrix
    if path == "moe":
        still = [STACK]
        _skip(model.layers[1].experts)
    else:
        still = [FROZEN, *UNUSED]
        dict(model.named_parameters())[FROZEN].requires_grad_(False)
        _skip(model.layers[1].mlp)
    weights = get_model_state_dict(model)
    momenta = _momenta(model, optimizer)
    _step(model, optimizer, 1, rank, world_size)
    after = get_model_state_dict(model)
    after_momenta = _momenta(model, optimizer)
    # Trainable again (the fix the optimizer's refusal of a parameter unfrozen after it was
    # built names): the next step trains it.
    if path != "moe":
        dict(model.named_parameters())[FROZEN].requires_grad_(True)
        _step(model, optimizer, 2, rank, world_size)
    again = get_model_state_dict(model)
    return {
        "trains again": path == "moe" or not torch.equal(after[FROZEN], again[FROZEN]),
        "unchanged": {n: torch.equal(weights[n], after[n]) for n in still},
        "momentum kept": {n: torch.equal(momenta[n], after_momenta[n]) for n in still},
        "others moved": all(
            not torch.equal(weights[n], after[n])
            for n in after_momenta
            if n not in still and "layers.1" not in n
        ),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("path", ["1d", "hsdp", "tp", "ddp", "moe"])
def test_a_matrix_without_a_gradient_keeps_its_weight_and_momentum(path: str) -> None:
    for result in run_distributed(_frozen_and_unused, 2, path):
        assert all(result["unchanged"].values()), result  # type: ignore[union-attr]
        assert all(result["momentum kept"].values()), result  # type: ignore[union-attr]
        assert result["others moved"], result
        assert result["trains again"], result


def _zero_grads_kept(rank: int, world_size: int, path: str) -> dict[str, bool]:
    """``zero_grad(set_to_none=False)`` keeps zero gradients, as torch's does: a matrix frozen
    after a step is stepped on its zero gradient (its momentum times β, its weight moved), as
    ``torch.optim.Muon`` steps it, and so is every matrix in a step with no backward; the
    owners' gradients are zeroed in place, the same tensors from step to step."""
    model = _model(path, world_size)
    optimizer = Muon(model, lr=0.05, momentum=0.9, weight_decay=0.1)
    _step(model, optimizer, 0, rank, world_size)
    dict(model.named_parameters())[FROZEN].requires_grad_(False)
    weights, momenta = get_model_state_dict(model), _momenta(model, optimizer)
    optimizer.zero_grad(set_to_none=False)
    loss_fn(model, batch(1, ROWS).chunk(world_size)[rank]).backward()
    optimizer.step()
    after, after_momenta = get_model_state_dict(model), _momenta(model, optimizer)
    grads = {dp.fqn: dp.grad for dp in optimizer.runtime.owned}
    optimizer.zero_grad(set_to_none=False)
    optimizer.step()  # no backward: every gradient is zero
    last = _momenta(model, optimizer)
    return {
        # Zeroed in place, as torch's .grad: the same tensors from step to step.
        "owner grads kept": all(
            dp.grad is not None and dp.grad is grads[dp.fqn] and not dp.grad.any()
            for dp in optimizer.runtime.owned
        ),
        "frozen momentum times β": torch.equal(after_momenta[FROZEN], momenta[FROZEN] * 0.9),
        "frozen weight moved": not torch.equal(after[FROZEN], weights[FROZEN]),
        "every momentum times β": all(torch.equal(last[n], after_momenta[n] * 0.9) for n in last),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("path", ["1d", "ddp"])
def test_zero_grad_set_to_none_false_steps_on_zeros_as_torch(path: str) -> None:
    for result in run_distributed(_zero_grads_kept, 2, path):
        assert all(result.values()), result


def _loss_before_the_last_layer(rank: int, world_size: int, path: str) -> dict[str, bool]:
    """Every layer's forward runs, but the loss is taken on the first layer's output (a probe,
    a distillation of hidden states): the last layer's backward never runs on any rank."""
    model = _model(path, world_size)
    optimizer = Muon(model, lr=0.05, weight_decay=0.1)
    _step(model, optimizer, 0, rank, world_size)
    hidden: list[Tensor] = []
    model.layers[0].register_forward_hook(lambda module, args, out: hidden.append(out))
    weights = get_model_state_dict(model)
    momenta = _momenta(model, optimizer)
    optimizer.zero_grad()
    model(batch(1, ROWS).chunk(world_size)[rank])
    hidden[0].square().mean().backward()
    optimizer.step()
    after = get_model_state_dict(model)
    after_momenta = _momenta(model, optimizer)
    last = [n for n in after_momenta if n.startswith("layers.1.")]
    return {
        "last layer kept": bool(last) and all(torch.equal(weights[n], after[n]) for n in last),
        "its momentum kept": all(torch.equal(momenta[n], after_momenta[n]) for n in last),
        "first layer moved": all(
            not torch.equal(weights[n], after[n])
            for n in after_momenta
            if n.startswith("layers.0.")
        ),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("path", ["1d", "hsdp"])
def test_a_layer_whose_backward_never_runs_keeps_its_weights(path: str) -> None:
    for result in run_distributed(_loss_before_the_last_layer, 2 if path == "1d" else 4, path):
        assert all(result.values()), result


def _peer_bytes(model: nn.Module) -> int:
    """The bytes this rank holds of dedicated weights it neither owns nor replicates."""
    return sum(
        pack.buffer.untyped_storage().size()
        for group in get_runtime(model).groups
        for pack in group.packs
        if pack.role is Role.PEER
    )


def _after_an_iteration_that_raised(rank: int, world_size: int, where: str) -> list[dict]:
    """A forward (inside the last layer, after its weights were broadcast), a backward, or
    under Z2 the loss after a forward that ran to its end raises on every rank (a hook's error,
    an out-of-memory); the script recovers as FSDP2 documents (``reset_iter_state`` on the
    root, then ``zero_grad``) and retries. With a frozen matrix in a pack (its pack is reduced
    by the end-of-backward callback, which an aborted backward dropped) every step after it
    must still train the dedicated weights as a run that never failed, and after the recovery
    no peer may hold a dedicated weight (Z3; and Z2, which keeps a forward's weights for its
    backward: the recovery drops them, as FSDP2's ``reset_iter_state`` reshards its own)."""
    runs = []
    for fail in (False, True):
        model = _model("z2" if where == "loss" else "1d", world_size)
        dict(model.named_parameters())[FROZEN].requires_grad_(False)
        optimizer = Muon(model, lr=0.05, weight_decay=0.1)
        _step(model, optimizer, 0, rank, world_size)
        held = 0
        if fail:

            def raise_in_forward(module: nn.Module, args: object) -> None:
                raise RuntimeError("injected")

            def raise_in_backward(module: nn.Module, args: object, out: Tensor) -> None:
                out.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("injected")))

            def raise_in_loss(module: nn.Module, args: object, out: Tensor) -> None:
                raise RuntimeError("injected")  # the model's forward has run to its end

            if where == "forward":
                handle = model.layers[-1].mlp.register_forward_pre_hook(raise_in_forward)
            elif where == "backward":
                handle = model.layers[0].register_forward_hook(raise_in_backward)
            else:
                handle = model.register_forward_hook(raise_in_loss)
            optimizer.zero_grad()
            with pytest.raises(RuntimeError, match="injected"):
                loss_fn(model, batch(1, ROWS).chunk(world_size)[rank]).backward()
            handle.remove()
            model.reset_iter_state()
            # A backward that raised left FSDP2's own gradients on its gathered weights (the
            # root's norm and head here), which FSDP2's recovery keeps: zero_grad drops them
            # ([Note: FSDP2's held gradients]), else the retry's backward adds them in.
            optimizer.zero_grad()
            held = _peer_bytes(model)
        _step(model, optimizer, 1, rank, world_size)
        retried = get_model_state_dict(model)
        _step(model, optimizer, 2, rank, world_size)
        after = get_model_state_dict(model)
        matrices = list(_momenta(model, optimizer))
        runs.append(
            {
                "retried": {n: retried[n] for n in matrices},
                "after": after,
                "moved next": all(not torch.equal(retried[n], after[n]) for n in matrices),
                "held after recovery": held,
            }
        )
    return runs


@pytest.mark.distributed
@pytest.mark.skipif(
    not hasattr(FSDPModule, "reset_iter_state"),
    reason="FSDP2's recovery after a failed backward, reset_iter_state, is torch 2.13's",
)
@pytest.mark.parametrize("where", ["forward", "backward", "loss"])
def test_training_goes_on_after_an_iteration_that_raised(where: str) -> None:
    for clean, recovered in run_distributed(_after_an_iteration_that_raised, 2, where):
        # The retried step's dedicated weights are the clean run's, and every weight after the
        # step that follows (FSDP2's too).
        assert clean["retried"].keys() == recovered["retried"].keys()
        assert FROZEN not in clean["retried"]
        for name, value in clean["retried"].items():
            assert torch.equal(recovered["retried"][name], value), name
        assert clean["after"].keys() == recovered["after"].keys()
        for name, value in clean["after"].items():
            assert torch.equal(recovered["after"][name], value), name
        # Every dedicated matrix trains on: none waits for a reduce that never comes.
        assert clean["moved next"] and recovered["moved next"]
        # The recovery freed what the aborted iteration gathered (it kept them until the next
        # forward before: 8704 bytes on each rank, a layer's weights, or under Z2 after a loss
        # that raised every weight the forward gathered).
        assert recovered["held after recovery"] == 0


BRANCH = "layers.1.mlp.branch.weight"


def _branch_predicate(name: str, param: nn.Parameter) -> bool:
    return param.ndim == 2 and ("proj" in name or name == BRANCH)


def _with_branch(model: nn.Module, bias: bool = False) -> nn.Module:
    """Give the last block's MLP a residual branch that ``mlp.branch_mode`` turns on
    (``"use"``), off (``"skip"``: the branch's weight gets no gradient) or to zero (``"zero"``:
    its output times zero, the FAQ's way to keep a skipped weight's backward). The last block
    is the first that backward reaches: every collective of the first block follows the
    branch's."""
    mlp = model.layers[1].mlp
    torch.manual_seed(1)
    mlp.branch = nn.Linear(mlp.down_proj.out_features, mlp.down_proj.out_features, bias=bias)
    mlp.branch_mode = "use"
    forward = mlp.forward

    def with_branch(x: Tensor) -> Tensor:
        out = forward(x)
        if mlp.branch_mode == "skip":
            return out
        branch = mlp.branch(x)
        return out + (branch * 0 if mlp.branch_mode == "zero" else branch)

    mlp.forward = with_branch
    return model


@dataclass
class _Hidden:
    """A layer's input and output wrapped in a dataclass that torch's pytree does not know."""

    x: Tensor


def _with_dataclass_edges(model: nn.Module) -> nn.Module:
    """Each layer takes and returns a ``_Hidden``: dmuon finds the tensors inside it as FSDP2
    does (the output's for the gather before backward under Z3, the input's for the reduce
    point a rank that skips a weight needs)."""
    for layer in model.layers:
        layer.forward = lambda h, forward=layer.forward: _Hidden(forward(h.x))

    def forward(tokens: Tensor) -> Tensor:
        hidden = _Hidden(model.embed_tokens(tokens))
        for layer in model.layers:
            hidden = layer(hidden)
        return model.lm_head(model.norm(hidden.x))

    model.forward = forward
    return model


def _branch_model(
    path: str, world_size: int, shared: bool = False, bias: bool = False, edges: bool = False
) -> tuple[nn.Module, list, int, int]:
    """The model with the branch on ``path``; its dedicated parameters, and this rank's
    data-parallel rank and size (under tensor parallelism both ranks of a TP pair read the
    same rows). ``edges``: the layers take and return dataclasses."""
    model = _with_branch(build(0), bias)
    if edges:
        model = _with_dataclass_edges(model)
    rank = torch.distributed.get_rank()
    if path == "tp":  # (dp 2, tp 2)
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
        tensor_parallel(model, mesh["tp"])
        runtime = dedicate_params(model, mesh["dp"], _branch_predicate, small_param_threshold=0)
        shard_layers_then_root(model, mesh["dp"])
        return model, runtime.params, mesh["dp"].get_local_rank(), 2
    if path == "ddp":
        mesh = init_device_mesh("cpu", (world_size,))
        runtime = dedicate_params_ddp(model, mesh, _branch_predicate, small_param_threshold=0)
        replicate(model, mesh)
        return model, runtime.params, rank, world_size
    mesh, shard_mesh, replicate_mesh = make_mesh(world_size, 2 if path == "hsdp" else 1)
    runtime = dedicate_params(
        model,
        shard_mesh,
        _branch_predicate,
        replicate_mesh=replicate_mesh,
        process_group_policy="shared" if shared else "isolated",
    )
    shard_layers_then_root(model, mesh)
    return model, runtime.params, rank, world_size


def _branch_on_some_ranks(
    rank: int, world_size: int, path: str, skipper: str, how: str, options: dict[str, bool]
) -> dict[str, object]:
    """Three steps in which one data-parallel rank (the branch weight's owner, or another)
    leaves the branch out, ``how``: ``"skip"`` or the reference ``"zero"``; with
    ``options["accumulate"]`` two micro-batches per step, the rank leaving it out in the
    first only; with ``options["no_sync"]`` the first of them under ``no_sync``; with
    ``options["shared"]`` dmuon's collectives share FSDP2's process groups, so they must
    also keep their place among FSDP2's reduce-scatters; with ``options["discard"]`` each
    step starts with a forward whose graph no backward takes; with ``options["bias"]`` (the
    replicated path) the branch has a bias, which the replicated path all-reduces; with
    ``options["dataclass"]`` each layer takes and returns a dataclass."""
    model, params, dp_rank, dp_size = _branch_model(
        path,
        world_size,
        options.get("shared", False),
        options.get("bias", False),
        options.get("dataclass", False),
    )
    (branch,) = [dp for dp in params if dp.fqn == BRANCH]
    owns = torch.tensor([float(dp_rank if branch.role is Role.OWNER else -1)])
    owners = [torch.zeros(1) for _ in range(world_size)]
    torch.distributed.all_gather(owners, owns)
    owner = int(max(owners))
    leaves_out = owner if skipper == "owner" else (owner + 1) % dp_size
    optimizer = Muon(
        model,
        lr=0.05,
        weight_decay=0.1,
        options=StepOptions(ns_overlap=options.get("ns_overlap", False)),
    )
    unsynced = options.get("no_sync", False)
    micro = 2 if options.get("accumulate") or unsynced else 1
    for step in range(3):
        optimizer.zero_grad()
        if options.get("discard"):  # a forward whose graph is dropped (a loss not finite)
            model.layers[1].mlp.branch_mode = "use"
            loss_fn(model, batch(step, ROWS).chunk(dp_size)[dp_rank])
        for index in range(micro):
            first = index == 0
            model.layers[1].mlp.branch_mode = how if dp_rank == leaves_out and first else "use"
            rows = batch(step * micro + index, ROWS).chunk(dp_size)[dp_rank]
            with no_sync(model) if unsynced and first else nullcontext():
                (loss_fn(model, rows) / micro).backward()
        optimizer.step()
    return {"weights": get_model_state_dict(model), "momenta": _momenta(model, optimizer)}


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("world_size", "path", "skipper", "options"),
    [
        (2, "1d", "owner", {}),
        (2, "1d", "peer", {}),
        (2, "1d", "owner", {"ns_overlap": True}),
        (2, "1d", "owner", {"accumulate": True}),
        (2, "1d", "owner", {"no_sync": True}),
        (2, "1d", "peer", {"discard": True}),
        pytest.param(
            2,
            "1d",
            "peer",
            {"dataclass": True},
            marks=pytest.mark.xfail(
                not hasattr(FSDPModule, "reset_iter_state"),  # torch before 2.13
                reason="torch 2.11's autograd engine segfaults in this backward (H100 machine,"
                " 2026-12-06); torch 2.13 runs it",
                strict=False,
            ),
        ),
        (4, "hsdp", "owner", {}),
        (4, "hsdp", "peer", {"shared": True}),
        (4, "tp", "owner", {}),
        (2, "ddp", "owner", {}),
        (2, "ddp", "peer", {"bias": True}),
    ],
    ids=[
        "1d-owner",
        "1d-peer",
        "1d-owner-ns_overlap",
        "1d-owner-accumulate",
        "1d-owner-no_sync",
        "1d-peer-discard",
        "1d-peer-dataclass",
        "hsdp-owner",
        "hsdp-peer-shared",
        "tp-owner",
        "ddp-owner",
        "ddp-peer-bias",
    ],
)
def test_a_matrix_some_ranks_leave_out_trains_on_what_the_others_gave(
    world_size: int, path: str, skipper: str, options: dict[str, bool]
) -> None:
    """A weight one rank's forward leaves out (a branch it did not take, an expert that got
    no token there) trains on the gradients the other ranks gave, also when that rank is its
    owner: bit for bit as when the rank runs it on zero (output times zero). The branch is in
    the block backward reaches first, so the collectives of the other block must follow it
    in the same order on every rank (see [Note: reduce points] in dmuon_fsdp.runtime._order)."""
    skipped = run_distributed(_branch_on_some_ranks, world_size, path, skipper, "skip", options)
    zeroed = run_distributed(_branch_on_some_ranks, world_size, path, skipper, "zero", options)
    for got, want in zip(skipped, zeroed, strict=True):
        assert got["weights"].keys() == want["weights"].keys()
        for name, value in want["weights"].items():
            assert torch.equal(got["weights"][name], value), name
        assert got["momenta"].keys() == want["momenta"].keys()
        assert BRANCH in want["momenta"]
        for name, value in want["momenta"].items():
            assert torch.equal(got["momenta"][name], value), name


def _layer_left_out_when_synced(rank: int, world_size: int, path: str, how: str) -> dict:
    """Two micro-batches per step: the first under ``no_sync`` runs every layer, the second
    (synced) leaves the second layer out on every rank (LayerDrop with a seed the ranks share),
    ``how``: ``"skip"`` or the reference ``"zero"`` (the layer's change to its input times
    zero, so that its backward runs and adds nothing)."""
    dp_rank, dp_size = rank, world_size
    if path == "ddp":
        model = ddp_model(world_size)[0]
    elif path == "tp":  # (dp 2, tp 2): the TP pair of a data-parallel rank reads its rows
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
        model = build(0)
        tensor_parallel(model, mesh["tp"])
        dedicate_params(model, mesh["dp"], muon_predicate, small_param_threshold=0)
        shard_layers_then_root(model, mesh["dp"])
        dp_rank, dp_size = mesh["dp"].get_local_rank(), 2
    else:
        model = setup_model(world_size, reshard=path == "z3")[0]
    mode = {"now": "run"}

    def forward(tokens: Tensor) -> Tensor:
        x = model.embed_tokens(tokens)
        for index, layer in enumerate(model.layers):
            if index != 1 or mode["now"] == "run":
                x = layer(x)
            elif mode["now"] == "zero":
                x = x + (layer(x) - x) * 0
            # "skip": the layer is not called at all
        return model.lm_head(model.norm(x))

    model.forward = forward
    optimizer = Muon(model, lr=0.05, weight_decay=0.1)
    for step in range(2):
        optimizer.zero_grad()
        for index in range(2):
            mode["now"] = "run" if index == 0 else how
            rows = batch(2 * step + index, ROWS).chunk(dp_size)[dp_rank]
            with no_sync(model) if index == 0 else nullcontext():
                (loss_fn(model, rows) / 2).backward()
        optimizer.step()
    return {"weights": get_model_state_dict(model), "momenta": _momenta(model, optimizer)}


@pytest.mark.distributed
@pytest.mark.parametrize("path", ["z3", "z2", "ddp", "tp"])
def test_a_layer_every_rank_leaves_out_of_the_synced_micro_batch_still_trains(path: str) -> None:
    """The layer's gradients of the micro-batch under ``no_sync`` reach its owners (on the
    replicated path, its replicated parameters' all-reduce too) although the synced backward
    never reaches the layer: bit for bit the run whose second micro-batch runs the layer times
    zero."""
    world_size = 4 if path == "tp" else 2
    skipped = run_distributed(_layer_left_out_when_synced, world_size, path, "skip")
    zeroed = run_distributed(_layer_left_out_when_synced, world_size, path, "zero")
    for got, want in zip(skipped, zeroed, strict=True):
        assert got["weights"].keys() == want["weights"].keys()
        for name, value in want["weights"].items():
            assert torch.equal(got["weights"][name], value), name
        assert any(name.startswith("layers.1.") for name in want["momenta"])
        for name, value in want["momenta"].items():
            assert torch.equal(got["momenta"][name], value), name


def _norm_used_outside_its_dropped_layer(
    rank: int, world_size: int, how: str, unsynced: bool
) -> dict[str, Tensor]:
    """The replicated path; every forward leaves the second layer out on every rank (``how``:
    ``"skip"``, or the reference ``"zero"``: the layer's change to its input times zero),
    while its MLP norm, a replicated parameter of that layer's boundary, weighs a penalty
    from the rank's own rows: its gradient comes from outside the boundary, whose own backward
    never runs. With ``unsynced``, a micro-batch under ``no_sync`` first."""
    model = ddp_model(world_size)[0]
    norm = model.get_parameter(NORM)

    def forward(tokens: Tensor) -> Tensor:
        x = model.embed_tokens(tokens)
        for index, layer in enumerate(model.layers):
            if index != 1:
                x = layer(x)
            elif how == "zero":
                x = x + (layer(x) - x) * 0
        return model.lm_head(model.norm(x))

    model.forward = forward
    optimizer = Muon(model, lr=0.05, weight_decay=0.1)

    def loss(rows: Tensor) -> Tensor:
        return loss_fn(model, rows) + 1e-2 * (norm * rows.float().mean()).square().sum()

    for step in range(2):
        optimizer.zero_grad()
        if unsynced:
            with no_sync(model):
                loss(batch(10 + step, ROWS).chunk(world_size)[rank]).backward()
        loss(batch(step, ROWS).chunk(world_size)[rank]).backward()
        optimizer.step()
    return get_model_state_dict(model)


NORM = "layers.1.mlp_norm.weight"


@pytest.mark.distributed
@pytest.mark.parametrize("unsynced", [False, True], ids=["synced", "after-no_sync"])
def test_a_replicated_weight_used_only_outside_its_dropped_layer_is_averaged(
    unsynced: bool,
) -> None:
    """Its boundary's bucket leaves at the end of backward: every rank ends on the same norm,
    bit for bit the run whose layer runs times zero (the layer's matrices differ there: they
    get zero gradients instead of none)."""
    skipped = run_distributed(_norm_used_outside_its_dropped_layer, 2, "skip", unsynced)
    zeroed = run_distributed(_norm_used_outside_its_dropped_layer, 2, "zero", unsynced)
    for got, want in zip(skipped, zeroed, strict=True):
        assert torch.equal(got[NORM], skipped[0][NORM])
        for name, value in want.items():
            if name == NORM or not name.startswith("layers.1."):
                assert torch.equal(got[name], value), name


PENALISED = ("layers.1.mlp.up_proj.weight", "layers.1.mlp_norm.weight")


def _penalty_before_or_after_forward(
    rank: int, world_size: int, when: str, unsynced: bool
) -> dict[str, object]:
    """Two steps on the replicated path, with a penalty on a dedicated matrix and a replicated
    norm of the last block added to the loss, computed ``"before"`` the forward (backward then
    reaches it after the block's reduce point) or ``"after"`` it."""
    model = ddp_model(world_size)[0]
    optimizer = Muon(model, lr=0.05, weight_decay=0.1)
    weights = [model.get_parameter(name) for name in PENALISED]
    for step in range(2):
        optimizer.zero_grad()
        if unsynced:  # a micro-batch under no_sync first, without the penalty
            with no_sync(model):
                loss_fn(model, batch(10 + step, ROWS).chunk(world_size)[rank]).backward()
        rows = batch(step, ROWS).chunk(world_size)[rank]
        if when == "before":
            penalty = sum(w.square().sum() for w in weights)
            loss = loss_fn(model, rows)
        else:
            loss = loss_fn(model, rows)
            penalty = sum(w.square().sum() for w in weights)
        (loss + 1e-2 * penalty).backward()
        optimizer.step()
    return {"weights": get_model_state_dict(model), "momenta": _momenta(model, optimizer)}


@pytest.mark.distributed
@pytest.mark.parametrize("unsynced", [False, True], ids=["synced", "after-no_sync"])
def test_a_gradient_after_the_reduce_point_is_sent_at_the_end_of_backward(unsynced: bool) -> None:
    """A penalty taken before the forward reaches its weights after their block's reduce
    point: those gradients are sent at the end of backward (the matrix's pack again, the norm's
    all-reduce), bit for bit as when the penalty follows the forward (see [Note: reduce
    points] in dmuon_fsdp.runtime._order). After a micro-batch under ``no_sync`` the norm's
    bucket carried that micro-batch's gradient before the late one came, and the late
    all-reduce replaces it whole. The matrix's pack, though, took its no_sync gradient at the
    reduce point, so its owner adds the two averages where the reference averages their sum
    once: equal to rounding (a lost gradient is off by 2e-2)."""
    before = run_distributed(_penalty_before_or_after_forward, 2, "before", unsynced)
    after = run_distributed(_penalty_before_or_after_forward, 2, "after", unsynced)
    for got, want in zip(before, after, strict=True):
        assert PENALISED[0] in want["momenta"]
        for kind in ("weights", "momenta"):
            for name, value in want[kind].items():
                if unsynced:
                    torch.testing.assert_close(got[kind][name], value, rtol=1e-5, atol=1e-5)
                else:
                    assert torch.equal(got[kind][name], value), name


def _branch_no_rank_takes(rank: int, world_size: int) -> dict[str, object]:
    """Three steps on the replicated path in which no rank takes the branch (it has a bias):
    the weights before and after, and the optimizer's state of the branch."""
    model = _with_branch(build(0), bias=True)
    mesh = init_device_mesh("cpu", (world_size,))
    dedicate_params_ddp(model, mesh, _branch_predicate, small_param_threshold=0)
    replicate(model, mesh)
    before = {name: p.detach().clone() for name, p in model.layers[1].mlp.branch.named_parameters()}
    optimizer = Muon(model, lr=0.05, weight_decay=0.1)
    model.layers[1].mlp.branch_mode = "skip"
    for step in range(3):
        optimizer.zero_grad()
        loss_fn(model, batch(step, ROWS).chunk(world_size)[rank]).backward()
        optimizer.step()
    after = {name: p.detach().clone() for name, p in model.layers[1].mlp.branch.named_parameters()}
    states = [optimizer.state[p] for p in model.layers[1].mlp.branch.parameters()]
    return {
        "before": before,
        "after": after,
        "grads": [p.grad for p in model.layers[1].mlp.branch.parameters()],
        "states": states,
    }


@pytest.mark.distributed
def test_a_replicated_parameter_no_rank_used_is_left_alone() -> None:
    """On the replicated path a bias no rank's forward used keeps its value, no gradient and
    no optimizer state, as DDP and ``torch.optim`` leave it, although its boundary's bucket
    travelled (see [Note: replicated parameters a rank left out] in
    dmuon_fsdp.runtime._collectives)."""
    for result in run_distributed(_branch_no_rank_takes, 2):
        for name, value in result["before"].items():
            assert torch.equal(result["after"][name], value), name
        assert result["grads"] == [None, None]
        assert all(not state for state in result["states"])


def _bias_after_a_backward_that_raised(rank: int, world_size: int) -> list[object]:
    """The replicated path: a backward that raises after the branch's layer sent its bucket,
    ``zero_grad``, then a backward no rank takes the branch in: the branch's bias keeps no
    gradient (the thrown-away bucket is not written)."""
    model, _, _, _ = _branch_model("ddp", world_size, bias=True)
    optimizer = Muon(model, lr=0.05)

    def raise_in_backward(module: nn.Module, args: object, out: Tensor) -> None:
        out.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("injected")))

    handle = model.layers[0].register_forward_hook(raise_in_backward)
    with pytest.raises(RuntimeError, match="injected"):
        loss_fn(model, batch(0, ROWS).chunk(world_size)[rank]).backward()
    handle.remove()
    optimizer.zero_grad()
    model.layers[1].mlp.branch_mode = "skip"
    loss_fn(model, batch(1, ROWS).chunk(world_size)[rank]).backward()
    return [p.grad for p in model.layers[1].mlp.branch.parameters()]


@pytest.mark.distributed
def test_zero_grad_drops_the_buckets_of_a_backward_that_raised() -> None:
    for grads in run_distributed(_bias_after_a_backward_that_raised, 2):
        assert grads == [None, None]
