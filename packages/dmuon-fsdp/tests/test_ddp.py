"""The replicated (DDP) path: ``dedicate_params_ddp`` + ``replicate`` against the single-process
reference, its bytes per step, and ``no_sync`` over micro-batches."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _models import build, muon_numel, muon_predicate
from _reference import Hyper, lm_loss, make_batch, shard, train_reference
from _sgd_train import ddp_model
from torch.distributed.device_mesh import init_device_mesh

from dmuon_fsdp import (
    DedicateConfig,
    Muon,
    dedicate_params_ddp,
    get_model_state_dict,
    no_sync,
)
from dmuon_testing.distributed import run_distributed

HYPER = Hyper()
STEPS = 8
ROWS, SEQ, VOCAB = 8, 8, 32


def _train(rank: int, world_size: int):
    with pytest.raises(TypeError, match=r"unexpected option\(s\) \['reshard_after_forward'\]"):
        dedicate_params_ddp(
            build(0),
            init_device_mesh("cpu", (world_size,)),
            muon_predicate,
            reshard_after_forward=True,
        )  # type: ignore[call-arg]
    # Other seeds per rank: replicate and the owners' first publish make every copy rank 0's
    # and the owner's, as DDP does.
    model, runtime = ddp_model(world_size, seed=rank if rank else 0)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    losses, steps = [], []
    for step in range(STEPS):
        runtime.counter.reset()
        optimizer.zero_grad()
        loss = lm_loss(model, shard(make_batch(step, ROWS, SEQ, VOCAB), rank, world_size))
        loss.backward()
        optimizer.step()
        runtime.drain()  # count the publish of this step
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world_size)
        steps.append(runtime.counter.snapshot())
    # Every rank holds every weight, and they agree (owners' updates were broadcast).
    state = get_model_state_dict(model)
    mine = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, steps, all(torch.equal(mine[n], state[n]) for n in mine)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_path_matches_the_reference_with_two_rounds_of_bytes(world_size: int) -> None:
    results = run_distributed(_train, world_size)
    losses = results[0][0]
    assert all(r[0] == losses for r in results)
    assert all(r[2] for r in results), "a rank's weights differ from the owners'"
    plain = build(0)
    names = [n for n, p in plain.named_parameters() if muon_predicate(n, p)]
    ref = train_reference(plain, names, HYPER, STEPS, ROWS, SEQ, VOCAB)
    for step, (got, want) in enumerate(zip(losses, ref)):
        assert abs(got - want) <= 2e-3 * abs(want), f"step {step}: {got} vs {want}"
    # Per step each Muon element travels once to its owner and once back: 2(N-1)/N·P_M; the
    # reduce also carries one presence flag per matrix.
    p_m = muon_numel(build(0)) * 4
    for _, steps, _ in results:
        for counts in steps:
            assert counts["shard/reduce"]["bytes"] == p_m + 4 * len(names)
            assert counts["shard/publish"]["bytes"] == p_m
            assert "shard/broadcast" not in counts


def _micro_batches(rank: int, world_size: int):
    tokens = shard(make_batch(0, 16, SEQ, VOCAB), rank, world_size)
    big, big_runtime = ddp_model(world_size)
    lm_loss(big, tokens).backward()
    # The replicated gradients are final when backward returns, as under DDP (a clip before
    # step() reads them): nothing waited for them here.
    big_params = dict(big.named_parameters())
    replicated = {n: big_params[n].grad.clone() for n in _names(big, big_runtime)}
    big_runtime.wait_all_reduces()
    big_grads = {dp.fqn: dp.grad for dp in big_runtime.owned}
    for name, grad in replicated.items():
        assert torch.equal(grad, big_params[name].grad), name
    # Four micro-batches, each but the last under no_sync, or each synchronised (DDP's slower
    # way): both give the large batch's gradients.
    for synced in (False, True):
        acc, acc_runtime = ddp_model(world_size)
        for i, part in enumerate(tokens.chunk(4)):
            if i < 3 and not synced:
                with no_sync(acc):
                    (lm_loss(acc, part) / 4).backward()
            else:
                (lm_loss(acc, part) / 4).backward()
        acc_params = dict(acc.named_parameters())
        for name in replicated:
            torch.testing.assert_close(
                acc_params[name].grad, replicated[name], rtol=1e-5, atol=1e-7, msg=name
            )
        acc_runtime.wait_all_reduces()
        for dp in acc_runtime.owned:
            torch.testing.assert_close(dp.grad, big_grads[dp.fqn], rtol=1e-5, atol=1e-7)


def _names(model: torch.nn.Module, runtime) -> list[str]:
    ids = {id(p) for p in runtime.replicated_params}
    return [n for n, p in model.named_parameters() if id(p) in ids]


@pytest.mark.distributed
def test_ddp_path_micro_batches_match_one_large_batch() -> None:
    run_distributed(_micro_batches, 2)


def _deprecated_names_and_config(rank: int, world_size: int):
    import dmuon_fsdp

    mesh = init_device_mesh("cpu", (world_size,))
    model = build(0)
    with pytest.warns(
        DeprecationWarning,
        match=r"dedicate_params_ddp_tp is deprecated.*dmuon\.dedicate_params_ddp\(",
    ) as caught:
        old_runtime = dmuon_fsdp.dedicate_params_ddp_tp(
            model, mesh, muon_predicate, small_param_threshold=0
        )
    assert caught[0].filename == __file__  # stacklevel=2: the caller's line
    with pytest.warns(DeprecationWarning, match=r"replicate_tp is deprecated.*dmuon\.replicate\("):
        dmuon_fsdp.replicate_tp(model, mesh)
    new, new_runtime = ddp_model(world_size)
    assert old_runtime.config == new_runtime.config
    assert old_runtime.plan.fingerprint() == new_runtime.plan.fingerprint()
    assert len(old_runtime.replicated_params) == len(new_runtime.replicated_params)
    # The deprecated names still train: one step each, the same bits.
    states = []
    for m in (model, new):
        optimizer = Muon(m, **HYPER.muon_kwargs())
        lm_loss(m, shard(make_batch(0, ROWS, SEQ, VOCAB), rank, world_size)).backward()
        optimizer.step()
        states.append(get_model_state_dict(m))
    assert all(torch.equal(states[0][k], v) for k, v in states[1].items())

    # config= on the replicated path: its own fields, never the sharding ones.
    config = DedicateConfig(small_param_threshold=0, hook_boundary_strict=False)
    runtime = dedicate_params_ddp(build(0), mesh, muon_predicate, config=config)
    assert runtime.config.replicated and not runtime.config.reshard_after_forward
    assert runtime.config.small_param_threshold == 0 and not runtime.config.hook_boundary_strict
    assert runtime.plan.fingerprint() == new_runtime.plan.fingerprint()
    with pytest.raises(ValueError, match=r"got config= and debug_fence: pass each option once"):
        dedicate_params_ddp(build(0), mesh, muon_predicate, config=config, debug_fence=True)
    # The replicated path calls no fully_shard: it never installs the patch.
    assert not runtime.config.patch_fully_shard


@pytest.mark.distributed
def test_deprecated_tp_names_warn_and_do_what_the_new_names_do() -> None:
    """dedicate_params_ddp_tp and replicate_tp (same functions as dedicate_params_ddp and
    replicate) warn, naming the replacement, and still work; config= on the DDP path."""
    run_distributed(_deprecated_names_and_config, 2)
