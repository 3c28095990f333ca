"""A Hugging Face ``config.json`` as work items, without building the model.

[Note: the parameters of a config]

:func:`model_shapes` writes out the parameters that ``transformers`` (5.x) builds for a config
(``AutoModelForCausalLM.from_config``): the same names, shapes and dtypes, in three kinds, by
what dmuon does with them.

- ``dedicated``: every 2-D weight inside a decoder layer (attention and MLP projections,
  shared experts, routers). These are what ``dedicate_params(model, mesh,
  predicate=lambda n, p: p.ndim == 2 and ".layers." in n)`` selects, route ``"muon"``, hook
  boundary ``model.layers.N``, itemsize of the dtype the model is built in: exactly the
  :class:`WorkItem` list the runtime hands :func:`plan_owners`, so the plan is the runtime's.
- ``experts``: a mixture-of-experts layer's expert stacks, ``(E, out, in)``
  (``mlp.experts.gate_up_proj`` with ``out = 2 × moe_intermediate_size``,
  ``mlp.experts.down_proj``). They stay with FSDP2, sharded on dim 0, and each rank steps Muon
  on its own experts (a stack of matrices, as the Newton–Schulz front end treats a 3-D
  tensor); nobody owns them.
- ``fsdp``: everything else (embeddings, norms, biases, the head), route ``"sharded_adamw"``:
  FSDP2 + AdamW, as any parameter the predicate leaves out.

Families, by ``model_type``: ``llama``, ``mistral``, ``qwen2``, ``qwen3`` (grouped-query
attention, dense MLP); ``mixtral``, ``qwen3_moe`` (the same attention, routed experts;
``qwen3_moe`` keeps a dense MLP in ``mlp_only_layers`` and off its ``decoder_sparse_step``);
``deepseek_v3`` and ``kimi_k2`` (multi-head latent attention with ``q_lora_rank`` (or none),
``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``; dense MLP in the
first ``first_k_dense_replace`` layers, then ``n_routed_experts`` experts of
``moe_intermediate_size`` and ``n_shared_experts`` shared ones; the router weight is float32
whatever the model's dtype, as transformers keeps it). A field that decides the architecture
must be in the config; fields with a transformers default (``head_dim``, ``attention_bias``,
``num_key_value_heads``, ...) take it when absent.

With a tensor-parallel degree ``tp > 1`` the items that Megatron-style plans shard get
``tp``: attention projections (``q/k/v/o_proj``, MLA's ``q_b_proj``, ``kv_b_proj``,
``o_proj``), the dense and shared-expert MLP, the embedding and the head; MLA's low-rank
``q_a_proj`` / ``kv_a_proj_with_mqa``, routers, norms, biases and experts stay whole on every
TP rank.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dmuon_ownership import Route, WorkItem, normalize_dtype

__all__ = ["ITEMSIZE", "MODEL_TYPES", "ModelShapes", "model_shapes"]

_GQA = ("llama", "mistral", "qwen2", "qwen3")
_GQA_MOE = ("mixtral", "qwen3_moe")
_MLA = ("deepseek_v3", "kimi_k2")
MODEL_TYPES: tuple[str, ...] = (*_GQA, *_GQA_MOE, *_MLA)

ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
# Projections a tensor-parallel plan shards (the last component before ".weight").
_TP_SHARDED = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "q_b_proj", "kv_b_proj"}
    | {"gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head"}
)


# Of those, the ones a Megatron-style plan shards row-wise (RowwiseParallel, ``Shard(1)``);
# the others are column-wise (``Shard(0)``).
_TP_ROWWISE = frozenset({"o_proj", "down_proj"})


def tp_dim_of(name: str) -> int:
    """The dimension a Megatron-style plan shards the weight ``name`` on: 1 for the row-wise
    output projections (``o_proj``, ``down_proj``), 0 for the column-wise others."""
    leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
    return 1 if leaf in _TP_ROWWISE else 0


@dataclass(frozen=True)
class ModelShapes:
    """The parameters of one config, by what dmuon does with them (see [Note: the
    parameters of a config]). ``num_experts`` is 0 for a dense model.

    Args:
        model_type: the config's ``model_type`` (``"llama"``, ``"qwen3_moe"``,
            ``"deepseek_v3"``, ...).
        num_layers: its decoder layers (``num_hidden_layers``).
        num_experts: the routed experts of its largest mixture-of-experts layer; 0 for a dense
            model.
        dedicated: every 2-D weight inside a decoder layer, route ``"muon"``: the items
            ``dedicate_params`` plans owners for.
        experts: the expert stacks ``(E, out, in)``, left to FSDP2 and stepped with Muon where
            they are held.
        fsdp: everything else (embeddings, norms, biases, the head), route
            ``"sharded_adamw"``.
    """

    model_type: str
    num_layers: int
    num_experts: int
    dedicated: tuple[WorkItem, ...]
    experts: tuple[WorkItem, ...]
    fsdp: tuple[WorkItem, ...]

    @property
    def all_items(self) -> tuple[WorkItem, ...]:
        return self.dedicated + self.experts + self.fsdp

    @property
    def numel(self) -> int:
        """Parameters of the model."""
        return sum(item.numel for item in self.all_items)


class _Config:
    """Field access that names the config (its file, when it came from one) and the field in
    its errors."""

    def __init__(self, raw: Mapping[str, Any], model_type: str, at: str) -> None:
        self.raw = raw
        self.model_type = model_type
        self.at = at  # " in '<path>'" for a config read from a file, else ""

    def need(self, key: str) -> Any:
        if key not in self.raw:
            raise ValueError(
                f"model_shapes: config of model_type {self.model_type!r}{self.at} has no "
                f"{key!r}; that field decides the shapes, so pass the model's full config.json"
            )
        return self.raw[key]

    def size(self, key: str, default: int | None = None, *, allow_zero: bool = False) -> int:
        value = self.raw.get(key) if default is not None else self.need(key)
        if value is None:
            if default is None:
                self.need(key)  # a null where a size is needed
            value = default
        low = 0 if allow_zero else 1
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(
                f"model_shapes: config field {key!r}{self.at} must be an int >= {low}, got "
                f"{value!r}"
            )
        return value

    def first_size(self, *keys: str, allow_zero: bool = False) -> int:
        """The first of ``keys`` the config has (transformers renames some fields between
        releases, e.g. Qwen3-MoE's ``num_experts`` is ``num_local_experts`` in 5.x)."""
        for key in keys:
            if key in self.raw:
                return self.size(key, allow_zero=allow_zero)
        raise ValueError(
            f"model_shapes: config of model_type {self.model_type!r}{self.at} has none of "
            f"{', '.join(repr(k) for k in keys)}; one of them decides the shapes, so pass the "
            "model's full config.json"
        )

    def flag(self, key: str, default: bool = False) -> bool:
        return bool(self.raw.get(key, default) or False)


_JSON_TYPES = {
    list: "an array",
    str: "a string",
    bool: "a boolean",
    int: "a number",
    float: "a number",
}


def _load(config: Mapping[str, Any] | str | os.PathLike[str]) -> tuple[Mapping[str, Any], str]:
    """The config's fields, and where they came from for errors (``" in '<path>'"``, or ``""``
    for a dict)."""
    if isinstance(config, Mapping):
        return config, ""
    if not isinstance(config, str | os.PathLike):
        raise ValueError(
            "model_shapes: config must be a dict (a parsed config.json) or the path of a "
            f"config.json or of a model directory, got {type(config).__name__}"
        )
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        if path.name == "config.json" and path.parent.is_dir():
            what = f"{str(path.parent)!r} is a directory without a config.json"
        elif path.exists():
            what = f"{str(path)!r} is not a file"
        else:
            what = f"{str(path)!r} does not exist"
        raise ValueError(
            f"model_shapes: {what}; pass a config.json or a model directory that holds one"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"model_shapes: cannot read {str(path)!r}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise ValueError(
            f"model_shapes: {str(path)!r} is not UTF-8 text (byte {error.start}: "
            f"{error.reason}); a config.json is a UTF-8 JSON file"
        ) from None
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as error:
        # An unterminated string runs to the end of the file (a newline inside a string is
        # "Invalid control character" instead): both mean the file stops mid-value.
        ended = not text[error.pos :].strip() or error.msg.startswith("Unterminated string")
        raise ValueError(
            f"model_shapes: {str(path)!r} is not valid JSON: line {error.lineno}, column "
            f"{error.colno}: {error.msg}"
            + (" (the file ends there: is it cut short?)" if ended else "")
        ) from None
    if not isinstance(loaded, dict):
        kind = "null" if loaded is None else _JSON_TYPES.get(type(loaded), "a JSON value")
        raise ValueError(
            f"model_shapes: {str(path)!r} holds {kind}, not a JSON object; a config.json is "
            'one object of fields ({"model_type": ..., "hidden_size": ..., ...})'
        )
    return loaded, f" in {str(path)!r}"


def model_shapes(
    config: Mapping[str, Any] | str | os.PathLike[str],
    *,
    tp: int = 1,
    dtype: str = "float32",
) -> ModelShapes:
    """The parameters of a Hugging Face causal LM config, as :class:`WorkItem` lists.

    ``config`` is a parsed ``config.json``, its path, or a model directory. ``dtype`` is the
    dtype the model's parameters have when ``dedicate_params`` sees them (the master dtype in
    mixed precision): it sets ``WorkItem.itemsize``, as the runtime does. ``tp`` marks the
    items a tensor-parallel plan shards. Nothing is allocated. See [Note: the parameters of a
    config]; raises ``ValueError`` naming the field (and the file the config came from) for
    an unsupported ``model_type``, a missing field, or sizes that do not fit together.

    Args:
        config: a parsed Hugging Face ``config.json`` (a mapping), the path of that file, or
            the path of a model directory holding it; its ``model_type`` must be one of
            ``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``mixtral``, ``qwen3_moe``,
            ``deepseek_v3``, ``kimi_k2``.
        tp: the tensor-parallel degree, an int >= 1: items a Megatron-style plan shards
            (attention projections, the dense MLP, the embedding, the head) get ``tp``, the
            others 1.
        dtype: the dtype of the parameters by name (``"bf16"``, ``"float32"``, ...) or a
            torch dtype: it sets the items' itemsize (a DeepSeek-V3 router stays float32).
    """
    raw, at = _load(config)
    if "model_type" not in raw:
        raise ValueError(
            f"model_shapes: config{at} has no 'model_type'; it names the architecture, one of "
            f"{', '.join(MODEL_TYPES)}"
        )
    model_type = raw["model_type"]
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"model_shapes: model_type {model_type!r}{at} is not supported; supported: "
            f"{', '.join(MODEL_TYPES)} (a model with the same parameter names and shapes may "
            "set one of them as its model_type)"
        )
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"model_shapes: tp must be an int >= 1, got {tp!r}")
    canonical = normalize_dtype(dtype, "model_shapes: dtype")
    assert canonical is not None
    itemsize = ITEMSIZE[canonical]
    cfg = _Config(raw, model_type, at)
    hidden = cfg.size("hidden_size")
    layers = cfg.size("num_hidden_layers")
    _check_heads(cfg, hidden)

    dedicated: list[WorkItem] = []
    experts: list[WorkItem] = []
    fsdp: list[WorkItem] = []

    def add(name: str, shape: tuple[int, ...], boundary: str, size: int = itemsize) -> None:
        leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        item_tp = tp if leaf in _TP_SHARDED else 1
        if ".experts." in name:
            experts.append(WorkItem(name, shape, boundary, Route.MUON, size))
        elif len(shape) == 2 and boundary:
            _check_tp_split(name, shape, item_tp, cfg.at)
            dedicated.append(WorkItem(name, shape, boundary, Route.MUON, size, item_tp))
        else:
            fsdp.append(WorkItem(name, shape, boundary, Route.SHARDED_ADAMW, size, item_tp))

    vocab = cfg.size("vocab_size")
    add("model.embed_tokens.weight", (vocab, hidden), "")
    num_experts = 0
    for index in range(layers):
        boundary = f"model.layers.{index}"
        for name, shape, size in _layer(cfg, index, hidden, itemsize):
            add(f"{boundary}.{name}", shape, boundary, size)
        num_experts = max(num_experts, _layer_experts(cfg, index))
    add("model.norm.weight", (hidden,), "")
    if not cfg.flag("tie_word_embeddings"):
        add("lm_head.weight", (vocab, hidden), "")
    return ModelShapes(
        model_type, layers, num_experts, tuple(dedicated), tuple(experts), tuple(fsdp)
    )


_Param = tuple[str, tuple[int, ...], int]


def _check_tp_split(name: str, shape: tuple[int, ...], tp: int, at: str) -> None:
    """A dedicated matrix a tensor-parallel plan shards splits into equal shards, as
    ``dedicate_params`` requires of every tensor-parallel matrix it dedicates."""
    size = shape[tp_dim_of(name)]
    if tp > 1 and size % tp:
        raise ValueError(
            f"model_shapes: tp={tp} splits a dim of {size} of {name!r} (shape {shape}){at} over "
            f"{tp} ranks unevenly; dedicate_params refuses such a tensor-parallel matrix (dmuon "
            "needs equal TP shards): pick a TP degree that divides it"
        )


def _check_heads(cfg: _Config, hidden: int) -> None:
    """The attention head counts fit together as transformers builds them: key/value heads
    shared by equal groups of query heads, and, where ``head_dim`` is not given, heads of
    ``hidden_size / num_attention_heads`` (a floor would build other shapes)."""
    heads = cfg.size("num_attention_heads")
    kv_heads = cfg.size("num_key_value_heads", heads)
    if heads % kv_heads:
        raise ValueError(
            f"model_shapes: config field 'num_key_value_heads' ({kv_heads}){cfg.at} does not "
            f"divide 'num_attention_heads' ({heads}): grouped-query attention shares each "
            "key/value head among an equal group of query heads"
        )
    if cfg.model_type not in _MLA and cfg.raw.get("head_dim") is None and hidden % heads:
        raise ValueError(
            f"model_shapes: config field 'num_attention_heads' ({heads}){cfg.at} does not "
            f"divide 'hidden_size' ({hidden}), and there is no 'head_dim' to say how wide a "
            "head is"
        )


def _layer(cfg: _Config, index: int, hidden: int, itemsize: int) -> Iterator[_Param]:
    """One decoder layer's parameters: ``(name under the layer, shape, itemsize)``."""
    if cfg.model_type in _MLA:
        yield from _mla_attention(cfg, hidden, itemsize)
    else:
        yield from _gqa_attention(cfg, hidden, itemsize)
    experts = _layer_experts(cfg, index)
    if experts:
        yield from _moe(cfg, hidden, itemsize, experts)
    else:
        yield from _mlp("mlp", cfg.size("intermediate_size"), hidden, itemsize, cfg)
    yield "input_layernorm.weight", (hidden,), itemsize
    yield "post_attention_layernorm.weight", (hidden,), itemsize


def _layer_experts(cfg: _Config, index: int) -> int:
    """Routed experts of layer ``index`` (0: a dense MLP)."""
    if cfg.model_type == "mixtral":
        return cfg.first_size("num_local_experts", "num_experts")
    if cfg.model_type == "qwen3_moe":
        experts = cfg.first_size("num_experts", "num_local_experts", allow_zero=True)
        step = cfg.size("decoder_sparse_step", 1)
        dense_only = cfg.raw.get("mlp_only_layers") or ()
        sparse = experts > 0 and index not in dense_only and (index + 1) % step == 0
        return experts if sparse else 0
    if cfg.model_type in _MLA:
        first_dense = cfg.size("first_k_dense_replace", allow_zero=True)
        return cfg.first_size("n_routed_experts", "num_experts") if index >= first_dense else 0
    return 0


def _gqa_attention(cfg: _Config, hidden: int, itemsize: int) -> Iterator[_Param]:
    heads = cfg.size("num_attention_heads")
    kv_heads = cfg.size("num_key_value_heads", heads)
    head_dim = cfg.size("head_dim", hidden // heads)
    bias = cfg.model_type != "mistral" and cfg.flag("attention_bias")
    shapes = {
        "q_proj": (heads * head_dim, hidden),
        "k_proj": (kv_heads * head_dim, hidden),
        "v_proj": (kv_heads * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
    }
    for name, shape in shapes.items():
        yield f"self_attn.{name}.weight", shape, itemsize
        # qwen2 always biases q/k/v (never o); the others follow attention_bias.
        if bias or (cfg.model_type == "qwen2" and name != "o_proj"):
            yield f"self_attn.{name}.bias", (shape[0],), itemsize
    if cfg.model_type in ("qwen3", "qwen3_moe"):
        yield "self_attn.q_norm.weight", (head_dim,), itemsize
        yield "self_attn.k_norm.weight", (head_dim,), itemsize


def _mla_attention(cfg: _Config, hidden: int, itemsize: int) -> Iterator[_Param]:
    heads = cfg.size("num_attention_heads")
    nope = cfg.size("qk_nope_head_dim")
    rope = cfg.size("qk_rope_head_dim")
    v_dim = cfg.size("v_head_dim")
    kv_rank = cfg.size("kv_lora_rank")
    bias = cfg.flag("attention_bias")
    q_rank = cfg.need("q_lora_rank")
    if q_rank is None:
        yield "self_attn.q_proj.weight", (heads * (nope + rope), hidden), itemsize
    else:
        q_rank = cfg.size("q_lora_rank")
        yield "self_attn.q_a_proj.weight", (q_rank, hidden), itemsize
        if bias:
            yield "self_attn.q_a_proj.bias", (q_rank,), itemsize
        yield "self_attn.q_a_layernorm.weight", (q_rank,), itemsize
        yield "self_attn.q_b_proj.weight", (heads * (nope + rope), q_rank), itemsize
    yield "self_attn.kv_a_proj_with_mqa.weight", (kv_rank + rope, hidden), itemsize
    if bias:
        yield "self_attn.kv_a_proj_with_mqa.bias", (kv_rank + rope,), itemsize
    yield "self_attn.kv_a_layernorm.weight", (kv_rank,), itemsize
    yield "self_attn.kv_b_proj.weight", (heads * (nope + v_dim), kv_rank), itemsize
    yield "self_attn.o_proj.weight", (hidden, heads * v_dim), itemsize
    if bias:
        yield "self_attn.o_proj.bias", (hidden,), itemsize


def _mlp(
    prefix: str, intermediate: int, hidden: int, itemsize: int, cfg: _Config
) -> Iterator[_Param]:
    bias = cfg.model_type == "llama" and cfg.flag("mlp_bias")
    for name, shape in (
        ("gate_proj", (intermediate, hidden)),
        ("up_proj", (intermediate, hidden)),
        ("down_proj", (hidden, intermediate)),
    ):
        yield f"{prefix}.{name}.weight", shape, itemsize
        if bias:
            yield f"{prefix}.{name}.bias", (shape[0],), itemsize


def _moe(cfg: _Config, hidden: int, itemsize: int, experts: int) -> Iterator[_Param]:
    if cfg.model_type == "mixtral":
        size = cfg.size("intermediate_size")
    else:
        size = cfg.size("moe_intermediate_size")
    # transformers keeps DeepSeek-V3's router weight in float32 (_keep_in_fp32_modules_strict).
    router_size = 4 if cfg.model_type in _MLA else itemsize
    yield "mlp.gate.weight", (experts, hidden), router_size
    yield "mlp.experts.gate_up_proj", (experts, 2 * size, hidden), itemsize
    yield "mlp.experts.down_proj", (experts, hidden, size), itemsize
    if cfg.model_type in _MLA:
        shared = cfg.size("n_shared_experts", allow_zero=True)
        yield from _mlp("mlp.shared_experts", size * shared, hidden, itemsize, cfg)
