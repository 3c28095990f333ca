"""Where one call's GPU time goes: a ``torch.profiler`` trace of ``fn`` summed per kernel name,
with the call's busy time (the union of its kernel intervals). Wall minus busy is the host's
launch cost and the gaps between kernels, the part a CUDA graph could take away; busy is what
faster kernels must shorten. Shared by the benchmarks' ``--trace`` options.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable

import torch

__all__ = ["trace", "union_us"]


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


def trace(name: str, fn: Callable[[], object], *, top: int = 12) -> None:
    """Profile one call of ``fn`` (the caller warms it up) and print its wall, busy and
    kernel-sum milliseconds and the ``top`` kernel families by GPU time."""
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
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0:
            per_kernel[_kernel_family(event.name)].append(event.device_time / 1e3)
            intervals.append((event.time_range.start, event.time_range.end))
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
