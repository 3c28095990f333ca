"""A built-in, learnable, deterministic token stream for the demo.

[Note: why a sparse Markov chain]
The demo must show a loss that clearly falls within a few dozen steps on a CPU, without
downloading anything. A first-order Markov chain in which every token has only a few possible
successors has an entropy rate far below ``ln(vocab)`` (about ``ln(branching)``), and a small
transformer learns its transition table quickly, so the loss drops from ~``ln(vocab)`` toward
that floor. Because the chain is known, the floor is known exactly (``loss_floor``), which
lets the demo say how far from optimal a run ended.

Each step's *global* batch is a pure function of ``(seed, step)``; a rank takes its contiguous
slice of rows. The stream is therefore identical for any world size or mesh layout, so runs on
2, 4 or 2×2 ranks see exactly the same data.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["MarkovStream"]

_GOLDEN = 0x9E3779B97F4A7C15
_MASK63 = (1 << 63) - 1


class MarkovStream:
    """Sequences of ``seq_len + 1`` tokens from a sparse first-order Markov chain."""

    def __init__(self, vocab: int, seq_len: int, seed: int = 0, branching: int = 4) -> None:
        if vocab < 2:
            raise ValueError(f"MarkovStream: vocab must be >= 2, got {vocab}")
        if seq_len < 1:
            raise ValueError(f"MarkovStream: seq_len must be >= 1, got {seq_len}")
        if not 1 <= branching <= vocab:
            raise ValueError(
                f"MarkovStream: branching must be in [1, vocab={vocab}], got {branching}"
            )
        self.vocab, self.seq_len, self.seed, self.branching = vocab, seq_len, seed, branching
        g = torch.Generator().manual_seed(seed & _MASK63)
        # successors[v] are the only tokens that may follow v; probs[v] their probabilities
        # (a flat Dirichlet draw, so some transitions are much likelier than others).
        # (Each row is cloned out of its permutation, so that the vocab-long permutations are
        # freed one by one instead of all held until the stack: vocab² · 8 bytes.)
        self.successors = torch.stack(
            [torch.randperm(vocab, generator=g)[:branching].clone() for _ in range(vocab)]
        )
        weights = -torch.rand(vocab, branching, generator=g, dtype=torch.float64).log()
        self.probs = weights / weights.sum(dim=1, keepdim=True)

    def batch(self, step: int, batch_size: int) -> Tensor:
        """The global batch of ``step``: (batch_size, seq_len + 1) int64, a pure function of
        (seed, step, batch_size)."""
        if batch_size < 1:
            raise ValueError(f"MarkovStream.batch: batch_size must be >= 1, got {batch_size}")
        g = torch.Generator().manual_seed((self.seed * _GOLDEN + step + 1) & _MASK63)
        out = torch.empty(batch_size, self.seq_len + 1, dtype=torch.int64)
        out[:, 0] = torch.randint(self.vocab, (batch_size,), generator=g)
        for t in range(self.seq_len):
            prev = out[:, t]
            pick = torch.multinomial(self.probs[prev], 1, generator=g).squeeze(1)
            out[:, t + 1] = self.successors[prev, pick]
        return out

    def shard(self, step: int, batch_size: int, rank: int, world_size: int) -> Tensor:
        """Rows ``[rank * b, (rank + 1) * b)`` of the global batch, ``b = batch_size /
        world_size``."""
        if batch_size % world_size:
            raise ValueError(
                f"MarkovStream.shard: batch_size ({batch_size}) must be divisible by the world"
                f" size ({world_size}); pick a multiple of {world_size}"
            )
        rows = batch_size // world_size
        return self.batch(step, batch_size)[rank * rows : (rank + 1) * rows]

    def transition_matrix(self) -> Tensor:
        """Dense (vocab, vocab) float64 transition matrix P[prev, next]."""
        dense = torch.zeros(self.vocab, self.vocab, dtype=torch.float64)
        dense.scatter_add_(1, self.successors, self.probs)
        return dense

    def loss_floor(self) -> float:
        """The best achievable mean next-token loss (nats) on this stream: each target's
        conditional entropy given its predecessor, averaged over the ``seq_len`` positions,
        with the predecessor's distribution propagated from the uniform first token.

        The propagation scatters each token's mass over its ``branching`` successors, never
        forming the dense transition matrix: that is ``vocab² · 8`` bytes, 20 GB at a GPT-2
        vocabulary of 50257, where this is ``vocab · branching`` per position."""
        row_entropy = -(self.probs * self.probs.log()).sum(dim=1)
        dist = torch.full((self.vocab,), 1.0 / self.vocab, dtype=torch.float64)
        targets = self.successors.flatten()
        total = 0.0
        for _ in range(self.seq_len):
            total += float(dist @ row_entropy)
            mass = (dist[:, None] * self.probs).flatten()
            dist = torch.zeros_like(dist).scatter_add_(0, targets, mass)
        return total / self.seq_len

    @property
    def uniform_loss(self) -> float:
        """The loss of a uniform guess, ``ln(vocab)``: where an untrained model starts."""
        return math.log(self.vocab)
