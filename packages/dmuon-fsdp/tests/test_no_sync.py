"""``no_sync``: micro-batches accumulate locally and one synced backward reduces their sum.
FSDP2's own ``model.set_requires_gradient_sync(False)`` does the same for dmuon's reduces
([Note: FSDP2's gradient sync])."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from _models import (
    batch,
    build,
    loss_fn,
    muon_numel,
    muon_predicate,
    reduce_numel,
    shard_layers_then_root,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from dmuon_fsdp import Muon, dedicate_params, get_model_state_dict, no_sync
from dmuon_testing.distributed import run_distributed

MICRO = 4
ROWS = 4  # rows per micro-batch on each rank


def _wrapped(world_size: int, reshard: bool, bf16: bool = False):
    model = build(0)
    mesh = init_device_mesh("cpu", (world_size,))
    runtime = dedicate_params(
        model, mesh, muon_predicate, reshard_after_forward=reshard, small_param_threshold=0
    )
    if bf16:  # FSDP2 accumulates its unreduced gradients in fp32, apart from .grad
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    else:
        shard_layers_then_root(model, mesh)
    return model, runtime


@contextlib.contextmanager
def _fsdp2_sync_off(model) -> Iterator[None]:
    """A loop written for FSDP2 alone: its flag on the root, which recurses into the layers."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


UNSYNCED = {"dmuon.no_sync": no_sync, "fsdp2": _fsdp2_sync_off}


def _accumulate_vs_large_batch(rank: int, world_size: int, reshard: bool, how: str) -> dict:
    tokens = batch(0, ROWS * MICRO * world_size).chunk(world_size)[rank]
    micro = tokens.chunk(MICRO)

    acc_model, acc = _wrapped(world_size, reshard)
    acc.counter.reset()
    for i, part in enumerate(micro):
        if i < MICRO - 1:
            with UNSYNCED[how](acc_model):
                (loss_fn(acc_model, part) / MICRO).backward()
            # Nothing was reduced: the local gradient stays on the parameter.
            assert all(dp.param.grad is not None for dp in acc.params)
            assert all(dp.grad is None for dp in acc.owned)
        else:
            (loss_fn(acc_model, part) / MICRO).backward()
    acc.wait_all_reduces()
    counts = {
        "broadcast": acc.counter.bytes("shard", "broadcast"),
        "reduce": acc.counter.bytes("shard", "reduce"),
    }

    big_model, big = _wrapped(world_size, reshard)
    loss_fn(big_model, tokens).backward()
    big.wait_all_reduces()

    big_grads = {dp.fqn: dp.grad for dp in big.owned}
    for dp in acc.owned:
        assert dp.param.grad is None
        torch.testing.assert_close(dp.grad, big_grads[dp.fqn], rtol=1e-5, atol=1e-7)
    # FSDP2's parameters accumulated without reduce-scatter and merged the same way.
    big_params = dict(big_model.named_parameters())
    dedicated = {dp.fqn for dp in acc.params}
    for name, param in acc_model.named_parameters():
        if name not in dedicated:
            torch.testing.assert_close(
                param.grad.full_tensor(), big_params[name].grad.full_tensor(), rtol=1e-5, atol=1e-7
            )
    return counts


@pytest.mark.distributed
@pytest.mark.parametrize("how", UNSYNCED)
@pytest.mark.parametrize("reshard", [True, False], ids=["z3", "z2"])
def test_no_sync_matches_one_large_batch(reshard: bool, how: str) -> None:
    world_size = 2
    counts = run_distributed(_accumulate_vs_large_batch, world_size, reshard, how)
    p_m = muon_numel(build(0)) * 4
    # Z2 keeps the weights over the accumulation: one broadcast round for all micro-batches;
    # Z3 broadcasts twice per micro-batch. One reduce round either way.
    rounds = 2 * MICRO if reshard else 1
    assert counts[0] == {"broadcast": rounds * p_m, "reduce": reduce_numel(build(0)) * 4}


def _discarded_micro_batch(rank: int, world_size: int, clear: str, bf16: bool) -> None:
    rows = ROWS * world_size
    tokens = batch(0, rows).chunk(world_size)[rank]
    model, runtime = _wrapped(world_size, reshard=True, bf16=bf16)
    optimizer = Muon(model, lr=0.02)
    with no_sync(model):
        loss_fn(model, batch(1, rows).chunk(world_size)[rank]).backward()
    # Thrown away (a NaN loss, a skipped batch, an exception after the first micro-batch):
    # zero_grad sets .grad = None on every parameter, also a peer's, which holds its local
    # gradient but no weight now (Z3), and drops the local gradients FSDP2 holds on its
    # unsharded parameters for the next synced backward ([Note: FSDP2's held gradients]),
    # which would otherwise be added into the retry's reduce-scatter.
    if clear == "optimizer":
        optimizer.zero_grad()
    else:
        model.zero_grad()
    assert all(dp.param.grad is None for dp in runtime.params)
    loss_fn(model, tokens).backward()
    runtime.wait_all_reduces()

    clean_model, clean = _wrapped(world_size, reshard=True, bf16=bf16)
    loss_fn(clean_model, tokens).backward()
    clean.wait_all_reduces()
    clean_grads = {dp.fqn: dp.grad for dp in clean.owned}
    for dp in runtime.owned:
        assert torch.equal(dp.grad, clean_grads[dp.fqn]), dp.fqn
    clean_params = dict(clean_model.named_parameters())
    dedicated = {dp.fqn for dp in runtime.params}
    for name, param in model.named_parameters():
        if name not in dedicated:
            assert torch.equal(param.grad.full_tensor(), clean_params[name].grad.full_tensor()), (
                name
            )


@pytest.mark.distributed
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("clear", ["optimizer", "model"])
def test_a_discarded_no_sync_micro_batch_leaves_no_gradient(clear: str, bf16: bool) -> None:
    run_distributed(_discarded_micro_batch, 2, clear, bf16)


def _step_after_no_sync_only(rank: int, world_size: int, how: str) -> None:
    rows = ROWS * world_size
    model, runtime = _wrapped(world_size, reshard=True)
    optimizer = Muon(model)
    before = get_model_state_dict(model)
    for i in range(2):  # the whole accumulation inside the context: nothing is ever reduced
        with UNSYNCED[how](model):
            loss_fn(model, batch(i, rows).chunk(world_size)[rank]).backward()
    with pytest.raises(RuntimeError, match=r"the last backward ran inside dmuon\.no_sync"):
        optimizer.step()
    after = get_model_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before), "the refused step changed weights"
    # A clip between the micro-batches is refused alike (it found nothing reduced: the owners
    # hold no gradient yet), before it changes any gradient.
    local = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert local  # the dedicated weights' local accumulation
    for params in ("muon", "all"):
        with pytest.raises(RuntimeError, match=r"Clip after the last micro-batch's backward"):
            optimizer.grads_for_clip(params)
    assert all(torch.equal(g, model.get_parameter(n).grad) for n, g in local.items())
    # Discarded, the accumulation no longer blocks the step; a synced backward then trains.
    optimizer.zero_grad()
    loss_fn(model, batch(2, rows).chunk(world_size)[rank]).backward()
    optimizer.step()
    trained = get_model_state_dict(model)
    assert all(not torch.equal(before[dp.fqn], trained[dp.fqn]) for dp in runtime.params)


@pytest.mark.distributed
@pytest.mark.parametrize("how", UNSYNCED)
def test_a_step_after_backwards_only_inside_no_sync_is_refused(how: str) -> None:
    run_distributed(_step_after_no_sync_only, 2, how)


def _nested_and_inside_fsdp2s_own(rank: int, world_size: int) -> None:
    """``no_sync`` leaves every flag as it found it: nested in itself, or entered while FSDP2's
    own sync is off (an accumulation loop around a helper that uses it), a backward after
    the inner exit still reduces nothing, dmuon's or FSDP2's."""
    rows = ROWS * world_size
    model, runtime = _wrapped(world_size, reshard=True)
    dedicated = {dp.fqn for dp in runtime.params}
    fsdp_params = [p for n, p in model.named_parameters() if n not in dedicated]
    for outer in UNSYNCED.values():
        with outer(model):
            with no_sync(model):
                loss_fn(model, batch(0, rows).chunk(world_size)[rank]).backward()
            loss_fn(model, batch(1, rows).chunk(world_size)[rank]).backward()
            runtime.wait_all_reduces()
            assert all(dp.grad is None for dp in runtime.owned)
            # FSDP2 reduce-scatters into the sharded .grad only when its sync is on.
            assert all(p.grad is None for p in fsdp_params)
        model.zero_grad()


@pytest.mark.distributed
def test_no_sync_restores_the_flags_it_found() -> None:
    run_distributed(_nested_and_inside_fsdp2s_own, 2)
