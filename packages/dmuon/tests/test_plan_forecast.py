"""The planner before the run (``dmuon.plan.forecast`` / ``dmuon-plan``) sees what the
runtime sees: its parameters are transformers' own for every supported family, and its work
items and owner plan are those ``dedicate_params`` makes for a model built from the same
config, started the way the Scale guide starts a big model (meta device, ``dedicate_params``,
``fully_shard`` with ``ignored_params``, ``to_empty``, load).

The runtime does not dedicate mixture-of-experts expert stacks yet; they stay with FSDP2. For
the MoE model the comparison therefore covers the dense (dedicated) items, and the runtime's
plan is compared with ``plan_owners`` on those items without the experts' base loads (the
forecast adds them, for the experts each rank will step itself).

It also predicts, per rank, the payload of every collective dmuon issues in a step (the unit of
the runtime's ``CommCounter``) and the bytes each rank keeps between steps; the runtime's
counter and allocations after a real step match them exactly (the counter under tensor
parallelism too, its TP matrices' Newton–Schulz gathered or by distributed Gram), and so does
``summarize_comm_plan``'s ``payload_bytes_per_step`` (each collective once: the forecast's shard
axis of any rank of the shard group, its replicate axis summed over the group's ranks, one in
each replicate group). FSDP2's
own collectives are not in the counter, so only dmuon's part of the forecast's bytes per step is
compared."""

from __future__ import annotations

import pytest
import torch

from dmuon.plan import Topology, forecast, model_shapes
from dmuon.plan._forecast import DEFAULT_NS_BATCH_BYTES
from dmuon_testing.distributed import run_distributed

pytest.importorskip("transformers")

_BASE = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "max_position_embeddings": 16,
}
FAMILIES = {
    "llama": {"attention_bias": True, "mlp_bias": True},
    "mistral": {"head_dim": 16},
    "qwen2": {},
    "qwen3": {"head_dim": 8, "tie_word_embeddings": True},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {
        "moe_intermediate_size": 24,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "head_dim": 8,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [2],
        "num_hidden_layers": 4,
    },
    "deepseek_v3": {
        "moe_intermediate_size": 16,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "n_shared_experts": 2,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "q_lora_rank": 24,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "n_group": 2,
        "topk_group": 1,
    },
    "deepseek_v3 without q_lora": {
        "moe_intermediate_size": 16,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 2,
        "q_lora_rank": None,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "n_group": 2,
        "topk_group": 1,
        "attention_bias": True,
    },
}


def _config(family: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(family.split()[0], **{**_BASE, **FAMILIES[family]})


def _predicate(name: str, param: torch.nn.Parameter) -> bool:
    """What the forecast dedicates: every 2-D weight of the decoder layers."""
    return param.ndim == 2 and ".layers." in name


def _muon(name: str, param: torch.nn.Parameter) -> bool:
    """What the forecast puts on Muon: those, and the expert stacks (stepped where FSDP2 holds
    them)."""
    return param.ndim in (2, 3) and ".layers." in name


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_model_shapes_are_the_models_parameters(family: str, dtype: torch.dtype) -> None:
    from transformers import AutoModelForCausalLM

    config = _config(family)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    built = {n: (tuple(p.shape), p.element_size()) for n, p in model.named_parameters()}
    shapes = model_shapes(config.to_dict(), dtype=str(dtype))
    assert {it.name: (it.shape, it.itemsize) for it in shapes.all_items} == built
    assert {it.name for it in shapes.dedicated} == {
        n for n, p in model.named_parameters() if _predicate(n, p)
    }
    assert all(p.ndim == 3 for n, p in model.named_parameters() if ".experts." in n)


def test_forecast_batches_ns_as_muon_does_by_default() -> None:
    from dmuon_fsdp.optim._optimizer import DEFAULT_NS_BATCH_BYTES as MUON_DEFAULT

    assert DEFAULT_NS_BATCH_BYTES == MUON_DEFAULT


def _started_like_a_big_model(rank: int, world_size: int, families: tuple[str, ...]):
    return {family: _start(world_size, family) for family in families}


def _start(world_size: int, family: str):
    """Meta device -> dedicate_params -> fully_shard(ignored_params) -> to_empty -> load; the
    runtime's items and owners, and the logits against the same weights on one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from dmuon_fsdp import dedicate_params, dedicated_params_of, set_model_state_dict

    config = _config(family)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    mesh = init_device_mesh("cpu", (world_size,))
    runtime = dedicate_params(model, mesh, _muon, patch_fully_shard=False)
    dedicated = dedicated_params_of(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=dedicated)
    fully_shard(model, mesh=mesh, ignored_params=dedicated)
    model.to_empty(device="cpu")
    with torch.no_grad():  # non-persistent buffers (rotary frequencies) are not in a checkpoint
        for name, buffer in reference.named_buffers():
            model.get_buffer(name).copy_(buffer)
    set_model_state_dict(model, reference.state_dict())
    tokens = torch.arange(12).reshape(2, 6) % config.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, reference(tokens).logits)
    items = [
        (dp.fqn, tuple(dp.shape), dp.boundary, dp.dtype.itemsize, dp.owner) for dp in runtime.params
    ]
    return items, runtime.plan.to_json()


@pytest.mark.distributed
def test_forecast_items_and_owners_are_the_runtimes() -> None:
    from dmuon_ownership import Plan

    dense, moe = "llama", "deepseek_v3"
    results = run_distributed(_started_like_a_big_model, 2, (dense, moe))
    assert all(other == results[0] for other in results[1:])
    topology = Topology(2, param_dtype="float32", master_dtype="float32")
    for family in (dense, moe):
        items, plan_json = results[0][family]
        fc = forecast(_config(family).to_dict(), topology)
        runtime_plan = Plan.from_json(plan_json)
        expected = [(it.name, it.shape, it.boundary, it.itemsize) for it in fc.items]
        assert sorted(item[:4] for item in items) == sorted(expected)
        # The forecast's plan is the runtime's, owner for owner; with experts, both weigh the
        # experts each rank steps (base loads) the same way.
        assert fc.plan == runtime_plan
        assert bool(fc.plan.base_loads) == (family == moe)
        owners = {n: fc.plan.owner_of(n) for n, *_ in expected}
        assert {item[0]: item[4] for item in items} == owners


# A tiny Llama with what the byte counts must get right: tied embeddings (one tensor for the
# embedding and the head), a vocabulary no shard size divides (torch.chunk's shards are uneven
# and FSDP2 pads them), 1-D biases and norms on AdamW.
BYTES_CONFIG = {**_BASE, "vocab_size": 61}
BYTES_CONFIG.update(attention_bias=True, tie_word_embeddings=True)
# (replicas, ZeRO, reduce dtype): ZeRO-3 reduces in fp32 and ZeRO-2 in the bf16 compute dtype,
# so each of the compute, reduce and master dtypes shows in the bytes.
BYTE_LAYOUTS = {
    2: [(1, 3, "float32", "llama"), (1, 2, "bfloat16", "llama")],
    4: [
        (1, 3, "float32", "llama"),
        (1, 2, "bfloat16", "llama"),
        (2, 3, "float32", "llama"),
        (2, 2, "bfloat16", "llama"),
        (2, 3, "float32", "qwen3_moe"),
    ],
}
# A tiny Qwen3-MoE whose plan under HSDP 2 x 2 names expert sources: a replica steps some
# expert stack shards for both and broadcasts them, which the payload must count.
BYTES_CONFIGS = {
    "llama": BYTES_CONFIG,
    "qwen3_moe": {**BYTES_CONFIG, **FAMILIES["qwen3_moe"], "tie_word_embeddings": False},
}


def _bytes_topology(world_size: int, replicas: int, zero: int, reduce: str) -> Topology:
    return Topology(
        world_size,
        shard_size=world_size // replicas,
        zero=zero,
        param_dtype="bfloat16",
        master_dtype="float32",
        reduce_dtype=reduce,
    )


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shard): what
    is allocated, padding included, each buffer once however many views share it."""
    storages = {}
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        storages[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
    return sum(storages.values())


def _second_step_bytes(model, optimizer, runtime, tokens) -> dict[str, int]:
    """Two steps; the bytes the runtime's counter holds for exactly the second, by key."""
    for warm_up in (True, False):
        if not warm_up:
            runtime.counter.reset()
        model(tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {key: entry["bytes"] for key, entry in runtime.counter.snapshot().items()}


def _counted_and_allocated(rank: int, world_size: int, layouts):
    """Per layout, on this rank: its grid coordinate, what dmuon's CommCounter counted over
    exactly one step (after a warm-up step), and the bytes of masters, optimizer states and
    HSDP replica copies allocated after it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from dmuon_fsdp import Muon, Role, dedicate_params, dedicated_params_of, summarize_comm_plan

    out = []
    for replicas, zero, reduce, family in layouts:
        config = AutoConfig.for_model(family, **BYTES_CONFIGS[family])
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        shard = world_size // replicas
        if replicas > 1:
            mesh = init_device_mesh("cpu", (replicas, shard), mesh_dim_names=("rep", "shard"))
            shard_mesh, extra = mesh["shard"], {"replicate_mesh": mesh["rep"]}
        else:
            mesh = shard_mesh = init_device_mesh("cpu", (shard,))
            extra = {}
        runtime = dedicate_params(
            model,
            shard_mesh,
            _muon,
            reshard_after_forward=zero == 3,
            patch_fully_shard=False,
            **extra,
        )
        dedicated = dedicated_params_of(model)
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=getattr(torch, reduce)
        )
        for module in [*model.model.layers, model]:
            fully_shard(
                module,
                mesh=mesh,
                mp_policy=policy,
                reshard_after_forward=zero == 3,
                ignored_params=dedicated,
            )
        optimizer = Muon(model, lr=0.01, adamw_lr=1e-3)
        tokens = (torch.arange(12).reshape(2, 6) + rank) % config.vocab_size

        counted = _second_step_bytes(model, optimizer, runtime, tokens)
        ignored = {id(p) for p in dedicated}
        masters = [dp.full for dp in runtime.params if dp.role is Role.OWNER]
        masters += [p for p in model.parameters() if id(p) not in ignored]
        states = [t for state in optimizer.state.values() for t in state.values()]
        replica_packs = [
            pack.buffer
            for group in runtime.groups
            for pack in group.packs
            if pack.role is Role.REPLICA
        ]
        allocated = {
            "masters": _storage_bytes(masters),
            "optimizer states": _storage_bytes(t for t in states if isinstance(t, torch.Tensor)),
            "HSDP replica copies": _storage_bytes(replica_packs),
        }
        coord = runtime.layout.coord
        plan = runtime.plan
        summary = summarize_comm_plan(model, optimizer)["payload_bytes_per_step"]
        out.append(
            ((coord.replicate, coord.shard), counted, allocated, plan.fingerprint(), summary)
        )
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", sorted(BYTE_LAYOUTS))
def test_forecast_bytes_and_state_are_what_the_runtime_counts_and_allocates(
    world_size: int,
) -> None:
    layouts = BYTE_LAYOUTS[world_size]
    results = run_distributed(_counted_and_allocated, world_size, layouts)
    for index, (replicas, zero, reduce, family) in enumerate(layouts):
        fc = forecast(
            BYTES_CONFIGS[family] | {"model_type": family},
            _bytes_topology(world_size, replicas, zero, reduce),
        )
        assert bool(fc.plan.expert_sources) == (family == "qwen3_moe")
        seen = set()
        for rank, per_layout in enumerate(results):
            (r, s), counted, allocated, fingerprint, summary = per_layout[index]
            where = (
                f"{family} rank {rank} at (replicate {r}, shard {s}), "
                f"{replicas} x {world_size // replicas}, ZeRO-{zero}"
            )
            assert fingerprint == fc.plan.fingerprint(), where
            predicted = fc.rank(replicate=r, shard=s)
            assert {k: v for k, v in counted.items() if v} == predicted.payload, where
            assert allocated == predicted.state, where
            # summarize_comm_plan: the payload of the collectives of this rank's shard group.
            row = [fc.rank(replicate=r, shard=i).payload for i in range(world_size // replicas)]
            expected = {k: v for k, v in predicted.payload.items() if k.startswith("shard/")}
            for payload in row:
                for key, nbytes in payload.items():
                    if not key.startswith("shard/"):
                        expected[key] = expected.get(key, 0) + nbytes
            assert summary == expected, where
            seen.add((r, s))
        assert len(seen) == world_size


def _tensor_parallel_counted(rank: int, world_size: int, tp_ns: str):
    """A tiny Llama with Megatron-style tensor parallelism on a (2, 2) ("dp", "tp") mesh and
    ``Muon(options=StepOptions(tp_ns=tp_ns))``: this rank's grid coordinate and TP index, what
    its CommCounter counted over the second step, summarize_comm_plan's payload and the plan's
    fingerprint."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from transformers import AutoConfig, AutoModelForCausalLM

    from dmuon_fsdp import (
        Muon,
        StepOptions,
        dedicate_params,
        dedicated_params_of,
        summarize_comm_plan,
    )

    config = AutoConfig.for_model("llama", **BYTES_CONFIG)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    plan = {
        **{f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], plan)
    runtime = dedicate_params(model, mesh["dp"], _muon, patch_fully_shard=False)
    dedicated = dedicated_params_of(model)
    for module in [*model.model.layers, model]:
        fully_shard(module, mesh=mesh["dp"], ignored_params=dedicated)
    optimizer = Muon(model, lr=0.01, adamw_lr=1e-3, options=StepOptions(tp_ns=tp_ns))
    layout = runtime.layout
    tokens = (torch.arange(12).reshape(2, 6) + layout.coord.shard) % config.vocab_size
    counted = _second_step_bytes(model, optimizer, runtime, tokens)
    summary = summarize_comm_plan(model, optimizer)["payload_bytes_per_step"]
    where = (layout.coord.replicate, layout.coord.shard, layout.tp_index)
    return where, counted, summary, runtime.plan.fingerprint()


@pytest.mark.distributed
def test_forecast_tensor_parallel_bytes_are_what_the_runtime_counts() -> None:
    # "gram" runs distributed Gram NS on the matrices whose shards split the long side and
    # gathers the others (k_proj and v_proj, 16 x 32 split into 8 rows): both ways at once.
    tp_ns = "gram"
    results = run_distributed(_tensor_parallel_counted, 4, tp_ns)
    fc = forecast(
        BYTES_CONFIG | {"model_type": "llama"},
        Topology(4, tp=2, param_dtype="float32", master_dtype="float32", tp_ns=tp_ns),
    )
    kinds = {key for _, counted, _, _ in results for key in counted}
    assert {"tp/all_reduce", "tp/gather", "tp/scatter"} <= kinds
    for (r, s, t), counted, summary, fingerprint in results:
        assert fingerprint == fc.plan.fingerprint()
        predicted = fc.rank(replicate=r, shard=s, tp=t)
        assert {k: v for k, v in counted.items() if v} == predicted.payload, (r, s, t)
        # summarize_comm_plan: the shard axis of one shard group, the TP axis of every TP
        # group (the ranks of this grid, one in each).
        expected = {k: v for k, v in predicted.payload.items() if k.startswith("shard/")}
        for shard in range(2):
            for key, nbytes in fc.rank(replicate=r, shard=shard, tp=t).payload.items():
                if key.startswith("tp/"):
                    expected[key] = expected.get(key, 0) + nbytes
        assert summary == expected, (r, s, t)
