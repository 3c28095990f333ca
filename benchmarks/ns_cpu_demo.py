"""Orthogonalize a few matrices on the CPU with dmuon-ns and show what happened.

    python benchmarks/ns_cpu_demo.py            # a few seconds on a laptop core

For each input: its shape, the NS form and kernel that ran, the median wall time, the relative
(Frobenius) error against the float64 reference of the same iterations, and the spread of the
singular values before (of the Frobenius-normalised input) and after: NS maps every singular
value into a narrow band around 1 while keeping the singular vectors. NS iterates in fp32 on
the CPU (``benchmarks/ns_cpu_bench.py`` compares the dtypes); rank-deficient and ill-conditioned
inputs show the largest errors: the polynomials amplify rounding noise in the directions of
(near-)zero singular values.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dmuon_ns
from dmuon_ns.testing import reference_newton_schulz, relative_error, singular_values


def _inputs(seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    lowrank = torch.randn(96, 8, generator=gen) @ torch.randn(8, 288, generator=gen)
    u, _ = torch.linalg.qr(torch.randn(128, 128, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(128, 128, generator=gen, dtype=torch.float64))
    ill = (u @ torch.diag(torch.logspace(0, -4, 128, dtype=torch.float64)) @ v.T).float()
    return [
        ("random wide", torch.randn(96, 384, generator=gen)),
        ("random tall", torch.randn(384, 96, generator=gen)),
        ("random square", torch.randn(192, 192, generator=gen)),
        ("batch of 8", torch.randn(8, 64, 256, generator=gen)),
        ("low rank (8)", lowrank),
        ("cond 1e4", ill),
    ]


def _spread(x: torch.Tensor) -> str:
    s = singular_values(x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True))
    return f"[{s.min().item():.1e}, {s.max().item():.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    # Small matrices gain nothing from more threads, and lose a lot on a busy machine.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = dmuon_ns.get_backend_status("cpu")["auto_choice"]

    print(dmuon_ns.get_ns_backend(device="cpu"))
    header = f"{'input':<14} {'shape':<14} {'form':<6} {'kernel':<6} {'ms':>8} {'err vs fp64':>12}"
    print(header + f"  {'σ before':<18} {'σ after (non-zero)':<18}")
    print("-" * (len(header) + 40))
    for name, g in _inputs(args.seed):
        ns = dmuon_ns.NewtonSchulz(steps=args.steps)
        out = ns(g)  # warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = ns(g)
            times.append((time.perf_counter() - start) * 1e3)
        form = "gram" if g.shape[-1] != g.shape[-2] else "direct"
        err = relative_error(out, reference_newton_schulz(g, steps=args.steps))
        s_after = singular_values(out)
        s_after = s_after[s_after > 1e-2 * s_after.max()]
        after = f"[{s_after.min().item():.2f}, {s_after.max().item():.2f}]"
        print(
            f"{name:<14} {'x'.join(map(str, g.shape)):<14} {form:<6} {kernel:<6}"
            f" {statistics.median(times):>8.2f} {err:>12.2e}  {_spread(g):<18} {after:<18}"
        )


if __name__ == "__main__":
    main()
