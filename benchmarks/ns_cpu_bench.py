"""Newton–Schulz on the CPU: the time and accuracy of each iteration dtype, with the torch
kernel (the one ``kernel="auto"`` runs on the CPU).

    python benchmarks/ns_cpu_bench.py                    # 256x1024, 512x2048, 1024x4096
    python benchmarks/ns_cpu_bench.py --shapes 256x1024 --threads 1 2 --repeats 7

Columns: the iteration dtype (``default`` is what ``dtype=None`` picks on the CPU), the
median wall time of ``--repeats`` calls after one untimed call, the relative Frobenius error
against the float64 iteration of the same algorithm (``dmuon_ns.testing``) and the range of
the output's singular values. Inputs are random fp32 Gaussians. fp16 has no fast CPU product
(one call at 1024x4096 takes about a minute), so it runs only on shapes of at most
``--fp16-max-elements`` elements.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch

import dmuon_ns
from dmuon_ns.testing import reference_newton_schulz, relative_error, singular_values

DTYPES = {"default": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_name() -> str:
    """The CPU's model name, as the bench tables record the machine."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", default=["256x1024", "512x2048", "1024x4096"])
    parser.add_argument("--threads", nargs="*", type=int, default=[1, torch.get_num_threads()])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fp16-max-elements", type=int, default=256 * 1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    print(
        f"# {datetime.date.today().isoformat()} | {cpu_name()}, {torch.get_num_threads()}"
        f" threads available, ISA {torch.backends.cpu.get_cpu_capability()}"
        f" | torch {torch.__version__} | dmuon-ns {dmuon_ns.__version__}"
    )
    print(f"# {dmuon_ns.get_ns_backend(device='cpu')}")
    default = dmuon_ns.NewtonSchulz()
    print(
        "| shape | threads | dtype | ms (median) | error vs float64 | output σ |\n"
        "|---|---|---|---|---|---|"
    )
    generator = torch.Generator().manual_seed(args.seed)
    for spec in args.shapes:
        rows, cols = (int(d) for d in spec.split("x"))
        g = torch.randn(rows, cols, generator=generator)
        reference = reference_newton_schulz(g)
        for threads in dict.fromkeys(args.threads):
            torch.set_num_threads(threads)
            for name, dtype in DTYPES.items():
                if dtype == torch.float16 and rows * cols > args.fp16_max_elements:
                    continue
                ns = dmuon_ns.NewtonSchulz(dtype=dtype)
                out = ns(g)  # untimed: allocator growth, BLAS thread start
                times = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    ns(g)
                    times.append((time.perf_counter() - start) * 1e3)
                sigma = singular_values(out)
                label = name if dtype is not None else f"default ({_iteration(default)})"
                print(
                    f"| {spec} | {threads} | {label} | {statistics.median(times):.1f}"
                    f" | {relative_error(out, reference):.1e}"
                    f" | [{sigma.min().item():.3f}, {sigma.max().item():.3f}] |",
                    flush=True,
                )


def _iteration(config: dmuon_ns.NewtonSchulz) -> str:
    from dmuon_ns._prepare import iteration_dtype

    dtype = iteration_dtype(config.dtype, torch.device("cpu"), ["torch"])
    return str(dtype).removeprefix("torch.")


if __name__ == "__main__":
    main()
