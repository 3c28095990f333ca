"""Cases for the fused Triton kernels on CPU, run by Triton's interpreter. Not collected on its
own (the name does not start with ``test_``): ``test_interpret.py`` runs this file in a fresh
pytest process with ``TRITON_INTERPRET=1``, because Triton decides between compiling and
interpreting when a kernel (its own standard library included) is decorated, i.e. at import.
Tiles are shrunk so that tiny tensors still span many chunks, ragged tails and several dtype
launches.
"""

from __future__ import annotations

import math
import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import pytest
import torch
import torch.distributed as dist
from _fake import FakeMuon, FakeMuonWithoutProbe
from _reference import assert_close, float64_norm, torch_clip

from dmuon_clip import (
    GradClipBucket,
    _fastpath,
    clip_grad_norm_,
    clip_grad_norm_buckets_,
    try_clip_optimizer_grad_norm_buckets_,
)

RTOL = 1e-6  # fp32 vs torch: a different summation order, a few ulps


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(_fastpath, "_CHUNK", 256)
    monkeypatch.setattr(_fastpath, "_BLOCK", 64)
    monkeypatch.setattr(_fastpath, "_REDUCE_BLOCK", 4)


def _rand(shape, seed, dtype=torch.float32, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def _fp32_buckets():
    return {
        "attn": [_rand((33, 17), 0), _rand((3,), 1), _rand((1000,), 2)],  # multi-chunk, tails
        "mlp": [_rand((600,), 3, scale=0.5)],
        "norms": [_rand((5,), 4), _rand((2,), 5)],  # smaller than one vector
    }


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.5, 1e4, None])
def test_kernel_buckets_match_torch(norm_type: float, max_norm: float | None) -> None:
    grads = _fp32_buckets()
    refs = {n: torch_clip(g, max_norm, norm_type) for n, g in grads.items()}
    before = {n: [t.clone() for t in g] for n, g in grads.items()}
    result = clip_grad_norm_buckets_(
        [GradClipBucket(n, g) for n, g in grads.items()], max_norm, norm_type=norm_type
    )
    assert result.fastpath and result.fallback_reason is None
    for name, (ref_total, ref_grads) in refs.items():
        stats = result[name]
        assert stats.fastpath
        assert_close(stats.total_norm, ref_total, rtol=RTOL)
        expected = before[name] if max_norm is None else ref_grads
        for got, want in zip(grads[name], expected):
            assert_close(got, want, rtol=RTOL)
        assert bool(stats.clipped) == (max_norm is not None and float(ref_total) > max_norm)
    every = [t for g in before.values() for t in g]
    assert float(result.total_norm) == pytest.approx(float64_norm(every, norm_type), rel=RTOL)


def test_kernel_matches_the_torch_path_bit_for_bit_on_coefficients(monkeypatch) -> None:
    a, b = _fp32_buckets(), _fp32_buckets()
    fast = clip_grad_norm_buckets_([GradClipBucket(n, g) for n, g in a.items()], 0.7)
    monkeypatch.setattr(_fastpath, "unavailable_reason", lambda *_: "forced")
    slow = clip_grad_norm_buckets_([GradClipBucket(n, g) for n, g in b.items()], 0.7)
    assert fast.fastpath and not slow.fastpath and slow.fallback_reason == "forced"
    for f, s in zip(fast.bucket_stats, slow.bucket_stats):
        assert_close(f.total_norm, s.total_norm, rtol=RTOL)
        # Same formula, same operation order: equal coefficients from equal norms.
        assert torch.equal(
            f.clip_coef, torch.clamp(torch.reciprocal(f.total_norm + 1e-6) * 0.7, max=1.0)
        )


def test_low_precision_dtypes_against_float64() -> None:
    grads = [
        _rand((700,), 10, torch.bfloat16),
        _rand((45, 7), 11, torch.float16),
        _rand((9,), 12, torch.bfloat16),
        _rand((300,), 13),
    ]
    before = [g.clone() for g in grads]
    result = clip_grad_norm_buckets_([GradClipBucket("lp", grads)], 1.0)
    assert result.fastpath
    # fp32 accumulation of ~1.6k squares: error far below 1e-6 relative; torch's own total for
    # these dtypes is rounded to bf16/fp16 per tensor, so float64 is the reference here.
    assert float(result.total_norm) == pytest.approx(float64_norm(before), rel=1e-6)
    coef = result["lp"].clip_coef
    for got, old in zip(grads, before):
        # The kernel's contract: x * coef in fp32, rounded once to the grad's dtype. Triton's
        # interpreter truncates fp32 -> bf16 instead of rounding to nearest (the GPU test checks
        # bf16 bit for bit), so bf16 may differ by one unit in the last place here.
        want = (old.float() * coef).to(old.dtype)
        if old.dtype == torch.bfloat16:
            assert_close(got.float(), want.float(), rtol=2**-7)
        else:
            assert torch.equal(got, want)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_kernel_nonfinite_bucket_isolated(bad: float, norm_type: float) -> None:
    good = [_rand((500,), 20, scale=2.0), _rand((7,), 21)]
    poisoned = [_rand((300,), 22), _rand((40,), 23, torch.bfloat16)]
    poisoned[0][257] = bad  # in the second chunk
    poisoned_before = [p.clone() for p in poisoned]
    _, good_ref = torch_clip(good, 1.0, norm_type)
    result = clip_grad_norm_buckets_(
        [GradClipBucket("good", good), GradClipBucket("bad", poisoned)], 1.0, norm_type=norm_type
    )
    assert result.fastpath
    assert bool(result["bad"].found_inf) and float(result["bad"].clip_coef) == 1.0
    for got, old in zip(poisoned, poisoned_before):
        assert_close(got, old, rtol=0, equal_nan=True)
    assert not bool(result["good"].found_inf) and bool(result["good"].clipped)
    for got, want in zip(good, good_ref):
        assert_close(got, want, rtol=RTOL)


class _FakeCollective:
    """Two identical ranks: SUM doubles, MAX keeps. Counts the calls."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, tensor, op=None, group=None, async_op=False):
        self.calls.append(tensor.numel())
        if op == dist.ReduceOp.SUM:
            tensor.mul_(2)


@pytest.mark.parametrize("mixed", [False, True])
def test_one_collective_whatever_falls_back(monkeypatch, mixed: bool) -> None:
    collective = _FakeCollective()
    monkeypatch.setattr(dist, "all_reduce", collective)
    shared = [_rand((400,), 30), _rand((10, 10), 31)]
    local = [_rand((50,), 32)]
    if mixed:
        flat = _rand((101,), 33)
        shared += [_rand((12, 9), 34).t(), flat[1:], _rand((20,), 35, torch.float64)]
    refs = {"s": float64_norm(shared), "l": float64_norm(local)}
    result = clip_grad_norm_buckets_(
        [
            GradClipBucket("l", local, reduce=False),
            GradClipBucket("s", shared),
            GradClipBucket("m", []),
        ],
        None,
        process_group=object(),
    )
    assert collective.calls == [2]  # one all-reduce over the two reducing buckets
    assert float(result["s"].total_norm) == pytest.approx(math.sqrt(2) * refs["s"], rel=RTOL)
    assert float(result["l"].total_norm) == pytest.approx(refs["l"], rel=RTOL)
    assert result.fastpath is not mixed and result["s"].fastpath is not mixed
    assert result["l"].fastpath
    if mixed:
        assert "3 tensor(s) outside the kernel's contract" in result.fallback_reason


def test_try_clip_three_segments() -> None:
    regular = [_rand((300,), 40), _rand((17,), 41)]
    muon = [_rand((16, 16), 42, scale=3.0), _rand((8, 24), 43)]
    adamw = [_rand((64,), 44, scale=0.01)]
    refs = {
        "regular": torch_clip(regular, 1.0),
        "muon": torch_clip(muon, 1.0),
        "adamw": torch_clip(adamw, 1.0),
    }
    opt = FakeMuon(muon)
    result = try_clip_optimizer_grad_norm_buckets_(
        opt, regular_grads=[*regular, None], adamw_grads=adamw, max_norm=1.0
    )
    assert result is not None and result.fastpath and opt.calls == 1
    assert [s.name for s in result.bucket_stats] == ["regular", "muon", "adamw"]
    for name, grads in (("regular", regular), ("muon", muon), ("adamw", adamw)):
        total, ref = refs[name]
        assert_close(result[name].total_norm, total, rtol=RTOL)
        for got, want in zip(grads, ref):
            assert_close(got, want, rtol=RTOL)
    assert not bool(result["adamw"].clipped)


def test_try_clip_scales_muon_copies_with_the_muon_bucket() -> None:
    muon = [_rand((16, 16), 45, scale=3.0), _rand((8, 24), 46)]
    copy = _rand((8, 24), 46)  # another rank's copy of muon[1]: counted there, not here
    total, ref = torch_clip(muon, 1.0)
    result = try_clip_optimizer_grad_norm_buckets_(
        FakeMuon(muon, copies=(copy,)), regular_grads=[], adamw_grads=[], max_norm=1.0
    )
    assert result is not None and bool(result["muon"].clipped)
    assert_close(result["muon"].total_norm, total, rtol=RTOL)
    assert_close(copy, ref[1], rtol=RTOL)
    assert torch.equal(copy, muon[1])  # the copy stays equal to its original


@pytest.mark.parametrize("probe", [True, False])
def test_try_clip_declines_a_muon_device_other_than_the_gradients(probe: bool) -> None:
    # An optimizer of the protocol may keep the Muon accumulator on another device than the
    # gradients (MuonClipGradsLike.device: where its group can reduce); the fused clip runs
    # on one device, so it declines: before the take with clip_group_and_device, after it
    # without (it ran on the gradients' device then).
    muon, regular = [_rand((16, 16), 47, scale=3.0)], [_rand((300,), 48)]
    before = [g.clone() for g in [*muon, *regular]]
    optimizer = (FakeMuon if probe else FakeMuonWithoutProbe)(muon, device="cuda:0")
    result = try_clip_optimizer_grad_norm_buckets_(
        optimizer, regular_grads=regular, adamw_grads=[], max_norm=1.0
    )
    assert result is None and optimizer.calls == (0 if probe else 1)
    assert all(torch.equal(a, b) for a, b in zip([*muon, *regular], before, strict=True))


def test_muon_clip_through_the_kernel_is_deterministic() -> None:
    grads = [_rand((40, 30), 50), _rand((24, 8), 51)]
    copy = [g.clone() for g in grads]
    total, ref = torch_clip(grads, 2.0)
    first = clip_grad_norm_(FakeMuon(grads), 2.0)
    second = clip_grad_norm_(FakeMuon(copy), 2.0)
    assert_close(first.total_norm, total, rtol=RTOL)
    assert torch.equal(first.total_norm, second.total_norm)
    for got, again, want in zip(grads, copy, ref):
        assert torch.equal(got, again)
        assert_close(got, want, rtol=RTOL)
