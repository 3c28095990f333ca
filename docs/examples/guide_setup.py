"""The setup every guide's snippets continue from: a process group, a 1-D mesh, a small
Llama-shaped model (Hugging Face parameter names), the Muon predicate, a loss and a loader.

    torchrun --nproc-per-node 2 guide_setup.py    # NCCL when every rank has a GPU, else gloo

Copy it into a script, append a guide's snippets and launch that with ``torchrun``.
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard  # noqa: F401  (the snippets shard the model)

import dmuon  # noqa: F401

use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(
    os.environ.get("LOCAL_WORLD_SIZE", "1")
)
if use_cuda:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
dist.init_process_group("nccl" if use_cuda else "gloo")  # torchrun sets RANK, WORLD_SIZE, ...
device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
world_size = dist.get_world_size()
mesh = init_device_mesh(device.type, (world_size,))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism a rank holds a share of them.
        q, k, v = (
            proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


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
        self.input_layernorm = nn.RMSNorm(dim)
        self.self_attn = Attention(dim, heads)
        self.post_attention_layernorm = nn.RMSNorm(dim)
        self.mlp = MLP(dim, hidden)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLlama(nn.Module):
    """Blocks under ``layers.N`` (dmuon's default hook boundary), embedding, norm and head."""

    def __init__(self, vocab: int = 256, dim: int = 64, heads: int = 4, n_layers: int = 2):
        super().__init__()
        self.vocab = vocab
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, 3 * dim) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))

    def init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding | nn.RMSNorm):
                module.reset_parameters()


def predicate(name: str, p: nn.Parameter) -> bool:
    """The Muon matrices: every 2-D attention and MLP projection."""
    return "proj" in name and p.ndim == 2


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batches(
    count: int, rows: int = 4, seq: int = 32, seed: int | None = None
) -> list[tuple[Tensor, Tensor]]:
    """This rank's (inputs, targets) of a learnable sequence: ``t[i+1] = (5 t[i] + 3) mod 256``,
    drawn from ``seed`` (default: the rank; ranks given one seed read the same batches)."""
    g = torch.Generator().manual_seed(dist.get_rank() if seed is None else seed)
    out = []
    for _ in range(count):
        tokens = [torch.randint(0, 256, (rows, 1), generator=g)]
        for _ in range(seq):
            tokens.append((5 * tokens[-1] + 3) % 256)
        t = torch.cat(tokens, dim=1).to(device)
        out.append((t[:, :-1], t[:, 1:]))
    return out


torch.manual_seed(0)  # the same initial weights on every rank
model = TinyLlama().to(device)
loader = batches(8)
