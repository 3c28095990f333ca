"""``StepOptions(cuda_graph=True)``: the Muon phase replayed from a CUDA graph gives the bits of
the eager step under a learning-rate schedule, a skipped step, a clip and a post-update hook,
and steps eagerly where the matrices stepped change (GPU); the phase run on the graph's device
tables (scalars and gradient offsets) gives the bits of the plain phase (CPU, Triton's
interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from _models import batch, build, loss_fn, muon_predicate, shard_layers_then_root
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from dmuon_fsdp import Muon, StepOptions, dedicate_params
from dmuon_fsdp.optim._fused import _join_background
from dmuon_testing.distributed import one_gpu_world

STEPS = 9


def _train(graphed: bool, device: torch.device):
    """Nine steps of a 3-layer model (one NS call per matrix, so many launches) with a
    learning rate that changes at every step: step 4 is skipped (an infinite gradient),
    step 5 steps without the first layer's query (no gradient: another signature), step 6
    clips the Muon gradients. Returns each weight and momentum, and the phase's counts."""
    model = build(0, 3).to(device)
    mesh = init_device_mesh("cuda", (1,))
    runtime = dedicate_params(model, mesh, muon_predicate)
    shard_layers_then_root(model, mesh)
    options = StepOptions(cuda_graph=graphed, ns_batch_bytes=1)
    optimizer = Muon(model, lr=0.05, weight_decay=0.1, adamw_lr=1e-2, options=options)
    _join_background()  # the fused kernels from the first step on: the counts below are exact
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + step))
    hooked = []
    optimizer.register_post_update_hook(lambda opt, parts: hooked.append(len(parts)))
    query = runtime.owned[0]
    for step in range(STEPS):
        optimizer.zero_grad()
        loss_fn(model, batch(step, 8).to(device)).backward()
        runtime.wait_all_reduces()
        if step == 4:
            query.grad[0, 0] = float("inf")
        if step == 5:
            query.grad = None
        if step == 6:
            for grad in optimizer.muon_grads_for_clip().grads:
                grad.mul_(0.25)
        optimizer.step()
        schedule.step()
        if step == 4:
            assert bool(optimizer.last_step_stats.skipped)
    torch.cuda.synchronize()
    state = {
        dp.fqn: (dp.full.clone(), optimizer.state[dp.param]["momentum_buffer"].clone())
        for dp in runtime.owned
    }
    state.update(
        {name: (p.full_tensor(),) for name, p in model.named_parameters() if isinstance(p, DTensor)}
    )
    assert len(hooked) == STEPS
    phase = optimizer._graphed
    return state, None if phase is None else (phase.captures, phase.replays)


@pytest.mark.gpu
def test_cuda_graph_gives_the_eager_bits() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with one_gpu_world() as device:
        eager, _ = _train(False, device)
        graphed, (captures, replays) = _train(True, device)
    assert eager.keys() == graphed.keys()
    for name, tensors in eager.items():
        for a, b in zip(tensors, graphed[name]):
            assert torch.equal(a, b), name
    # Captured at step 1 (replays from step 2); step 4's skip is the graph's too (its flag is
    # read on the device). Step 5, with a matrix without a gradient, runs eagerly; the graph
    # stays, and steps 6 to 8 replay it.
    assert (captures, replays) == (1, 6), (captures, replays)


# Run as a script under TRITON_INTERPRET=1: the fused passes run as (interpreted) kernels on
# the CPU, where no graph can be captured but every table a replay reads is built and read.
_TABLES_BODY = textwrap.dedent(
    """
    import tempfile
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from _models import batch, build, loss_fn, muon_predicate, shard_layers_then_root
    from dmuon_fsdp import Muon, StepOptions, dedicate_params
    from dmuon_fsdp.optim._fused import static_tables
    from dmuon_fsdp.optim._graphed_step import _Buffers
    from dmuon_fsdp.optim._muon_math import muon_phase

    tmp = tempfile.mkdtemp()
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=0, world_size=1)

    def on_tables(work, skip, mark):
        parts = [items for _, items, _ in work.batches] + list(work.momentum_only)
        items = [item for part in parts for item in part]
        tables = _Buffers("signature", parts, skip is not None)
        flag = tables.write(items, skip)
        with static_tables(tables.tables):
            muon_phase(work.batches, work.momentum_only, flag, mark, scalars=tables.scalars)

    def train(tabled, cap):
        model = build(0, 2)
        runtime = dedicate_params(model, init_device_mesh("cpu", (1,)), muon_predicate)
        shard_layers_then_root(model, init_device_mesh("cpu", (1,)))
        options = StepOptions(ns_batch_bytes=cap)
        optimizer = Muon(model, lr=0.05, weight_decay=0.1, adamw_lr=1e-2, options=options)
        # Two parameter groups' worth of hyperparameters: the rows differ per matrix.
        optimizer.param_groups[0]["lr"] = 0.03
        if tabled:
            optimizer._muon_update = on_tables
        for step in range(3):
            optimizer.zero_grad()
            loss_fn(model, batch(step, 8)).backward()
            optimizer.step()
            optimizer.param_groups[0]["lr"] *= 0.5
        return {
            dp.fqn: (dp.full.clone(), optimizer.state[dp.param]["momentum_buffer"].clone())
            for dp in runtime.owned
        }

    for cap in (None, 1):  # one NS call per shape; one matrix per call
        plain, tabled = train(False, cap), train(True, cap)
        assert plain.keys() == tabled.keys() and len(plain) == 14, cap
        for fqn, tensors in plain.items():
            for a, b in zip(tensors, tabled[fqn]):
                assert torch.equal(a, b), (cap, fqn)
    dist.destroy_process_group()
    print("ok")
    """
)


def test_the_phase_on_the_device_tables_gives_the_plain_bits() -> None:
    pytest.importorskip("triton")
    tests_dir = os.path.dirname(__file__)
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", _TABLES_BODY], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().endswith("ok")
