"""Every misuse of dedicate_params gets an error naming the argument or module and the fix."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from _models import (
    MLP,
    Attention,
    batch,
    build,
    loss_fn,
    muon_predicate,
    tensor_parallel,
    wrap_all_gather,
)
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from dmuon_fsdp import (
    DedicateConfig,
    Muon,
    NotHeldError,
    collect_forward_unshard_profile,
    dedicate_params,
    dedicated_params_of,
    get_model_state_dict,
    get_owned_params,
    get_runtime,
    summarize_comm_plan,
    uninstall_patch,
)
from dmuon_fsdp.holder import is_dedicated
from dmuon_testing.distributed import run_distributed


def _mesh(world_size: int):
    return init_device_mesh("cpu", (world_size,))


def _fully_shard_first(rank: int, world_size: int) -> None:
    model = build(0)
    mesh = _mesh(world_size)
    fully_shard(model.layers[0], mesh=mesh)
    with pytest.raises(
        RuntimeError,
        match=r"fully_shard was already applied to module 'layers\.0'.*dedicate_params.*before fully_shard",
    ):
        dedicate_params(model, mesh, muon_predicate)


# What every entry point says of a dedicated parameter that fully_shard took.
_TAKEN = (
    r"dedicated parameter 'layers\.0\.[\w.]+' \(owner: rank \d+; this rank \d+ is its \w+\) "
    r"was taken by fully_shard \(FSDP2 replaced it on its module with {kind}\).*"
    r"patch_fully_shard=True.*"
    r"ignored_params=dmuon\.dedicated_params_of\(model\) to every fully_shard call"
)


def _fully_shard_without_ignored_params(rank: int, world_size: int) -> None:
    uninstall_patch()  # the worker process outlives the tests it ran before
    mesh = _mesh(world_size)
    model = build(0)
    dedicate_params(model, mesh, muon_predicate, patch_fully_shard=False)
    fully_shard(model.layers[0], mesh=mesh)  # no ignored_params: FSDP2 shards the layer's all
    fully_shard(model, mesh=mesh, ignored_params=dedicated_params_of(model))
    shards = _TAKEN.format(kind="a DTensor shard")
    with pytest.raises(RuntimeError, match=shards):
        Muon(model)
    with pytest.raises(RuntimeError, match=shards):
        get_model_state_dict(model)
    with pytest.raises(RuntimeError, match=shards):
        summarize_comm_plan(model)
    with pytest.raises(RuntimeError, match=shards):
        collect_forward_unshard_profile(model)
    # The first forward meets FSDP2's unsharded copy, registered by its pre-forward hook.
    with pytest.raises(RuntimeError, match=_TAKEN.format(kind="its unsharded copy")):
        loss_fn(model, batch(0, 2))

    # A meta-device model: to_empty materialises FSDP2's shards, which are not adopted.
    with torch.device("meta"):
        meta = build(0)
    dedicate_params(meta, mesh, muon_predicate, patch_fully_shard=False)
    fully_shard(meta.layers[0], mesh=mesh)
    meta.to_empty(device="cpu")
    with pytest.raises(RuntimeError, match=shards):
        Muon(meta)

    # Any other replacement of a dedicated parameter is named too.
    model = build(0)
    dedicate_params(model, mesh, muon_predicate)
    model.layers[1].mlp.up_proj.weight = nn.Parameter(torch.zeros(24, 16))
    with pytest.raises(
        RuntimeError,
        match=r"'layers\.1\.mlp\.up_proj\.weight' is no longer registered on its module.*"
        r"ignored_params=dmuon\.dedicated_params_of\(model\).*do not reassign",
    ):
        loss_fn(model, batch(0, 2))

    # A module swapped after dedicate_params, keeping the weight object (torchao's
    # convert_to_float8_training swaps each nn.Linear for a Float8Linear so): dmuon's refusals
    # stayed on the old module, and model.load_state_dict wrote the owners' weights alone.
    class Swapped(nn.Linear):
        pass

    model = build(0)
    dedicate_params(model, mesh, muon_predicate)
    old = model.layers[1].mlp.up_proj
    new = Swapped(old.in_features, old.out_features, bias=False, device="meta")
    new.weight = old.weight
    model.layers[1].mlp.up_proj = new
    swapped = (
        r"the Linear that holds dedicated parameter 'layers\.1\.mlp\.up_proj\.weight' was "
        r"replaced after dedicate_params \(now a Swapped\).*convert_to_float8_training"
    )
    with pytest.raises(RuntimeError, match=swapped):
        Muon(model)
    with pytest.raises(RuntimeError, match=swapped):
        loss_fn(model, batch(0, 2))


def _config_argument(rank: int, world_size: int) -> None:
    mesh = _mesh(world_size)
    config = DedicateConfig(reshard_after_forward=False, small_param_threshold=0)
    runtime = dedicate_params(build(0), mesh, muon_predicate, config=config)
    assert runtime.config is config
    keywords = dedicate_params(
        build(0), mesh, muon_predicate, reshard_after_forward=False, small_param_threshold=0
    )
    assert keywords.config == config
    assert keywords.plan.fingerprint() == runtime.plan.fingerprint()
    with pytest.raises(
        ValueError,
        match=r"dedicate_params got config= and debug_fence=True: pass each option once.*"
        r"dataclasses\.replace\(config, debug_fence=True\)",
    ):
        dedicate_params(build(0), mesh, muon_predicate, config=config, debug_fence=True)
    with pytest.raises(TypeError, match=r"config must be a dmuon\.DedicateConfig.*got dict"):
        dedicate_params(build(0), mesh, muon_predicate, config={"debug_fence": True})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"replicated=True.*dedicate_params_ddp\(model, mesh"):
        dedicate_params(build(0), mesh, muon_predicate, config=DedicateConfig(replicated=True))


def _dtensor_param(rank: int, world_size: int) -> None:
    model = build(0)
    mesh = _mesh(world_size)
    mlp = model.layers[0].mlp
    mlp.up_proj.weight = nn.Parameter(
        distribute_tensor(mlp.up_proj.weight.detach(), mesh, [Shard(0)])
    )
    with pytest.raises(
        RuntimeError,
        match=r"'layers\.0\.mlp\.up_proj\.weight' is already a DTensor.*dedicate_params.*first",
    ):
        dedicate_params(model, mesh, muon_predicate)


def _tensor_parallel(rank: int, world_size: int) -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
    # A replicated TP parameter (as SequenceParallel makes of a norm) is not a matrix shard.
    model = build(0)
    norm = model.layers[0].attn_norm
    norm.weight = nn.Parameter(distribute_tensor(norm.weight.detach(), mesh["tp"], [Replicate()]))
    with pytest.raises(
        NotImplementedError,
        match=r"'layers\.0\.attn_norm\.weight' is a DTensor with placements \(Replicate\(\),\).*"
        r"leave replicated parameters",
    ):
        dedicate_params(
            model,
            mesh["dp"],
            lambda n, p: n == "layers.0.attn_norm.weight",
            hook_boundary_strict=False,
            param_policy={"defaults": {"route": "adamw"}},
        )
    # Shards must be equal: 24 rows over 2 ranks are, 3 ranks would not be (checked on 2).
    model = build(0, n_layers=1)
    model.layers[0].mlp.up_proj = nn.Linear(16, 23, bias=False)
    model.layers[0].mlp.down_proj = nn.Linear(23, 16, bias=False)
    parallelize_module(model.layers[0].mlp, mesh["tp"], {"up_proj": ColwiseParallel()})
    with pytest.raises(
        ValueError, match=r"'layers\.0\.mlp\.up_proj\.weight' splits a dim of 23 over 2"
    ):
        dedicate_params(model, mesh["dp"], muon_predicate)
    # The TP dimension passed as the data-parallel mesh.
    model = build(0, n_layers=1)
    parallelize_module(model.layers[0].mlp, mesh["tp"], {"up_proj": ColwiseParallel()})
    with pytest.raises(
        RuntimeError,
        match=r"'layers\.0\.mlp\.up_proj\.weight'.*pass the data-parallel.*mesh\['dp'\]",
    ):
        dedicate_params(model, mesh["tp"], muon_predicate)
    # A data-parallel mesh from another mesh than the TP plan's: the grid does not tile.
    other = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r"shard 2 x replicate 1 x tensor-parallel 2 != 2 ranks"):
        dedicate_params(model, other["dp"], muon_predicate)


def _non_matrix(rank: int, world_size: int) -> None:
    model = build(0)
    with pytest.raises(
        ValueError,
        match=r"'layers\.0\.attn_norm\.weight' \(shape \(16,\)\).*2-D matrix.*p\.ndim == 2",
    ):
        dedicate_params(model, _mesh(world_size), lambda n, p: "layers" in n)
    # A sparse embedding's gradient is a sparse tensor, which the owner's reduce cannot take.
    model = build(0)
    model.embed_tokens.sparse = True
    with pytest.raises(ValueError, match=r"'embed_tokens\.weight' belongs to a Embedding built"):
        dedicate_params(model, _mesh(world_size), lambda n, p: n == "embed_tokens.weight")


def _strict_boundary(rank: int, world_size: int) -> None:
    model = build(0)
    with pytest.raises(
        ValueError,
        match=r"'lm_head\.weight' has no hook boundary.*hook_boundary_predicate.*hook_boundary_strict=False",
    ):
        dedicate_params(model, _mesh(world_size), lambda n, p: p.ndim == 2 and "embed" not in n)
    # The same with a predicate that matches nothing above it.
    model = build(0)
    with pytest.raises(ValueError, match=r"hook_boundary_predicate matches none of its ancestors"):
        dedicate_params(
            model, _mesh(world_size), muon_predicate, hook_boundary_predicate=lambda m: False
        )


def _non_strict_root_boundary(rank: int, world_size: int) -> None:
    model, ref = build(0), build(0)
    runtime = dedicate_params(
        model,
        _mesh(world_size),
        lambda n, p: p.ndim == 2 and "embed" not in n,
        hook_boundary_strict=False,
    )
    boundaries = {dp.fqn: dp.boundary for dp in runtime.params}
    assert boundaries["lm_head.weight"] == ""
    assert boundaries["layers.1.mlp.up_proj.weight"] == "layers.1"
    loss_fn(model, batch(0, 4)).backward()
    loss_fn(ref, batch(0, 4)).backward()
    runtime.wait_all_reduces()
    for dp in runtime.owned:
        torch.testing.assert_close(dp.grad, ref.get_parameter(dp.fqn).grad)


class _Matrix(nn.Module):
    """A model that is one module: its matrix registered on the root, which has no children."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


def _childless_root(rank: int, world_size: int) -> None:
    # torch.distributed.checkpoint.state_dict's functions never consulted such a root before
    # reading its weights: get_model_state_dict returned the matrix on its owner and raised
    # NotHeldError on the other rank, and the full state dict and the set_ functions went on
    # into their collectives on the owner alone.
    from torch.distributed.checkpoint import state_dict as dsd

    model = _Matrix()
    with pytest.raises(ValueError, match=r"'w' is registered on the root _Matrix.*submodule"):
        dedicate_params(model, _mesh(world_size), lambda n, p: n == "w", hook_boundary_strict=False)
    assert not is_dedicated(model.w) and getattr(model, "_dmuon_runtime", None) is None
    # The fix the message names: the same matrix in a submodule, whose functions torch asks.
    wrapped = nn.Sequential(_Matrix())
    dedicate_params(
        wrapped,
        _mesh(world_size),
        lambda n, p: n == "0.w",
        hook_boundary_predicate=lambda m: isinstance(m, _Matrix),
    )
    fully_shard(wrapped, mesh=_mesh(world_size), ignored_params=dedicated_params_of(wrapped))
    with pytest.raises(RuntimeError, match="cannot take a dmuon model"):
        dsd.get_model_state_dict(wrapped)


def _boundary_predicate_lowest(rank: int, world_size: int) -> None:
    model = build(0)
    runtime = dedicate_params(
        model,
        _mesh(world_size),
        muon_predicate,
        hook_boundary_predicate=lambda m: isinstance(m, (MLP, Attention, type(model.layers[0]))),
    )
    boundaries = {dp.boundary for dp in runtime.params}
    assert boundaries == {f"layers.{i}.{m}" for i in range(2) for m in ("attn", "mlp")}


def _bad_arguments(rank: int, world_size: int) -> None:
    mesh = _mesh(world_size)
    with pytest.raises(
        ValueError, match=r"process_group_policy='private' is not one of 'isolated', 'shared'"
    ):
        dedicate_params(build(0), mesh, muon_predicate, process_group_policy="private")
    with pytest.raises(TypeError, match=r"predicate must be a callable"):
        dedicate_params(build(0), mesh, "proj")  # type: ignore[arg-type]
    with pytest.raises(
        TypeError,
        match=r"reshard_after_forward must be a bool, got 2: dmuon has no partial reshard.*"
        r"Pass the int to fully_shard only",
    ):
        dedicate_params(build(0), mesh, muon_predicate, reshard_after_forward=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"reshard_after_forward must be a bool, got 'no'"):
        dedicate_params(build(0), mesh, muon_predicate, reshard_after_forward="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"mesh must be a torch.distributed DeviceMesh"):
        dedicate_params(build(0), [0], muon_predicate)
    # Per-parameter dtypes are honoured (tests/test_precision.py); one boundary cannot cast its
    # inputs to two dtypes.
    refused = build(0)
    before = [(n, p, type(p), p.detach().clone()) for n, p in refused.named_parameters()]
    with pytest.raises(
        ValueError,
        match=r"boundary module 'layers\.0' to cast its inputs to bfloat16 \(for '.*'\) and "
        r"to float16 \(for '.*'\).*cast_forward_inputs=False",
    ):
        dedicate_params(
            refused,
            mesh,
            muon_predicate,
            param_policy={
                "defaults": {"route": "muon", "param_dtype": torch.bfloat16},
                "overrides": [{"name": ["mlp"], "set": {"param_dtype": "float16"}}],
            },
        )
    # A parameter dmuon cannot take (a subclass of nn.Parameter), planned last.
    last = [n for n, p in refused.named_parameters() if muon_predicate(n, p)][-1]
    module, _, name = last.rpartition(".")

    class Tagged(nn.Parameter):
        pass

    setattr(refused.get_submodule(module), name, Tagged(refused.get_parameter(last).detach()))
    with pytest.raises(TypeError, match=r"a plain nn\.Parameter .*, not a Tagged; leave it out"):
        dedicate_params(refused, mesh, muon_predicate)
    # A class that customises FSDP2's all-gather (torchao's float8 all-gather weight): the
    # message names the float8 conversion that keeps the matrix on Muon.
    wrap_all_gather(refused.get_submodule(module), name)
    with pytest.raises(
        TypeError,
        match=r"not a AllGatherWeight; its class customises FSDP2's all-gather.*"
        r"enable_fsdp_float8_all_gather=False",
    ):
        dedicate_params(refused, mesh, muon_predicate)
    setattr(refused.get_submodule(module), name, before[[b[0] for b in before].index(last)][1])
    # Both were refused before any parameter was taken over (the first one had marked every
    # parameter dedicated, and a retry was refused as a second dedicate_params).
    for (name, param, kind, value), (_, current) in zip(
        before, refused.named_parameters(), strict=True
    ):
        assert current is param and type(current) is kind and not is_dedicated(current), name
        assert torch.equal(current.detach(), value), name
    dedicate_params(refused, mesh, muon_predicate)
    with pytest.raises(ValueError, match=r"has no dmuon runtime.*dedicate_params"):
        get_runtime(build(0))
    model = build(0)
    dedicate_params(model, mesh, muon_predicate)
    with pytest.raises(ValueError, match=r"a part of the model given to dmuon.dedicate_params"):
        get_runtime(model.layers[0])
    with pytest.raises(RuntimeError, match=r"already called on this TinyLlama"):
        dedicate_params(model, mesh, muon_predicate)
    with pytest.raises(ValueError, match=r"rank must be an int .* or a \(shard, replicate\) pair"):
        get_owned_params(model, (0, 0, 0))  # type: ignore[arg-type]
    assert len(get_owned_params(model, rank)) == len(get_runtime(model).owned)
    # torchao's convert_to_float8_training after dedicate_params reads every weight it wraps
    # (Float8Linear.from_float under enable_fsdp_float8_all_gather=True): refused on a peer,
    # naming the order instead of dmuon's readers.
    peer = next(dp for dp in get_runtime(model).params if not dp.is_owner)
    source = "def from_float(weight):\n    return weight.is_pinned()\n"
    torchao: dict = {}
    exec(compile(source, "/site-packages/torchao/float8/float8_linear.py", "exec"), torchao)
    with pytest.raises(NotHeldError, match=r"convert_to_float8_training .*before dedicate_params"):
        torchao["from_float"](peer.param)


def _routes(rank: int, world_size: int) -> None:
    model = build(0)
    mesh = _mesh(world_size)
    runtime = dedicate_params(
        model,
        mesh,
        lambda n, p: "layers" in n,
        param_policy={
            "defaults": {"route": "adamw"},
            "overrides": [
                {
                    "name": [
                        "q_proj",
                        "k_proj",
                        "v_proj",
                        "o_proj",
                        "gate_proj",
                        "up_proj",
                        "down_proj",
                    ],
                    "set": {"route": "muon"},
                },
                {"name": ["mlp_norm"], "set": {"route": "sharded_adamw"}},
            ],
        },
    )
    routes = {dp.fqn: dp.route for dp in runtime.params}
    assert routes["layers.0.attn.q_proj.weight"] == "muon"
    assert routes["layers.0.attn_norm.weight"] == "adamw"  # 1-D is fine off the Muon route
    assert "layers.0.mlp_norm.weight" not in routes  # left to FSDP2
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=dedicated_params_of(model))
    from torch.distributed.tensor import DTensor

    assert isinstance(model.layers[0].mlp_norm.weight, DTensor)
    assert not isinstance(model.layers[0].attn_norm.weight, DTensor)


def _policy_typo(rank: int, world_size: int) -> None:
    # An override that matches no parameter changes nothing: a warning names it.
    policy = {
        "overrides": [
            {"name": ["mpl", "down_proj"], "set": {"route": "adamw"}},
            {"contains": ["norm", "ln_"], "set": {"route": "adamw"}},
        ]
    }
    with pytest.warns(UserWarning) as caught:
        dedicate_params(build(0), _mesh(world_size), muon_predicate, param_policy=policy)
    messages = [str(w.message) for w in caught]
    # Each selector's miss gets its own rule: components for a name, substrings for contains.
    assert any(
        re.search(r"override name\(s\) \['mpl'\] match no parameter.*whole", m) for m in messages
    ), messages
    assert any(
        re.search(r"'contains' substring\(s\) \['ln_'\] occur in no parameter name.*plain", m)
        for m in messages
    ), messages


def _bias_stack_on_muon(rank: int, world_size: int) -> None:
    # Moonlight's predicate (every parameter of 2 dims or more) takes GPT-OSS's 2-D expert
    # bias stacks too: a warning names them, as Muon would orthogonalise each as one matrix.
    from _moe import build_moe

    def moonlight(n: str, p: nn.Parameter) -> bool:
        return p.ndim >= 2 and "embed" not in n and "head" not in n

    def gpt_oss_like() -> nn.Module:
        model = build_moe(4, "hf")
        for layer in model.layers:
            experts = layer.experts
            experts.down_proj_bias = nn.Parameter(torch.zeros(4, experts.down_proj.shape[1]))
        return model

    with pytest.warns(UserWarning, match=r"2 bias\(es\) on the Muon route.*down_proj_bias"):
        dedicate_params(gpt_oss_like(), _mesh(world_size), moonlight)
    # Left out of the predicate, or routed to AdamW: no warning.
    policy = {"overrides": [{"name": ["down_proj_bias"], "set": {"route": "adamw"}}]}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        dedicate_params(gpt_oss_like(), _mesh(world_size), moonlight, param_policy=policy)
        dedicate_params(
            gpt_oss_like(), _mesh(world_size), lambda n, p: moonlight(n, p) and "bias" not in n
        )


class _TinyViT(nn.Module):
    """A class token and a position embedding, held with a leading dim of one."""

    def __init__(self) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, 8))
        self.pos_embed = nn.Parameter(torch.zeros(1, 5, 8))
        self.layers = nn.ModuleList([nn.Linear(8, 8)])


def _stack_of_one_on_muon(rank: int, world_size: int) -> None:
    # p.ndim >= 2 takes a ViT's class token and position embedding, which dmuon would take as
    # stacks of one expert and Muon would orthogonalise: a warning names them.
    with pytest.warns(
        UserWarning,
        match=r"2 3-D parameter\(s\) with a leading dim of 1.*"
        r"'cls_token \(1, 1, 8\)', 'pos_embed \(1, 5, 8\)'",
    ):
        dedicate_params(_TinyViT(), _mesh(world_size), lambda n, p: p.ndim >= 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        dedicate_params(_TinyViT(), _mesh(world_size), lambda n, p: p.ndim == 2)


def _expert_stack_dtypes(rank: int, world_size: int) -> None:
    # param_policy's dtypes never reach an expert stack (FSDP2 or replicate holds it, in its
    # own dtypes): the blocks' inputs went bf16 and the fp32 experts' matmul failed in the
    # forward ("expected scalar type Float but found BFloat16"), naming nothing. Refused on
    # the replicated path on every rank alike, naming the stack; a warning on the sharded path
    # (FSDP2's MixedPrecisionPolicy may give the stack that dtype).
    from _moe import build_moe, moe_predicate

    from dmuon_fsdp import dedicate_params_ddp

    bf16 = {"defaults": {"param_dtype": "bfloat16", "master_dtype": "float32"}}
    with pytest.raises(
        ValueError,
        match=r"dedicate_params_ddp: .*expert stack.*'layers\.0\.experts\.w1' \(float32\):"
        r" param_dtype='bfloat16'.*torch\.autocast",
    ):
        dedicate_params_ddp(build_moe(4), _mesh(world_size), moe_predicate, param_policy=bf16)
    with pytest.warns(UserWarning, match=r"layers\.0\.experts\.w1.*MixedPrecisionPolicy"):
        dedicate_params(build_moe(4), _mesh(world_size), moe_predicate, param_policy=bf16)
    # The fix the message names: the stacks' dtypes left out (or equal to their own).
    fixed = {**bf16, "overrides": [{"name": ["experts"], "set": {"param_dtype": None}}]}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model = build_moe(4)
        dedicate_params_ddp(model, _mesh(world_size), moe_predicate, param_policy=fixed)
        assert model.layers[0].q_proj.weight.dtype == torch.bfloat16
        assert model.layers[0].experts.w1.dtype == torch.float32


def _plan_differs(rank: int, world_size: int) -> None:
    # A rank-dependent predicate gives each rank another plan: caught before any weight moves.
    def predicate(n, p):
        return muon_predicate(n, p) and (rank == 0 or "q_proj" not in n)

    with pytest.raises(RuntimeError, match=r"owner plan differs across ranks.*same predicate"):
        dedicate_params(build(0), _mesh(world_size), predicate)
    # The same plan on models that differ elsewhere (pipeline stages taken for HSDP replicas:
    # the first owns the embedding, the last the head) is caught too, and names the cause.
    model = build(0)
    if rank == 1:
        model.extra_head = torch.nn.Linear(4, 4, bias=False)
        model.extra_head.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"owner plan differs across ranks.*pipeline"):
        dedicate_params(model, _mesh(world_size), muon_predicate)


def _mesh_errors(rank: int, world_size: int) -> None:
    unnamed = init_device_mesh("cpu", (2, 2))
    with pytest.raises(
        ValueError, match=r"unnamed 2-D DeviceMesh.*mesh_dim_names=\('replicate', 'shard'\)"
    ):
        dedicate_params(build(0), unnamed, muon_predicate)
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    with pytest.raises(ValueError, match=r"replicate_mesh does not match mesh"):
        dedicate_params(build(0), hsdp["shard"], muon_predicate, replicate_mesh=hsdp["shard"])
    with pytest.raises(
        ValueError,
        match=r"do not multiply to the world size: shard 2 x replicate 1 != 4.*tensor-parallel,"
        r" parallelize it first.*pipeline",
    ):
        dedicate_params(build(0), hsdp["shard"], muon_predicate)
    with pytest.raises(ValueError, match=r"replicate_mesh must be a 1-D DeviceMesh"):
        dedicate_params(build(0), hsdp["shard"], muon_predicate, replicate_mesh=hsdp)
    # A mesh over fewer ranks than the world (its size taken from a world of one, as Hugging
    # Face's TrainingArguments on CPU ranks without use_cpu=True report): the ranks it leaves
    # out once failed alone inside torch (IndexError), the others went on; now every rank
    # raises, naming the sizes.
    one = init_device_mesh("cpu", (1,))
    with pytest.raises(
        ValueError, match=r"do not multiply to the world size: shard 1 x replicate 1 != 4"
    ):
        dedicate_params(build(0), one, muon_predicate)
    # A mesh built from ranks listed out of order: its process group (and FSDP2) numbers the
    # ranks in increasing order, its coordinates in the listed one. Refused on every rank, and
    # said so (it once read "replicate_mesh does not match mesh" with no replicate_mesh given).
    listed = DeviceMesh("cpu", torch.tensor([1, 0, 2, 3]))
    with pytest.raises(ValueError, match=r"out of increasing order \(this rank's: \(1, 0, 2, 3\)"):
        dedicate_params(build(0), listed, muon_predicate)
    # A named 2-D mesh is accepted as a shorthand for (mesh['shard'], replicate_mesh=mesh['replicate']).
    runtime = dedicate_params(build(0), hsdp, muon_predicate)
    assert runtime.layout.shard_size == 2 and runtime.layout.replicate_size == 2
    _fully_shard_mesh_errors(hsdp)


def _sharded(model, *meshes) -> nn.Module:
    """``fully_shard`` each layer on its mesh of ``meshes``, then the root on the last."""
    for layer, mesh in zip(model.layers, meshes):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=meshes[-1])
    return model


def _fully_shard_mesh_errors(hsdp) -> None:
    """A fully_shard mesh over part of dmuon's grid (on 4 ranks): FSDP2 averaged its own
    parameters inside each group of ranks apart, and after 3 steps the two replicas' norms,
    embedding and head differed (up to 5.8e-2) with no error. Refused at Muon(model) on every
    rank, naming the module and the mesh to pass; the same ranks laid out otherwise are not."""
    from torch.distributed.device_mesh import DeviceMesh

    from dmuon_fsdp import dedicate_params_ddp, install_patch

    world = _mesh(4)

    def hsdp_model():
        model = build(0)
        dedicate_params(model, hsdp["shard"], muon_predicate, replicate_mesh=hsdp["replicate"])
        return model

    # HSDP in dmuon, one layer given the shard dimension alone (the replicate one forgotten).
    with pytest.raises(
        ValueError,
        match=r"fully_shard\('layers\.1'\) holds 'layers\.1\.attn_norm\.weight' on ranks "
        r"\(\d, \d\) \(the mesh it was given\), which does not cover dmuon's data-parallel grid, "
        r"ranks \(0, 1, 2, 3\).*drift apart.*fully_shard\(module, mesh=hsdp\) with "
        r"dedicate_params\(model, hsdp\['shard'\], \.\.\., replicate_mesh=hsdp\['replicate'\]\)",
    ):
        Muon(_sharded(hsdp_model(), hsdp, hsdp["shard"], hsdp))
    # A 1-D grid over the world, fully_shard over two of its ranks.
    model = build(0)
    dedicate_params(model, world, muon_predicate)
    with pytest.raises(ValueError, match=r"fully_shard\('model'\) holds 'embed_tokens\.weight'"):
        Muon(_sharded(model, world, world, hsdp["shard"]))
    # The replicated path, whose other parameters fully_shard took (the patch installed).
    model = build(0)
    dedicate_params_ddp(model, world, muon_predicate)
    install_patch()
    with pytest.raises(ValueError, match=r"the mesh that dedicate_params_ddp got, over every"):
        Muon(_sharded(model, hsdp["replicate"], world, world))
    # The TP dimension of a (dp, tp) mesh given to fully_shard (dmuon has mesh['dp']): the
    # same size, other ranks.
    dp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = build(0)
    tensor_parallel(model, dp_tp["tp"])
    dedicate_params(model, dp_tp["dp"], muon_predicate)
    with pytest.raises(ValueError, match=r"not the tensor-parallel dimension: mesh\['dp'\]"):
        Muon(_sharded(model, dp_tp["dp"], dp_tp["dp"], dp_tp["tp"]))
    # TP shards neither dedicated nor FSDP2's: their TP mesh only, so nothing reduced them over
    # mesh['dp'] and AdamW trained each replica's copy apart (up_proj differed by 5e-2 after 3
    # steps), as they counted as FSDP2's for being DTensors. No fully_shard at all (everything
    # else dedicated), and one that leaves them out (ignored_params, formerly named as though
    # it held them).
    loose = r"\d trainable parameter\(s\) are neither dedicated nor managed by FSDP2.*"
    model = build(0)
    tensor_parallel(model, dp_tp["tp"])
    routes = {
        "overrides": [{"name": ["*norm*", "embed_tokens", "lm_head"], "set": {"route": "adamw"}}]
    }
    dedicate_params(
        model,
        dp_tp["dp"],
        lambda n, p: "mlp." not in n,
        param_policy=routes,
        hook_boundary_strict=False,
    )
    with pytest.raises(ValueError, match=loose + r"'layers\.0\.mlp\.gate_proj\.weight'"):
        Muon(model)
    model = build(0)
    tensor_parallel(model, dp_tp["tp"])
    dedicate_params(model, dp_tp["dp"], lambda n, p: "attn." in n and p.ndim == 2)
    mlp = set(model.layers.get_submodule("1.mlp").parameters())
    fully_shard(model, mesh=dp_tp["dp"], ignored_params=mlp)
    with pytest.raises(ValueError, match=loose + r"'layers\.1\.mlp\.gate_proj\.weight'"):
        Muon(model)
    # The grid's ranks laid out otherwise average over the same ranks: FSDP2 given the 2-D
    # HSDP mesh over a 1-D grid, a 1-D mesh over an HSDP grid, the world in another order.
    model = build(0)
    dedicate_params(model, world, muon_predicate)
    Muon(_sharded(model, hsdp, hsdp, hsdp))
    Muon(_sharded(hsdp_model(), world, world, world))
    backwards = DeviceMesh("cpu", [3, 2, 1, 0])
    model = build(0)
    dedicate_params(model, world, muon_predicate)
    Muon(_sharded(model, backwards, backwards, backwards))


@pytest.mark.distributed
@pytest.mark.parametrize(
    "body",
    [
        _fully_shard_first,
        _dtensor_param,
        _tensor_parallel,
        _non_matrix,
        _strict_boundary,
        _non_strict_root_boundary,
        _childless_root,
        _boundary_predicate_lowest,
        _bad_arguments,
        _routes,
        _policy_typo,
        _bias_stack_on_muon,
        _stack_of_one_on_muon,
        _expert_stack_dtypes,
        _plan_differs,
        _config_argument,
    ],
    ids=lambda f: f.__name__.strip("_"),
)
def test_dedicate_errors_and_options(body) -> None:
    run_distributed(body, 2)


@pytest.mark.distributed
def test_fully_shard_without_ignored_params_raises_at_every_entry_point() -> None:
    """With ``patch_fully_shard=False`` (the default patches it) a ``fully_shard`` without
    ``ignored_params`` takes the dedicated parameters: each is named, with the fix, at
    Muon(model), checkpoint and diagnostics calls and the first forward."""
    run_distributed(_fully_shard_without_ignored_params, 1)


@pytest.mark.distributed
def test_mesh_errors() -> None:
    run_distributed(_mesh_errors, 4)


def test_install_patch_is_idempotent_and_only_touches_marked_params() -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_init

    from dmuon_fsdp import install_patch
    from dmuon_fsdp.holder._guard import guard_parameter
    from dmuon_fsdp.setup._fsdp_integration import is_installed

    uninstall_patch()
    originals = (_fsdp_init._get_managed_modules, _fsdp_init._get_managed_states)
    assert not is_installed()
    install_patch()
    try:
        first = (_fsdp_init._get_managed_modules, _fsdp_init._get_managed_states)
        assert first != originals
        install_patch()
        assert (_fsdp_init._get_managed_modules, _fsdp_init._get_managed_states) == first
        assert is_installed()
        model = build(0)
        # Nothing marked: the wrapped functions return exactly what FSDP2 would.
        params, _ = _fsdp_init._get_managed_states(list(model.modules()))
        assert len(params) == len(list(model.parameters()))
        guard_parameter(model.layers[0].mlp.up_proj.weight, "a dedicated test weight")
        params, _ = _fsdp_init._get_managed_states(list(model.modules()))
        assert all(p is not model.layers[0].mlp.up_proj.weight for p in params)
        assert len(params) == len(list(model.parameters())) - 1
        modules = _fsdp_init._get_managed_modules((model,))
        assert model.layers[0].mlp.up_proj not in modules  # all its parameters are dedicated
    finally:
        uninstall_patch()
    assert (_fsdp_init._get_managed_modules, _fsdp_init._get_managed_states) == originals
    assert not is_installed()
