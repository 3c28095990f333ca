"""Experts kept as an ``nn.ModuleList`` and run by a loop that skips the experts no token
picked (the loop of Mixtral-style checkpoints), hooked at the decoder layer: each rank skips
the experts its own tokens did not pick, in every layer, and training matches a
single-process model that runs the same loop on the full batch (see [Note: reduce points] in
dmuon_fsdp.runtime._order)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from _models import DIM, HIDDEN, MLP, Block, build, muon_predicate, shard_layers_then_root
from _reference import Hyper, lm_loss, make_batch, shard, train_reference
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh

from dmuon_fsdp import Muon, dedicate_params, get_model_state_dict
from dmuon_testing.distributed import run_distributed

EXPERTS = 8
STEPS = 4
HYPER = Hyper()


class ExpertLoop(nn.Module):
    """Top-1 routing over ``nn.ModuleList`` experts; an expert no token picked is not run
    (its weights get no gradient on this rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(MLP(DIM, HIDDEN) for _ in range(EXPERTS))
        self.skipped: list[frozenset[int]] = []  # per forward, the experts not run

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = self.router(flat).softmax(-1)
        top = probs.argmax(-1)
        out = torch.zeros_like(flat)
        skipped = set()
        for index, expert in enumerate(self.experts):
            rows = (top == index).nonzero().squeeze(-1)
            if rows.numel() == 0:
                skipped.add(index)
                continue
            out = out.index_add(0, rows, expert(flat[rows]) * probs[rows, index : index + 1])
        self.skipped.append(frozenset(skipped))
        return out.reshape_as(x)


def _model() -> nn.Module:
    model = build(0)
    torch.manual_seed(1)
    for layer in model.layers:
        layer.mlp = ExpertLoop()
    return model


def _train(rank: int, world_size: int) -> tuple[list[float], dict[str, Tensor], list, list[str]]:
    model = _model()
    mesh = init_device_mesh("cpu", (world_size,))
    runtime = dedicate_params(
        model,
        mesh,
        muon_predicate,
        hook_boundary_predicate=lambda module: isinstance(module, Block),
        small_param_threshold=0,
    )
    shard_layers_then_root(model, mesh)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = lm_loss(model, shard(make_batch(step, 8, 8, 32), rank, world_size))
        loss.backward()
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world_size)
    skipped = [layer.mlp.skipped for layer in model.layers]
    return losses, get_model_state_dict(model), skipped, [dp.fqn for dp in runtime.params]


@pytest.mark.distributed
def test_an_expert_loop_that_skips_experts_without_tokens_trains_like_one_process() -> None:
    results = run_distributed(_train, 2)
    (losses, state, skipped, names), (_, _, other_skipped, _) = results
    # The ranks skipped different experts, also in the last layer (the first backward reaches).
    assert skipped[1] != other_skipped[1]
    assert any("experts" in name for name in names)
    plain = _model()
    want = train_reference(plain, names, HYPER, STEPS, 8, 8, 32)
    for step, (got, ref) in enumerate(zip(losses, want, strict=True)):
        assert abs(got - ref) <= 2e-3 * abs(ref), f"step {step}: {got} vs {ref}"
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=2e-3, atol=2e-4)


def _boundary_warnings(rank: int, world_size: int) -> tuple[list[str], list[str]]:
    """The warnings ``dedicate_params`` gives the expert loop with the default hook
    boundaries (each expert its own, inside its layer), and with the layer as boundary."""
    mesh = init_device_mesh("cpu", (world_size,))
    caught = []
    for predicate in (None, lambda module: isinstance(module, Block)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            dedicate_params(
                _model(),
                mesh,
                muon_predicate,
                hook_boundary_predicate=predicate,
                small_param_threshold=0,
            )
        caught.append([str(w.message) for w in seen if "hook boundaries" in str(w.message)])
    return caught[0], caught[1]


@pytest.mark.distributed
def test_experts_hooked_one_by_one_inside_a_layer_are_warned_about() -> None:
    default, at_layer = run_distributed(_boundary_warnings, 2)[0]
    assert at_layer == []
    assert len(default) == 1
    assert "16 hook boundaries lie inside another layer" in default[0]
    assert "'layers.0.mlp.experts.0'" in default[0]
    # The fix names the model's own layer class, the stack item above the experts.
    assert "hook_boundary_predicate=lambda m: isinstance(m, Block)" in default[0]
