"""The 1-D runtime against a plain single-process model: same loss, same averaged gradients,
no full storage on peers, Z2 == Z3 bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _models import batch, build, loss_fn, muon_predicate, shard_layers_then_root
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from dmuon_fsdp import Role, dedicate_params
from dmuon_testing.distributed import run_distributed

ROWS = 8


def _setup(world_size: int, reshard: bool, checkpoint: bool | str = False, threshold: int = 0):
    model = build(0, 2, checkpoint)
    mesh = init_device_mesh("cpu", (world_size,))
    runtime = dedicate_params(
        model,
        mesh,
        muon_predicate,
        reshard_after_forward=reshard,
        small_param_threshold=threshold,
    )
    shard_layers_then_root(model, mesh)
    return model, runtime


def _local(tokens: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return tokens.chunk(world_size)[rank]


def _grads_match_reference(
    rank: int, world_size: int, reshard: bool, checkpoint: bool | str = False, threshold: int = 0
) -> None:
    model, runtime = _setup(world_size, reshard, checkpoint, threshold)
    owners = {dp.owner for dp in runtime.params}
    # threshold 0: every matrix placed alone, every rank owns some; default: one pack per layer.
    assert len(owners) == (world_size if threshold == 0 else min(world_size, 2))
    ref = build(0)
    tokens = batch(0, ROWS)
    loss = loss_fn(model, _local(tokens, rank, world_size))
    loss.backward()
    runtime.wait_all_reduces()
    ref_loss = loss_fn(ref, tokens)
    ref_loss.backward()

    total = loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total / world_size, ref_loss.detach(), rtol=1e-6, atol=1e-6)
    ref_params = dict(ref.named_parameters())
    for dp in runtime.params:
        assert dp.param.grad is None, f"{dp.fqn}: param.grad must be dropped"
        if dp.is_owner:
            assert dp.grad is not None and dp.full is not None
            torch.testing.assert_close(dp.grad, ref_params[dp.fqn].grad, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(dp.full, ref_params[dp.fqn].detach(), rtol=0, atol=0)
        else:
            assert dp.grad is None and dp.full is None
            # Peers hold no storage between steps (shape kept, memory gone).
            assert dp.role is Role.PEER
            assert dp.param.untyped_storage().size() == 0
            assert dp.param.shape == ref_params[dp.fqn].shape
    # Everything else is ordinary FSDP2 and got its usual gradient.
    dedicated = {dp.fqn for dp in runtime.params}
    for name, param in model.named_parameters():
        if name in dedicated:
            assert not isinstance(param, DTensor)
            continue
        assert isinstance(param, DTensor), name
        torch.testing.assert_close(
            param.grad.full_tensor(), ref_params[name].grad, rtol=1e-5, atol=1e-7
        )
    expected = {n for n, p in ref.named_parameters() if muon_predicate(n, p)}
    assert dedicated == expected


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("reshard", [True, False], ids=["z3", "z2"])
def test_grads_match_single_process(world_size: int, reshard: bool) -> None:
    run_distributed(_grads_match_reference, world_size, reshard)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("reshard", "checkpoint"),
    [(True, True), (False, True), (True, "reentrant")],
    ids=["z3", "z2", "z3-reentrant"],
)
def test_grads_match_with_activation_checkpointing(reshard: bool, checkpoint: bool | str) -> None:
    # The recompute runs each boundary's forward again inside backward; its hooks must
    # unshard without disturbing the step's order, counters or freeing. Reentrant
    # checkpointing runs the forward without grad: the recompute's graph carries the
    # boundary's reduce point. Also the planner's default packing: one pack (one owner) per
    # boundary.
    run_distributed(_grads_match_reference, 4, reshard, checkpoint, 5_000_000)


def _two_backwards(rank: int, world_size: int) -> bool:
    """Two synced backward passes on the same batch before a step: each reduce adds its
    average to the owner's gradient, so it is exactly twice the first; a backward dropped by
    ``clear_grads`` (the optimizer's ``zero_grad``) before its reduces landed adds nothing."""
    model, runtime = _setup(world_size, reshard=True)
    tokens = _local(batch(0, ROWS), rank, world_size)
    loss_fn(model, tokens).backward()
    runtime.wait_all_reduces()
    once = {dp.fqn: dp.grad.clone() for dp in runtime.owned}
    runtime.clear_grads()
    for _ in range(2):
        loss_fn(model, tokens).backward()
    runtime.wait_all_reduces()
    assert once
    for dp in runtime.owned:
        assert torch.equal(dp.grad, 2 * once[dp.fqn]), dp.fqn
    # A backward thrown away (zero_grad) before its reduces were waited leaves nothing behind.
    runtime.clear_grads()
    loss_fn(model, _local(batch(1, ROWS), rank, world_size)).backward()
    runtime.clear_grads()
    loss_fn(model, tokens).backward()
    runtime.wait_all_reduces()
    for dp in runtime.owned:
        assert torch.equal(dp.grad, once[dp.fqn]), dp.fqn
    return True


def test_a_second_backward_adds_its_gradient_and_zero_grad_drops_one() -> None:
    assert all(run_distributed(_two_backwards, 2))


def _first_layer_twice(rank: int, world_size: int) -> None:
    """The first block runs twice per forward (one boundary, two reduce points): its owners'
    gradients are the single-process model's."""

    def twice(model: torch.nn.Module) -> torch.nn.Module:
        def forward(tokens: torch.Tensor) -> torch.Tensor:
            x = model.embed_tokens(tokens)
            for layer in (model.layers[0], model.layers[0], model.layers[1]):
                x = layer(x)
            return model.lm_head(model.norm(x))

        model.forward = forward  # type: ignore[method-assign]
        return model

    model = twice(build(0))
    mesh = init_device_mesh("cpu", (world_size,))
    runtime = dedicate_params(model, mesh, muon_predicate, small_param_threshold=0)
    shard_layers_then_root(model, mesh)
    tokens = batch(0, ROWS)
    loss_fn(model, _local(tokens, rank, world_size)).backward()
    runtime.wait_all_reduces()
    ref = twice(build(0))
    loss_fn(ref, tokens).backward()
    ref_params = dict(ref.named_parameters())
    owned = [dp for dp in runtime.params if dp.is_owner]
    assert owned
    for dp in owned:
        torch.testing.assert_close(dp.grad, ref_params[dp.fqn].grad, rtol=1e-5, atol=1e-7)


@pytest.mark.distributed
def test_a_boundary_called_twice_per_forward_gets_its_whole_gradient() -> None:
    run_distributed(_first_layer_twice, 2)
