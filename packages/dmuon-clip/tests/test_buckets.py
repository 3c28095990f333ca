"""Segmented clip on CPU (torch path): every bucket equals torch.nn.utils.clip_grad_norm_."""

from __future__ import annotations

import math

import pytest
import torch
from _fake import FakeMuon
from _reference import assert_close, float64_norm, torch_clip

from dmuon_clip import GradClipBucket, clip_grad_norm_, clip_grad_norm_buckets_

# fp32 results may differ from torch's by the rounding of a different summation order: the
# norm of norms vs. one sum of squares. A few fp32 ulps (eps = 1.2e-7) cover it.
RTOL = 1e-6


def _grads(seed: int, shapes, scale: float = 1.0, dtype=torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=gen) * scale).to(dtype) for s in shapes]


SHAPES = {"a": [(7, 5), (13,), (4, 4, 3)], "b": [(31, 9), (2,)], "c": [(6, 6)]}


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 3.0, 1.0])
@pytest.mark.parametrize("max_norm", [0.5, 1e3, None])
def test_each_bucket_matches_torch(norm_type: float, max_norm: float | None) -> None:
    grads = {n: _grads(i, s) for i, (n, s) in enumerate(SHAPES.items())}
    refs = {n: torch_clip(g, max_norm, norm_type) for n, g in grads.items()}
    before = {n: [t.clone() for t in g] for n, g in grads.items()}
    result = clip_grad_norm_buckets_(
        [GradClipBucket(n, g) for n, g in grads.items()], max_norm, norm_type=norm_type
    )
    for name, (ref_total, ref_grads) in refs.items():
        stats = result[name]
        assert_close(stats.total_norm, ref_total, rtol=RTOL)
        if max_norm is None:
            for got, old in zip(grads[name], before[name]):
                assert torch.equal(got, old)
        else:
            for got, want in zip(grads[name], ref_grads):
                assert_close(got, want, rtol=RTOL)
        assert stats.param_count == len(grads[name])
        assert stats.max_norm == max_norm
        assert not stats.found_inf
        expected_clipped = max_norm is not None and float(ref_total) > max_norm
        assert bool(stats.clipped) == expected_clipped
        if not expected_clipped:
            assert float(stats.clip_coef) == 1.0
    every = [t for g in before.values() for t in g]
    assert float(result.total_norm) == pytest.approx(float64_norm(every, norm_type), rel=RTOL)
    assert not result.fastpath and result.fallback_reason


def test_clip_coefficient_is_torch_formula_bit_for_bit() -> None:
    grads = _grads(3, [(40, 30)], scale=2.0)
    total, ref = torch_clip(grads, 0.75)
    result = clip_grad_norm_buckets_([GradClipBucket("m", grads)], 0.75)
    assert torch.equal(result["m"].total_norm, total)
    assert torch.equal(result["m"].clip_coef, torch.clamp(0.75 / (total + 1e-6), max=1.0))
    assert torch.equal(grads[0], ref[0])


def test_per_bucket_max_norm_mapping() -> None:
    grads = {n: _grads(i, s) for i, (n, s) in enumerate(SHAPES.items())}
    limits = {"a": 0.1, "b": None, "c": 0.2}
    refs = {n: torch_clip(grads[n], limits[n]) for n in grads}
    result = clip_grad_norm_buckets_([GradClipBucket(n, g) for n, g in grads.items()], limits)
    for n, (_, ref_grads) in refs.items():
        assert result[n].max_norm == limits[n]
        for got, want in zip(grads[n], ref_grads):
            assert_close(got, want, rtol=RTOL)
    assert not result["b"].clipped and result["a"].clipped


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_nonfinite_bucket_is_flagged_untouched_and_isolated(bad: float, norm_type: float) -> None:
    good = _grads(1, [(8, 8), (5,)], scale=3.0)
    poisoned = _grads(2, [(4, 4)])
    poisoned[0][1, 2] = bad
    poisoned_before = poisoned[0].clone()
    _, good_ref = torch_clip(good, 1.0, norm_type)
    result = clip_grad_norm_buckets_(
        [GradClipBucket("good", good), GradClipBucket("bad", poisoned)], 1.0, norm_type=norm_type
    )
    assert bool(result["bad"].found_inf) and not bool(result["bad"].clipped)
    assert float(result["bad"].clip_coef) == 1.0
    assert_close(poisoned[0], poisoned_before, rtol=0, equal_nan=True)
    assert not bool(result["good"].found_inf) and bool(result["good"].clipped)
    for got, want in zip(good, good_ref):
        assert_close(got, want, rtol=RTOL)
    assert not math.isfinite(float(result.total_norm))


def test_fallback_inputs_sparse_noncontiguous_float64_empty() -> None:
    dense = torch.randn(6, 5, dtype=torch.float64)
    strided = torch.randn(5, 8).t()
    sparse = torch.sparse_coo_tensor(
        torch.tensor([[0, 1, 1], [2, 0, 0]]),
        torch.tensor([3.0, -4.0, 1.0]),
        (2, 3),
        check_invariants=True,
    )
    empty = torch.empty(0, 3)
    ref_inputs = [dense, strided.contiguous(), sparse.to_dense(), empty]
    total, ref = torch_clip(ref_inputs, 0.5)
    grads = [dense, strided, sparse, empty]
    result = clip_grad_norm_buckets_([GradClipBucket("mixed", grads)], 0.5)
    assert_close(result.total_norm.double(), total, rtol=RTOL)
    assert_close(dense, ref[0], rtol=RTOL)
    assert_close(strided, ref[1], rtol=RTOL)
    assert_close(sparse.to_dense(), ref[2], rtol=RTOL)
    assert result["mixed"].param_count == 4


def test_the_inf_norm_skips_empty_tensors() -> None:
    # An FSDP2 shard of a dimension smaller than the world is empty on some ranks; the
    # inf-norm of an empty tensor is an error in torch, and it adds nothing to the maximum.
    dense = torch.tensor([[1.0, -3.0], [2.0, 0.5]])
    before = dense.clone()
    empty = torch.empty(0, 4)
    no_values = torch.sparse_coo_tensor(
        torch.empty(2, 0, dtype=torch.long), torch.empty(0), (2, 3), check_invariants=True
    )
    result = clip_grad_norm_buckets_(
        [GradClipBucket("b", [dense, empty, no_values])], 1.5, norm_type=math.inf
    )
    assert float(result.total_norm) == 3.0
    coef = result["b"].clip_coef
    assert 0.0 < float(coef) < 1.0
    assert torch.equal(dense, before * coef)


def test_reduce_false_and_empty_buckets_without_group() -> None:
    grads = _grads(5, [(3, 3)])
    result = clip_grad_norm_buckets_(
        [GradClipBucket("local", grads, reduce=False), GradClipBucket("none", [])], 1.0
    )
    assert float(result["none"].total_norm) == 0.0 and float(result["none"].clip_coef) == 1.0
    assert result["local"].total_norm.device.type == "cpu"
    assert [s.name for s in result.bucket_stats] == ["local", "none"]


def test_no_buckets() -> None:
    result = clip_grad_norm_buckets_([], 1.0)
    assert result.bucket_stats == () and float(result.total_norm) == 0.0


def test_bad_arguments_name_the_fix() -> None:
    g = [torch.ones(2)]
    with pytest.raises(ValueError, match="unique"):
        clip_grad_norm_buckets_([GradClipBucket("x", g), GradClipBucket("x", g)], 1.0)
    with pytest.raises(ValueError, match=r"missing \['y'\], unknown \['z'\]"):
        clip_grad_norm_buckets_(
            [GradClipBucket("x", g), GradClipBucket("y", g)], {"x": 1.0, "z": 1.0}
        )
    with pytest.raises(ValueError, match="norm_type must be a positive"):
        clip_grad_norm_buckets_([GradClipBucket("x", g)], 1.0, norm_type=0.0)
    with pytest.raises(ValueError, match="norm_type must be a positive"):
        clip_grad_norm_buckets_([GradClipBucket("x", g)], 1.0, norm_type=math.nan)
    with pytest.raises(ValueError, match="max_norm must be a number >= 0"):
        clip_grad_norm_buckets_([GradClipBucket("x", g)], -1.0)
    with pytest.raises(ValueError, match=r"max_norm\['x'\] must be a number >= 0"):
        clip_grad_norm_buckets_([GradClipBucket("x", g)], {"x": math.nan})
    # inf is torch's "measure, do not clip" (its coefficient clamps to 1): nothing is scaled.
    before = [t.clone() for t in g]
    for inf in (math.inf, {"x": math.inf}):
        result = clip_grad_norm_buckets_([GradClipBucket("x", g)], inf)
        assert float(result["x"].clip_coef) == 1.0
        assert all(torch.equal(a, b) for a, b in zip(g, before, strict=True))
        assert float(result.total_norm) == float(torch.stack([t.norm() for t in before]).norm())
    # Not numbers: a bool would clip at 1.0, a string such as "1" passed float(); "fro" said
    # only "could not convert string to float". torch's "inf" spelling stays the inf-norm.
    for bad in [True, "1", b"1", [1.0]]:
        with pytest.raises(ValueError, match="max_norm must be a number >= 0"):
            clip_grad_norm_buckets_([GradClipBucket("x", g)], bad)  # type: ignore[arg-type]
    for bad in [True, "fro", "2", None]:
        with pytest.raises(ValueError, match="norm_type must be a positive"):
            clip_grad_norm_buckets_([GradClipBucket("x", g)], 1.0, norm_type=bad)  # type: ignore[arg-type]
    assert g[0].tolist() == [1.0, 1.0]
    inf_norm = clip_grad_norm_buckets_([GradClipBucket("x", g)], None, norm_type="inf")  # type: ignore[arg-type]
    assert float(inf_norm.total_norm) == 1.0
    assert (
        float(clip_grad_norm_buckets_([GradClipBucket("x", g)], torch.tensor(9.0)).total_norm) > 1
    )  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"drop parameters whose \.grad is None"):
        GradClipBucket("x", [torch.ones(1), None])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="non-empty string"):
        GradClipBucket("", g)
    with pytest.raises(KeyError, match="no bucket named 'q'"):
        clip_grad_norm_buckets_([GradClipBucket("x", g)], 1.0)["q"]


def test_dtensor_grads_are_rejected_with_the_fix() -> None:
    class DTensor(torch.Tensor):  # stands in for torch.distributed.tensor.DTensor by name
        def to_local(self) -> torch.Tensor:
            return self.as_subclass(torch.Tensor)

    g = torch.ones(3).as_subclass(DTensor)
    with pytest.raises(ValueError, match=r"to_local\(\)"):
        GradClipBucket("x", [g])
    # Through clip_grad_norm_, whose caller built no bucket: the message names the optimizer's
    # protocol, not GradClipBucket's reduce flag.
    with pytest.raises(
        ValueError, match=r"'global_norm' clip strategy got a DTensor as gradient 1"
    ):
        clip_grad_norm_(FakeMuon([torch.ones(2), g]), 1.0)
