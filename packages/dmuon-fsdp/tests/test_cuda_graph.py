"""``StepOptions(cuda_graph=True)``: the Muon phase replayed from a CUDA graph gives the bits of
the eager step under a learning-rate schedule, a skipped step, a clip and a post-update hook,
and steps eagerly where the matrices stepped change."""

from __future__ import annotations

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
