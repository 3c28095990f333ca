"""A new kind of parameter is one holder class, registered in the holder sub-package: a toy kind
whose Newton–Schulz is the identity, claimed for the MLP down projections, trains on two ranks;
its matrices take the identity-NS update of their averaged gradient, and every other parameter
steps bit for bit as in a run without it (see [Note: the kinds of holders])."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from _reference import Hyper, lm_loss, make_batch, shard
from _sgd_train import setup_model
from torch import Tensor

from dmuon_fsdp import DedicatedParam, Muon, get_model_state_dict
from dmuon_fsdp.holder import KINDS, Found, StepContext, register_kind
from dmuon_testing.distributed import run_distributed

HYPER = Hyper()
STEPS = 3
TOY = "mlp.down_proj.weight"  # (16, 24): no other matrix of the model has its shape


def _identity(stack: Tensor) -> Tensor:
    return stack


class IdentityNS(DedicatedParam):
    """A packed matrix whose orthogonalisation is the identity: its update is its Nesterov
    momentum itself."""

    @classmethod
    def claims(cls, found: Found) -> bool:
        return found.fqn.endswith(TOY)

    def newton_schulz(self, context: StepContext):
        return _identity


def _train(rank: int, world_size: int, toy: bool):
    registration = register_kind(IdentityNS) if toy else None
    try:
        model, runtime = setup_model(world_size, small_param_threshold=0)
    finally:
        if registration is not None:
            registration.remove()
    registered = IdentityNS in KINDS
    kinds = {dp.fqn: type(dp).__name__ for dp in runtime.params}
    optimizer = Muon(model, **HYPER.muon_kwargs())
    losses, first, after = [], {}, {}
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = lm_loss(model, shard(make_batch(step, 8, 8, 32), rank, world_size))
        loss.backward()
        if step == 0:
            runtime.wait_all_reduces()
            first = {dp.fqn: (dp.full.clone(), dp.grad.clone()) for dp in runtime.owned}
        optimizer.step()
        if step == 0:
            after = get_model_state_dict(model)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world_size)
    return losses, kinds, first, after, registered


def _identity_update(weight: Tensor, grad: Tensor) -> Tensor:
    """The first step of a matrix whose NS is the identity, in float64: momentum ``grad``,
    Nesterov input ``grad + momentum * grad``, decoupled decay, Moonlight's scale."""
    w, g = weight.double(), grad.double()
    scale = 0.2 * math.sqrt(max(w.shape))
    update = g + HYPER.momentum * g
    return w * (1 - HYPER.lr * HYPER.weight_decay) - HYPER.lr * scale * update


class _NoClassmethod(DedicatedParam):
    def claims(self, found: Found) -> bool:  # type: ignore[override]
        return False


def test_register_kind_refuses_what_is_not_a_holder_class() -> None:
    with pytest.raises(TypeError, match="is not a holder class"):
        register_kind(dict)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="claims must be a classmethod"):
        register_kind(_NoClassmethod)
    assert _NoClassmethod not in KINDS and dict not in KINDS


@pytest.mark.distributed
def test_a_kind_registered_in_the_holder_sub_package_trains_on_two_ranks() -> None:
    toy = run_distributed(_train, 2, True)
    plain = run_distributed(_train, 2, False)
    for (losses, kinds, _, after, registered), (base_losses, base_kinds, *_rest) in zip(toy, plain):
        assert not registered, "the registration outlived its dedicate_params"
        toy_names = {fqn for fqn in kinds if fqn.endswith(TOY)}
        assert toy_names and all(kinds[fqn] == "IdentityNS" for fqn in toy_names)
        assert {kinds[fqn] for fqn in kinds if fqn not in toy_names} == {"DedicatedParam"}
        assert set(base_kinds.values()) == {"DedicatedParam"}
        assert losses[0] == base_losses[0] and losses[-1] < losses[0]
        assert all(math.isfinite(loss) for loss in losses)
        base_after = plain[0][3]
        for key, value in after.items():
            if key in toy_names:
                assert not torch.allclose(value, base_after[key]), f"{key}: NS ran anyway"
            else:
                assert torch.equal(value, base_after[key]), key
    owned = {fqn: tensors for result in toy for fqn, tensors in result[2].items()}
    toy_names = {fqn for fqn in owned if fqn.endswith(TOY)}
    assert len(toy_names) == 2  # one per layer, on their owners
    for fqn in toy_names:
        weight, grad = owned[fqn]
        expected = _identity_update(weight, grad).float()
        torch.testing.assert_close(toy[0][3][fqn], expected, rtol=1e-6, atol=1e-7)
