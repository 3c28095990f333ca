"""The fused kernels on a CUDA device: against torch and float64, bit-exact scaling, and no host
sync (``torch.cuda.set_sync_debug_mode("error")``)."""

from __future__ import annotations

import math

import pytest
import torch
from _fake import FakeMuon
from _reference import assert_close, float64_norm, torch_clip

from dmuon_clip import (
    GradClipBucket,
    clip_grad_norm_,
    clip_grad_norm_buckets_,
    clip_grads_with_norm_,
    try_clip_optimizer_grad_norm_buckets_,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")

EPS32 = torch.finfo(torch.float32).eps


def _rand(shape, seed, dtype=torch.float32, scale=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, generator=gen, device="cuda") * scale).to(dtype)


def _buckets():
    return {
        "attn": [_rand((1024, 4096), 0, torch.bfloat16), _rand((256, 4096), 1, torch.bfloat16)],
        "mlp": [_rand((3584, 1024), 2, torch.bfloat16, 0.5), _rand((1000, 333), 3)],
        "norms": [_rand((4096,), 4, torch.bfloat16), _rand((7,), 5, torch.float16)],
    }


def _norm_error_ok(ours: float, theirs: float, ref: float, n: int) -> bool:
    # The fast path's error is no worse than twice torch's own, or than the eps * log2(n) bound
    # of a tree-shaped fp32 sum of n terms (torch may be luckier than its bound on one input).
    return abs(ours - ref) <= max(2 * abs(theirs - ref), EPS32 * math.log2(max(n, 2)) * ref)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_kernel_norms_against_float64_and_torch(norm_type: float) -> None:
    grads = _buckets()
    before = {n: [g.clone() for g in gs] for n, gs in grads.items()}
    result = clip_grad_norm_buckets_(
        [GradClipBucket(n, gs) for n, gs in grads.items()], 0.5, norm_type=norm_type
    )
    assert result.fastpath and result.fallback_reason is None
    for name, gs in before.items():
        ref = float64_norm(gs, norm_type)
        theirs = float(torch.nn.utils.get_total_norm([g.float() for g in gs], norm_type))
        ours = float(result[name].total_norm)
        assert _norm_error_ok(ours, theirs, ref, sum(g.numel() for g in gs)), (
            name,
            ours,
            theirs,
            ref,
        )
        if norm_type == math.inf:
            assert ours == ref  # a max is exact
        coef = result[name].clip_coef
        assert torch.equal(
            coef, torch.clamp(torch.reciprocal(result[name].total_norm + 1e-6) * 0.5, max=1.0)
        )
        for got, old in zip(grads[name], gs):
            assert torch.equal(got, (old.float() * coef).to(old.dtype))  # fp32 math, one rounding


@pytest.mark.parametrize("max_norm", [0.25, 1e6, None])
def test_fp32_buckets_equal_torch_clip(max_norm: float | None) -> None:
    grads = {
        "a": [_rand((513, 77), 10), _rand((3,), 11)],
        "b": [_rand((4096, 256), 12, scale=0.01)],
    }
    refs = {n: torch_clip(gs, max_norm) for n, gs in grads.items()}
    before = {n: [g.clone() for g in gs] for n, gs in grads.items()}
    result = clip_grad_norm_buckets_([GradClipBucket(n, gs) for n, gs in grads.items()], max_norm)
    for name, (total, ref) in refs.items():
        ref64 = float64_norm(before[name])
        n = sum(g.numel() for g in before[name])
        assert _norm_error_ok(float(result[name].total_norm), float(total), ref64, n)
        expected = before[name] if max_norm is None else ref
        # Coefficients differ only by the norms' last-bit difference: ~1e-6 relative at most.
        for got, want in zip(grads[name], expected):
            assert_close(got, want, rtol=1e-6)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_nonfinite_bucket_on_gpu(norm_type: float) -> None:
    good = [_rand((2000, 300), 20, scale=2.0)]
    bad = [_rand((70000,), 21, torch.bfloat16)]
    bad[0][65537] = math.nan
    bad_before = bad[0].clone()
    _, ref = torch_clip(good, 1.0, norm_type)
    result = clip_grad_norm_buckets_(
        [GradClipBucket("good", good), GradClipBucket("bad", bad)], 1.0, norm_type=norm_type
    )
    assert bool(result["bad"].found_inf) and float(result["bad"].clip_coef) == 1.0
    assert_close(bad[0], bad_before, rtol=0, equal_nan=True)
    assert not bool(result["good"].found_inf)
    assert_close(good[0], ref[0], rtol=1e-6)


def test_fallback_tensors_on_gpu() -> None:
    flat = _rand((4097,), 30)
    grads = [_rand((300, 200), 31).t(), flat[1:], _rand((50,), 32, torch.float64), _rand((99,), 33)]
    before = [g.clone() for g in grads]
    result = clip_grad_norm_buckets_([GradClipBucket("mixed", grads)], 0.1)
    assert not result.fastpath and "3 tensor(s)" in result.fallback_reason
    ref = float64_norm(before)
    assert float(result.total_norm) == pytest.approx(ref, rel=1e-6)
    coef = result["mixed"].clip_coef
    for got, old in zip(grads, before):
        assert_close(got, old * coef.to(old.dtype), rtol=1e-6)


def _no_sync(fn) -> None:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_kernel_path_never_syncs() -> None:
    clip_grad_norm_buckets_([GradClipBucket(n, gs) for n, gs in _buckets().items()], 1.0)  # compile
    fresh = _buckets()  # new addresses: the tables are built and uploaded inside the checked call
    _no_sync(
        lambda: clip_grad_norm_buckets_(
            [GradClipBucket(n, gs) for n, gs in fresh.items()],
            {"attn": 1.0, "mlp": 2.0, "norms": None},
        )
    )
    _no_sync(
        lambda: clip_grad_norm_buckets_(
            [GradClipBucket(n, gs) for n, gs in fresh.items()], 1.0, norm_type=math.inf
        )
    )


def test_muon_clip_and_try_clip_never_sync() -> None:
    muon = [_rand((512, 512), 40), _rand((256, 1024), 41, torch.bfloat16)]
    regular, adamw = [_rand((1000,), 42)], [_rand((64, 64), 43, torch.bfloat16)]
    clip_grad_norm_(FakeMuon(muon, device="cuda"), 1.0)
    try_clip_optimizer_grad_norm_buckets_(
        FakeMuon(muon, device="cuda"), regular_grads=regular, adamw_grads=adamw, max_norm=1.0
    )
    out = {}
    _no_sync(lambda: out.update(stats=clip_grad_norm_(FakeMuon(muon, device="cuda"), 0.5)))
    _no_sync(
        lambda: out.update(
            result=try_clip_optimizer_grad_norm_buckets_(
                FakeMuon(muon, device="cuda"),
                regular_grads=regular,
                adamw_grads=adamw,
                max_norm={"regular": 0.1, "muon": 0.5, "adamw": None},
            )
        )
    )
    assert out["result"] is not None and out["result"].fastpath
    assert out["stats"].total_norm.device.type == "cuda"
    # The split clip's second half with a norm held on the host (a number, a CPU tensor) as
    # with one on the device: no sync (a copy to the device waited for the stream), the same
    # bits.
    scaled = []
    for norm in (3.0, torch.tensor(3.0), torch.tensor(3.0, device="cuda")):
        grads = [g.clone() for g in muon]
        _no_sync(lambda g=grads, n=norm: clip_grads_with_norm_(FakeMuon(g, device="cuda"), 0.5, n))
        scaled.append(grads)
    assert all(torch.equal(a, b) for other in scaled[1:] for a, b in zip(scaled[0], other))


def test_torch_path_on_cuda_never_syncs() -> None:
    grads = [_rand((300, 300), 50), _rand((10,), 51, torch.bfloat16)]
    clip_grad_norm_buckets_([GradClipBucket("p3", grads)], 1.0, norm_type=3.0)
    _no_sync(lambda: clip_grad_norm_buckets_([GradClipBucket("p3", grads)], 1.0, norm_type=3.0))


def test_try_clip_declines_mixed_devices() -> None:
    muon = [_rand((8, 8), 60)]
    regular = [torch.ones(3)]
    assert (
        try_clip_optimizer_grad_norm_buckets_(
            FakeMuon(muon, device="cuda"), regular_grads=regular, adamw_grads=[], max_norm=1.0
        )
        is None
    )
    assert torch.equal(regular[0], torch.ones(3))
