"""Where Newton–Schulz time goes on one GPU: each product of the Gram iteration on each library,
and a kernel-by-kernel profile of dmuon-ns against gram-newton-schulz on the same input.

    python benchmarks/ns_profile.py                       # 2048x8192 4096x14336 8192x28672
    python benchmarks/ns_profile.py --shapes 8192x28672 --no-trace

Part 1 (products): median ms (``triton.testing.do_bench_cudagraph``: GPU time without the
host's launch cost) and TFLOP/s of the products one Gram NS step is made of, fp16, on torch
(cuBLAS), quack ``gemm`` (autotuned and default config), quack ``gemm_symmetric`` (its own and
dmuon's tile shape) and dmuon's Triton products (autotuned). FLOPs count a symmetric product
once (m·m·k), a plain one as 2·m·k·n.
Part 2 (trace): GPU time per kernel name of one full call of dmuon's ``NewtonSchulz`` (each
available kernel) and of gram-newton-schulz+quack, summed over the call, from
``torch.profiler``, with the call's busy time (the union of its kernel intervals): wall minus
busy is host overhead and launch gaps. Compare implementations by busy time, not by per-kernel
sums: quack's SM90 kernels use programmatic dependent launch, so a kernel may start before its
predecessor ends and its traced time then includes that wait.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from gpu_trace import trace
from torch import Tensor

from dmuon_ns._iterations import Products

DEFAULT_SHAPES = ["2048x8192", "4096x14336", "8192x28672"]


def _bench(fn: Callable[[], object]) -> float:
    """Median ms of ``fn`` replayed in a CUDA graph: a product of ~25 µs would otherwise be
    timed with the host's launch cost (Triton's launcher alone is tens of µs)."""
    import triton.testing

    fn()  # compile and autotune outside the capture
    torch.cuda.synchronize()
    ms: float = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return ms


def _loop_products(
    label: str, products: Products, x: Tensor, r: Tensor, q: Tensor
) -> list[tuple[str, str, Callable[[], object], float]]:
    """The three products of a dmuon kernel's ``Products`` (see ``_iterations``)."""
    m, n = x.shape[-2], x.shape[-1]
    return [
        ("X·Xᵀ", label, lambda: products.gram(x), m * m * n),
        ("b·R+c·R²", label, lambda: products.sym(r, r, r, alpha=0.25, beta=0.5), m * m * m),
        ("Q·X", label, lambda: products.mm(q, x), 2 * m * m * n),
    ]


def _products(m: int, n: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(1, m, n, device="cuda", generator=gen) / (m * n) ** 0.5).half()
    r = torch.bmm(x, x.mT)
    q = torch.randn(1, m, m, device="cuda", generator=gen).half() / m**0.5
    rows: list[tuple[str, str, float, float]] = []
    sym_mk = m * m * n  # X·Xᵀ, symmetric: half of 2·m·m·n
    sym_mm = m * m * m
    full_mn = 2 * m * m * n
    cases: list[tuple[str, str, Callable[[], object], float]] = [
        ("X·Xᵀ", "torch", lambda: torch.bmm(x, x.mT), 2 * sym_mk),
        ("b·R+c·R²", "torch", lambda: torch.baddbmm(r, r, r, beta=0.5, alpha=0.25), 2 * sym_mm),
        ("Q·X", "torch", lambda: torch.bmm(q, x), full_mn),
    ]
    try:
        from quack.gemm_interface import gemm, gemm_symmetric

        cases += [
            ("X·Xᵀ", "quack sym", lambda: gemm_symmetric(x, x.mT), sym_mk),
            (
                "b·R+c·R²",
                "quack sym",
                lambda: gemm_symmetric(r, r, C=r, alpha=0.25, beta=0.5),
                sym_mm,
            ),
            ("Q·X", "quack tuned", lambda: gemm(q, x), full_mn),
            ("Q·X", "quack default", lambda: gemm(q, x, tuned=False), full_mn),
            ("Q·X→bf16", "quack tuned", lambda: gemm(q, x, out_dtype=torch.bfloat16), full_mn),
        ]
        from dmuon_ns._quack_backend import _QuackProducts

        # quack's symmetric product on the tile shape dmuon picks
        cases += _loop_products("dmuon quack", _QuackProducts(), x, r, q)
    except ImportError as err:
        print(f"# quack unavailable: {err}")
    try:
        from dmuon_ns._triton_kernels import TRITON_PRODUCTS

        cases += _loop_products("dmuon triton", TRITON_PRODUCTS, x, r, q)
    except ImportError as err:
        print(f"# triton unavailable: {err}")
    for what, lib, fn, flops in cases:
        ms = _bench(fn)
        rows.append((what, lib, ms, flops / ms / 1e9))
    print(f"\n## products, {m}x{n} fp16\n\n| product | library | ms | TFLOP/s (sym once) |")
    print("|---|---|---|---|")
    for what, lib, ms, tflops in rows:
        print(f"| {what} | {lib} | {ms:.3f} | {tflops:.0f} |")


def _trace(name: str, fn: Callable[[], object]) -> None:
    for _ in range(3):
        fn()
    trace(name, fn, top=50)


def _traces(m: int, n: int) -> None:
    import dmuon_ns
    from dmuon_ns._registry import kernel_status

    gen = torch.Generator(device="cuda").manual_seed(0)
    g = torch.randn(m, n, device="cuda", generator=gen).bfloat16()
    status = kernel_status(torch.device("cuda"))
    print(f"\n## trace, {m}x{n} bf16 input")
    for kernel in ("torch", "triton", "quack"):
        if status.get(kernel) is None:
            ns = dmuon_ns.NewtonSchulz(kernel=kernel, cuda_graphs=False)
            _trace(f"dmuon[{kernel}]", lambda ns=ns: ns(g))
    try:
        from gram_newton_schulz import GramNewtonSchulz

        gns = GramNewtonSchulz(ns_use_kernels=True)
        _trace("gram-newton-schulz+quack", lambda: gns(g))
    except ImportError as err:
        print(f"# gram-newton-schulz unavailable: {err}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", default=DEFAULT_SHAPES)
    parser.add_argument("--no-trace", action="store_true")
    args = parser.parse_args()
    print("#", torch.cuda.get_device_name(), "torch", torch.__version__)
    for spec in args.shapes:
        m, n = (int(d) for d in spec.split("x"))
        _products(m, n)
        if not args.no_trace:
            _traces(m, n)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
