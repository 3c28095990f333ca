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
    rank: int,
    world_size: int,
    reshard: bool,
    checkpoint: bool | str = False,
    threshold: int = 0,
    factors: dict[str, float] | None = None,
) -> None:
    """``factors``: FSDP2's ``set_gradient_divide_factor`` for the modules named, and the loss
    divided by the world size (the global token count, as torchtitan does): each gradient is
    then the reference's times ``world_size / factor`` of the nearest module holding it, the
    reference's where that is 1 (``1 / world_size`` where none was set)."""
    model, runtime = _setup(world_size, reshard, checkpoint, threshold)
    owners = {dp.owner for dp in runtime.params}
    # threshold 0: every matrix placed alone, every rank owns some; default: one pack per layer.
    assert len(owners) == (world_size if threshold == 0 else min(world_size, 2))
    scale = 1.0
    if factors is not None:
        scale = 1 / world_size
        for name, factor in factors.items():
            model.get_submodule(name).set_gradient_divide_factor(factor)
            # gloo has no PREMUL_SUM: FSDP2 then sums and divides afterwards (on one rank,
            # torch 2.13 divides twice so: no collective there, no need)
            model.get_submodule(name).set_force_sum_reduction_for_comms(world_size > 1)

    def expected(name: str, grad: torch.Tensor) -> torch.Tensor:
        nearest = max(
            (m for m in factors or {} if not m or name.startswith(f"{m}.")), key=len, default=None
        )
        if nearest is None:
            return grad * scale
        return grad * (scale * world_size / factors[nearest])  # type: ignore[index]

    ref = build(0)
    tokens = batch(0, ROWS)
    loss = loss_fn(model, _local(tokens, rank, world_size))
    (loss * scale).backward()
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
            want = expected(dp.fqn, ref_params[dp.fqn].grad)
            torch.testing.assert_close(dp.grad, want, rtol=1e-5, atol=1e-7)
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
            param.grad.full_tensor(), expected(name, ref_params[name].grad), rtol=1e-5, atol=1e-7
        )
    assert dedicated == {n for n, p in ref.named_parameters() if muon_predicate(n, p)}
    if factors is not None:
        # FSDP2 reads a module's factor at each reduce, and so does dmuon: one changed after
        # the first backward divides the next one's gradients.
        for name in factors:
            factors[name] *= 2
            model.get_submodule(name).set_gradient_divide_factor(factors[name])
        runtime.clear_grads()
        (loss_fn(model, _local(tokens, rank, world_size)) * scale).backward()
        runtime.wait_all_reduces()
        for dp in runtime.owned:
            want = expected(dp.fqn, ref_params[dp.fqn].grad)
            torch.testing.assert_close(dp.grad, want, rtol=1e-5, atol=1e-7)


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


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("world_size", "factors"),
    [(2, {"": 1.0, "layers.0": 1.0, "layers.1": 1.0}), (1, {"layers.1": 4.0})],
    ids=["torchtitan", "one-layer"],
)
def test_grads_follow_fsdp2_gradient_divide_factor(
    world_size: int, factors: dict[str, float]
) -> None:
    # torchtitan sets factor 1.0 on every fully_shard module and divides the loss by the global
    # token count: the dedicated gradients are sums too, as FSDP2's (averaging them made them
    # world_size times smaller, which a clip over both routes would see). A factor on one layer
    # divides that layer's gradients alone, on one rank too.
    run_distributed(_grads_match_reference, world_size, True, False, 0, factors)


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


def _penalised_grads(model: torch.nn.Module, tokens: torch.Tensor, world_size: int) -> None:
    """A gradient penalty on the embedding output: ``loss + λ·|∂loss/∂x|²``, through
    ``create_graph=True`` (the math attention kernel has a double backward on the CPU); on a
    sharded model, FSDP2's own fix around the first backward (its weights stay gathered)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    outputs: list[torch.Tensor] = []
    handle = model.embed_tokens.register_forward_hook(lambda m, i, out: outputs.append(out))
    fsdp = hasattr(model, "set_reshard_after_backward")
    with sdpa_kernel(SDPBackend.MATH):
        loss = loss_fn(model, tokens)
        if fsdp:
            model.set_reshard_after_backward(False)
        (grad,) = torch.autograd.grad(loss, outputs[0], create_graph=True)
        if fsdp:
            model.set_reshard_after_backward(True)
        # Each rank's gradient is of its own mean loss, world_size times the whole batch's on
        # its rows: λ / world_size makes the mean over ranks the single-process penalty.
        (loss + 100.0 / world_size * grad.pow(2).sum()).backward()
    handle.remove()


def _gradient_penalty(rank: int, world_size: int) -> None:
    """Z3 and Z2: a backward with ``create_graph=True`` leaves the peers' weights gathered for
    the backward of the graph it created, whose owners' gradients are the single-process
    model's."""
    tokens = batch(0, ROWS)
    ref = build(0)
    _penalised_grads(ref, tokens, 1)
    ref_params = dict(ref.named_parameters())
    for reshard in (True, False):
        model, runtime = _setup(world_size, reshard)
        _penalised_grads(model, _local(tokens, rank, world_size), world_size)
        runtime.wait_all_reduces()
        assert runtime.owned
        for dp in runtime.owned:
            torch.testing.assert_close(dp.grad, ref_params[dp.fqn].grad, rtol=1e-5, atol=1e-7)
        for name, param in model.named_parameters():
            if isinstance(param, DTensor):
                torch.testing.assert_close(
                    param.grad.full_tensor(), ref_params[name].grad, rtol=1e-5, atol=1e-7
                )


@pytest.mark.distributed
def test_a_gradient_penalty_double_backward_matches_single_process() -> None:
    run_distributed(_gradient_penalty, 2)


def _two_forwards_reentrant_inside(rank: int, world_size: int) -> None:
    """Z3 and Z2: two forwards before one backward (a siamese loss), each block wrapped in
    reentrant checkpointing inside its boundary: the owners' gradients are the
    single-process model's (each use's recompute runs a backward of its own)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    def two(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return loss_fn(model, tokens) + 0.5 * loss_fn(model, (tokens + 7) % 32)

    tokens = batch(0, ROWS)
    ref = build(0)
    two(ref, tokens).backward()
    ref_params = dict(ref.named_parameters())
    for reshard in (True, False):
        model = build(0)
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.REENTRANT)
        mesh = init_device_mesh("cpu", (world_size,))
        runtime = dedicate_params(
            model, mesh, muon_predicate, reshard_after_forward=reshard, small_param_threshold=0
        )
        shard_layers_then_root(model, mesh)
        two(model, _local(tokens, rank, world_size)).backward()
        runtime.wait_all_reduces()
        assert runtime.owned
        for dp in runtime.owned:
            want = ref_params[dp.fqn.replace("._checkpoint_wrapped_module", "")].grad
            torch.testing.assert_close(dp.grad, want, rtol=1e-5, atol=1e-7)


@pytest.mark.distributed
def test_two_forwards_under_reentrant_checkpointing_inside_the_boundary() -> None:
    run_distributed(_two_forwards_reentrant_inside, 2)


def _reentrant_after_a_dropped_forward(rank: int, world_size: int) -> None:
    """A forward with gradients enabled whose graph is dropped (an evaluation without
    ``no_grad``), then a training step under reentrant checkpointing: its real forward adds no
    reduce point (it runs without grad), so the recompute must add one although the dropped
    forward's dead point is still listed. The owners' gradients are the reference's."""
    model, runtime = _setup(world_size, True, "reentrant", 0)
    tokens = batch(0, ROWS)
    model.checkpoint = False
    loss_fn(model, _local(tokens, rank, world_size))  # graph dropped at once
    model.checkpoint = "reentrant"
    hooks = runtime.hooks
    reached: list[int] = []
    point = hooks._reduce_point
    hooks._reduce_point = lambda index: (reached.append(index), point(index))[1]  # type: ignore[method-assign]
    loss_fn(model, _local(tokens, rank, world_size)).backward()
    runtime.wait_all_reduces()
    assert sorted(reached) == list(range(len(hooks.groups))), reached
    ref = build(0)
    loss_fn(ref, tokens).backward()
    ref_params = dict(ref.named_parameters())
    assert runtime.owned
    for dp in runtime.owned:
        torch.testing.assert_close(dp.grad, ref_params[dp.fqn].grad, rtol=1e-5, atol=1e-7)


@pytest.mark.distributed
def test_reentrant_checkpointing_after_a_forward_whose_graph_was_dropped() -> None:
    run_distributed(_reentrant_after_a_dropped_forward, 2)
