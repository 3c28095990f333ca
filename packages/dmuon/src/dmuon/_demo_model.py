"""A small Llama-style decoder for the demo and the benchmarks.

Parameter names follow the Hugging Face Llama layout (``layers.N.self_attn.q_proj.weight``,
``layers.N.mlp.gate_proj.weight``, ...) so that the usual predicate
``lambda n, p: "proj" in n and p.ndim == 2`` selects exactly the attention and MLP matrices,
and the default hook boundary (the nearest ``layers.N`` ancestor) is one decoder layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "LlamaConfig",
    "LlamaStack",
    "TinyLlama",
    "causal_attention",
    "dedicated_matrix",
    "muon_predicate",
    "next_token_loss",
]


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of the model. ``intermediate`` is the SwiGLU width (gate/up output)."""

    vocab: int = 256
    hidden: int = 128
    intermediate: int = 384
    layers: int = 4
    heads: int = 4
    kv_heads: int | None = None  # grouped-query attention; None: as many as ``heads``
    seq_len: int = 64
    rope_theta: float = 10_000.0
    # Mixture-of-experts: experts per layer (0: a dense SwiGLU MLP). Each MoE layer holds a
    # router and torchtitan's expert stacks w1, w3 (E, I, H) and w2 (E, H, I); top-2 routing.
    experts: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab", "hidden", "intermediate", "layers", "heads", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(
                f"LlamaConfig.hidden ({self.hidden}) must be divisible by heads ({self.heads});"
                " pick a head count that divides the hidden size"
            )
        if self.experts < 0:
            raise ValueError(f"LlamaConfig.experts must be >= 0 (0: dense), got {self.experts}")
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise ValueError(
                f"LlamaConfig.kv_heads ({self.kv_heads}) must be >= 1 and divide heads"
                f" ({self.heads}); use a divisor of heads or None"
            )
        if (self.hidden // self.heads) % 2:
            raise ValueError(
                f"LlamaConfig: the head dim hidden/heads = {self.hidden // self.heads} must be even"
                " for rotary embeddings; change hidden or heads"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads


def muon_predicate(name: str, param: nn.Parameter) -> bool:
    """The predicate the demo hands to ``dedicate_params``: every 2-D projection matrix, and
    in an MoE model the router and the expert stacks (Muon per expert)."""
    if ".experts." in name:
        return param.ndim == 3
    return ("proj" in name or name.endswith("mlp.gate.weight")) and param.ndim == 2


def dedicated_matrix(name: str, param: nn.Parameter) -> bool:
    """A Muon parameter dmuon's owners broadcast and reduce: the 2-D ones (expert stacks stay
    where FSDP2 shards them and move as FSDP2 moves them, in every run alike)."""
    return muon_predicate(name, param) and param.ndim == 2


def _rope_tables(cfg: LlamaConfig) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / cfg.rope_theta ** (
        torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim
    )
    angles = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: (batch, heads, seq, head_dim); rotate the two halves of the head dim as Llama does.
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[: x.shape[-2]].to(x.dtype), sin[: x.shape[-2]].to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal scaled dot-product attention of (batch, heads, seq, head_dim) tensors, grouped-query
    when k and v have fewer heads: what ``Attention.attend`` runs unless replaced."""
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1]
    )


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        # (q, k, v) -> output, after RoPE; replaced by whoever needs more of the attention than
        # its output (the QK-clip demo and benchmark record each head's largest logit).
        self.attend: Callable[[Tensor, Tensor, Tensor], Tensor] = causal_attention
        kv_width = cfg.n_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, kv_width, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, kv_width, bias=False)
        self.o_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, _ = x.shape

        # Head counts are read off the projections' outputs: under tensor parallelism
        # (ColwiseParallel q/k/v) a rank holds heads / TP of them.
        def split(y: Tensor) -> Tensor:
            return y.view(b, t, -1, self.head_dim).transpose(1, 2)

        q = _apply_rope(split(self.q_proj(x)), cos, sin)
        k = _apply_rope(split(self.k_proj(x)), cos, sin)
        y = self.attend(q, k, split(self.v_proj(x)))
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """``experts`` SwiGLU experts as torchtitan stacks them: w1 (gate) and w3 (up) (E, I, H),
    w2 (down) (E, H, I)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        e, h, i = cfg.experts, cfg.hidden, cfg.intermediate
        self.w1 = nn.Parameter(torch.empty(e, i, h))
        self.w3 = nn.Parameter(torch.empty(e, i, h))
        self.w2 = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: Tensor, weights: Tensor) -> Tensor:
        """``x (T, H)``; ``weights (T, E)``, zero where a token did not pick the expert (every
        expert runs on every token, masked: fine at the demo's size)."""
        gate = torch.einsum("th,eih->tei", x, self.w1)
        up = torch.einsum("th,eih->tei", x, self.w3)
        out = torch.einsum("tei,ehi->teh", F.silu(gate) * up, self.w2)
        return torch.einsum("teh,te->th", out, weights)


class MoE(nn.Module):
    """A router (``gate``) choosing 2 experts per token, and the experts."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.experts = Experts(cfg)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        scores = self.gate(flat).softmax(-1)
        top = scores.topk(min(2, scores.shape[-1]), dim=-1).indices
        mask = torch.zeros_like(scores).scatter(1, top, 1.0)
        return self.experts(flat, scores * mask).view_as(x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden, eps=1e-6)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden, eps=1e-6)
        self.mlp: nn.Module = MoE(cfg) if cfg.experts else MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


@torch.no_grad()
def _init_weights(model: nn.Module, cfg: LlamaConfig) -> None:
    std = cfg.hidden**-0.5
    for name, p in model.named_parameters():
        if p.ndim >= 2:
            nn.init.normal_(p, std=std)
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.w2")):
                # Residual-branch outputs start small so that deep stacks begin near identity.
                p.div_((2 * cfg.layers) ** 0.5)
            elif name == "lm_head.weight":
                # Near-zero logits: training starts at the uniform guess, loss ≈ ln(vocab).
                p.mul_(std)
        else:
            nn.init.ones_(p)


class TinyLlama(nn.Module):
    """Embedding, ``layers`` of pre-norm decoder layers, final RMSNorm, untied LM head."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden, eps=1e-6)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        cos, sin = _rope_tables(cfg)
        # Not persistent: derived from the config, so they stay out of state dicts.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_weights(self, self.cfg)

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens: (batch, seq) int64 → logits (batch, seq, vocab)."""
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        return self.lm_head(self.norm(x))


class LlamaStack(nn.Module):
    """The decoder layers and final norm alone, on hidden states (no embedding, no head): the
    "Llama-style stack" that the step benchmark times."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden, eps=1e-6)
        cos, sin = _rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        _init_weights(self, cfg)

    def forward(self, x: Tensor) -> Tensor:
        """x: (batch, seq, hidden) → (batch, seq, hidden)."""
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        return self.norm(x)


def next_token_loss(model: nn.Module, tokens: Tensor) -> Tensor:
    """Mean next-token cross entropy; ``tokens`` holds seq_len + 1 tokens per row.

    A free function rather than a method: FSDP2 and dmuon hook ``forward``, so the model must
    be called, not a side method of it."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
