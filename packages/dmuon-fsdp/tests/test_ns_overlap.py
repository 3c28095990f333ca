"""``StepOptions(ns_overlap=True)``: Newton–Schulz during backward gives the bits of the step
without it (1-D and HSDP, Z2 and Z3, one batch per shape and one matrix per batch), also when
gradients change after backward (no_sync accumulation, a second backward, a clip that scales
them); and a profiler trace shows NS finishing while backward still runs."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from _models import batch, loss_fn, shard_layers_then_root
from _moe import build_moe, moe_predicate
from _reference import shard
from _sgd_train import ddp_model, setup_model
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

from dmuon_fsdp import Muon, StepOptions, dedicate_params, no_sync
from dmuon_fsdp._warnings import warn
from dmuon_testing.distributed import one_gpu_world, run_distributed
from dmuon_testing.warning_line import check_warning_line

ROWS = 8
STEPS = 5


def _backward(model, step: int, rank: int, world_size: int, device: str = "cpu") -> None:
    loss_fn(model, shard(batch(step, ROWS), rank, world_size).to(device)).backward()


def _train(rank, world_size, replicate, reshard, overlap, cap, device="cpu"):
    """Five steps: two plain (the second after a backward that zero_grad threw away), one
    accumulated under no_sync, one with two synced backward passes and its gradients halved
    by a torch op, one whose Muon gradients a clip scales in place, unseen by torch. Returns each owned matrix's weight and momentum, and the early results used and found
    stale."""
    model, runtime = setup_model(
        world_size, replicate=replicate, reshard=reshard, n_layers=3, device=device
    )
    options = StepOptions(ns_overlap=overlap, ns_batch_bytes=cap)
    optimizer = Muon(model, lr=0.05, weight_decay=0.1, adamw_lr=1e-2, options=options)
    overlap_state = optimizer._overlap
    for step in range(STEPS):
        optimizer.zero_grad()
        if step == 1:  # a backward whose gradients are thrown away before any step
            _backward(model, 300, rank, world_size, device)
            optimizer.zero_grad()
        if step == 2:
            with no_sync(model):
                _backward(model, 100, rank, world_size, device)
        _backward(model, step, rank, world_size, device)
        if step == 3:
            _backward(model, 200, rank, world_size, device)
            runtime.wait_all_reduces()  # every owned gradient final
            for dp in runtime.owned:  # scaled by a torch op: their versions move
                if dp.grad is not None:
                    dp.grad.mul_(0.5)
        if step == 4:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                grads = optimizer.muon_grads_for_clip().grads
            # The clip's protocol turns the option off, with one warning that says why, at
            # this line (not muon_grads_for_clip's call of grads_for_clip).
            assert optimizer._overlap is None
            off = [w.filename for w in caught if "ns_overlap=True) is off" in str(w.message)]
            assert off == [__file__] * overlap, off
            for grad in grads:
                if device == "cpu":
                    grad.numpy()[...] *= 0.5  # a write torch does not see, as a Triton kernel's
                else:
                    grad.mul_(0.5)
        optimizer.step()
    owned = {
        dp.fqn: (dp.full.clone(), optimizer.state[dp.param]["momentum_buffer"].clone())
        for dp in runtime.owned
    }
    counts = (0, 0) if overlap_state is None else (overlap_state.used, overlap_state.stale)
    return owned, counts


# (NS batch cap, reshard): one NS call per shape or one matrix per call, Z3 or Z2.
EVERY_OPTION = ((None, True), (None, False), (1, True), (1, False))


def _same_bits(
    world_size: int, replicate: int, run=run_distributed, device="cpu", options=EVERY_OPTION
) -> None:
    for cap, reshard in options:
        runs = {
            overlap: run(_train, world_size, replicate, reshard, overlap, cap, device)
            for overlap in (False, True)
        }
        used = sum(counts[0] for _, counts in runs[True])
        stale = sum(counts[1] for _, counts in runs[True])
        where = f"cap={cap} reshard={reshard}"
        # Early results were used (plain steps) and some found stale (the gradients
        # scaled by a torch op after backward) and recomputed.
        assert used > 0 and stale > 0, (where, used, stale)
        assert sum(len(plain) for plain, _ in runs[False]) == 21, where  # 3 layers x 7
        for (plain, _), (early, _) in zip(runs[False], runs[True]):
            assert plain.keys() == early.keys(), where
            for fqn, (weight, buf) in plain.items():
                assert torch.equal(weight, early[fqn][0]), (where, fqn)
                assert torch.equal(buf, early[fqn][1]), (where, fqn)


def test_ns_overlap_is_bit_for_bit_on_a_1d_mesh() -> None:
    _same_bits(2, replicate=1)


@pytest.mark.parametrize(
    "options",
    [
        # Each value of each option once; the 1-D test above runs every pair.
        pytest.param(((None, True), (1, False)), id="z3-per-shape,z2-per-matrix"),
        # Extended: the other two pairs, the HSDP ranks of a pair the 1-D test runs.
        pytest.param(
            ((None, False), (1, True)), id="z2-per-shape,z3-per-matrix", marks=pytest.mark.extended
        ),
    ],
)
def test_ns_overlap_is_bit_for_bit_under_hsdp(options) -> None:
    _same_bits(4, replicate=2, options=options)


def _optimizers_on_one_model(rank, world_size):
    """Muons built one after another on one model: one deleted (is it freed?), one with
    ``ns_overlap`` and a plain one after it (the earlier one's steps, and their warnings), and a
    third with the option (its NS during backward); the losses of each phase, and those of a
    plain run."""
    model, _ = setup_model(world_size)
    options = StepOptions(ns_overlap=True)
    deleted = Muon(model, lr=0.05, adamw_lr=1e-2, options=options)
    freed = weakref.ref(deleted)
    del deleted
    gc.collect()

    def train(optimizer, steps):
        losses = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in steps:
                optimizer.zero_grad()
                loss = loss_fn(model, shard(batch(step, ROWS), rank, world_size))
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
        return losses, [
            (str(w.message), w.filename) for w in caught if w.category is RuntimeWarning
        ]

    first = Muon(model, lr=0.05, adamw_lr=1e-2, options=options)
    # Its step() is called through the scheduler's wrapper: one more frame before the caller's.
    torch.optim.lr_scheduler.LambdaLR(first, lambda _: 1.0)
    Muon(model, lr=0.05, adamw_lr=1e-2)  # built later, never stepped: first no longer listens
    out = {"freed": freed() is None}
    out["first"], out["first_warnings"] = train(first, range(2))
    third = Muon(model, lr=0.05, adamw_lr=1e-2, options=options)
    third.load_state_dict(first.state_dict())
    out["third"], out["third_warnings"] = train(third, range(2, 4))
    out["used"] = third._overlap.used
    model, _ = setup_model(world_size)
    plain = Muon(model, lr=0.05, adamw_lr=1e-2)
    out["plain"], _ = train(plain, range(4))
    return out


def test_optimizers_built_one_after_another_on_one_model() -> None:
    """A deleted optimizer is freed (the runtime held its NS-during-backward listener, and with
    it the optimizer's states); one built earlier than the last loses the listener with one
    warning at its step and trains the same bits; the last one built runs NS during backward."""
    outs = run_distributed(_optimizers_on_one_model, 2)
    for out in outs:
        assert out["freed"]
        assert len(out["first_warnings"]) == 1, out["first_warnings"]
        message, filename = out["first_warnings"][0]
        assert "a dmuon.Muon built after this one" in message
        assert filename == __file__  # the line that stepped, not torch's or dmuon's
        assert out["third_warnings"] == []
        assert out["first"] + out["third"] == out["plain"], out
    assert sum(out["used"] for out in outs) > 0


def test_the_stop_warning_names_the_callers_line_through_training_libraries() -> None:
    # Under DmuonTrainer the clip that stops the option is reached through the Trainer's loop
    # (and Muon.step through accelerate's optimizer wrapper): the warning named the Trainer's
    # line, not the user's trainer.train().
    check_warning_line(warn, "dmuon_fsdp.optim._ns_overlap")


def _model_on(path: str, world_size: int):
    """The model of one other path, its runtime and this rank's data-parallel index and size:
    tensor parallelism (2 x 2), the replicated (DDP) path, expert stacks with dense
    matrices."""
    if path == "tp":
        from test_tp import _tp_model

        model, runtime, dp_index = _tp_model((2, 2))
        return model, runtime, dp_index, 2
    if path == "ddp":
        model, runtime = ddp_model(world_size)
    else:
        model = build_moe(4, "fused")
        mesh = init_device_mesh("cpu", (world_size,))
        runtime = dedicate_params(model, mesh, moe_predicate)
        shard_layers_then_root(model, mesh)
    return model, runtime, runtime.coord.shard, world_size


def _losses_on(rank, world_size, path):
    """Three steps of ``path`` without and with ``ns_overlap``: the losses of each."""
    out = {}
    for overlap in (False, True):
        model, _, dp_index, dp_size = _model_on(path, world_size)
        options = StepOptions(ns_overlap=overlap)
        optimizer = Muon(model, lr=0.05, weight_decay=0.1, adamw_lr=1e-2, options=options)
        losses = []
        for step in range(3):
            optimizer.zero_grad()
            tokens = shard(batch(step, ROWS), dp_index, dp_size)
            loss = loss_fn(model, tokens)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        out[overlap] = losses
        if overlap:
            out["used"] = optimizer._overlap.used
    return out


@pytest.mark.parametrize(("path", "world_size"), [("tp", 4), ("ddp", 2), ("moe", 2)])
def test_ns_overlap_leaves_other_paths_bit_for_bit(path: str, world_size: int) -> None:
    """Tensor-parallel matrices and expert stacks run in the step, the DDP path's and the
    MoE model's dense matrices during backward: every loss the same bits."""
    outs = run_distributed(_losses_on, world_size, path)
    for out in outs:
        assert out[False] == out[True], out
    used = sum(out["used"] for out in outs)
    # Every matrix of the TP model is tensor-parallel: nothing runs early there.
    assert used == 0 if path == "tp" else used > 0, used


def _trace(rank, world_size):
    """One profiled iteration (after one that records the forward order) of a 4-layer model,
    one matrix per NS call: when each ``dmuon::ns_overlap`` span ran, and when each backward
    op of the autograd engine started."""
    model, _ = setup_model(world_size, n_layers=4)
    options = StepOptions(ns_overlap=True, ns_batch_bytes=1)
    optimizer = Muon(model, lr=0.05, adamw_lr=1e-2, options=options)
    for step in range(2):
        optimizer.zero_grad()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _backward(model, step, rank, world_size)
            optimizer.step()
    ns = [
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.name == "dmuon::ns_overlap"
    ]
    backward = [
        e.time_range.start
        for e in prof.events()
        if e.name.startswith("autograd::engine::evaluate_function")
    ]
    return ns, backward, optimizer._overlap.used


def test_ns_overlap_runs_while_backward_goes_on() -> None:
    for ns, backward, used in run_distributed(_trace, 2):
        assert ns and used > 0
        first_done = min(end for _, end in ns)
        # Backward ops of earlier layers start after the first NS has finished.
        later = [start for start in backward if start > first_done]
        assert len(later) >= 4, (len(later), len(backward))


def _on_one_gpu(fn, world_size, *args):
    """``fn`` in this process, in a one-rank NCCL world on the first GPU."""
    with one_gpu_world():
        return [fn(0, world_size, *args)]


@pytest.mark.gpu
def test_ns_overlap_is_bit_for_bit_on_a_gpu() -> None:
    """The side stream on CUDA (NS beside backward, CUDA-graphed NS, the fused passes):
    the same bits as the step without it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _same_bits(1, replicate=1, run=_on_one_gpu, device="cuda")
