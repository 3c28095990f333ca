"""The per-head max-logit helpers against explicit float64 logits: the exact chunked one
(causal, masked, grouped-query, any chunk size), flex attention's max scores reduced per head,
and the log-sum-exp bound of a fused kernel (never below the maximum, at most ln(keys) above)."""

from __future__ import annotations

import math

import pytest
import torch
from _attention import explicit_max_logits

from dmuon_fsdp import max_logits, max_logits_from_lse, max_logits_from_scores


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("chunk_size", [None, 1, 3, 100])
def test_max_logits_is_the_largest_explicit_logit(causal: bool, chunk_size: int | None) -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 10, 8, generator=gen)
    k = torch.randn(3, 2, 12, 8, generator=gen)  # grouped-query: two query heads per key head
    mask = torch.rand(3, 1, 10, 12, generator=gen) > 0.3
    for m in (None, mask):
        want = explicit_max_logits(q, k, 0.3, causal, m)
        got = max_logits(q, k, 0.3, is_causal=causal, attn_mask=m, chunk_size=chunk_size)
        assert got.dtype == torch.float32 and got.shape == (4,)
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
    # More leading dimensions fold into the batch; the default scale is head_dim ** -0.5.
    got = max_logits(q.reshape(1, 3, 4, 10, 8), k.reshape(1, 3, 2, 12, 8), is_causal=causal)
    torch.testing.assert_close(
        got.double(), explicit_max_logits(q, k, 8**-0.5, causal, None), rtol=1e-6, atol=0
    )


def test_max_logits_rejects_what_it_cannot_read() -> None:
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 3, 5, 8)
    with pytest.raises(ValueError, match="multiple of the key heads"):
        max_logits(q, k)
    with pytest.raises(ValueError, match="same batch dimensions and head_dim"):
        max_logits(q, torch.randn(1, 4, 5, 6))
    with pytest.raises(ValueError, match="same batch dimensions and head_dim"):
        max_logits(torch.ones(8), torch.ones(8))  # no heads dim (it raised an unpacking error)
    with pytest.raises(TypeError, match="takes a boolean attn_mask"):
        max_logits(q, q, attn_mask=torch.zeros(5, 5))
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        max_logits(q, q, chunk_size=0)
    with pytest.raises(ValueError, match="is not a dimension of a tensor"):
        max_logits_from_lse(torch.zeros(2, 3), heads_dim=2)


def test_lse_bound_brackets_the_max_logit() -> None:
    # The log-sum-exp a fused kernel returns (torch's CPU flash attention), against the exact
    # maximum: never below it, above it by at most ln(keys per row).
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=gen) * 3 for _ in range(3))
    _, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    exact = max_logits(q, k, is_causal=True)
    bound = max_logits_from_lse(lse)
    assert (bound >= exact * (1 - 1e-6)).all() and (bound <= exact + math.log(16) + 1e-5).all()
    # Kernels write inf for rows with no key: those drop out.
    lse[0, 1, 3] = math.inf
    assert torch.equal(max_logits_from_lse(lse), bound)
    # Variable-length layout: (heads, total queries).
    assert torch.equal(max_logits_from_lse(lse.transpose(0, 1).reshape(4, -1)), bound)


def test_flex_max_scores_reduce_to_the_per_head_maximum() -> None:
    scores = torch.tensor([[[1.0, -math.inf], [5.0, 2.0]], [[3.0, 0.5], [-math.inf, -math.inf]]])
    assert torch.equal(max_logits_from_scores(scores), torch.tensor([3.0, 5.0]))
