"""The first ``newton_schulz`` call of a new shape against warm ones, on an empty autotune cache.

    python benchmarks/cold_start.py                          # every shape below, one process
    python benchmarks/cold_start.py --shapes 1024x4096 8192x28672

Needs a CUDA device. The autotune cache is a fresh temporary directory (``DMUON_NS_CACHE_DIR``,
set before the first call), so no verdict of an earlier run helps (a table shipped for the
card still does); a tiny call first starts CUDA and cuBLAS, which every job pays once whatever
the shapes. Then, per shape (random bf16 input, ``kernel="auto"``):

  first ms     the first call: what a new job pays for a new shape (the table's kernel,
               compiled in it, or torch; never a measurement)
  warm ms      median of ``--warm`` calls right after
  tune s       ``NewtonSchulz.tune``: measuring every candidate at once (0 where a verdict
               exists, e.g. from the table)
  tuned ms     median of ``--warm`` calls on the verdict's kernel
  first-tuned  the cold start's cost over a settled call
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

SHAPES = ["1024x4096", "2048x8192", "4096x4096", "4096x14336", "8192x28672"]


def _timed_s(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _input(spec: str, seed: int) -> torch.Tensor:
    dims = [int(d) for d in spec.split("x")]
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*dims, device="cuda", generator=generator).to(torch.bfloat16)


def _fresh_cache() -> None:
    from dmuon_ns import _autotune

    os.environ["DMUON_NS_CACHE_DIR"] = tempfile.mkdtemp(prefix="dmuon-cold-start-")
    _autotune.clear_cache()


def _cold_and_tuned(spec: str, warm: int) -> None:
    import dmuon_ns

    ns = dmuon_ns.NewtonSchulz()
    g = _input(spec, seed=0)
    first = _timed_s(lambda: ns(g))
    warm_ms = statistics.median(_timed_s(lambda: ns(g)) for _ in range(warm))
    tune_s = _timed_s(lambda: ns.tune(g))
    (kernel,) = ns.tune(g).values()
    tuned = statistics.median(_timed_s(lambda: ns(g)) for _ in range(warm))
    print(
        f"| {spec} | {first * 1e3:.1f} | {warm_ms * 1e3:.3f} | {tune_s:.1f}"
        f" | {tuned * 1e3:.3f} | {kernel} | {first - tuned:.2f} s |",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", default=SHAPES)
    parser.add_argument("--warm", type=int, default=10, help="calls per warm median")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cold_start needs a CUDA device")
    _fresh_cache()
    import dmuon_ns

    start_s = _timed_s(lambda: dmuon_ns.newton_schulz(_input("64x256", seed=2)))
    print(
        f"# {datetime.date.today().isoformat()} | {torch.cuda.get_device_name()}"
        f" | torch {torch.__version__} | dmuon-ns {dmuon_ns.__version__}"
        f" | CUDA and cuBLAS start: {start_s:.2f} s"
    )
    print(f"# {dmuon_ns.get_ns_backend()}")
    print(
        "| shape | first ms | warm ms | tune s | tuned ms | verdict | first-tuned |\n"
        "|---|---|---|---|---|---|---|"
    )
    for spec in args.shapes:
        _cold_and_tuned(spec, args.warm)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
