"""Newton–Schulz on one GPU: dmuon-ns (each kernel and auto) against torch.optim.Muon's NS,
gram-newton-schulz with quack kernels and (with ``--dion``) microsoft/dion's Triton NS, in one
run, plus each one's error against float64 and its peak memory.

    python benchmarks/ns_bench.py                      # every shape of the issue
    python benchmarks/ns_bench.py --shapes 1024x4096 32x1024x4096 --out /tmp/ns
    python benchmarks/ns_bench.py --dion ~/src/dion/dion   # the folder of newton_schulz_triton.py

Needs a CUDA device; the ``quack`` and gram-newton-schulz columns need quack-kernels and
gram-newton-schulz importable (on the GPU machine, staged from wheels carried with the checkout).
Inputs are random bf16 Gaussians. Times are medians of ``triton.testing.do_bench`` (CUDA
events, L2 flushed between runs) after ``NewtonSchulz.tune`` (which measures a shape that has no
verdict; nothing where the shipped table holds it) and the untimed calls below,
taken in ``--rounds`` interleaved rounds (each in a rotated method order) and reduced to the
median over rounds.
Errors are max over matrices of ‖out − ref‖_F/‖ref‖_F with ref the float64 iteration of the
same algorithm and coefficients (``dmuon_ns.testing.reference_newton_schulz``).
Peak memory (``peak MiB``) is ``torch.cuda.max_memory_allocated`` over a method's first three
calls (the first compiles and captures; dmuon's ``tune`` comes before), above what was
allocated before them (the input, the caller's), the result included; ``held MiB`` is what stays allocated after them (CUDA graphs'
buffers, compiled callables' pools). For dmuon, ``kernel`` says which kernel auto ran and where
its verdict came from (``table``, ``measured``) and ``tune s`` what ``NewtonSchulz.tune`` took.
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
    "64x1408x2048",
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


def _methods(
    dion: str | None,
) -> dict[str, Callable[[list[Tensor] | Tensor], list[Tensor] | Tensor]]:
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
    if dion is not None:
        sys.path.insert(0, dion)
        from newton_schulz_triton import newton_schulz_triton

        def dion_ns(g: list[Tensor] | Tensor) -> list[Tensor] | Tensor:
            if isinstance(g, list):
                return [newton_schulz_triton(m) for m in g]
            return newton_schulz_triton(g)

        methods["dion triton"] = dion_ns
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


def _first_and_peak(
    fn: Callable[[list[Tensor] | Tensor], object], g: list[Tensor] | Tensor
) -> tuple[float, float, float]:
    """Seconds of the first call (compiles, captures); peak MiB above the allocation before
    the calls, over three calls, results included; MiB still allocated after them."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    first_s = 0.0
    for i in range(3):
        t0 = time.perf_counter()
        out = fn(g)
        torch.cuda.synchronize()
        if i == 0:
            first_s = time.perf_counter() - t0
        del out
    peak = torch.cuda.max_memory_allocated() - base
    held = torch.cuda.memory_allocated() - base
    return first_s, peak / 2**20, held / 2**20


def _auto_kernel(g: list[Tensor] | Tensor) -> str:
    """The kernel auto runs for ``g``'s problems and where each verdict came from."""
    from dmuon_ns import _autotune

    shapes = {tuple(t.shape) for t in _matrices(g)}
    found = []
    for choice in list(_autotune._choices.values()):
        if (
            tuple(choice.problem.shape[-2:]) in shapes
            or tuple(choice.problem.shape[-2:])[::-1] in shapes
        ):
            found.append(f"{choice.kernel.name} ({choice.source or 'no verdict'})")
    return ", ".join(sorted(set(found)))


def _installed(dists: tuple[str, ...]) -> dict[str, str]:
    """Each distribution's installed version, ``"absent"`` where it is not installed (what a
    log or a table records it ran with; ``ns_tables`` records its own with it)."""
    out = {}
    for dist in dists:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "absent"
    return out


def _versions() -> dict[str, str]:
    return {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        **_installed(("triton", "quack-kernels", "nvidia-cutlass-dsl", "gram-newton-schulz")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", default=ISSUE_SHAPES)
    parser.add_argument("--methods", nargs="*", default=None, help="subset of column names")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for logs")
    parser.add_argument("--rep-ms", type=float, default=300.0, help="timed ms per method")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop starting new shapes")
    parser.add_argument("--dion", default=None, help="folder of dion's newton_schulz_triton.py")
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

    methods = _methods(args.dion)
    if args.methods:
        methods = {k: v for k, v in methods.items() if k in args.methods}
    generator = torch.Generator(device="cuda").manual_seed(0)
    start = time.perf_counter()
    rows: list[tuple[str, dict[str, tuple[float, float, float, float]]]] = []
    for spec in args.shapes:
        if time.perf_counter() - start > args.budget_s:
            print(f"# budget spent, skipping {spec}", flush=True)
            continue
        g = _inputs(spec, generator)
        refs = _reference(g, muon=False)
        refs_muon = _reference(g, muon=True)
        results: dict[str, tuple[float, float, float, float]] = {}
        errors: dict[str, float] = {}
        memory: dict[str, tuple[float, float]] = {}
        for name, fn in methods.items():  # first call: compile, capture; error; memory
            try:
                t0 = time.perf_counter()
                if hasattr(fn, "tune"):  # measures where no verdict exists (none with a table)
                    fn.tune(g)
                tune_s = time.perf_counter() - t0
                first_s, *peak_held = _first_and_peak(fn, g)
                memory[name] = (peak_held[0], peak_held[1])
                out = fn(g)
                errors[name] = _error(out, refs_muon if name.startswith("torch.optim") else refs)
                del out
            except Exception as exc:
                print(f"# {spec} {name} failed: {exc!r}", flush=True)
                traceback.print_exc(file=sys.stdout)
                log.write(json.dumps({"shape": spec, "method": name, "error": repr(exc)}) + "\n")
                continue
            record = {"shape": spec, "method": name, "first_s": first_s, "tune_s": tune_s}
            record |= {"peak_mib": memory[name][0], "held_mib": memory[name][1]}
            if hasattr(fn, "tune"):
                record["kernel"] = _auto_kernel(g)
            log.write(json.dumps(record) + "\n")
            print(
                f"{spec:>14} {name:<28} first {first_s:6.2f} s  tune {tune_s:6.2f} s  peak"
                f" {memory[name][0]:8.1f} MiB  held {memory[name][1]:7.1f} MiB"
                f"  {record.get('kernel', '')}",
                flush=True,
            )
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
            results[name] = (ms, err, *memory[name])
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
                ms, err, peak, _ = results[name]
                cells.append(f"{ms:.3f} ({err:.1e}; {peak:.0f} MiB)")
            else:
                cells.append("—")
        print(f"| {spec} | " + " | ".join(cells) + " |")
    print("\nms median (relative error vs float64; peak MiB)")
    peers = [n for n in names if not n.startswith("dmuon")]
    for spec, results in rows:
        timed = [n for n in peers if n in results]
        if "dmuon[auto]" not in results or not timed:
            continue
        best = min(timed, key=lambda n: results[n][0])
        ratio = results["dmuon[auto]"][0] / results[best][0]
        line = f"# {spec}: dmuon[auto] / best public ({best}) = {ratio:.3f}"
        gns = "gram-newton-schulz+quack"
        if gns in results and results[gns][2] > 0:
            line += f"; peak / {gns}'s = {results['dmuon[auto]'][2] / results[gns][2]:.2f}"
        print(line)


if __name__ == "__main__":
    main()
