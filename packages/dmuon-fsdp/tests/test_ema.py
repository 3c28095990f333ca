"""The weight EMA (see [Note: the weight EMA]): kept where each weight is stepped, it equals the
recurrence run on the full weights bit for bit; the model computes with it inside
``applied()`` and gets its own weights back on exit; its state dict loads at another topology."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _models import build, muon_predicate
from _reference import Hyper, make_batch, shard
from _sgd_train import make_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from dmuon_fsdp import (
    EMA,
    Muon,
    dedicate_params,
    dedicated_params_of,
    get_model_state_dict,
    set_model_state_dict,
)
from dmuon_testing.distributed import run_distributed

HYPER = Hyper()
DECAY = 0.75
MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
CASES = {  # name: (world size, replicas, Z3, FSDP2's mixed precision)
    "z3": (2, 1, True, False),
    "z2, bf16 compute": (2, 1, False, True),
    "hsdp 2x2": (4, 2, True, False),
}


def _setup(case: str, threshold: int = 0) -> tuple[torch.nn.Module, Muon]:
    world_size, replicas, reshard, mixed = CASES[case]
    model = build(0)
    mesh, shard_mesh, replicate_mesh = make_mesh(world_size, replicas)
    dedicate_params(
        model,
        shard_mesh,
        muon_predicate,
        reshard_after_forward=reshard,
        replicate_mesh=replicate_mesh,
        small_param_threshold=threshold,
    )
    ignored = dedicated_params_of(model)
    policy = {"mp_policy": MP} if mixed else {}
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=ignored, **policy)
    fully_shard(model, mesh=mesh, ignored_params=ignored, **policy)
    return model, Muon(model, **HYPER.muon_kwargs())


def lm_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1]).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _step(model, optimizer, step: int, rank: int, world_size: int, nan: bool = False) -> None:
    optimizer.zero_grad()
    loss = lm_loss(model, shard(make_batch(step, 8, 8, 32), rank, world_size))
    (loss * float("nan") if nan else loss).backward()
    optimizer.step()


def _params(model) -> dict[str, torch.Tensor]:
    """The full weights of the model's parameters (not its buffers), gathered."""
    names = {name for name, _ in model.named_parameters()}
    return {k: v for k, v in get_model_state_dict(model).items() if k in names}


def _run(rank: int, world_size: int, case: str) -> None:
    model, optimizer = _setup(case)
    with pytest.raises(ValueError, match=r"EMA: decay must be a float in \(0, 1\)"):
        EMA(optimizer, decay=1.0)
    with pytest.raises(TypeError, match=r"EMA takes the dmuon\.Muon"):
        EMA(model)  # type: ignore[arg-type]
    ema = EMA(optimizer, decay=DECAY)
    # A decay set during training is checked as the constructor checks it (a NaN would turn
    # the average NaN at the next step), and a refused one leaves the rate as it was.
    for bad in (1.5, float("nan"), -0.1, True):
        with pytest.raises(ValueError, match=r"EMA\.decay must be a float in \(0, 1\)"):
            ema.decay = bad
    assert ema.decay == DECAY
    # The recurrence on the full weights, with the factor the EMA uses (a device tensor: the
    # default skip_nonfinite hands the hook each step's skip decision); the third step at a
    # decay set in between (a warm-up of the decay).
    reference = {k: v.float() for k, v in _params(model).items()}
    for step in range(3):
        ema.decay = DECAY if step < 2 else 0.5
        rate = torch.tensor(1 - ema.decay)
        # The second step is skipped (a NaN gradient): the average stays too.
        _step(model, optimizer, step, rank, world_size, nan=step == 1)
        weights = _params(model)
        factor = torch.zeros(()) if step == 1 else rate
        torch._foreach_lerp_(list(reference.values()), [weights[k] for k in reference], factor)
    ema.decay = DECAY
    saved = ema.state_dict()
    averaged = saved["weights"]
    assert all(torch.equal(averaged[k], reference[k].to(averaged[k].dtype)) for k in reference)

    # Inside applied() the model computes with the average: the loss of a second model loaded
    # with it; on exit the weights are the trained ones, and training goes on as without.
    other, _ = _setup(case)
    set_model_state_dict(other, averaged)
    tokens = shard(make_batch(9, 8, 8, 32), rank, world_size)
    before = get_model_state_dict(model)
    with torch.no_grad():
        # An evaluation of the trained weights first: FSDP2 keeps the root's weights gathered
        # after a forward without a backward, and applied() must not compute with those.
        lm_loss(model, tokens)
        with ema.applied():
            loss = lm_loss(model, tokens)
            # A step here would be undone on exit, its momentum kept (it was): refused before
            # anything changes (the training below matches the plain run's bit for bit).
            with pytest.raises(RuntimeError, match=r"Muon\.step\(\) was called inside ema\."):
                optimizer.step()
    assert torch.equal(loss, lm_loss(other, tokens).detach())
    after = get_model_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    _step(model, optimizer, 3, rank, world_size)
    plain, plain_optimizer = _setup(case)
    for step in range(4):
        _step(plain, plain_optimizer, step, rank, world_size, nan=step == 1)
    trained, expected = get_model_state_dict(model), get_model_state_dict(plain)
    assert all(torch.equal(trained[k], expected[k]) for k in expected)

    # Loaded into another EMA (another model, and here another plan: one owner per layer),
    # the average is the same, and the model it sits on keeps its weights.
    third, third_optimizer = _setup(case, threshold=10**9)
    kept = get_model_state_dict(third)
    loaded = EMA(third_optimizer, decay=0.5)
    with pytest.raises(ValueError, match=r"EMA\.load_state_dict takes what EMA\.state_dict"):
        loaded.load_state_dict({"decay": 1.5, "weights": saved["weights"]})
    # A mistake on one rank raises on every rank (the others would wait in the load), before
    # anything changes; so does a construction with another decay or dtype on one rank.
    start = {name: value.clone() for name, value in loaded.average.items()}
    with pytest.raises(ValueError, match=r"EMA\.state_dict\(\) returned"):
        loaded.load_state_dict(saved if rank != 1 else {})
    with pytest.raises(ValueError, match=rf"hold other decays \(rank 0: {DECAY}, rank 1: 0\.5"):
        loaded.load_state_dict({**saved, "decay": DECAY if rank == 0 else 0.5})
    lacking = dict(list(saved["weights"].items())[1:])
    with pytest.raises(ValueError, match=r"EMA\.load_state_dict: the averaged weights: .*missing"):
        loaded.load_state_dict({**saved, "weights": lacking})
    assert all(torch.equal(loaded.average[name], value) for name, value in start.items())
    with pytest.raises(ValueError, match=r"EMA: decay must be a float in \(0, 1\)|EMA failed on"):
        EMA(third_optimizer, decay=0.5 if rank == 0 else 2.0)
    with pytest.raises(
        ValueError, match=r"EMA: decay differs across ranks \(rank 0: 0\.5, rank 1: 0\.25"
    ):
        EMA(third_optimizer, decay=0.5 if rank == 0 else 0.25)
    with pytest.raises(ValueError, match=r"EMA: dtype differs across ranks"):
        EMA(third_optimizer, decay=0.5, dtype=torch.float32 if rank == 0 else torch.float64)
    assert loaded.decay == 0.5
    if case == "hsdp 2x2":  # only rank 0 reads the file
        loaded.load_state_dict(saved if rank == 0 else {}, broadcast_from_rank0=True)
    else:
        loaded.load_state_dict(saved)
    assert loaded.decay == DECAY
    again = loaded.state_dict()["weights"]
    assert all(torch.equal(again[k], averaged[k]) for k in averaged)
    now = get_model_state_dict(third)
    assert all(torch.equal(kept[k], now[k]) for k in kept)


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_the_ema_is_the_recurrence_and_the_model_computes_with_it_inside_applied(case) -> None:
    world_size = CASES[case][0]
    run_distributed(_run, world_size, case)
