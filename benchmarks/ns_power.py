"""Sustained Newton–Schulz on one GPU: throughput, SM clock and board power while one workload
runs back to back for a few seconds, for dmuon-ns, gram-newton-schulz+quack and the plain
products they are made of.

    python benchmarks/ns_power.py                     # 8192x28672
    python benchmarks/ns_power.py --shape 4096x14336 --seconds 3

A short ``do_bench`` measures a card at its boost clock; a long training step, or a long
benchmark round, runs at whatever clock the board's power limit allows. This script shows
which regime a shape is in: each phase runs its workload for ``--seconds`` while a thread reads
NVML every 20 ms, and the table gives ms per call (CUDA events over the phase), TFLOP/s where
the FLOPs are known, the mean SM clock and board power (over the phase after its first second)
and NVML's clock-limit reasons (0x4: software power cap). Idle phases between show the
clock coming back. Needs nvidia-ml-py (``pynvml``) and the same imports as ns_bench.py.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable

import pynvml
import torch
from ns_bench import _methods


class _Sampler(threading.Thread):
    """(time, SM MHz, watts, clock-limit reasons) of GPU 0 every ``period`` seconds."""

    def __init__(self, period: float = 0.02) -> None:
        super().__init__(daemon=True)
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.period = period
        self.samples: list[tuple[float, int, float, int]] = []
        self.done = threading.Event()

    def run(self) -> None:
        h = self.handle
        # nvidia-ml-py renamed "throttle reasons" to "event reasons" (12.535); either will do.
        read_reasons = getattr(
            pynvml,
            "nvmlDeviceGetCurrentClocksEventReasons",
            getattr(pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None),
        )
        while not self.done.is_set():
            clock = pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
            watts = pynvml.nvmlDeviceGetPowerUsage(h) / 1000
            reasons = read_reasons(h)
            self.samples.append((time.time(), clock, watts, reasons))
            time.sleep(self.period)

    def between(self, t0: float, t1: float) -> list[tuple[float, int, float, int]]:
        return [s for s in self.samples if t0 <= s[0] <= t1]


def _sustain(fn: Callable[[], object] | None, seconds: float) -> float | None:
    """ms per call of ``fn`` run back to back for ``seconds`` (``None``: sleep, idle)."""
    if fn is None:
        time.sleep(seconds)
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0, calls = time.time(), 0
    start.record()
    while time.time() - t0 < seconds:
        for _ in range(4):
            fn()
        calls += 4
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    ms: float = start.elapsed_time(end) / calls
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="8192x28672", help="m x n, m <= n")
    parser.add_argument("--seconds", type=float, default=4.0, help="length of each phase")
    args = parser.parse_args()
    m, n = (int(d) for d in args.shape.split("x"))
    from quack.gemm_interface import gemm

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
    a = torch.randn(m, m, device="cuda", generator=gen).to(torch.bfloat16)
    b = torch.randn(m, m, device="cuda", generator=gen).to(torch.bfloat16)
    q = a / m**0.5  # Q·X of the size the iteration sees
    methods = _methods()
    dmuon, gns = methods["dmuon[auto]"], methods["gram-newton-schulz+quack"]
    square, qx = 2.0 * m**3, 2.0 * m * m * n
    phases: list[tuple[str, Callable[[], object] | None, float | None]] = [
        (f"torch.mm {m}³", lambda: torch.mm(a, b), square),
        ("Q·X torch.mm", lambda: torch.mm(q, x), qx),
        ("Q·X quack gemm", lambda: gemm(q, x), qx),
        ("dmuon[auto] NS", lambda: dmuon(x), None),
        ("gram-newton-schulz NS", lambda: gns(x), None),
        ("idle", None, None),
        ("gram-newton-schulz NS", lambda: gns(x), None),
        ("dmuon[auto] NS", lambda: dmuon(x), None),
        ("idle", None, None),
    ]
    for _, fn, _ in phases:  # compile, autotune, capture
        if fn is not None:
            fn()
    torch.cuda.synchronize()

    sampler = _Sampler()
    limit = pynvml.nvmlDeviceGetEnforcedPowerLimit(sampler.handle) / 1000
    print(f"# {torch.cuda.get_device_name()}, {args.shape}, power limit {limit:.0f} W", flush=True)
    sampler.start()
    rows = []
    for name, fn, flops in phases:
        t0 = time.time()
        ms = _sustain(fn, args.seconds)
        rows.append((name, ms, flops, sampler.between(t0 + 1.0, time.time())))
    sampler.done.set()
    sampler.join()

    print("\n| phase | ms per call | TFLOP/s | SM MHz (mean) | W (mean) | reasons |")
    print("|---|---|---|---|---|---|")
    for name, ms, flops, samples in rows:
        clock = statistics.mean(s[1] for s in samples)
        watts = statistics.mean(s[2] for s in samples)
        reasons = ",".join(sorted({hex(s[3]) for s in samples}))
        ms_cell = f"{ms:.3f}" if ms is not None else "—"
        tflops = f"{flops / ms / 1e9:.0f}" if ms is not None and flops else "—"
        print(f"| {name} | {ms_cell} | {tflops} | {clock:.0f} | {watts:.0f} | {reasons} |")


if __name__ == "__main__":
    main()
