"""Per-head maximum attention logits, the statistic QK-clip acts on, from the attention a
model runs.

[Note: three ways to the max logit]
QK-clip needs, per head, ``S_max``: the largest pre-softmax logit ``scale · q_i · k_j`` over every
query, every key it may attend to and every sequence of the step. Fused attention kernels never
materialise the logits, so there are three ways to it, by what the kernel returns:

- :func:`max_logits` (exact, any attention): recomputes ``Q Kᵀ`` in query chunks, in float32,
  under ``no_grad``. Cost: one extra ``Q Kᵀ`` per attention, ``2 · B · H · Lq · Lk · D`` flops
  in float32 (as much arithmetic as one of the attention forward's two matmuls, at float32
  speed, and no backward), and ``chunk_size · Lk`` float32 logits per (batch, head) in memory
  at a time. Exact up to the float32 rounding of the dot products (TF32 matmuls, when
  enabled, round their inputs further).
- :func:`max_logits_from_scores` (exact, flex attention): ``flex_attention(...,
  return_aux=AuxRequest(max_scores=True))`` returns each query row's maximum score after
  ``score_mod`` and masking; reducing it over batch and rows costs nothing beyond the
  attention. Flex attention computes them on CUDA only (torch 2.13 raises on the CPU).
- :func:`max_logits_from_lse` (an upper bound, flash/efficient/cuDNN kernels, flash-attn,
  flex): kernels that train return each row's log-sum-exp ``lse_i = log Σ_j exp(s_ij)``, and
  ``max_j s_ij ≤ lse_i ≤ max_j s_ij + ln n_i`` for a row with ``n_i`` keys. So ``max(lse)`` is
  never below ``S_max`` (a clip computed from it never lets a head through above τ) and is
  above it by at most ``ln n`` (``ln 131072 ≈ 11.8``: at S = τ = 100 the clip then shrinks the
  logits by up to about 11 % more than needed). The gap vanishes when one key dominates its row,
  which is exactly the regime that explodes. Free: the kernel computes it anyway.

Each returns a float32 tensor of shape ``(heads,)``, detached, made without a host sync, ready
for :meth:`QKClip.observe`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._checks import is_int

__all__ = ["max_logits", "max_logits_from_lse", "max_logits_from_scores"]

# Logits one chunk may hold (float32 elements): 64 MiB.
_CHUNK_ELEMENTS = 2**24


def max_logits(
    q: Tensor,
    k: Tensor,
    scale: float | None = None,
    *,
    is_causal: bool = False,
    attn_mask: Tensor | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    """The exact largest logit ``scale · q·k`` of every query head, over batch and positions.

    ``q`` is ``(batch, heads, Lq, head_dim)`` and ``k`` ``(batch, kv_heads, Lk, head_dim)`` as
    for ``F.scaled_dot_product_attention`` (more leading dimensions are folded into the batch);
    with fewer key heads, query head ``h`` reads key head ``h // (heads / kv_heads)``, as
    ``enable_gqa=True`` does. ``scale`` defaults to ``head_dim ** -0.5``. ``is_causal`` masks
    keys after their query (top-left aligned, like SDPA); ``attn_mask`` is a boolean mask
    broadcastable to ``(batch, heads, Lq, Lk)``, True where a query may attend. A head whose
    every logit is masked reports ``-inf``. ``chunk_size`` queries are done at a time (default:
    64 MiB of float32 logits per chunk). Costs one extra ``Q Kᵀ`` in float32 and no backward;
    see [Note: three ways to the max logit].

    Args:
        q: the queries, ``(..., heads, Lq, head_dim)``, as given to the attention (after any
            rotary embedding); read, never differentiated.
        k: the keys, ``(..., kv_heads, Lk, head_dim)`` with ``q``'s leading dimensions and
            ``head_dim``, ``kv_heads`` dividing ``heads``; otherwise ``ValueError``.
        scale: the factor of the logits, the attention's softmax scale; ``None``:
            ``head_dim ** -0.5``, SDPA's default.
        is_causal: ``True`` masks every key after its query (top-left aligned, as SDPA's
            ``is_causal``); ``False`` masks nothing.
        attn_mask: a boolean tensor broadcastable to ``(batch, heads, Lq, Lk)``, ``True``
            where a query may attend; ``None``: no mask. Another dtype raises ``TypeError``
            (an additive mask becomes ``mask == 0``).
        chunk_size: how many query positions are computed at a time, an int >= 1 (it bounds
            the float32 logits held at once); ``None``: as many as fit in 64 MiB.
    """
    if q.ndim < 3 or k.ndim < 3 or q.shape[-1] != k.shape[-1] or q.shape[:-3] != k.shape[:-3]:
        raise ValueError(
            f"max_logits: q {tuple(q.shape)} and k {tuple(k.shape)} must be (batch, heads, L,"
            " head_dim) with the same batch dimensions and head_dim, as for"
            " F.scaled_dot_product_attention"
        )
    heads, lq, dim = q.shape[-3:]
    kv_heads, lk = k.shape[-3], k.shape[-2]
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(
            f"max_logits: q has {heads} heads and k {kv_heads}; the query heads must be a"
            " multiple of the key heads (grouped-query attention)"
        )
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        raise TypeError(
            f"max_logits takes a boolean attn_mask (True: may attend), got {attn_mask.dtype};"
            " for an additive mask of 0 and -inf (or a large negative value) pass"
            " attn_mask=(mask == 0)"
        )
    if chunk_size is not None and (not is_int(chunk_size) or chunk_size < 1):
        raise ValueError(f"max_logits: chunk_size must be a positive int, got {chunk_size!r}")
    group = heads // kv_heads
    scale = dim**-0.5 if scale is None else float(scale)
    with torch.no_grad():
        q5 = q.detach().reshape(-1, kv_heads, group, lq, dim)
        batch = q5.shape[0]
        # One key head serves `group` query heads: a broadcast, not a copy.
        kt = k.detach().reshape(batch, kv_heads, 1, lk, dim).transpose(-1, -2).float()
        mask = None
        if attn_mask is not None:
            mask = torch.broadcast_to(attn_mask, (batch, heads, lq, lk))
        if chunk_size is None:
            chunk_size = max(1, _CHUNK_ELEMENTS // max(1, batch * heads * lk))
        best = torch.full((kv_heads, group), -math.inf, dtype=torch.float32, device=q.device)
        keys = torch.arange(lk, device=q.device)
        for start in range(0, lq, chunk_size):
            stop = min(lq, start + chunk_size)
            logits = torch.matmul(q5[..., start:stop, :].float(), kt).mul_(scale)
            if is_causal:
                rows = torch.arange(start, stop, device=q.device)
                logits.masked_fill_(keys[None, :] > rows[:, None], -math.inf)
            if mask is not None:
                part = mask[:, :, start:stop, :].reshape(batch, kv_heads, group, stop - start, lk)
                logits.masked_fill_(~part, -math.inf)
            torch.maximum(best, logits.amax(dim=(0, 3, 4)), out=best)
        return best.reshape(heads)


def max_logits_from_scores(max_scores: Tensor, heads_dim: int = -2) -> Tensor:
    """Per-head maximum logit from flex attention's per-row maxima (exact): ``max_scores`` is
    ``aux.max_scores`` of ``flex_attention(..., return_aux=AuxRequest(max_scores=True))``,
    ``(batch, heads, L)``; rows with nothing to attend to hold ``-inf`` and drop out. Reduced
    over every dimension but ``heads_dim``.

    Args:
        max_scores: flex attention's per-row maxima, any shape with one dimension of heads
            (``(batch, heads, L)`` as flex returns them).
        heads_dim: the index of the heads dimension of ``max_scores`` (negative counts from
            the end); one out of range raises ``ValueError``.
    """
    return _reduce_but(max_scores, heads_dim, "max_logits_from_scores")


def max_logits_from_lse(lse: Tensor, heads_dim: int = -2) -> Tensor:
    """A per-head upper bound of the maximum logit from the log-sum-exp a fused attention
    kernel returns: ``max(lse) ≥ S_max``, above it by at most ``ln`` of the keys per row (see
    [Note: three ways to the max logit]). ``lse`` is ``(batch, heads, L)`` (the flash,
    efficient and cuDNN SDPA kernels, flash-attn's ``softmax_lse``, flex's
    ``AuxRequest(lse=True)``) or ``(heads, total_q)`` (variable-length kernels); both have heads
    at ``heads_dim=-2``. Entries that are not finite, which kernels write for rows with no key
    to attend to, drop out.

    Args:
        lse: the kernel's log-sum-exp of each query row, any shape with one dimension of heads.
        heads_dim: the index of the heads dimension of ``lse`` (negative counts from the end);
            one out of range raises ``ValueError``.
    """
    finite = torch.where(torch.isfinite(lse), lse, -math.inf)
    return _reduce_but(finite, heads_dim, "max_logits_from_lse")


def _reduce_but(values: Tensor, heads_dim: int, caller: str) -> Tensor:
    if not -values.dim() <= heads_dim < values.dim():
        raise ValueError(
            f"{caller}: heads_dim={heads_dim} is not a dimension of a tensor of shape"
            f" {tuple(values.shape)}; pass the index of the heads dimension"
        )
    per_head = values.detach().movedim(heads_dim, 0)
    return per_head.reshape(per_head.shape[0], -1).float().amax(dim=1)
