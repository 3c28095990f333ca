"""torch.compile with dedicated parameters (inductor on CPU): per-block compile (also with
``fullgraph=True``, as torchtitan compiles), whole-model compile and a compiled loss function
match eager, compile once, and dmuon adds no graph break inside a block. A compiled train step
that calls ``zero_grad()`` and ``step()`` runs them (and dmuon's backward hooks) eagerly and
matches eager; ``fullgraph=True`` refuses them, and blocks wrapped in ``checkpoint_wrapper``
after ``dedicate_params``, naming the fix."""

from __future__ import annotations

import os
import re
from collections.abc import Callable

import pytest
import torch
from _models import build, muon_predicate, shard_layers_then_root
from _reference import Hyper, lm_loss, make_batch, shard
from _sgd_train import setup_model
from torch.distributed.fsdp import FSDPModule

from dmuon_fsdp import Muon
from dmuon_testing.distributed import run_distributed

HYPER = Hyper()
STEPS = 4


def _model(world_size: int, reshard: bool, n_layers: int = 2, frozen_embedding: bool = False):
    model, _ = setup_model(world_size, reshard=reshard, n_layers=n_layers)
    if frozen_embedding:  # the first layer's inputs need no gradient: it has no reduce point
        model.embed_tokens.weight.requires_grad_(False)
    return model


def _losses(rank: int, world_size: int, reshard: bool, compile_: str | None, **shape):
    """(``STEPS`` losses, graphs compiled after each step, graph breaks) of the model (of
    ``_model(world_size, reshard, **shape)``) compiled as ``compile_`` says."""
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    model = _model(world_size, reshard, **shape)
    if compile_ == "block":
        for layer in model.layers:
            layer.compile()
    elif compile_ == "block_fullgraph":
        for layer in model.layers:
            layer.compile(fullgraph=True)  # torchtitan's per-block compile (apply_compile)
    elif compile_ == "model":
        model.compile()
    loss_fn = torch.compile(lm_loss) if compile_ == "loss" else lm_loss
    optimizer = Muon(model, **HYPER.muon_kwargs())
    losses, graphs = [], []
    for step in range(STEPS):
        losses.append(_step(model, optimizer, loss_fn, step, rank, world_size))
        graphs.append(dynamo_utils.counters["stats"]["unique_graphs"])
    breaks = dict(dynamo_utils.counters["graph_break"])
    return losses, graphs, breaks


def _compiled_autograd(rank: int, world_size: int, reshard: bool, traced: bool, **shape):
    """A backward under torch's compiled autograd (refused), then the recovery of a backward
    that raised, then ``STEPS`` eager steps: (the error's messages, the losses). With
    ``traced`` dynamo traces a captured graph (``backend="eager"``) before it runs; without,
    it runs as captured."""
    from torch._dynamo import compiled_autograd

    torch._dynamo.reset()
    model = _model(world_size, reshard, **shape)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    loss = lm_loss(model, shard(make_batch(0, 8, 8, 32), rank, world_size))
    messages = []
    compiler = torch.compile(backend="eager") if traced else (lambda graph: graph)
    try:
        with compiled_autograd._enable(compiler):
            loss.backward()
    except Exception as error:  # the capture's own error may wrap dmuon's
        messages = [str(error), str(error.__cause__)]
    model.reset_iter_state()
    optimizer.zero_grad()
    losses = [_step(model, optimizer, lm_loss, step, rank, world_size) for step in range(STEPS)]
    return messages, losses


def _step(model, optimizer, loss_fn, step: int, rank: int, world_size: int) -> float:
    """One training step on this rank's share of step ``step``'s batch; its loss."""
    optimizer.zero_grad()
    loss = loss_fn(model, shard(make_batch(step, 8, 8, 32), rank, world_size))
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def _one_layer_cases(world_size: int, reshard: bool) -> list[tuple[str, dict]]:
    """The one-layer models compiled autograd also gets, named, with their ``_model`` shape.
    "one owner" (two ranks, Z3): the layer's 7 small matrices share one owner
    (``small_param_threshold``), which holds every weight the capture reads; without a refusal
    before the capture that rank ran the captured graph, whose first FSDP2 hook all-gathered
    while its peer had raised (rank 0 aborted). "no reduce point" (one rank): the layer's
    inputs need no gradient, so the graph holds no dmuon node to refuse at; the capture passes
    and the captured graph, traced, meets dmuon's hook, which refuses."""
    if world_size == 1:
        return [("no reduce point", {"n_layers": 1, "frozen_embedding": True})]
    return [("one owner", {"n_layers": 1})] if reshard else []


def _all_modes(rank: int, world_size: int, reshards: tuple[bool, ...], traced: bool):
    out = {}
    # The recovery after the refused backward is FSDP2's reset_iter_state (torch 2.13 on).
    recovers = hasattr(FSDPModule, "reset_iter_state")
    for reshard in reshards:
        eager = _losses(rank, world_size, reshard, None)[0]
        if recovers:
            refused = _compiled_autograd(rank, world_size, reshard, traced)
            out[(reshard, "compiled autograd")] = (eager, refused)
        for name, shape in _one_layer_cases(world_size, reshard) if recovers else ():
            out[(reshard, f"compiled autograd, {name}")] = (
                _losses(rank, world_size, reshard, None, **shape)[0],
                _compiled_autograd(rank, world_size, reshard, traced, **shape),
            )
        for mode in ("block", "block_fullgraph", "model", "loss"):
            out[(reshard, mode)] = (eager, *_losses(rank, world_size, reshard, mode))
    return out


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("world_size", "reshards", "traced"),
    [
        # One rank (extended) runs what two ranks run, without broadcasts, and a layer without
        # a reduce point, whose captured graph of compiled autograd runs (the one rank holds
        # every weight), traced by dynamo as torch.compile traces it.
        pytest.param(1, (True,), True, marks=pytest.mark.extended),
        # Two ranks: dmuon's refusal is at the graph's reduce points, before the capture, not
        # in what a backend makes of a graph, which runs as captured.
        (2, (True, False), False),
    ],
)
def test_compiled_blocks_and_models_match_eager_and_compile_once(world_size, reshards, traced):
    for result in run_distributed(_all_modes, world_size, reshards, traced):
        for (reshard, mode), (eager, *got) in result.items():
            where = f"{mode} compile, {'Z3' if reshard else 'Z2'}"
            if mode.startswith("compiled autograd"):
                # Refused on every rank with an error that names it. At the graph's reduce
                # points that is before the capture and before any gradient exists, whatever
                # rank holds which weight, so after the recovery of a backward that raised
                # training matches eager bit for bit; without one the captured graph runs the
                # head's backward first, whose gradient FSDP2's recovery keeps (as without
                # dmuon).
                messages, losses = got[0]
                assert any("dmuon does not support compiled autograd" in m for m in messages), (
                    where,
                    messages,
                )
                assert mode.endswith("no reduce point") or losses == eager, (where, losses, eager)
                continue
            losses, graphs, breaks = got
            for got, want in zip(losses, eager):
                assert abs(got - want) <= 1e-4 * abs(want), (where, losses, eager)
            assert graphs[1] == graphs[-1], f"{where}: recompiled after step 2: {graphs}"
            # dmuon's only breaks are its hooks, at a block's edges ("_untraced"): a block's
            # own compute is one graph (every layer runs the same block code).
            # (By the module dynamo names, not by file paths, which may contain "dmuon".)
            ours = [reason for reason in breaks if "module: dmuon_fsdp" in reason]
            assert all("_untraced" in reason for reason in ours), (where, breaks)
            others = [reason for reason in breaks if reason not in ours]
            if mode == "loss":
                # Traced from the loss, the model's call meets FSDP2's own root hook, which
                # FSDP2 keeps out of graphs itself (torch._dynamo.disable).
                assert all("`disable`" in reason for reason in others), (where, breaks)
            else:
                assert not others, (where, breaks)
            if mode.startswith("block"):
                assert graphs[-1] == 1, (where, graphs)


def _traced_into_dmuon(traced: list[str]):
    """A ``torch.compile`` backend that runs each graph as traced (no inductor: fast) and
    appends to ``traced`` the stack of every graph node that comes from dmuon's sources."""
    import dmuon_fsdp

    sources = os.path.dirname(dmuon_fsdp.__file__)

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        for node in gm.graph.nodes:
            stack = node.meta.get("stack_trace") or ""
            if sources in stack:
                traced.append(stack)
        return gm.forward

    return backend


# A compiled function that calls backward() on an FSDP2 model fails inside FSDP2 on torch 2.11
# ("modified by an inplace operation", plain FSDP2 + torch.optim.AdamW alike) and trains on
# 2.13; the compile guide says so.
BACKWARD_COMPILES = tuple(int(v) for v in re.findall(r"\d+", torch.__version__)[:2]) >= (2, 13)


def _compiled_train_step(rank: int, world_size: int) -> dict:
    """The train-step habits of torch's own optimizers: ``torch.compile(optimizer.step)``
    under ``fullgraph=True``, and a compiled function that calls ``zero_grad()``, the model,
    ``backward()`` and ``step()``; then ``checkpoint_wrapper`` put around the blocks after
    ``dedicate_params`` and compiled with ``fullgraph=True``. What each raised, the compiled
    loop's and the eager loop's losses, and the graph nodes dynamo traced from dmuon's code."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon_fsdp import dedicate_params

    out: dict = {"traced": []}
    torch._dynamo.reset()
    backend = _traced_into_dmuon(out["traced"])
    model = _model(world_size, reshard=True)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    for name, fn in (("step", optimizer.step), ("zero_grad", optimizer.zero_grad)):
        try:
            torch.compile(fn, backend=backend, fullgraph=True)()
        except Exception as error:  # dynamo's Unsupported
            out[name] = str(error)

    @torch.compile(backend=backend)
    def train_step(tokens: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = lm_loss(model, tokens)
        loss.backward()
        optimizer.step()
        return loss.detach()

    batches = [shard(make_batch(step, 8, 8, 32), rank, world_size) for step in range(2)]
    if BACKWARD_COMPILES:
        out["compiled"] = [float(train_step(tokens)) for tokens in batches]
        model = _model(world_size, reshard=True)
        optimizer = Muon(model, **HYPER.muon_kwargs())
        out["eager"] = [_step(model, optimizer, lm_loss, s, rank, world_size) for s in range(2)]

    torch._dynamo.reset()
    model = build(0, 2)
    mesh = init_device_mesh("cpu", (world_size,))
    dedicate_params(model, mesh, muon_predicate)
    for i, layer in model.layers.named_children():  # after dedicate_params: hooks inside
        model.layers.register_module(i, checkpoint_wrapper(layer))
    shard_layers_then_root(model, mesh)
    for layer in model.layers:
        layer.compile(backend=backend, fullgraph=True)
    try:
        lm_loss(model, batches[0])
    except Exception as error:  # dynamo's Unsupported
        out["wrapped after"] = str(error)
    return out


@pytest.mark.distributed
def test_compiled_step_runs_eagerly_and_fullgraph_names_the_fix():
    # [Note: the step under torch.compile], [Note: a hook inside a checkpointed region]
    for result in run_distributed(_compiled_train_step, 2):
        # Before: 21 graphs of dmuon's step, pieces of its backward hooks traced, and errors
        # under fullgraph=True that named a private torch call or a skipped torch function.
        for name in ("step", "zero_grad"):
            assert f"dmuon.Muon.{name} runs eagerly under torch.compile" in result[name]
            assert "outside the compiled function" in result[name]
        assert not result["traced"], result["traced"][:3]
        if BACKWARD_COMPILES:
            assert result["compiled"] == result["eager"], (result["compiled"], result["eager"])
        message = result["wrapped after"]
        assert "wrap the layers in checkpoint_wrapper before dmuon.dedicate_params" in message
