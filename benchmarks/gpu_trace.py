"""Where one call's GPU time goes: a ``torch.profiler`` trace of ``fn`` summed per kernel name,
with the call's busy time (the union of its kernel intervals) and where the device sat idle
between kernels (by the kernels on either side). Wall minus busy is the host's launch cost and
the gaps between kernels, the part a CUDA graph could take away; busy is what faster kernels
must shorten. Shared by the benchmarks' ``--trace`` options.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable

import torch

__all__ = ["ns_tflop", "print_product_rate", "trace", "union_us"]


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


def _kernel_family(name: str) -> str:
    """A kernel's name without the template arguments and launch-specific suffixes that would
    split one kernel into many rows (cuBLAS tile names, Triton's specialisations)."""
    name = re.sub(r"<.*", "", name)
    name = re.sub(r"_\d+(_\d+)*$", "", name)
    return name[:70]


def trace(name: str, fn: Callable[[], object], *, top: int = 12) -> dict[str, float]:
    """Profile one call of ``fn`` (the caller warms it up) and print its wall, busy and
    kernel-sum milliseconds and the ``top`` kernel families by GPU time; returns the
    milliseconds of every family."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
    wall = start.elapsed_time(end)
    per_kernel: dict[str, list[float]] = collections.defaultdict(list)
    intervals: list[tuple[float, float]] = []
    named: list[tuple[float, float, str]] = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0:
            family = _kernel_family(event.name)
            per_kernel[family].append(event.device_time / 1e3)
            intervals.append((event.time_range.start, event.time_range.end))
            named.append((event.time_range.start, event.time_range.end, family))
    total = sum(sum(v) for v in per_kernel.values())
    busy = union_us(intervals) / 1e3
    launches = sum(len(v) for v in per_kernel.values())
    print(
        f"\n### {name}: wall {wall:.3f} ms, busy {busy:.3f} ms, kernel sum {total:.3f} ms,"
        f" {launches} kernels\n"
    )
    print("| kernel | calls | ms |\n|---|---|---|")
    ranked = sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))
    for kname, times in ranked[:top]:
        print(f"| `{kname}` | {len(times)} | {sum(times):.3f} |")
    rest = ranked[top:]
    if rest:
        calls = sum(len(t) for _, t in rest)
        print(f"| ({len(rest)} others) | {calls} | {sum(sum(t) for _, t in rest):.3f} |")
    _print_gaps(named, top)
    return {kname: sum(times) for kname, times in per_kernel.items()}


def _print_gaps(named: list[tuple[float, float, str]], top: int) -> None:
    """Where the device sat idle: each gap between the end of the kernels so far and the next
    kernel's start, summed by the pair of kernel families around it."""
    gaps: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    reach, last = None, ""
    for start, end, family in sorted(named):
        if reach is not None and start > reach:
            gaps[(last[:40], family[:40])].append((start - reach) / 1e3)
        if reach is None or end > reach:
            reach, last = end, family
    if not gaps:
        return
    total = sum(sum(v) for v in gaps.values())
    print(f"\nidle between kernels: {total:.3f} ms in {sum(len(v) for v in gaps.values())} gaps")
    print("| before | after | gaps | ms |\n|---|---|---|---|")
    for (before, after), times in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"| `{before}` | `{after}` | {len(times)} | {sum(times):.3f} |")


# Kernel families that are matrix products (dmuon's Triton products, cuBLAS, CUTLASS/quack).
_PRODUCT_MARKS = ("_product_kernel", "gemm", "xmma", "cutlass", "Gemm")


def print_product_rate(kernel_ms: dict[str, float], tflop: float) -> None:
    """The matrix products' share of a traced call and their throughput, given the TFLOP they
    compute (:func:`ns_tflop`)."""
    ms = sum(v for k, v in kernel_ms.items() if any(mark in k for mark in _PRODUCT_MARKS))
    if ms > 0:
        print(
            f"\nNS products: {ms:.2f} ms for {tflop:.2f} TFLOP (a symmetric product counted"
            f" once): {tflop / ms * 1e3:.0f} TFLOP/s"
        )


class _CountingProducts:
    """The products of the NS loops on meta tensors, counting FLOPs: ``2·m·k·n`` for a plain
    product, half of that for a symmetric one (computed once, as dmuon's kernels do)."""

    def __init__(self) -> None:
        self.flops = 0

    def _count(self, a: torch.Tensor, b: torch.Tensor, symmetric: bool) -> None:
        batch, m, k = a.shape
        n = b.shape[-1]
        self.flops += batch * m * k * n * (1 if symmetric else 2)

    def gram(self, x: torch.Tensor) -> torch.Tensor:
        self._count(x, x.mT, True)
        return torch.bmm(x, x.mT)

    def sym(self, a, b, c, *, alpha: float = 1.0, beta: float) -> torch.Tensor:
        self._count(a, b, True)
        return torch.bmm(a, b)

    def mm(self, a, b, out_dtype=None) -> torch.Tensor:
        self._count(a, b, False)
        return torch.bmm(a, b)

    def mm_add(self, a, b, c, beta: float, out_dtype=None) -> torch.Tensor:
        self._count(a, b, False)
        return torch.bmm(a, b)


def ns_tflop(matrices: dict[tuple[int, int], int], ns: object) -> float:
    """TFLOP of one Newton–Schulz call per matrix of each shape (``{(rows, cols): count}``) as
    ``ns`` (a ``dmuon_ns.NewtonSchulz``) runs it: the Gram form for a non-square matrix under
    the Gram backend, the direct form otherwise, on the short side."""
    from dmuon_ns._iterations import direct_iterations, gram_iterations

    counter = _CountingProducts()
    for (rows, cols), count in matrices.items():
        m, n = min(rows, cols), max(rows, cols)
        x = torch.empty(count, m, n, device="meta")
        coefficients = ns.step_coefficients  # type: ignore[attr-defined]
        if getattr(ns, "backend", "gram") == "gram" and m != n:
            gram_iterations(counter, x, coefficients, ns.restarts).finish()  # type: ignore[attr-defined,arg-type]
        else:
            direct_iterations(counter, x, coefficients).finish()  # type: ignore[arg-type]
    return counter.flops / 1e12
