"""Newton–Schulz on one GPU: dmuon-ns (each kernel and auto) against torch.optim.Muon's NS and
gram-newton-schulz with quack kernels, in one run, plus each one's error against float64.

    python benchmarks/ns_bench.py                      # every shape of the issue
    python benchmarks/ns_bench.py --shapes 1024x4096 32x1024x4096 --out /tmp/ns

Needs a CUDA device; the ``quack`` and gram-newton-schulz columns need quack-kernels and
gram-newton-schulz importable (on the GPU machine, staged from wheels carried with the checkout).
Inputs are random bf16 Gaussians. Times are medians of ``triton.testing.do_bench`` (CUDA
events, L2 flushed between runs) after ``NewtonSchulz.tune`` (dmuon's autotuner otherwise
measures over the calls after the first) and a first, untimed call that compiles,
taken in ``--rounds`` interleaved rounds (each in a rotated method order) and reduced to the
median over rounds.
Errors are max over matrices of ‖out − ref‖_F/‖ref‖_F with ref the float64 iteration of the
same algorithm and coefficients (``dmuon_ns.testing.reference_newton_schulz``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

ISSUE_SHAPES = [
    "1024x4096",
    "2048x8192",
    "4096x4096",
    "4096x14336",
    "8192x28672",
    "32x1024x4096",
    "llama8b-layer",
]
# One Llama-3-8B decoder layer: q, k, v, o, gate, up, down.
LLAMA8B_LAYER = [
    (4096, 4096),
    (1024, 4096),
    (1024, 4096),
    (4096, 4096),
    (14336, 4096),
    (14336, 4096),
    (4096, 14336),
]
QUINTIC = (3.4445, -4.7750, 2.0315)


def _inputs(spec: str, generator: torch.Generator) -> list[Tensor] | Tensor:
    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, device="cuda", generator=generator).to(torch.bfloat16)

    if spec == "llama8b-layer":
        return [rand(m, n) for m, n in LLAMA8B_LAYER]
    dims = [int(d) for d in spec.split("x")]
    return rand(*dims)


def _matrices(g: list[Tensor] | Tensor) -> list[Tensor]:
    if isinstance(g, list):
        return g
    return list(g.reshape(-1, *g.shape[-2:]).unbind(0)) if g.ndim == 3 else [g]


def _methods() -> dict[str, Callable[[list[Tensor] | Tensor], list[Tensor] | Tensor]]:
    import dmuon_ns
    from dmuon_ns._registry import kernel_status

    methods: dict[str, Callable[[list[Tensor] | Tensor], list[Tensor] | Tensor]] = {}
    status = kernel_status(torch.device("cuda"))
    for kernel in ("torch", "triton", "quack", "auto"):
        if kernel != "auto" and status.get(kernel) is not None:
            print(f"# dmuon[{kernel}] unavailable: {status[kernel]}", flush=True)
            continue
        ns = dmuon_ns.NewtonSchulz(kernel=kernel)
        methods[f"dmuon[{kernel}]"] = ns
    methods["dmuon[auto,eager]"] = dmuon_ns.NewtonSchulz(kernel="auto", cuda_graphs=False)

    from torch.optim._muon import _zeropower_via_newtonschulz

    def muon(g: list[Tensor] | Tensor) -> list[Tensor] | Tensor:
        if isinstance(g, Tensor) and g.ndim == 2:
            return _zeropower_via_newtonschulz(g, QUINTIC, 5, 1e-7)
        return [_zeropower_via_newtonschulz(m, QUINTIC, 5, 1e-7) for m in _matrices(g)]

    methods["torch.optim.Muon NS"] = muon

    try:
        # gram-newton-schulz compiles its call; keep one static graph per shape rather than a
        # dynamic-shape recompile, as a user benchmarking fixed shapes would.
        dynamo_config = importlib.import_module("torch._dynamo").config
        dynamo_config.automatic_dynamic_shapes = False
        dynamo_config.cache_size_limit = 64
        from gram_newton_schulz import GramNewtonSchulz

        gns = GramNewtonSchulz(ns_use_kernels=True)

        def gram_ns(g: list[Tensor] | Tensor) -> list[Tensor] | Tensor:
            if isinstance(g, list):
                return [gns(m) for m in g]
            return gns(g)

        methods["gram-newton-schulz+quack"] = gram_ns
    except Exception as err:  # reported, the other columns still run
        print(f"# gram-newton-schulz unavailable: {err!r}", flush=True)
    return methods


def _reference(g: list[Tensor] | Tensor, muon: bool) -> list[Tensor]:
    from dmuon_ns.testing import reference_newton_schulz

    refs = []
    for m in _matrices(g):
        if muon:
            refs.append(
                reference_newton_schulz(m, coefficients=[QUINTIC], backend="direct", eps=1e-7)
            )
        else:
            refs.append(reference_newton_schulz(m))
    return refs


def _error(out: list[Tensor] | Tensor, refs: list[Tensor]) -> float:
    worst = 0.0
    for o, r in zip(_matrices(out), refs, strict=True):
        o64 = o.to(torch.float64)
        if not torch.isfinite(o64).all():
            return math.inf
        worst = max(worst, float(torch.linalg.norm(o64 - r) / torch.linalg.norm(r)))
    return worst


def _versions() -> dict[str, str]:
    out = {"torch": torch.__version__, "python": sys.version.split()[0]}
    for dist in ("triton", "quack-kernels", "nvidia-cutlass-dsl", "gram-newton-schulz"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "absent"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", default=ISSUE_SHAPES)
    parser.add_argument("--methods", nargs="*", default=None, help="subset of column names")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for logs")
    parser.add_argument("--rep-ms", type=float, default=300.0, help="timed ms per method")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop starting new shapes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ns_bench needs a CUDA device")
    import triton.testing

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = (out_dir / "ns_bench.jsonl").open("a")
    header = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "versions": _versions(),
    }
    print("#", json.dumps(header), flush=True)
    log.write(json.dumps({"header": header}) + "\n")

    methods = _methods()
    if args.methods:
        methods = {k: v for k, v in methods.items() if k in args.methods}
    generator = torch.Generator(device="cuda").manual_seed(0)
    start = time.perf_counter()
    rows: list[tuple[str, dict[str, tuple[float, float]]]] = []
    for spec in args.shapes:
        if time.perf_counter() - start > args.budget_s:
            print(f"# budget spent, skipping {spec}", flush=True)
            continue
        g = _inputs(spec, generator)
        refs = _reference(g, muon=False)
        refs_muon = _reference(g, muon=True)
        results: dict[str, tuple[float, float]] = {}
        errors: dict[str, float] = {}
        for name, fn in methods.items():  # first call: compile, autotune, capture; error
            try:
                t0 = time.perf_counter()
                if hasattr(fn, "tune"):  # auto measures over later calls: settle it up front
                    fn.tune(g)
                out = fn(g)
                torch.cuda.synchronize()
                first_s = time.perf_counter() - t0
                errors[name] = _error(out, refs_muon if name.startswith("torch.optim") else refs)
                del out
            except Exception as exc:
                print(f"# {spec} {name} failed: {exc!r}", flush=True)
                traceback.print_exc(file=sys.stdout)
                log.write(json.dumps({"shape": spec, "method": name, "error": repr(exc)}) + "\n")
                continue
            log.write(json.dumps({"shape": spec, "method": name, "first_s": first_s}) + "\n")
        # Timed in rounds, each round in a rotated order, so that no method always runs
        # right after the same heavy neighbour (clocks drift with temperature); the cell is
        # the median over rounds of each round's do_bench median.
        names = [name for name in methods if name in errors]
        samples: dict[str, list[float]] = {name: [] for name in names}
        for round_ in range(args.rounds):
            order = names[round_ % len(names) :] + names[: round_ % len(names)] if names else []
            for name in order:
                fn = methods[name]
                samples[name].append(
                    triton.testing.do_bench(
                        lambda fn=fn, g=g: fn(g),
                        warmup=25,
                        rep=args.rep_ms / args.rounds,
                        return_mode="median",
                    )
                )
        for name in names:
            ms, err = statistics.median(samples[name]), errors[name]
            results[name] = (ms, err)
            record = {"shape": spec, "method": name, "ms": ms, "rounds_ms": samples[name]}
            log.write(json.dumps({**record, "err": err}) + "\n")
            log.flush()
            print(f"{spec:>14} {name:<28} {ms:9.3f} ms  err {err:.3e}", flush=True)
        rows.append((spec, results))
        del g, refs, refs_muon
        torch.cuda.empty_cache()

    from dmuon_ns import _autotune

    for key, verdict in _autotune.verdicts().items():
        problem = "|".join(key.split("|")[:3])  # op|shape|dtype; the full key is in the log
        print(f"# autotune {problem} -> {verdict['kernel']} {verdict['times_ms']}")
        log.write(json.dumps({"autotune": key, "verdict": verdict}) + "\n")
    log.close()

    names = list(methods)
    print("\n| shape | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for spec, results in rows:
        cells = []
        for name in names:
            if name in results:
                ms, err = results[name]
                cells.append(f"{ms:.3f} ({err:.1e})")
            else:
                cells.append("—")
        print(f"| {spec} | " + " | ".join(cells) + " |")
    print("\nms median (relative error vs float64)")
    peer = "gram-newton-schulz+quack"
    for spec, results in rows:
        if "dmuon[auto]" in results and peer in results:
            ratio = results["dmuon[auto]"][0] / results[peer][0]
            print(f"# {spec}: dmuon[auto] / {peer} = {ratio:.3f}")


if __name__ == "__main__":
    main()
