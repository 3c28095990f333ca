"""``QKClip.from_model`` on tiny Hugging Face models built from configs (Llama with grouped-query
attention, Qwen2 with q/k biases, Qwen3 with QK-norm, DeepSeek-V3's latent attention with and
without a query LoRA): the specs it finds, that its row maps scale every logit of each head by
exactly that head's γ in the models' own forwards, and the guide's recipe (an attention
function registered with transformers that observes) on 2 gloo ranks."""

from __future__ import annotations

import math

import pytest
import torch
from _attention import ROWS, SEQ, ZERO_LR, ClipModel
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dmuon_fsdp import (
    Muon,
    QKClip,
    QKRowMap,
    dedicate_params,
    dedicated_params_of,
    get_model_state_dict,
    max_logits,
)
from dmuon_fsdp.optim._qk_clip import _uses_qk_norm
from dmuon_testing.distributed import run_distributed

pytest.importorskip("transformers")


def _hf_models() -> dict[str, nn.Module]:
    """One-layer Llama (grouped-query), Qwen2 (q/k biases), Qwen3 (QK-norm) and DeepSeek-V3
    (latent attention, with and without a query LoRA), built from configs."""
    transformers = pytest.importorskip("transformers")
    common = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    gqa = {"num_attention_heads": 4, "num_key_value_heads": 2}
    mla = {
        **common,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "moe_intermediate_size": 16,
        "first_k_dense_replace": 1,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
    }
    torch.manual_seed(0)
    return {
        "llama": transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, **gqa)),
        "qwen2": transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, **gqa)),
        "qwen3": transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, **gqa)),
        "dsv3": transformers.DeepseekV3ForCausalLM(
            transformers.DeepseekV3Config(**mla, q_lora_rank=16)
        ),
        "dsv3-no-lora": transformers.DeepseekV3ForCausalLM(
            transformers.DeepseekV3Config(**mla, q_lora_rank=None)
        ),
    }


def test_from_model_finds_hugging_face_attention() -> None:
    models = _hf_models()
    prefix = "model.layers.0.self_attn"
    for name, model in models.items():
        clip = QKClip.from_model(model, tau=50.0, alpha=0.4)
        assert (clip.tau, clip.alpha) == (50.0, 0.4)
        (attention,) = clip._attentions
        if name.startswith("dsv3"):
            query = "q_b_proj" if name == "dsv3" else "q_proj"
            assert attention[:4] == (f"{prefix}.{query}.weight", f"{prefix}.kv_b_proj.weight", 4, 4)
            assert attention.q_rows == QKRowMap((("q", 8), ("q_rope", 4)))
            assert attention.k_rows == QKRowMap((("k", 8), ("skip", 8)))
        else:
            assert attention[:4] == (f"{prefix}.q_proj.weight", f"{prefix}.k_proj.weight", 4, 2)
            head_dim = model.get_parameter(attention.q).shape[0] // 4  # Qwen3's default is 128
            assert attention.q_rows == QKRowMap((("q", head_dim),))
            assert attention.k_rows == QKRowMap((("k", head_dim),))
        assert _uses_qk_norm(model, attention) == (name == "qwen3"), name
    transformers = pytest.importorskip("transformers")
    # An encoder-decoder whose decoder has fewer heads than its encoder: each attention
    # takes its own module's count (the config's num_attention_heads is the encoder's).
    bart = transformers.BartForConditionalGeneration(
        transformers.BartConfig(
            vocab_size=64,
            d_model=32,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=4,
            decoder_attention_heads=2,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
        )
    )
    heads = {
        a.q.rsplit(".", 2)[0]: (a.heads, a.q_rows) for a in QKClip.from_model(bart)._attentions
    }
    assert heads["model.encoder.layers.0.self_attn"] == (4, QKRowMap((("q", 8),)))
    assert heads["model.decoder.layers.0.self_attn"] == (2, QKRowMap((("q", 16),)))
    assert heads["model.decoder.layers.0.encoder_attn"] == (2, QKRowMap((("q", 16),)))
    with pytest.raises(ValueError, match="found no attention"):
        QKClip.from_model(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="has q_proj and k_proj but no config"):
        QKClip.from_model(ClipModel("mha"))


def _capture(store: dict[nn.Module, tuple[Tensor, Tensor, float]]):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attend(module, query, key, value, attention_mask, **kwargs):
        store[module] = (query.detach().double(), key.detach().double(), kwargs["scaling"])
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    return attend


def _logits(store: dict[nn.Module, tuple[Tensor, Tensor, float]]) -> Tensor:
    ((q, k, scaling),) = store.values()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return q @ k.transpose(-1, -2) * scaling  # (batch, heads, L, L), every pair


def test_row_maps_of_hugging_face_attention_scale_every_logit_by_gamma() -> None:
    # The rows from_model's maps pick, scaled by γ of their group as the clip does, scale every
    # logit of each head (not just the largest) by exactly that γ: the maps match the layouts
    # these models compute q and k from (biases, grouped heads, the latent attention's split).
    from transformers import AttentionInterface

    from dmuon_fsdp.optim._qk_clip import _attention_rows  # the rows the clip scales

    store: dict[nn.Module, tuple[Tensor, Tensor, float]] = {}
    AttentionInterface.register("dmuon_test_capture", _capture(store))
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    for name, model in _hf_models().items():
        if name == "qwen3":
            continue  # QK-norm: nothing to scale
        model.set_attn_implementation("dmuon_test_capture")
        store.clear()
        model(tokens)
        before = _logits(store)
        (attention,) = QKClip.from_model(model)._attentions
        gamma = torch.tensor([0.3, 0.7, 0.9, 0.5])[: attention.kv_heads]
        params = dict(model.named_parameters())
        with torch.no_grad():
            for fqn, rows in _attention_rows(attention, params, 0, 0.5):
                factor = gamma[rows.group] ** rows.power
                params[fqn].mul_(factor.view(-1, *[1] * (params[fqn].dim() - 1)))
        model(tokens)
        per_head = gamma.repeat_interleave(attention.heads // attention.kv_heads).double()
        torch.testing.assert_close(
            _logits(store), before * per_head[:, None, None], rtol=1e-5, atol=1e-7
        )


def _hf_step(rank: int, world_size: int) -> tuple[int, int]:
    """The guide's recipe on a tiny Llama with q/k biases: from_model, an attention function
    registered with transformers that observes dmuon.max_logits, one zero-lr step."""
    from transformers import (
        AttentionInterface,
        AttentionMaskInterface,
        LlamaConfig,
        LlamaForCausalLM,
    )
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=True,
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.randint(0, 64, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    # The reference: explicit logits of a plain copy, per layer.
    store: dict[nn.Module, tuple[Tensor, Tensor, float]] = {}
    AttentionInterface.register("dmuon_test_capture", _capture(store))
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(initial)
    plain.set_attn_implementation("dmuon_test_capture")
    plain(tokens)
    future = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
    before = torch.stack(
        [
            _logits({m: v}).masked_fill(future, -math.inf).amax(dim=(0, 2, 3))
            for m, v in store.items()
        ]
    )
    groups = before.reshape(2, 2, 2).amax(dim=-1)  # (layers, key heads)
    tau = float(groups.flatten().median())

    # What the guide shows.
    clip = QKClip.from_model(model, tau=tau)
    names = {model.get_submodule(q.rsplit(".", 2)[0]): q for q in clip.names}

    def observed_sdpa(module, query, key, value, attention_mask, **kwargs):
        mask = attention_mask
        if mask is not None and mask.dtype != torch.bool:
            mask = mask == 0
        clip.observe(
            names[module],
            max_logits(query, key, kwargs.get("scaling"), is_causal=mask is None, attn_mask=mask),
        )
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("dmuon_sdpa", observed_sdpa)
    AttentionMaskInterface.register("dmuon_sdpa", sdpa_mask)
    model.set_attn_implementation("dmuon_sdpa")
    mesh = init_device_mesh("cpu", (world_size,))
    dedicate_params(model, mesh, lambda n, p: "proj" in n and p.ndim == 2, small_param_threshold=0)
    ignored = dedicated_params_of(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=ignored)
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    optimizer = Muon(model, **ZERO_LR)
    clip.attach(optimizer)
    local = tokens.chunk(world_size)[rank]
    model(local, labels=local).loss.backward()
    optimizer.step()
    torch.testing.assert_close(clip.last_max_logits().double(), before, rtol=1e-5, atol=0)
    state = get_model_state_dict(model)
    clipped = kept = 0
    for layer in range(2):
        for g in range(2):
            gamma = min(1.0, tau / float(groups[layer, g]))
            rows = [("q_proj", h) for h in (2 * g, 2 * g + 1)] + [("k_proj", g)]
            for proj, h in rows:
                for suffix in ("weight", "bias"):
                    key = f"model.layers.{layer}.self_attn.{proj}.{suffix}"
                    part = slice(h * 8, (h + 1) * 8)
                    if gamma == 1.0:
                        assert torch.equal(state[key][part], initial[key][part]), key
                    else:
                        torch.testing.assert_close(
                            state[key][part],
                            initial[key][part] * math.sqrt(gamma),
                            rtol=1e-6,
                            atol=0,
                        )
            clipped += gamma < 1.0
            kept += gamma == 1.0
    return clipped, kept


@pytest.mark.distributed
def test_hugging_face_recipe_clips_a_llama() -> None:
    pytest.importorskip("transformers")
    for clipped, kept in run_distributed(_hf_step, 2):
        assert clipped > 0 and kept > 0
