"""A single-process reference for the distributed optimizer tests: a plain model, the Muon
Muon math (momentum, Nesterov, NS, Moonlight lr scaling, decoupled decay) written out per matrix on the full gradient (dmuon-ns for NS, one call
per matrix), and ``torch.optim.AdamW`` for every other parameter. It shares no code with
``dmuon_fsdp``: a bug in the optimizer's batching, lr scaling, momentum or routing shows up as
a loss mismatch.

The data is a learnable synthetic stream: each sequence follows ``t[i+1] = (a·t[i] + b) mod V``
with one fixed (a, b) and a random start, so next-token loss falls quickly from ln V.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dmuon_ns import NewtonSchulz


@dataclass(frozen=True)
class Hyper:
    """Optimizer hyperparameters shared by dmuon's ``Muon`` and the reference."""

    lr: float = 0.02
    momentum: float = 0.95
    weight_decay: float = 0.01
    nesterov: bool = True
    ns_steps: int = 5
    adamw_lr: float = 3e-3
    adamw_betas: tuple[float, float] = (0.9, 0.95)
    adamw_eps: float = 1e-8
    adamw_weight_decay: float = 0.01

    def muon_kwargs(self) -> dict:
        return asdict(self)


class ReferenceMuonAdamW:
    """Muon on the named matrices (a convolution kernel flattened to ``(out, in·k)``),
    torch.optim.AdamW on every other trainable parameter."""

    def __init__(self, model: nn.Module, muon_names: Iterable[str], hyper: Hyper) -> None:
        names = set(muon_names)
        params = dict(model.named_parameters())
        unknown = names - set(params)
        assert not unknown, f"reference: no parameters named {sorted(unknown)}"
        self.hyper = hyper
        self.muon = [(n, p) for n, p in params.items() if n in names]
        self.bufs = {n: torch.zeros_like(p) for n, p in self.muon}
        self.ns = NewtonSchulz(backend="gram", steps=hyper.ns_steps)
        self.adamw = torch.optim.AdamW(
            [p for n, p in params.items() if n not in names and p.requires_grad],
            lr=hyper.adamw_lr,
            betas=hyper.adamw_betas,
            eps=hyper.adamw_eps,
            weight_decay=hyper.adamw_weight_decay,
        )

    @torch.no_grad()
    def step(self) -> None:
        h = self.hyper
        for name, p in self.muon:
            if p.grad is None:
                continue
            buf = self.bufs[name]
            # dmuon rounds every product on its own (no fused multiply-add), so the products
            # here are separate ops too (torch.add with alpha would round once).
            buf.mul_(h.momentum).add_(p.grad)
            x = p.grad + buf * h.momentum if h.nesterov else buf
            # a convolution kernel is one (out, in·k) matrix, as Keller Jordan's Muon has it
            x = x.flatten(1)
            update = self.ns(x).view_as(p)
            rows, cols = x.shape
            p.mul_(1 - h.lr * h.weight_decay)
            p.add_(update * (-h.lr * 0.2 * math.sqrt(max(rows, cols))))
        self.adamw.step()

    def zero_grad(self) -> None:
        for _, p in self.muon:
            p.grad = None
        self.adamw.zero_grad(set_to_none=True)


def make_batch(step: int, batch: int, seq_len: int, vocab: int) -> Tensor:
    """``batch`` sequences of ``seq_len + 1`` tokens for training step ``step``."""
    gen = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    a, b = 5, 3
    cols = [start]
    for _ in range(seq_len):
        cols.append((a * cols[-1] + b) % vocab)
    return torch.cat(cols, dim=1)


def shard(tokens: Tensor, rank: int, world_size: int) -> Tensor:
    """This rank's equal share of a global batch."""
    assert tokens.shape[0] % world_size == 0, "global batch must divide by the world size"
    per = tokens.shape[0] // world_size
    return tokens[rank * per : (rank + 1) * per]


def lm_loss(model: Callable[[Tensor], Tensor], tokens: Tensor) -> Tensor:
    """Mean next-token cross-entropy of ``model`` (tokens → logits) on ``tokens``."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def train_reference(
    model: nn.Module,
    muon_names: Iterable[str],
    hyper: Hyper,
    steps: int,
    batch: int,
    seq_len: int,
    vocab: int,
) -> list[float]:
    """Losses of ``steps`` single-process steps on the full global batch."""
    opt = ReferenceMuonAdamW(model, muon_names, hyper)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = lm_loss(model, make_batch(step, batch, seq_len, vocab))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses
