"""A tiny mixture-of-experts model for the expert-stack tests, in two layouts, and a
single-process reference that orthogonalises every expert matrix on its own.

``layout="torchtitan"``: each MoE layer holds three ``(E, out, in)`` stacks ``w1`` (gate),
``w3`` (up), ``w2`` (down). ``layout="hf"``: Hugging Face's fused ``gate_up_proj (E, 2I, H)``
(rows ``[gate; up]``) and ``down_proj (E, H, I)`` on an ``experts`` module that carries
transformers 5's layout flags. Routing is top-2 of a linear router, computed densely (every
expert on every token, masked), so that experts no token picked still get a zero gradient.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from dmuon_ns import NewtonSchulz

VOCAB, DIM, HIDDEN, HEADS = 32, 16, 8, 2


class Experts(nn.Module):
    def __init__(self, experts: int, layout: str) -> None:
        super().__init__()
        self.layout = layout
        if layout == "hf":
            self.is_transposed, self.is_concatenated, self.has_gate = False, True, True
            self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * HIDDEN, DIM) / DIM**0.5)
            self.down_proj = nn.Parameter(torch.randn(experts, DIM, HIDDEN) / HIDDEN**0.5)
        else:
            self.w1 = nn.Parameter(torch.randn(experts, HIDDEN, DIM) / DIM**0.5)
            self.w3 = nn.Parameter(torch.randn(experts, HIDDEN, DIM) / DIM**0.5)
            self.w2 = nn.Parameter(torch.randn(experts, DIM, HIDDEN) / HIDDEN**0.5)

    def forward(self, x: Tensor, weights: Tensor) -> Tensor:
        """``x (T, D)``, ``weights (T, E)`` (zero for experts a token did not pick)."""
        if self.layout == "hf":
            gate, up = _all_experts(self.gate_up_proj).chunk(2, dim=1)
            down = _all_experts(self.down_proj)
        else:
            gate, up, down = (_all_experts(w) for w in (self.w1, self.w3, self.w2))
        h = F.silu(torch.einsum("td,efd->tef", x, gate)) * torch.einsum("td,efd->tef", x, up)
        out = torch.einsum("tef,edf->ted", h, down)
        return torch.einsum("ted,te->td", out, weights)


def _all_experts(w: Tensor) -> Tensor:
    """Every expert's weights on this rank. Under expert parallelism (a stack sharded on dim 0
    by an EP mesh) each rank gathers the others' experts, and its gradient for them is partial
    (its own tokens'): the backward sums it over the EP ranks into each expert's holder, as
    the token all-to-all of a real EP forward does."""
    if not isinstance(w, DTensor):
        return w
    full = w.redistribute(w.device_mesh, [Replicate()] * w.device_mesh.ndim)
    return full.to_local(grad_placements=[Partial()] * w.device_mesh.ndim)


class MoELayer(nn.Module):
    def __init__(self, experts: int, layout: str) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.q_proj = nn.Linear(DIM, DIM, bias=False)
        self.o_proj = nn.Linear(DIM, DIM, bias=False)
        self.gate = nn.Linear(DIM, experts, bias=False)  # the router
        self.experts = Experts(experts, layout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.o_proj(F.silu(self.q_proj(self.norm(x))))
        flat = x.reshape(-1, DIM)
        scores = self.gate(flat).softmax(-1)
        top = scores.topk(min(2, scores.shape[-1]), dim=-1).indices
        mask = torch.zeros_like(scores).scatter(1, top, 1.0)
        return x + self.experts(flat, scores * mask).view_as(x)


class TinyMoE(nn.Module):
    def __init__(self, experts: int, layout: str, n_layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(MoELayer(experts, layout) for _ in range(n_layers))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_moe(experts: int, layout: str = "torchtitan", seed: int = 0) -> TinyMoE:
    torch.manual_seed(seed)
    return TinyMoE(experts, layout)


def moe_predicate(name: str, param: nn.Parameter) -> bool:
    """Attention, router and experts on Muon (as Moonlight and Kimi K2 do)."""
    return name.endswith(("q_proj.weight", "o_proj.weight", "gate.weight")) or ".experts." in name


def expert_matrices(name: str, t: Tensor, interleaved: bool = False) -> list[Tensor]:
    """The matrices the reference orthogonalises apart: each expert's slice, and the gate and
    up halves of a fused ``gate_up_proj`` apart (rows ``[gate; up]``, or with ``interleaved``
    the last dim alternating gate and up, as GPT-OSS stores them)."""
    if t.dim() == 2:
        return [t]
    slices = list(t.unbind(0))
    if not name.endswith("gate_up_proj"):
        return slices
    if interleaved:
        return [s[..., half::2] for s in slices for half in (0, 1)]
    return [half for s in slices for half in s.chunk(2, dim=0)]


class ReferenceMoE:
    """Muon per matrix (momentum, Nesterov, NS, 0.2·√max(m, n), decoupled decay) on the named
    parameters, every expert matrix on its own; AdamW on the rest."""

    def __init__(
        self,
        model: nn.Module,
        muon_names: set[str],
        hyper,
        *,
        float64: bool = False,
        interleaved: bool = False,
    ) -> None:
        params = dict(model.named_parameters())
        self.muon = [(n, p) for n, p in params.items() if n in muon_names]
        self.bufs = {n: torch.zeros_like(p) for n, p in self.muon}
        self.hyper = hyper
        self.float64 = float64
        self.interleaved = interleaved
        self.ns = NewtonSchulz(backend="gram", steps=hyper.ns_steps)
        self.adamw = torch.optim.AdamW(
            [p for n, p in params.items() if n not in muon_names],
            lr=hyper.adamw_lr,
            betas=hyper.adamw_betas,
            eps=hyper.adamw_eps,
            weight_decay=hyper.adamw_weight_decay,
        )

    def _orthogonalise(self, x: Tensor) -> Tensor:
        if self.float64:
            from dmuon_ns.testing import reference_newton_schulz

            return reference_newton_schulz(x.double(), steps=self.hyper.ns_steps).to(x.dtype)
        return self.ns(x)

    @torch.no_grad()
    def step(self) -> None:
        h = self.hyper
        for name, p in self.muon:
            buf = self.bufs[name]
            buf.mul_(h.momentum).add_(p.grad)
            x = p.grad + buf * h.momentum if h.nesterov else buf
            p.mul_(1 - h.lr * h.weight_decay)
            split = (expert_matrices(name, t, self.interleaved) for t in (p, x))
            for w, m in zip(*split):
                rows, cols = w.shape
                w.add_(self._orthogonalise(m) * (-h.lr * 0.2 * math.sqrt(max(rows, cols))))
        self.adamw.step()

    def zero_grad(self) -> None:
        for _, p in self.muon:
            p.grad = None
        self.adamw.zero_grad(set_to_none=True)
