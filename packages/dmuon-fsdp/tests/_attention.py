"""Tiny attention models for the QK-clip tests: multi-head, grouped-query (optionally with
q/k/v biases), an MLA-style latent attention and a QK-norm one, each attention reporting its
per-head maxima to a ``QKClip``; an independent float64 reference of the largest logits; the
check of a zero-learning-rate step; and the ways to put a model under dmuon (1-D, HSDP, TP, the
replicated path, q/k left to FSDP2).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _models import RMSNorm
from _sgd_train import make_mesh
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from dmuon_fsdp import (
    QKClip,
    QKRowMap,
    dedicate_params,
    dedicate_params_ddp,
    dedicated_params_of,
    max_logits,
    replicate,
)

VOCAB, DIM, HEADS, HEAD_DIM, KV_HEADS = 32, 32, 4, 8, 2
NOPE, ROPE, LATENT, VDIM = 8, 4, 16, 8  # the MLA-style attention
ROWS, SEQ = 8, 8
BIG = 16.0  # the first heads' query rows are scaled by this: their logits too
ZERO_LR = {"lr": 0.0, "weight_decay": 0.0, "adamw_lr": 0.0, "adamw_weight_decay": 0.0}


class Attention(nn.Module):
    """``kind``: "mha", "gqa" (KV_HEADS key heads; ``bias`` adds q/k/v biases), "mla" (a query
    head is [nope | rope] rows of ``q_proj``; its key [rows of ``kv_b_proj`` | a rotary part
    shared by every head]) or "qknorm" (multi-head with RMSNorm over each head of q and k)."""

    def __init__(self, kind: str, bias: bool = False) -> None:
        super().__init__()
        self.kind = kind
        if kind == "mla":
            self.q_proj = nn.Linear(DIM, HEADS * (NOPE + ROPE), bias=False)
            self.kv_a_proj = nn.Linear(DIM, LATENT + ROPE, bias=False)
            self.kv_b_proj = nn.Linear(LATENT, HEADS * (NOPE + VDIM), bias=False)
            self.o_proj = nn.Linear(HEADS * VDIM, DIM, bias=False)
        else:
            kv = KV_HEADS if kind == "gqa" else HEADS
            self.q_proj = nn.Linear(DIM, HEADS * HEAD_DIM, bias=bias)
            self.k_proj = nn.Linear(DIM, kv * HEAD_DIM, bias=bias)
            self.v_proj = nn.Linear(DIM, kv * HEAD_DIM, bias=bias)
            self.o_proj = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)
            if kind == "qknorm":
                self.q_norm = RMSNorm(HEAD_DIM)
                self.k_norm = RMSNorm(HEAD_DIM)
        self.clip: QKClip | None = None
        self.q_name = ""

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(batch, heads, seq, dim) each; -1 heads: a tensor-parallel rank holds its share."""
        b, t, _ = x.shape

        def heads(y: Tensor, width: int) -> Tensor:
            return y.view(b, t, -1, width).transpose(1, 2)

        if self.kind == "mla":
            q = heads(self.q_proj(x), NOPE + ROPE)
            latent, k_rope = self.kv_a_proj(x).split([LATENT, ROPE], dim=-1)
            k_nope, v = heads(self.kv_b_proj(latent), NOPE + VDIM).split([NOPE, VDIM], dim=-1)
            shared = k_rope[:, None].expand(-1, k_nope.shape[1], -1, -1)
            return q, torch.cat([k_nope, shared], dim=-1), v
        q, k, v = (heads(p(x), HEAD_DIM) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.kind == "qknorm":
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x)
        if self.clip is not None:
            self.clip.observe(self.q_name, max_logits(q, k, is_causal=True))
        gqa = k.shape[1] != q.shape[1]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Layer(nn.Module):
    def __init__(self, kind: str, bias: bool) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(DIM)
        self.attn = Attention(kind, bias)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.attn(self.attn_norm(x))


class ClipModel(nn.Module):
    def __init__(self, kind: str, bias: bool = False, n_layers: int = 2) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer(kind, bias) for _ in range(n_layers))
        self.norm = RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def big_heads(kind: str) -> list[int]:
    """The heads whose logits start BIG times larger: the first two (grouped-query: head 0
    alone, so that its group holds one head over τ and one under)."""
    return [0] if kind == "gqa" else [0, 1]


def build(kind: str, bias: bool = False, seed: int = 0) -> ClipModel:
    torch.manual_seed(seed)
    model = ClipModel(kind, bias)
    rows = NOPE + ROPE if kind == "mla" else HEAD_DIM
    with torch.no_grad():
        for layer in model.layers:
            for h in big_heads(kind):
                layer.attn.q_proj.weight[h * rows : (h + 1) * rows] *= BIG
                if layer.attn.q_proj.bias is not None:
                    layer.attn.q_proj.bias[h * rows : (h + 1) * rows] *= BIG
    return model


def spec(kind: str, prefix: str) -> dict[str, Any]:
    """``QKClip.add`` arguments of one attention."""
    if kind == "mla":
        return {
            "q": f"{prefix}.q_proj.weight",
            "k": f"{prefix}.kv_b_proj.weight",
            "num_heads": HEADS,
            "q_rows": QKRowMap((("q", NOPE), ("q_rope", ROPE))),
            "k_rows": QKRowMap((("k", NOPE), ("skip", VDIM))),
        }
    return {
        "q": f"{prefix}.q_proj.weight",
        "k": f"{prefix}.k_proj.weight",
        "num_heads": HEADS,
        "num_kv_heads": KV_HEADS if kind == "gqa" else HEADS,
    }


def attach(model: nn.Module, clip: QKClip, kind: str) -> None:
    for i, layer in enumerate(model.layers):  # type: ignore[union-attr]
        prefix = f"layers.{i}.attn"
        clip.add(**spec(kind, prefix))
        layer.attn.clip, layer.attn.q_name = clip, f"{prefix}.q_proj.weight"


# -- the independent reference ------------------------------------------------------------------


def reference_max_logits(
    model: ClipModel, tokens: Tensor, inputs: ClipModel | None = None
) -> Tensor:
    """(layers, heads) largest causal logit over the whole batch, in float64, from explicit
    logits of a plain single-process copy of ``model``. Each layer's attention reads the
    hidden states ``inputs`` (default: ``model``) computes: the clip scales the logits of the
    data it measured, and scaling one layer changes what the next one reads."""
    plain = model.double()
    source = plain if inputs is None else inputs.double()
    found = []
    with torch.no_grad():
        x = source.embed_tokens(tokens)
        for layer, feeding in zip(plain.layers, source.layers):
            q, k, _ = layer.attn.qkv(layer.attn_norm(x))
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
            t = tokens.shape[1]
            future = torch.ones(t, t, dtype=torch.bool).triu(1)
            found.append(logits.masked_fill(future, -math.inf).amax(dim=(0, 2, 3)))
            x = feeding(x)
    return torch.stack(found)


def plain_copy(kind: str, bias: bool, state: dict[str, Tensor]) -> ClipModel:
    model = ClipModel(kind, bias)
    model.load_state_dict(state)
    return model


def groups_of(kind: str) -> list[list[int]]:
    per = HEADS // KV_HEADS if kind == "gqa" else 1
    return [list(range(g, g + per)) for g in range(0, HEADS, per)]


def head_rows(kind: str, weight: str, head: int) -> slice:
    """The rows of ``head`` (a key head for k weights) in a weight of the test attention."""
    if kind == "mla":
        width = NOPE + ROPE if weight == "q_proj" else NOPE + VDIM
        return slice(head * width, (head + 1) * width)
    return slice(head * HEAD_DIM, (head + 1) * HEAD_DIM)


def check_clip(
    kind: str,
    bias: bool,
    tau: float,
    before: Tensor,
    observed: Tensor,
    initial: dict[str, Tensor],
    state: dict[str, Tensor],
    tokens: Tensor,
) -> tuple[int, int]:
    """The bar of a zero-learning-rate step; returns (groups clipped, groups left alone)."""
    # The statistic the clip used is the whole global batch's maximum.
    torch.testing.assert_close(observed.double(), before, rtol=1e-5, atol=0)
    after = reference_max_logits(plain_copy(kind, bias, state), tokens, build(kind, bias))
    assert (after <= tau * (1 + 1e-3)).all(), (after, tau)
    clipped = untouched = 0
    k_name = "kv_b_proj" if kind == "mla" else "k_proj"
    for layer in range(before.shape[0]):
        prefix = f"layers.{layer}.attn"
        for g, heads in enumerate(groups_of(kind)):
            peak = before[layer, heads].max()
            gamma = tau / peak if peak > tau else 1.0
            # Every head of the group scales by the group's γ; its largest lands on τ.
            torch.testing.assert_close(
                after[layer, heads], before[layer, heads] * gamma, rtol=1e-4, atol=0
            )
            names = [(f"{prefix}.q_proj", h) for h in heads] + [(f"{prefix}.{k_name}", g)]
            for module, h in names:
                for suffix in ("weight", "bias"):
                    key = f"{module}.{suffix}"
                    if key not in initial:
                        continue
                    rows = head_rows(kind, module.rsplit(".", 1)[1], h)
                    if peak <= tau:
                        assert torch.equal(state[key][rows], initial[key][rows]), (key, h)
                    else:
                        assert not torch.equal(state[key][rows], initial[key][rows]), (key, h)
            if peak > tau:
                assert abs(float(after[layer, heads].max()) - tau) <= 1e-3 * tau
                clipped += 1
            else:
                untouched += 1
        if kind == "mla":  # value rows and the shared rotary key are never touched
            for h in range(HEADS):
                value = slice(h * (NOPE + VDIM) + NOPE, (h + 1) * (NOPE + VDIM))
                key = f"{prefix}.kv_b_proj.weight"
                assert torch.equal(state[key][value], initial[key][value])
            key = f"{prefix}.kv_a_proj.weight"
            assert torch.equal(state[key], initial[key])
    for key in initial:  # nothing but q/k rows changed
        if not any(p in key for p in ("q_proj", "k_proj", "kv_b_proj")):
            assert torch.equal(state[key], initial[key]), key
    return clipped, untouched


def threshold(kind: str, before: Tensor) -> float:
    """A τ between the groups with a big head and the others (geometric middle)."""
    big = [g for g in groups_of(kind) if set(g) & set(big_heads(kind))]
    small = [g for g in groups_of(kind) if not set(g) & set(big_heads(kind))]
    low = max(float(before[:, g].max()) for g in small)
    high = min(float(before[layer, g].max()) for g in big for layer in range(before.shape[0]))
    assert low < high, (low, high)
    return math.sqrt(low * high)


def explicit_max_logits(
    q: Tensor, k: Tensor, scale: float, causal: bool, mask: Tensor | None
) -> Tensor:
    k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    logits = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(1)
        logits = logits.masked_fill(future, -math.inf)
    if mask is not None:
        logits = logits.masked_fill(~mask, -math.inf)
    return logits.movedim(-3, 0).reshape(q.shape[-3], -1).amax(dim=1)


# -- under dmuon ---------------------------------------------------------------------------------


def _predicate(path: str):
    def muon(name: str, param: nn.Parameter) -> bool:
        if "proj" not in name or param.ndim != 2:
            return False
        # "fsdp": q/k weights stay with FSDP2 (AdamW on local shards).
        return path != "fsdp" or not any(p in name for p in ("q_proj", "k_proj", "kv_b_proj"))

    return muon


def _tp_plan() -> dict[str, Any]:
    """Megatron-style: q/k/v split their heads (output rows), o its input."""
    colwise = {f"attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
    return {**colwise, "attn.o_proj": RowwiseParallel()}


def wrap(model: nn.Module, path: str, world_size: int, device: str = "cpu") -> tuple[Any, int, int]:
    """dmuon on ``path`` ("1d", "hsdp" (2 replicas), "tp" (degree 2), "ddp", or "fsdp": 1-D
    with the q/k weights left to FSDP2); returns (runtime, this rank's data-parallel index,
    data-parallel size)."""
    rank = dist.get_rank()
    if path == "ddp":
        mesh = init_device_mesh("cpu", (world_size,))
        runtime = dedicate_params_ddp(model, mesh, _predicate(path), small_param_threshold=0)
        replicate(model, mesh)
        return runtime, rank, world_size
    if path == "tp":
        mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
        for layer in model.layers:  # type: ignore[union-attr]
            parallelize_module(layer, mesh["tp"], _tp_plan())
        fsdp_mesh = dp_mesh = mesh["dp"]
        replicate_mesh = None
    else:
        fsdp_mesh, dp_mesh, replicate_mesh = make_mesh(
            world_size, 2 if path == "hsdp" else 1, device
        )
    runtime = dedicate_params(
        model,
        dp_mesh,
        _predicate(path),
        replicate_mesh=replicate_mesh,
        small_param_threshold=0,
    )
    ignored = dedicated_params_of(model)
    for layer in model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=fsdp_mesh, ignored_params=ignored)
    fully_shard(model, mesh=fsdp_mesh, ignored_params=ignored)
    layout = runtime.layout
    dp_index = layout.coord.replicate * layout.shard_size + layout.coord.shard
    return runtime, dp_index, layout.world_size
