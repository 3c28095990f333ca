"""model_shapes: a Hugging Face config as work items, without building the model.

The names and shapes against transformers' own models are checked in
``test_plan_forecast.py`` (it builds them with transformers); here: published parameter counts,
the three kinds, tensor parallelism and errors."""

import json
import math

import pytest
from plan_configs import DEEPSEEK_V3, KIMI_K2, LLAMA_3_70B

from dmuon.plan import ModelShapes, model_shapes
from dmuon_ownership import Route


def test_llama_3_70b_has_its_published_parameter_count() -> None:
    shapes = model_shapes(LLAMA_3_70B)
    assert shapes.numel == 70_553_706_496  # the Hugging Face checkpoint's count
    assert shapes.num_experts == 0 and shapes.experts == ()
    assert len(shapes.dedicated) == 80 * 7
    assert {it.boundary for it in shapes.dedicated} == {f"model.layers.{i}" for i in range(80)}
    assert all(it.route is Route.MUON and it.itemsize == 4 for it in shapes.dedicated)
    names = {it.name: it.shape for it in shapes.all_items}
    assert names["model.layers.0.self_attn.k_proj.weight"] == (1024, 8192)
    assert names["model.layers.79.mlp.down_proj.weight"] == (8192, 28672)
    assert names["lm_head.weight"] == (128256, 8192)


def test_deepseek_v3_and_kimi_k2() -> None:
    shapes = model_shapes(DEEPSEEK_V3)
    assert round(shapes.numel / 1e9) == 671  # DeepSeek-V3's 671 B, without the MTP module
    assert shapes.num_experts == 256
    assert len(shapes.experts) == 2 * (61 - 3)
    items = {it.name: it for it in shapes.all_items}
    layer = "model.layers.3"
    assert items[f"{layer}.mlp.experts.gate_up_proj"].shape == (256, 4096, 7168)
    assert items[f"{layer}.mlp.experts.down_proj"].shape == (256, 7168, 2048)
    assert items[f"{layer}.mlp.gate.weight"].itemsize == 4  # float32 router, as transformers
    assert items[f"{layer}.mlp.shared_experts.gate_proj.weight"].shape == (2048, 7168)
    assert items[f"{layer}.self_attn.q_b_proj.weight"].shape == (128 * 192, 1536)
    assert items[f"{layer}.self_attn.kv_a_proj_with_mqa.weight"].shape == (576, 7168)
    assert items[f"{layer}.self_attn.kv_b_proj.weight"].shape == (128 * 256, 512)
    assert items[f"{layer}.self_attn.o_proj.weight"].shape == (7168, 128 * 128)
    assert items["model.layers.2.mlp.down_proj.weight"].shape == (7168, 18432)
    # Every 2-D weight of a layer is dedicated; experts and the rest are not.
    assert {it.name for it in shapes.dedicated} == {
        name for name, it in items.items() if len(it.shape) == 2 and ".layers." in name
    }
    assert all(it.route is Route.SHARDED_ADAMW for it in shapes.fsdp)

    k2 = model_shapes(KIMI_K2)
    assert k2.num_experts == 384 and len(k2.experts) == 2 * 60
    experts = sum(it.numel for it in k2.experts)
    assert experts == 60 * 384 * 3 * 2048 * 7168
    assert 1.0e12 < k2.numel < 1.05e12


def test_moe_layer_rules() -> None:
    qwen = {
        "model_type": "qwen3_moe",
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 8,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
        "vocab_size": 100,
    }
    shapes = model_shapes(qwen)
    sparse = sorted({it.boundary for it in shapes.experts})
    assert sparse == ["model.layers.1", "model.layers.5"]  # (i + 1) % 2 == 0, not layer 3
    names = {it.name for it in shapes.all_items}
    assert "model.layers.3.mlp.down_proj.weight" in names
    assert "model.layers.0.self_attn.q_norm.weight" in names
    # transformers 5 calls Qwen3-MoE's num_experts num_local_experts; either is read.
    renamed = {k: v for k, v in qwen.items() if k != "num_experts"} | {"num_local_experts": 8}
    assert model_shapes(renamed) == shapes


def test_tp_marks_the_sharded_projections() -> None:
    shapes = model_shapes(DEEPSEEK_V3, tp=8)
    tp = {it.name.split(".")[-2] for it in shapes.all_items if it.tp == 8}
    assert tp == {"q_b_proj", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} | {
        "embed_tokens",
        "lm_head",
    }
    assert all(it.tp == 1 for it in shapes.experts)


def test_config_from_a_file_or_directory(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_70B))
    direct = model_shapes(tmp_path / "config.json", dtype="bf16")
    assert model_shapes(str(tmp_path)) == model_shapes(LLAMA_3_70B)
    assert isinstance(direct, ModelShapes) and direct.dedicated[0].itemsize == 2
    assert math.prod(direct.dedicated[0].shape) == direct.dedicated[0].numel


def test_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not supported; supported: llama"):
        model_shapes({"model_type": "gpt2"})
    missing = {k: v for k, v in DEEPSEEK_V3.items() if k != "kv_lora_rank"}
    with pytest.raises(ValueError, match=r"'deepseek_v3' has no 'kv_lora_rank'; that field"):
        model_shapes(missing)
    no_experts = {k: v for k, v in DEEPSEEK_V3.items() if k != "n_routed_experts"}
    with pytest.raises(ValueError, match=r"has none of 'n_routed_experts', 'num_experts'"):
        model_shapes(no_experts)
    with pytest.raises(ValueError, match=r"field 'hidden_size' must be an int >= 1, got '8'"):
        model_shapes({**LLAMA_3_70B, "hidden_size": "8"})
    with pytest.raises(ValueError, match=r"tp must be an int >= 1, got 0"):
        model_shapes(LLAMA_3_70B, tp=0)
    # dedicate_params refuses a tensor-parallel matrix split into unequal shards; so does the
    # forecast, which would otherwise plan a run that cannot start.
    with pytest.raises(ValueError, match=r"tp=3 splits a dim of 8192 of 'model.layers.0.self_att"):
        model_shapes(LLAMA_3_70B, tp=3)
    with pytest.raises(ValueError, match=r"model_shapes: dtype: unsupported dtype 'int8'"):
        model_shapes(LLAMA_3_70B, dtype="int8")
    with pytest.raises(ValueError, match=r"does not exist; pass a config.json or a model dir"):
        model_shapes(tmp_path / "nope.json")
    with pytest.raises(ValueError, match=r"config must be a dict \(a parsed config.json\)"):
        model_shapes(3)  # type: ignore[arg-type]
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match=r"holds an array, not a JSON object"):
        model_shapes(tmp_path / "list.json")
