"""A tiny Llama-like model for the runtime tests (and anyone else's): token embedding, N
blocks under ``layers.N`` with attention ``q/k/v/o_proj`` and a SwiGLU MLP
``gate/up/down_proj`` (bias-free ``nn.Linear``), RMSNorm, and an untied head.

Everything is float32 and seeded, so two builds with the same seed are identical: the tests
compare a dmuon model against a plain single-process copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from dmuon_fsdp import dedicated_params_of

VOCAB = 32
DIM = 16
HEADS = 2
HIDDEN = 24
SEQ = 8


def muon_predicate(name: str, param: nn.Parameter) -> bool:
    return "proj" in name and param.ndim == 2


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        head_dim = d // self.heads
        # -1 heads: under tensor parallelism each rank holds a share of the heads.
        q, k, v = (
            p(x).view(b, t, -1, head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp_norm = RMSNorm(dim)
        self.mlp = MLP(dim, hidden)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nn.Module):
    def __init__(
        self,
        n_layers: int = 2,
        vocab: int = VOCAB,
        dim: int = DIM,
        hidden: int = HIDDEN,
        checkpoint: bool | str = False,
        tie: bool = False,
        share_mlp: bool = False,
    ) -> None:
        super().__init__()
        # Activation checkpointing per layer: True (non-reentrant) or "reentrant".
        self.checkpoint = checkpoint
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, HEADS, hidden) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tie:  # one matrix for the embedding and the head (registered under both names)
            self.lm_head.weight = self.embed_tokens.weight
        if share_mlp:  # every layer calls layer 0's MLP
            for layer in self.layers[1:]:
                layer.mlp = self.layers[0].mlp

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            if self.checkpoint:
                reentrant = self.checkpoint == "reentrant"
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=reentrant)
            else:
                x = layer(x)
        return self.lm_head(self.norm(x))


def build(
    seed: int = 0,
    n_layers: int = 2,
    checkpoint: bool | str = False,
    tie: bool = False,
    share_mlp: bool = False,
    hidden: int = HIDDEN,
) -> TinyLlama:
    torch.manual_seed(seed)
    return TinyLlama(n_layers, hidden=hidden, checkpoint=checkpoint, tie=tie, share_mlp=share_mlp)


def batch(step: int, rows: int, seq: int = SEQ, vocab: int = VOCAB) -> Tensor:
    """Deterministic, learnable token batch for ``step`` (same on every rank; shard it by
    rows): each row follows ``t[i+1] = (3·t[i] + 1) mod vocab`` from a random start."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, vocab, (rows, 1), generator=g)
    cols = [start]
    for _ in range(seq):
        cols.append((3 * cols[-1] + 1) % vocab)
    return torch.cat(cols, dim=1)


def loss_fn(model: nn.Module, tokens: Tensor) -> Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def muon_numel(model: nn.Module) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if muon_predicate(n, p))


def reduce_numel(model: nn.Module) -> int:
    """The elements one reduce round carries: every Muon element and one presence flag per
    matrix (see [Note: a parameter without a gradient] in dmuon_fsdp.runtime._collectives)."""
    return sum(p.numel() + 1 for n, p in model.named_parameters() if muon_predicate(n, p))


def tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Megatron-style tensor parallelism of every block: q/k/v and gate/up column-wise, o and
    down row-wise (the residual stream stays whole on every TP rank)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {
        **{f"attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
        "attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.layers:  # type: ignore[union-attr]
        parallelize_module(layer, tp_mesh, plan)


def shard_layers_then_root(model: nn.Module, mesh: DeviceMesh) -> None:
    """``fully_shard`` each of ``model.layers``, then the root: the required order, after
    ``dedicate_params``, each call leaving the dedicated parameters alone."""
    dedicated = dedicated_params_of(model)
    for layer in model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh, ignored_params=dedicated)
    fully_shard(model, mesh=mesh, ignored_params=dedicated)


class AllGatherWeight(torch.Tensor):
    """A weight whose class customises FSDP2's all-gather, as torchao's float8 all-gather
    weight (``WeightWithDynamicFloat8CastTensor``, from ``convert_to_float8_training`` under
    ``enable_fsdp_float8_all_gather=True``) does, without float8: a wrapper around a plain
    tensor, which every operation unwraps (results are plain tensors but for the operations
    FSDP2 shards and copies with, which keep the class), with no storage of its own, and
    ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` (torchao sends the float8 cast; this one
    the values as they are, so a model holding it computes what a plain one does)."""

    _KEEP = frozenset(
        {
            torch.ops.aten.empty_like.default,
            torch.ops.aten.new_zeros.default,
            torch.ops.aten.slice.Tensor,
            torch.ops.aten.copy_.default,
            torch.ops.aten.view.default,
            torch.ops.aten.as_strided.default,
            torch.ops.aten._to_copy.default,
            torch.ops.aten.split.Tensor,
            torch.ops.aten.clone.default,
        }
    )

    @staticmethod
    def __new__(cls, tensor: Tensor) -> AllGatherWeight:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: Tensor) -> None:
        self._tensor = tensor

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        from torch.utils._pytree import tree_map_only

        if func is torch.ops.aten.detach.default:
            return cls(args[0]._tensor)
        args, kwargs = tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        return tree_map_only(torch.Tensor, cls, out) if func in cls._KEEP else out

    def __tensor_flatten__(self):  # type: ignore[no-untyped-def]
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner, spec, size, stride):  # type: ignore[no-untyped-def]
        return AllGatherWeight(inner["_tensor"])

    def fsdp_pre_all_gather(self, mesh):  # type: ignore[no-untyped-def]
        return (self._tensor,), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):  # type: ignore[no-untyped-def]
        (data,) = outputs
        if out is not None:
            return None
        return data, (data,)


def wrap_all_gather(module: nn.Module, name: str) -> None:
    """Give ``module``'s parameter ``name`` the class :class:`AllGatherWeight`, as
    ``convert_to_float8_training(..., config=Float8LinearConfig(enable_fsdp_float8_all_gather=
    True))`` gives each weight it converts."""
    weight = getattr(module, name)
    setattr(module, name, nn.Parameter(AllGatherWeight(weight.detach()), weight.requires_grad))
