"""Nothing crashes, nothing is silent, nothing leaks.

Every rank runs in its own worker process (``dmuon_testing.distributed``), so a read that
crashed a rank (a segfault) fails its test at once, with the rank's exit code, instead of
taking the test session down.
"""

from __future__ import annotations

import functools
import gc
import io
import math
import os
import re
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
from _models import batch, build, loss_fn, muon_predicate, shard_layers_then_root
from _reference import Hyper, lm_loss, make_batch, shard, train_reference
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
from torch.nn.parallel import DistributedDataParallel

from dmuon_fsdp import (
    Muon,
    NotHeldError,
    Role,
    dedicate_params,
    dedicate_params_ddp,
    dedicated_params_of,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_runtime,
    replicate,
    set_model_state_dict,
    summarize_param_groups,
)
from dmuon_testing.distributed import run_distributed

HYPER = Hyper()


def _wrapped(world_size: int, **options):
    model = build(0)
    mesh = init_device_mesh("cpu", (world_size,))
    runtime = dedicate_params(model, mesh, muon_predicate, small_param_threshold=0, **options)
    shard_layers_then_root(model, mesh)
    return model, runtime


def _step(model, optimizer, rank, world_size, step=0, scale=1.0):
    optimizer.zero_grad()
    tokens = shard(make_batch(step, 8, 8, 32), rank, world_size)
    loss = lm_loss(model, tokens) * scale
    loss.backward()
    optimizer.step()
    return loss.detach()


# -- reads of a weight this rank does not hold -------------------------------------------------


def _peer_reads(rank: int, world_size: int) -> dict[str, str]:
    model, runtime = _wrapped(world_size)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    outcome: dict[str, str] = {}
    # Peers hold nothing from dedicate_params on. Conversions that change nothing go through
    # (scripts call model.to(device) by habit; before the first backward, as FSDP2 needs); one
    # that would convert a dedicated weight is refused on every rank before anything changes.
    model.to("cpu")
    model.cpu()
    model.float()
    model.to(torch.device("cpu"), torch.float32)
    outcome["no-op conversions"] = "ok"
    dtypes = {name: t.dtype for name, t in model.state_dict(keep_vars=True).items()}
    for convert in (lambda: model.to(torch.float64), model.half, lambda: model.layers[0].half()):
        with pytest.raises(ValueError, match="would convert dedicated parameter"):
            convert()
    assert {name: t.dtype for name, t in model.state_dict(keep_vars=True).items()} == dtypes
    outcome["converting"] = "refused, nothing converted"
    _step(model, optimizer, rank, world_size)
    peer = next(dp for dp in runtime.params if dp.role is Role.PEER)
    owned = next(dp for dp in runtime.params if dp.is_owner)
    p = peer.param

    def expect_not_held(label, fn):
        with pytest.raises(NotHeldError) as caught:
            fn()
        message = str(caught.value)
        # The first weight the read touched that is not held here, named with its owner.
        named = [dp for dp in runtime.params if f"{dp.fqn!r}" in message]
        assert len(named) == 1 and named[0].role is Role.PEER, message
        assert f"owner: rank {runtime.global_rank(named[0].owner)}" in message, message
        assert "dmuon.get_model_state_dict(model)" in message, message
        outcome[label] = "clear error"
        return message

    ema = torch.zeros(tuple(p.shape))
    expect_not_held("norm", lambda: p.norm())
    expect_not_held("ema", lambda: ema.lerp_(p.detach(), 0.1))
    expect_not_held("data", lambda: p.data.sum())
    expect_not_held(
        "parameters_to_vector",
        lambda: torch.nn.utils.parameters_to_vector(model.parameters()),
    )
    # A state dict's values are refused on every rank, the owners' too (see
    # _torch_state_dict_functions), naming the first dedicated weight it reaches.
    with pytest.raises(NotHeldError, match="refused on every rank") as caught:
        torch.save(model.state_dict(), io.BytesIO())
    assert "dmuon.get_model_state_dict(model)" in str(caught.value)
    outcome["torch.save(state_dict)"] = "clear error"
    # print(p) says where the weight is instead of printing values.
    text = repr(p)
    assert "not held on this rank" in text and peer.fqn in text, text
    outcome["print"] = "description"
    # Metadata stays readable, and the owner reads its own weight as usual.
    assert p.shape == peer.shape and p.requires_grad and p.grad is None and p.numel() > 0
    assert torch.equal(owned.param.detach(), owned.full)
    assert math.isfinite(float(owned.param.norm()))
    # The supported read gives every rank the value.
    full = get_model_state_dict(model)
    assert torch.equal(full[peer.fqn], full[peer.fqn]) and full[peer.fqn].shape == peer.shape
    # The forward of a module that does not hold the weight: the error says so.
    x = torch.zeros(2, p.shape[1])
    message = expect_not_held("another module's forward", lambda: _Borrower(p)(x))
    assert "read in the forward of a _Borrower that does not hold it" in message, message
    # Inside forward the weight is held: training goes on after the refused reads.
    assert math.isfinite(float(_step(model, optimizer, rank, world_size, step=1)))
    # Last, as each leaves its module half changed: a method registered with FSDP2's
    # register_fsdp_forward_method on the layer (FSDP2 gathers its own parameters for it, not
    # dmuon's), and a parametrization registered after dedicate_params.
    layer = model.get_submodule(".".join(peer.fqn.split(".")[:2]))
    layer.reads = lambda x: torch.nn.functional.linear(x, p)
    register_fsdp_forward_method(layer, "reads")
    message = expect_not_held("register_fsdp_forward_method", lambda: layer.reads(x))
    assert "register_fsdp_forward_method, which gathers FSDP2's parameters" in message
    module = model.get_submodule(peer.fqn.rpartition(".")[0])
    message = expect_not_held(
        "parametrization", lambda: torch.nn.utils.parametrizations.weight_norm(module)
    )
    assert "register it before dedicate_params" in message, message
    return outcome


def _equal_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[name].keys() == b[name].keys()
        and all(
            torch.equal(torch.as_tensor(a[name][f]), torch.as_tensor(b[name][f])) for f in a[name]
        )
        for name in a
    )


class _Borrower(torch.nn.Module):
    """Reads another module's weight in its forward."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.borrowed = [weight]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.borrowed[0])


@pytest.mark.distributed
def test_reads_on_a_non_owner_raise_a_clear_error_and_never_crash() -> None:
    outcomes = run_distributed(_peer_reads, 2)
    assert outcomes[0] == outcomes[1]
    assert set(outcomes[0]) == {
        "norm",
        "ema",
        "data",
        "parameters_to_vector",
        "torch.save(state_dict)",
        "print",
        "no-op conversions",
        "converting",
        "another module's forward",
        "register_fsdp_forward_method",
        "parametrization",
    }


def _torch_state_dict_functions(rank: int, world_size: int) -> list[str]:
    """Every function of torch.distributed.checkpoint.state_dict given a dmuon model and Muon:
    each raises the same message on every rank before it reads or changes anything, with a
    fresh optimizer (torch starts it with a step of its own, at lr 0) and after a step, where
    the ranks own some matrices each and where one rank owns every matrix (it went on into a
    collective the other never reached, and a fresh optimizer's groups kept lr 0); on the
    replicated path the model functions work (every rank holds every weight). So does
    ``model.state_dict()``, which a hand-written ``dcp.save({"model": model.state_dict()})``
    saves: the rank that owned every matrix got its dictionary and went on into dcp.save's
    collectives while the other raised ``NotHeldError``; and a head tied to a dedicated
    embedding refuses its own ``state_dict()``, ``load_state_dict`` and DDP alike."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dsd

    full = {"options": dsd.StateDictOptions(full_state_dict=True)}
    rank0 = {"options": dsd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)}
    messages = []
    for plan in ("spread", "one owner", "replicated"):
        model = build(0)
        mesh = init_device_mesh("cpu", (world_size,))
        if plan == "replicated":
            dedicate_params_ddp(model, mesh, muon_predicate, small_param_threshold=0)
            replicate(model, mesh)
        else:
            only_q = plan == "one owner"
            predicate = (lambda n, p: n == "layers.0.attn.q_proj.weight") if only_q else None
            dedicate_params(model, mesh, predicate or muon_predicate, small_param_threshold=0)
            shard_layers_then_root(model, mesh)
        optimizer = Muon(model, **HYPER.muon_kwargs())
        for stepped in (False, True):
            if stepped:
                _step(model, optimizer, rank, world_size)
                optimizer.zero_grad()
            weights = get_model_state_dict(model)
            saved = get_optimizer_state_dict(model, optimizer)
            groups = [dict(g) for g in optimizer.param_groups]
            calls = {
                "get_optimizer_state_dict": (dsd.get_optimizer_state_dict, (), {}),
                "set_optimizer_state_dict": (dsd.set_optimizer_state_dict, (saved,), full),
                "get_state_dict": (dsd.get_state_dict, (), full),
                "set_state_dict": (
                    dsd.set_state_dict,
                    (),
                    {"model_state_dict": weights, "optim_state_dict": saved},
                ),
                "get_model_state_dict": (dsd.get_model_state_dict, (), full),
                "set_model_state_dict": (dsd.set_model_state_dict, (weights,), rank0),
            }
            for name, (function, args, kwargs) in calls.items():
                args = (model, *(() if "model_state" in name else (optimizer,)), *args)
                if plan == "replicated" and name.endswith("model_state_dict"):
                    function(*args, **kwargs)  # every rank holds every weight
                    continue
                with pytest.raises(RuntimeError, match="cannot take a dmuon model") as caught:
                    function(*args, **kwargs)
                message = str(caught.value)
                assert f"state_dict.{name} cannot" in message and "Use dmuon." in message
                messages.append(message)
                assert all(p.grad is None for p in model.parameters()), (plan, name)
                assert [dict(g) for g in optimizer.param_groups] == groups, (plan, name)
                state = get_optimizer_state_dict(model, optimizer)["state"]
                assert _equal_states(state, saved["state"]), (plan, name)
                assert stepped or not optimizer.state, (plan, name)
                now = get_model_state_dict(model)
                assert all(torch.equal(now[k], v) for k, v in weights.items()), (plan, name)
            if plan == "replicated":
                assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
                continue
            # The owner of every matrix too; the model as a DCP Stateful calls the same.
            path = os.path.join(tempfile.gettempdir(), f"dmuon-unsaved-{os.getpid()}")
            saves = (model.state_dict, functools.partial(dcp.save, {"model": model}, path))
            for save in saves:
                with pytest.raises(NotHeldError, match=r"every rank.*dmuon\.AppState") as caught:
                    save()
                messages.append(str(caught.value))
            assert not os.path.exists(os.path.join(path, ".metadata"))
            assert model.state_dict(keep_vars=True).keys() == weights.keys()
    # A head tied to a dedicated embedding: its module refuses as the embedding's does (before,
    # lm_head.state_dict() returned the weight on its owner and raised on the other rank, and
    # lm_head.load_state_dict wrote the owner's weight alone). DDP(model.lm_head) as well.
    model = build(0, tie=True)
    mesh = init_device_mesh("cpu", (world_size,))
    dedicate_params(model, mesh, lambda n, p: p.ndim == 2)
    shard_layers_then_root(model, mesh)
    weights = get_model_state_dict(model)
    with pytest.raises(NotHeldError, match="refused on every rank") as caught:
        model.lm_head.state_dict()
    messages.append(str(caught.value))
    with pytest.raises(RuntimeError, match="is the dedicated parameter") as caught:
        model.lm_head.load_state_dict({"weight": torch.zeros_like(weights["lm_head.weight"])})
    messages.append(str(caught.value))
    with pytest.raises(RuntimeError, match="DistributedDataParallel cannot wrap") as caught:
        DistributedDataParallel(model.lm_head)
    messages.append(str(caught.value))
    now = get_model_state_dict(model)
    assert all(torch.equal(now[k], v) for k, v in weights.items())
    return messages


@pytest.mark.distributed
def test_torch_state_dict_functions_raise_the_same_error_on_every_rank() -> None:
    messages = run_distributed(_torch_state_dict_functions, 2)
    assert messages[0] == messages[1]
    assert len(messages[0]) == 2 * ((6 + 2) + (6 + 2) + 4) + 3


class _ViTBlock(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)  # fused q, k, v
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, n, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, n, d))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))


class _ViT(torch.nn.Module):
    """timm's layout in small: a conv patch embedding, a (1, 1, d) class token and a (1, n, d)
    position embedding, whose FSDP2 shards are empty on every rank but the first."""

    def __init__(self, d: int = 32, depth: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.patch_embed = torch.nn.Conv2d(3, d, 4, 4)
        self.cls_token = torch.nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.pos_embed = torch.nn.Parameter(torch.randn(1, 17, d) * 0.02)
        self.blocks = torch.nn.ModuleList(_ViTBlock(d) for _ in range(depth))
        self.norm, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


def _vit_matrices(fqn: str, p: torch.Tensor) -> bool:
    return p.ndim == 2 and not fqn.startswith("head")


def _vit(rank: int, world_size: int) -> list[float]:
    torch.manual_seed(0)
    model = _ViT()
    mesh = init_device_mesh("cpu", (world_size,))
    dedicate_params(model, mesh, _vit_matrices, small_param_threshold=0)
    dedicated = dedicated_params_of(model)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, ignored_params=dedicated)
    fully_shard(model, mesh=mesh, ignored_params=dedicated)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(4):
        images, labels = torch.randn(8, 3, 16, 16, generator=gen), torch.randint(10, (8,))
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(
            model(images[rank::world_size]), labels[rank::world_size]
        )
        loss.backward()
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world_size)
    return losses


@pytest.mark.distributed
def test_a_vit_layout_with_shards_empty_on_some_ranks_trains_like_one_rank() -> None:
    # Before, the non-finite check took the inf-norm of the empty class-token shard and raised
    # on one rank while the other waited in its all-reduce.
    (one,) = run_distributed(_vit, 1)
    for got in run_distributed(_vit, 2):
        for step, (a, b) in enumerate(zip(got, one)):
            assert abs(a - b) <= 1e-4 * abs(b), (step, got, one)


def _ddp_over_dedicated(rank: int, world_size: int) -> tuple[str, str]:
    model = build(0)
    mesh = init_device_mesh("cpu", (world_size,))
    dedicate_params(model, mesh, muon_predicate)
    with pytest.raises(RuntimeError, match="DistributedDataParallel cannot wrap") as caught:
        DistributedDataParallel(model)
    with pytest.raises(RuntimeError, match="DistributedDataParallel cannot wrap"):
        DistributedDataParallel(model.layers[0])
    # Sharded as dmuon asks, then handed to a framework that wraps every model in DDP
    # (accelerate's prepare(model) without an FSDP plugin). Before, the message told the user
    # to apply dedicate_params + fully_shard, which they had done.
    shard_layers_then_root(model, mesh)
    with pytest.raises(RuntimeError, match="fully_shard already sharded it") as sharded:
        DistributedDataParallel(model)
    # Lightning's DDP strategy wraps the LightningModule, dedicated as a whole, whose child
    # model was sharded: the wrapper itself is no FSDP2 module (the old message before).
    outer = torch.nn.Module()
    outer.model = build(0)
    dedicate_params(outer, mesh, muon_predicate)
    shard_layers_then_root(outer.model, mesh)
    with pytest.raises(RuntimeError, match="fully_shard already sharded it"):
        DistributedDataParallel(outer)
    return str(caught.value), str(sharded.value)


def _accelerate_clip(rank: int, world_size: int) -> list[str]:
    from accelerate import Accelerator

    model = build(0)
    mesh = init_device_mesh("cpu", (world_size,))
    dedicate_params(model, mesh, muon_predicate)
    shard_layers_then_root(model, mesh)
    # accelerate imported after dedicate_params (its wrappers undone here): the end of the
    # backward wraps its clips. Before, accelerator.clip_grad_norm_(model.parameters()) took
    # the FSDP2 gradients alone and left the dedicated ones unclipped, without a word.
    for name in ("clip_grad_norm_", "clip_grad_value_"):
        setattr(Accelerator, name, getattr(Accelerator, name).__wrapped__)
    loss_fn(model, shard(batch(0, 4), rank, world_size)).backward()
    accelerator = Accelerator(cpu=True)
    messages = []
    for clip, value in ((accelerator.clip_grad_norm_, 1.0), (accelerator.clip_grad_value_, 1.0)):
        with pytest.raises(
            ValueError, match="its parameters hold the dedicated parameter"
        ) as caught:
            clip(model.parameters(), value)
        messages.append(str(caught.value))
    # Without a dedicated parameter accelerate's own clip runs.
    held = dedicated_params_of(model)
    accelerator.clip_grad_norm_([p for p in model.parameters() if p not in held], 1.0)
    return messages


@pytest.mark.distributed
def test_accelerates_clip_refuses_a_dedicated_parameter() -> None:
    pytest.importorskip("accelerate")
    messages = run_distributed(_accelerate_clip, 2)
    assert messages[0] == messages[1]  # alike on every rank
    assert "dmuon.clip_grad_norm_(muon, max_norm, params='all')" in messages[0][0]
    assert "dmuon.clip.clip_grad_value_(muon, clip_value, params='all')" in messages[0][1]


def _ddp_before_dedicated(rank: int, world_size: int, eval_first: bool) -> str:
    # A DDP script gaining dmuon: the wrapper was built first, so its constructor saw no
    # dedicated parameter; its reducer then all-reduced the dedicated gradients too and the
    # run drifted from the reference without a word. The first forward now refuses it.
    model = build(0)
    ddp = DistributedDataParallel(model)
    mesh = init_device_mesh("cpu", (world_size,))
    dedicate_params_ddp(model, mesh, muon_predicate)
    replicate(model, mesh)
    if eval_first:  # a forward of the bare model first (an evaluation before training)
        with torch.no_grad():
            model(make_batch(0, 2, 8, 32)[:, :-1])
    with pytest.raises(RuntimeError, match="built before dedicate_params") as caught:
        ddp(make_batch(0, 2, 8, 32)[:, :-1])
    return str(caught.value)


@pytest.mark.distributed
@pytest.mark.parametrize("eval_first", [False, True])
def test_ddp_built_before_dedicate_params_raises_at_its_first_forward(eval_first) -> None:
    messages = run_distributed(_ddp_before_dedicated, 2, eval_first)
    assert messages[0] == messages[1]


def _ddp_inside_before_dedicated(rank: int, world_size: int) -> str:
    # A block wrapped in DDP in place: dmuon's hooks on the wrapper run before its forward.
    model = build(0)
    model.layers[1] = DistributedDataParallel(model.layers[1])
    mesh = init_device_mesh("cpu", (world_size,))
    with pytest.raises(RuntimeError, match="cannot wrap a module of a model") as caught:
        dedicate_params_ddp(model, mesh, muon_predicate)
    assert not dedicated_params_of(model)
    return str(caught.value)


@pytest.mark.distributed
def test_ddp_inside_the_model_raises_at_dedicate_params() -> None:
    messages = run_distributed(_ddp_inside_before_dedicated, 2)
    assert messages[0] == messages[1] and "'layers.1'" in messages[0]


@pytest.mark.distributed
def test_ddp_over_a_dedicated_model_raises_on_every_rank() -> None:
    messages = run_distributed(_ddp_over_dedicated, 2)
    assert messages[0] == messages[1]
    plain, sharded = messages[0]
    assert "dedicate_params_ddp" in plain and "dmuon.replicate" in plain
    assert "accelerator.prepare_model(model, device_placement=False" in sharded, sharded


# -- shared weights ------------------------------------------------------------------------------

STEPS = 6


def _shared(rank: int, world_size: int, tie: bool, share_mlp: bool):
    def predicate(name, p):
        # With ``tie`` the head is dedicated (it is the embedding's matrix, named first as
        # 'embed_tokens.weight'); the shared MLP's projections are dedicated either way.
        return p.ndim == 2 and ("proj" in name or (tie and name == "lm_head.weight"))

    model = build(0, tie=tie, share_mlp=share_mlp)
    mesh = init_device_mesh("cpu", (world_size,))
    runtime = dedicate_params(model, mesh, predicate, small_param_threshold=0)
    shard_layers_then_root(model, mesh)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    losses = []
    for step in range(STEPS):
        loss = _step(model, optimizer, rank, world_size, step)
        total = loss.clone()
        dist.all_reduce(total)
        losses.append(float(total) / world_size)
    state = get_model_state_dict(model)
    fresh = build(7, tie=tie, share_mlp=share_mlp)
    dedicate_params(fresh, mesh, predicate, small_param_threshold=0)
    shard_layers_then_root(fresh, mesh)
    set_model_state_dict(fresh, state)
    again = get_model_state_dict(fresh)
    round_trip = state.keys() == again.keys() and all(
        torch.equal(state[k], again[k]) for k in state
    )
    if tie:
        # A safetensors file of save_pretrained keeps one key of a tied pair.
        one_key = {k: v for k, v in state.items() if k != "lm_head.weight"}
        with pytest.raises(
            ValueError, match=r"'lm_head\.weight' is tied to 'embed_tokens\.weight'"
        ):
            set_model_state_dict(fresh, one_key)
    names = [dp.fqn for dp in runtime.params]
    return losses, state, round_trip, names


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("tie", "share_mlp"), [(True, False), (False, True)], ids=["tied-head", "shared-mlp"]
)
def test_shared_weights_train_like_the_reference_and_round_trip(tie: bool, share_mlp: bool) -> None:
    results = run_distributed(_shared, 2, tie, share_mlp)
    losses, state, _, names = results[0]
    assert all(r[2] for r in results), "get -> set -> get changed a tensor"
    plain = build(0, tie=tie, share_mlp=share_mlp)
    ref = train_reference(plain, names, HYPER, STEPS, 8, 8, 32)
    for step, (got, want) in enumerate(zip(losses, ref)):
        assert abs(got - want) <= 2e-3 * abs(want), f"step {step}: {got} vs {want}"
    reference_state = plain.state_dict()
    assert state.keys() == reference_state.keys()
    if tie:
        assert "lm_head.weight" in state and torch.equal(
            state["lm_head.weight"], state["embed_tokens.weight"]
        )
    for key, value in reference_state.items():
        torch.testing.assert_close(state[key], value, rtol=2e-3, atol=2e-4)


# -- nothing silent ------------------------------------------------------------------------------


def _silent_cases(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    # Parameters outside every fully_shard (no root) would train unsynchronised.
    model = build(0)
    dedicate_params(model, mesh, muon_predicate)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=dedicated_params_of(model))
    with pytest.raises(
        ValueError,
        match=r"neither dedicated nor managed by FSDP2.*'embed_tokens\.weight'.*fully_shard\(model\)",
    ):
        Muon(model)
    # A predicate that selects nothing is reported.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dedicate_params(build(0), mesh, lambda n, p: "no such name" in n)
    # Once, at this line (not dedicate_params' call of the common path).
    assert [w.filename for w in caught if "selected none of the" in str(w.message)] == [__file__]
    # A model frozen whole (a distillation teacher) is told apart: no predicate would help.
    teacher = build(0).requires_grad_(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dedicate_params(teacher, mesh, muon_predicate)
    assert [str(w.message) for w in caught if "no trainable parameter" in str(w.message)] == [
        "dedicate_params: TinyLlama has no trainable parameter (every one is frozen, and"
        " dedicate_params selects trainable parameters only), so dmuon dedicates nothing and"
        " will run no Muon step. A model that only runs forward, such as a frozen teacher for"
        " distillation, needs no dedicate_params: shard it with fully_shard alone; to train it,"
        " make its parameters trainable before dedicate_params"
    ]
    # Dedicating a submodule, then the whole model.
    whole = build(0)
    dedicate_params(whole.layers[0], mesh, muon_predicate, hook_boundary_strict=False)
    with pytest.raises(
        RuntimeError, match=r"already dedicated.*call dedicate_params once, on the whole model"
    ):
        dedicate_params(whole, mesh, muon_predicate)
    # Two models that share a block, each dedicated: the message says how to train both.
    first, second = build(0), build(1)
    second.layers[0] = first.layers[0]
    dedicate_params(first, mesh, muon_predicate)
    with pytest.raises(RuntimeError, match=r"another model that shares them.*one root module"):
        dedicate_params(second, mesh, muon_predicate)


@pytest.mark.distributed
def test_silent_misuses_raise_or_warn() -> None:
    run_distributed(_silent_cases, 2)


def _snapshot(model, optimizer):
    return get_model_state_dict(model), get_optimizer_state_dict(model, optimizer)


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def _nonfinite(rank: int, world_size: int):
    model, _ = _wrapped(world_size)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    _step(model, optimizer, rank, world_size, 0)
    seen = []
    for bad in (float("nan"), float("inf")):
        before = _snapshot(model, optimizer)
        # One rank's loss is not finite: its gradients poison the reduces and FSDP2's shards.
        _step(model, optimizer, rank, world_size, 1, scale=bad if rank == 1 else 1.0)
        stats = optimizer.last_step_stats
        seen.append((bool(stats.skipped), int(stats.skipped_steps)))
        assert _same(_snapshot(model, optimizer), before), f"a {bad} gradient changed the state"
    before = _snapshot(model, optimizer)
    loss = _step(model, optimizer, rank, world_size, 2)
    after = _snapshot(model, optimizer)
    stats = optimizer.last_step_stats
    seen.append((bool(stats.skipped), int(stats.skipped_steps)))
    assert math.isfinite(float(loss)) and not _same(after[0], before[0])
    assert all(torch.isfinite(t).all() for t in after[0].values())
    return seen


@pytest.mark.distributed
def test_a_nonfinite_gradient_skips_the_step_everywhere_and_training_continues() -> None:
    for seen in run_distributed(_nonfinite, 2):
        assert seen == [(True, 1), (True, 2), (False, 2)]


# -- nothing leaks -------------------------------------------------------------------------------


def _counts() -> tuple[int, int, int]:
    threads = len(os.listdir("/proc/self/task"))
    fds = len(os.listdir("/proc/self/fd"))
    groups = len(dist.distributed_c10d._world.pg_map)
    return threads, fds, groups


def _rebuild(rank: int, world_size: int, policy: str):
    mesh = init_device_mesh("cpu", (world_size,))
    seen = []
    for i in range(3):  # a leak shows from the second model on
        model = build(i)
        dedicate_params(model, mesh, muon_predicate, process_group_policy=policy)
        shard_layers_then_root(model, mesh)
        optimizer = Muon(model, **HYPER.muon_kwargs())
        loss_fn(model, batch(i, 4).chunk(world_size)[rank]).backward()
        optimizer.step()
        del model, optimizer
        gc.collect()
        seen.append(_counts())
    return seen


@pytest.mark.distributed
@pytest.mark.parametrize("policy", ["isolated", "shared"])
def test_rebuilding_a_model_leaks_no_group_thread_or_file(policy: str) -> None:
    for seen in run_distributed(_rebuild, 2, policy):
        assert all(counts == seen[0] for counts in seen), seen


# -- nothing waits longer than the user said -------------------------------------------------------


def _timeouts(rank: int, world_size: int) -> list[float]:
    from datetime import timedelta

    from dmuon_fsdp import get_comm_ctx

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    model = build(0)
    dedicate_params(model, mesh["shard"], muon_predicate, replicate_mesh=mesh["replicate"])
    ctx = get_comm_ctx(model)
    groups = [ctx.shard_group, ctx.replicate_group, ctx.world_group, ctx.global_group]

    def timeout(group) -> timedelta:
        return group._get_backend(torch.device("cpu")).options._timeout

    want = timeout(dist.group.WORLD)
    return [timeout(g) / want for g in groups]


@pytest.mark.distributed
def test_dmuons_own_groups_time_out_as_the_default_group_does() -> None:
    # The worker pool's default group has a short timeout: a collective dmuon issues on its
    # own groups must fail after it too, not after torch's half-hour default.
    for ratios in run_distributed(_timeouts, 4):
        assert ratios == [1.0, 1.0, 1.0, 1.0], ratios


# What the step's all-reduce raises when a peer never joins it: gloo's timeout (as this torch
# words it), NCCL's under TORCH_NCCL_BLOCKING_WAIT=1 (a DistBackendError), gloo's when the
# peer's process ended; and errors that say nothing of the peers (a device error, a CUDA
# launch that timed out), which keep their own message.
_PEER_ERRORS = [
    (
        RuntimeError,
        "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 45000ms for recv"
        " operation to complete",
    ),
    (
        dist.DistBackendError,
        "[PG ID 0 PG GUID 0(default_pg) Rank 1] Watchdog caught collective"
        " operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE, NumelIn=1, NumelOut=1,"
        " Timeout(ms)=600000) ran for 600017 milliseconds before timing out.",
    ),
    (
        RuntimeError,
        "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:39330: Connection"
        " reset by peer. This is typically caused by a remote worker hanging or bugs in the"
        " application.",
    ),
]
_OTHER_ERRORS = [
    (dist.DistBackendError, "CUDA error: an illegal memory access was encountered"),
    (RuntimeError, "CUDA error: the launch timed out and was terminated"),
]


def _failing_on(group: dist.ProcessGroup, error: Exception):
    """``dist.all_reduce`` that raises ``error`` for a collective on ``group``."""
    all_reduce = dist.all_reduce

    def failed(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
        if kwargs.get("group") is group:
            raise error
        return all_reduce(tensor, *args, **kwargs)  # type: ignore[arg-type]

    return failed


def _step_rendezvous_failed(rank: int, world_size: int) -> list[list[str]]:
    """The step's first collective of its own, failed with each of ``_PEER_ERRORS`` (a rank
    skipped optimizer.step(), as in a loop whose data ran out on one rank: the others waited
    in it until gloo's timeout, which named no cause), then each of ``_OTHER_ERRORS``; the
    notes of each error."""
    mesh = init_device_mesh("cpu", (world_size,))
    model = build(0)
    dedicate_params(model, mesh, muon_predicate)
    shard_layers_then_root(model, mesh)
    optimizer = Muon(model)
    loss_fn(model, batch(0, 4)).backward()
    step_group = get_runtime(model).step_group
    all_reduce = dist.all_reduce
    notes = []
    for kind, message in _PEER_ERRORS + _OTHER_ERRORS:
        dist.all_reduce = _failing_on(step_group, kind(message))  # type: ignore[assignment]
        try:
            with pytest.raises(kind, match=re.escape(message)) as caught:
                optimizer.step()
        finally:
            dist.all_reduce = all_reduce
        notes.append(getattr(caught.value, "__notes__", []))
    optimizer.zero_grad()
    return notes


@pytest.mark.distributed
def test_a_step_rendezvous_that_times_out_names_its_cause() -> None:
    # Only the errors that mean a peer did not come get the note: a device error is not
    # labelled as a rank that skipped step().
    for notes in run_distributed(_step_rendezvous_failed, 2):
        peers, others = notes[: len(_PEER_ERRORS)], notes[len(_PEER_ERRORS) :]
        for got in peers:
            assert len(got) == 1 and re.match(
                r"dmuon: this collective is optimizer\.step\(\)'s agreement.*skipped "
                r"optimizer\.step\(\).*DistributedSampler\(\.\.\., drop_last=True\).*"
                r"'A step hangs in optimizer\.step\(\)'",
                got[0],
                re.DOTALL,
            ), got
        assert others == [[]] * len(_OTHER_ERRORS), others


def _tied_head_routed_by_its_alias(rank: int, world_size: int) -> tuple[list[str], list[str]]:
    mesh = init_device_mesh("cpu", (world_size,))
    model = build(0, tie=True)
    policy = {"overrides": [{"name": ["lm_head"], "set": {"route": "sharded_adamw"}}]}
    # Its two names routed two ways: refused, naming both, before anything changed.
    conflicting = {
        "overrides": [*policy["overrides"], {"name": ["embed_tokens"], "set": {"route": "muon"}}]
    }
    before = [(n, p, p.detach().clone()) for n, p in model.named_parameters()]
    modules = list(model.modules())
    with pytest.raises(ValueError, match=r"\['overrides'\]\[0\] sets route='sharded_adamw' for"):
        dedicate_params(model, mesh, lambda n, p: p.ndim == 2, param_policy=conflicting)
    assert list(model.modules()) == modules
    assert all(
        q is p and torch.equal(q, value)
        for (n, p, value), (m, q) in zip(before, model.named_parameters(), strict=True)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dedicate_params(model, mesh, lambda n, p: p.ndim == 2, param_policy=policy)
    shard_layers_then_root(model, mesh)
    optimizer = Muon(model)
    summarize_param_groups(model, optimizer, param_policy=policy)  # resolves it alike
    dedicated = {id(p) for p in dedicated_params_of(model)}
    names = [n for n, p in model.named_parameters() if id(p) in dedicated]
    return names, [str(w.message) for w in caught if "param_policy" in str(w.message)]


@pytest.mark.distributed
def test_a_tied_head_is_routed_by_its_second_name() -> None:
    # The predicate accepts a tied weight under any of its names; param_policy must too (it
    # routed the pair by 'embed_tokens' only, put it on Muon and warned that 'lm_head' matched
    # no parameter).
    for names, policy_warnings in run_distributed(_tied_head_routed_by_its_alias, 2):
        assert "embed_tokens.weight" not in names and names, names
        assert not policy_warnings, policy_warnings
