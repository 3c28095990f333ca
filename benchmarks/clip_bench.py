"""Fused segmented gradient clip vs. three calls of torch.nn.utils.clip_grad_norm_(foreach=True).

    PYTHONPATH=packages/dmuon-clip/src python benchmarks/clip_bench.py [--iters 20] [--json out.json]

Grads of an 8-layer Llama-style stack (q, k, v, o, gate, up, down matrices plus RMSNorm weights,
random bf16) are split into three buckets ("attn", "mlp", "norms"); each bucket is clipped by its
own norm. Two regimes: "clipping" (max_norm = 0.999 x the bucket norm: every bucket is scaled;
the bf16 values round back to themselves, so the regime holds over the iterations) and
"not clipping" (max_norm = 2 x the norm: coefficient 1, which the fused kernel skips without a
host sync, while torch multiplies by 1.0). Times are CUDA-event time per call of back-to-back
calls, so host overhead shows where it dominates.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform

import torch

from dmuon_clip import GradClipBucket, clip_grad_norm_buckets_

CONFIGS = {
    # name: (layers, hidden, intermediate, kv width)
    "8L H4096 I14336 kv1024": (8, 4096, 14336, 1024),
    "8L H1024 I3584 kv256": (8, 1024, 3584, 256),
}


def llama_grads(layers: int, hidden: int, inter: int, kv: int) -> dict[str, list[torch.Tensor]]:
    def g(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    buckets: dict[str, list[torch.Tensor]] = {"attn": [], "mlp": [], "norms": []}
    for _ in range(layers):
        buckets["attn"] += [g(hidden, hidden), g(kv, hidden), g(kv, hidden), g(hidden, hidden)]
        buckets["mlp"] += [g(inter, hidden), g(inter, hidden), g(hidden, inter)]
        buckets["norms"] += [g(hidden), g(hidden)]
    buckets["norms"].append(g(hidden))
    return buckets


def fp32_norm(grads: list[torch.Tensor]) -> float:
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    return float(torch.stack(norms).square().sum().sqrt())


def time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def run_config(name: str, iters: int) -> list[dict]:
    grads = llama_grads(*CONFIGS[name])
    params = {}
    for bucket, gs in grads.items():
        params[bucket] = []
        for g in gs:
            p = torch.nn.Parameter(torch.empty_like(g))
            p.grad = g  # the same storage: both methods clip the same tensors
            params[bucket].append(p)
    norms = {b: fp32_norm(gs) for b, gs in grads.items()}
    n_elem = sum(g.numel() for gs in grads.values() for g in gs)
    rows = []
    for regime, factor in (("clipping", 0.999), ("not clipping", 2.0)):
        limits = {b: factor * n for b, n in norms.items()}
        buckets = [GradClipBucket(b, gs) for b, gs in grads.items()]

        def fused(buckets=buckets, limits=limits):
            return clip_grad_norm_buckets_(buckets, limits)

        def torch_three(limits=limits, params=params):
            for b, ps in params.items():
                torch.nn.utils.clip_grad_norm_(ps, limits[b], foreach=True)

        result = fused()
        assert result.fastpath, result.fallback_reason
        worst = max(
            abs(float(result[b].total_norm) - fp32_norm(grads[b])) / fp32_norm(grads[b])
            for b in grads
        )
        clipped = [bool(s.clipped) for s in result.bucket_stats]
        assert all(clipped) == (factor < 1) and any(clipped) == (factor < 1), clipped
        t_torch = time_ms(torch_three, iters)
        t_fused = time_ms(fused, iters)
        moved = n_elem * 2 * (3 if factor < 1 else 1)  # bytes: read (+ read and write)
        rows.append(
            {
                "config": name,
                "regime": regime,
                "elements": n_elem,
                "torch_ms": t_torch,
                "fused_ms": t_fused,
                "speedup": t_torch / t_fused,
                "fused_GBps": moved / t_fused / 1e6,
                "norm_rel_err_vs_fp32_foreach": worst,
            }
        )
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    import triton

    header = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }
    print(" | ".join(f"{k} {v}" for k, v in header.items()))
    rows = [row for name in CONFIGS for row in run_config(name, args.iters)]
    print(
        f"{'config':<24} {'regime':<13} {'elements':>14} {'torch x3 ms':>12} {'fused ms':>9} "
        f"{'speedup':>8} {'fused GB/s':>11} {'norm rel err':>12}"
    )
    for r in rows:
        print(
            f"{r['config']:<24} {r['regime']:<13} {r['elements']:>14,} {r['torch_ms']:>12.3f} "
            f"{r['fused_ms']:>9.3f} {r['speedup']:>7.2f}x {r['fused_GBps']:>11.0f} "
            f"{r['norm_rel_err_vs_fp32_foreach']:>12.1e}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": rows}, f, indent=1)
    assert all(math.isfinite(r["speedup"]) for r in rows)


if __name__ == "__main__":
    main()
