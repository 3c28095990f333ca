"""End to end: dmuon's Muon on FSDP2 against a single-process reference trainer, NS counted
once per matrix per step across the world, and the dmuon-clip gradient protocol."""

from __future__ import annotations

import contextlib
import functools
import itertools

import pytest
import torch
import torch.distributed as dist
from _models import build, muon_predicate
from _reference import Hyper, lm_loss, make_batch, shard, train_reference
from _sgd_train import make_mesh, setup_model
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

from dmuon_fsdp import (
    Muon,
    StepOptions,
    dedicate_params,
    dedicated_params_of,
    get_model_state_dict,
    no_sync,
    uninstall_patch,
)
from dmuon_fsdp.holder import is_dedicated
from dmuon_fsdp.setup._fsdp_integration import is_installed
from dmuon_ns import NewtonSchulz
from dmuon_testing.distributed import run_distributed

ROWS = 8
STEPS = 10
HYPER = Hyper()
VOCAB = 32
SEQ = 8


def global_loss(loss: torch.Tensor, world_size: int) -> float:
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / world_size


def train_steps(model, optimizer, rank, world_size, steps, start=0, scheduler=None, rows=ROWS):
    losses = []
    for step in range(start, start + steps):
        optimizer.zero_grad()
        tokens = shard(make_batch(step, rows, SEQ, VOCAB), rank, world_size)
        loss = lm_loss(model, tokens)
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(global_loss(loss, world_size))
    return losses


def _muon_names(model) -> list[str]:
    return [n for n, p in model.named_parameters() if muon_predicate(n, p)]


class CountingNS:
    """An NS function for ``Muon(ns_backend=...)`` that counts the matrices it orthogonalises
    (dmuon-ns's Gram NS underneath)."""

    def __init__(self, steps: int) -> None:
        self.ns = NewtonSchulz(backend="gram", steps=steps)
        self.matrices = 0

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        self.matrices += batch.shape[0]
        return self.ns(batch)


def counting_muon(model, hyper: Hyper = HYPER) -> tuple[Muon, CountingNS]:
    """``Muon`` with ``hyper``'s hyperparameters whose NS counts the matrices it
    orthogonalises."""
    counting = CountingNS(hyper.ns_steps)
    kwargs = {k: v for k, v in hyper.muon_kwargs().items() if k != "ns_steps"}
    return Muon(model, ns_backend=counting, **kwargs), counting


def _plain_fully_shard_model(world_size: int, reshard: bool):
    """The tiny model as the first public DMuon's script builds it: ``dedicate_params`` with
    its defaults, then plain ``fully_shard`` calls (no ``ignored_params``), which its patch
    makes leave the dedicated parameters alone."""
    model = build(0)
    mesh, _, _ = make_mesh(world_size, 1)
    runtime = dedicate_params(model, mesh, muon_predicate, reshard_after_forward=reshard)
    assert is_installed(), "dedicate_params installs the fully_shard patch by default"
    assert dedicated_params_of(model) == {dp.param for dp in runtime.params}
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert all(is_dedicated(p) == (p in dedicated_params_of(model)) for p in model.parameters())
    return model, runtime


def _train_vs_reference(
    rank: int, world_size: int, reshard: bool, plain: bool = False, rows: int = ROWS
):
    uninstall_patch()  # the worker process outlives the tests it ran before
    try:
        if plain:
            model, runtime = _plain_fully_shard_model(world_size, reshard)
        else:
            model, runtime = setup_model(world_size, reshard=reshard, patch_fully_shard=False)
            assert not is_installed(), "patch_fully_shard=False leaves torch unpatched"
        optimizer, counting = counting_muon(model)
        losses = train_steps(model, optimizer, rank, world_size, STEPS, rows=rows)
    finally:
        uninstall_patch()
    owned_muon = sum(1 for dp in runtime.owned if dp.route == "muon")
    ref = None
    if rank == 0:
        reference = build(0)
        ref = train_reference(reference, _muon_names(reference), HYPER, STEPS, rows, SEQ, VOCAB)
    weights = {k: v.clone() for k, v in get_model_state_dict(model).items()}
    return losses, ref, counting.matrices, owned_muon, len(runtime.params), weights


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("world_size", "reshard", "rtol", "rows"),
    [(1, True, 1e-4, ROWS), (2, False, 2e-3, ROWS), (3, True, 2e-3, 6), (4, True, 2e-3, ROWS)],
    ids=["w1-z3", "w2-z2", "w3-z3", "w4-z3"],
)
def test_losses_match_single_process_reference(world_size, reshard, rtol, rows):
    """Through the patch-free route (``ignored_params`` on every ``fully_shard``); at world
    size 2 also through plain ``fully_shard`` calls (the default patch), which must train bit
    for bit alike. World size 3 divides no dim FSDP2 shards (the embedding's and the head's 32
    rows, the norms' 16: the last shard is shorter), and the plan puts each layer's pack on an
    owner of its own, so one rank owns no matrix; its global batch is 6 rows, 2 per rank."""
    results = run_distributed(_train_vs_reference, world_size, reshard, rows=rows)
    losses = results[0][0]
    ref = results[0][1]
    assert all(r[0] == losses for r in results), "ranks disagree on the global loss"
    assert len(losses) == STEPS >= 8
    for step, (got, want) in enumerate(zip(losses, ref)):
        assert abs(got - want) <= rtol * abs(want), f"step {step}: dmuon {got} vs reference {want}"
    assert losses[-1] < 0.85 * losses[0], f"loss did not fall: {losses}"
    # Newton–Schulz ran exactly once per Muon matrix per step, summed over the world, and
    # each rank ran it for exactly the matrices it owns.
    n_matrices = results[0][4]
    assert sum(r[2] for r in results) == n_matrices * STEPS
    for r in results:
        assert r[2] == r[3] * STEPS
    if world_size == 3:  # one owner per layer's pack, and a rank that owns nothing
        assert sorted(r[3] for r in results) == [0, n_matrices // 2, n_matrices // 2]
    if world_size == 2:
        plain = run_distributed(_train_vs_reference, world_size, reshard, True)
        for got, want in zip(plain, results):
            assert got[0] == want[0], "plain fully_shard and ignored_params trained differently"
            assert got[5].keys() == want[5].keys()
            assert all(torch.equal(got[5][k], want[5][k]) for k in want[5])


def _clip_protocol(rank: int, world_size: int):
    model, runtime = setup_model(world_size)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    tokens = make_batch(0, ROWS, SEQ, VOCAB)
    lm_loss(model, shard(tokens, rank, world_size)).backward()
    clip = optimizer.muon_grads_for_clip()
    owned = {id(dp.grad): dp.fqn for dp in runtime.owned if dp.route == "muon"}
    assert len(clip.grads) == len(owned)
    assert all(id(g) in owned for g in clip.grads), "grads must be the owners' own tensors"
    assert clip.device == torch.device("cpu")
    assert clip.process_group is runtime.world_group
    sq = torch.stack([g.double().pow(2).sum() for g in clip.grads]).sum() if clip.grads else None
    total = sq if sq is not None else torch.zeros((), dtype=torch.float64)
    dist.all_reduce(total, group=clip.process_group)
    names = sorted(owned.values())
    # Clipping scales in place and the next step reads the scaled tensors.
    for g in clip.grads:
        g.mul_(0.0)
    before = {dp.fqn: dp.full.clone() for dp in runtime.owned}
    optimizer.step()
    for dp in runtime.owned:
        # Zero gradient, zero momentum: NS(0) = 0 and weight decay is the only change.
        factor = 1 - HYPER.lr * HYPER.weight_decay
        torch.testing.assert_close(dp.full, before[dp.fqn] * factor, rtol=0, atol=1e-7)
    # The norm over owners equals the full-batch norm of the Muon matrices in one process.
    ref = build(0)
    lm_loss(ref, tokens).backward()
    want = sum(
        float(p.grad.double().pow(2).sum())
        for n, p in ref.named_parameters()
        if muon_predicate(n, p)
    )
    return names, float(total), want


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_muon_grads_for_clip_protocol(world_size):
    results = run_distributed(_clip_protocol, world_size)
    all_names = [n for names, _, _ in results for n in names]
    assert len(all_names) == len(set(all_names)), "a matrix's grad was returned on two ranks"
    model = build(0)
    assert sorted(all_names) == sorted(_muon_names(model)), "every matrix exactly once"
    for _, total, want in results:
        assert total == pytest.approx(want, rel=1e-5)


def _with_and_without_the_check(rank: int, world_size: int):
    states = []
    for skip in (True, False):
        model, _ = setup_model(world_size)
        optimizer = Muon(model, **HYPER.muon_kwargs(), options=StepOptions(skip_nonfinite=skip))
        train_steps(model, optimizer, rank, world_size, 3)
        states.append(get_model_state_dict(model))
    return states


@pytest.mark.distributed
def test_the_non_finite_check_changes_no_bit_of_a_finite_step():
    # Both steps run the same kernels (torch's fused AdamW included): the check only decides.
    for checked, unchecked in run_distributed(_with_and_without_the_check, 2):
        for name, value in checked.items():
            assert torch.equal(unchecked[name], value), name


def _layout_run(rank: int, world_size: int, layout: str) -> tuple[list[float], dict]:
    """Three steps of two micro-batches each, the FSDP2 layout and scheduling options of
    ``layout`` applied as torchtitan applies them; ``"plain"``: every layer, then the root,
    and ``dmuon.no_sync`` for the first micro-batch."""
    model = build(0, n_layers=3)
    mesh, _, _ = make_mesh(world_size, 1)
    dedicate_params(model, mesh, muon_predicate, small_param_threshold=0, patch_fully_shard=False)
    shard = functools.partial(fully_shard, mesh=mesh, ignored_params=dedicated_params_of(model))
    layers = list(model.layers)
    if layout == "torchtitan":  # the embedding alone, reshard per layer, [norm, head] as one
        shard(model.embed_tokens)
        model.embed_tokens.set_unshard_in_backward(False)  # its backward reads no weight
        for layer, reshard in zip(layers, (False, True, 2), strict=True):
            shard(layer, reshard_after_forward=reshard)
        shard([model.norm, model.lm_head], reshard_after_forward=False)
    else:
        for layer in layers:
            if layout == "nested":  # attention and MLP their own units inside each layer
                shard(layer.attn)
                shard(layer.mlp)
            shard(layer)
    shard(model)
    if layout == "prefetch":
        for before, after in itertools.pairwise(layers):
            before.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([before])
        # The loop calls a method of the root's other than forward, which calls the layers.
        model.loss_of = functools.partial(lm_loss, model)
        register_fsdp_forward_method(model, "loss_of")
    loss_of = model.loss_of if layout == "prefetch" else functools.partial(lm_loss, model)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    losses = []
    for step in range(3):
        optimizer.zero_grad()
        total = 0.0
        for micro in range(2):
            last = micro == 1
            if layout == "prefetch":
                model.unshard(async_op=last)
            if layout == "torchtitan":  # FSDP2's own accumulation flags, not dmuon.no_sync
                model.set_requires_gradient_sync(last)
                model.set_reshard_after_backward(last)
            tokens = make_batch(2 * step + micro, ROWS, SEQ, VOCAB).chunk(world_size)[rank]
            with contextlib.nullcontext() if last or layout == "torchtitan" else no_sync(model):
                loss = loss_of(tokens) / 2
                loss.backward()
            total += global_loss(loss, world_size)
        optimizer.step()
        losses.append(total)
    return losses, get_model_state_dict(model)


@pytest.mark.distributed
def test_fsdp2_layouts_and_scheduling_options_train_bit_for_bit_alike() -> None:
    """Explicit prefetching and ``unshard()``, ``register_fsdp_forward_method`` on the root,
    nested ``fully_shard`` units, per-layer ``reshard_after_forward`` (an int among them), a
    group of modules as one unit, ``set_unshard_in_backward(False)``, and accumulation through
    FSDP2's flags with ``set_reshard_after_backward(False)`` change when FSDP2 moves its own
    parameters, never dmuon's math: every layout trains bit for bit as the plain one (which
    ``test_losses_match_single_process_reference`` holds to the reference)."""
    runs = {
        layout: run_distributed(_layout_run, 4, layout)
        for layout in ("plain", "prefetch", "nested", "torchtitan")
    }
    plain_losses, plain_state = runs["plain"][0]
    assert plain_losses[-1] < plain_losses[0]
    for layout, results in runs.items():
        for losses, state in results:
            assert losses == plain_losses, layout
            assert state.keys() == plain_state.keys(), layout
            assert all(torch.equal(state[k], plain_state[k]) for k in state), layout


def _evaluating_run(rank: int, world_size: int, reshard: bool) -> dict[str, tuple]:
    """Three steps, after each an evaluation forward on another batch: none, under
    ``model.eval()`` and ``torch.no_grad()``, or under ``torch.inference_mode()`` (after the
    first training forward: FSDP2's first forward must not run under it)."""
    runs = {}
    for how in ("none", "no_grad", "inference_mode"):
        model, _ = setup_model(world_size, reshard=reshard, small_param_threshold=0)
        optimizer = Muon(model, **HYPER.muon_kwargs())
        losses = train_steps(model, optimizer, rank, world_size, 1)
        evaluations = []
        for step in range(1, 4):
            if how != "none":
                model.eval()
                with torch.no_grad() if how == "no_grad" else torch.inference_mode():
                    tokens = shard(make_batch(100 + step, ROWS, SEQ, VOCAB), rank, world_size)
                    evaluations.append(global_loss(lm_loss(model, tokens), world_size))
                model.train()
            losses += train_steps(model, optimizer, rank, world_size, 1, start=step)
        runs[how] = (losses, evaluations, get_model_state_dict(model))
    return runs


@pytest.mark.distributed
@pytest.mark.parametrize("reshard", [True, False], ids=["z3", "z2"])
def test_an_evaluation_between_steps_changes_no_bit_of_training(reshard: bool) -> None:
    for runs in run_distributed(_evaluating_run, 2, reshard):
        losses, _, state = runs["none"]
        for how in ("no_grad", "inference_mode"):
            assert runs[how][0] == losses, how
            assert all(torch.equal(runs[how][2][k], v) for k, v in state.items()), how
        # Both evaluations read the weights of the same steps.
        assert runs["no_grad"][1] == runs["inference_mode"][1]
        assert len(runs["no_grad"][1]) == 3
