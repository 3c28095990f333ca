"""Measure the kernel table that ``dmuon_ns`` ships for this card (``_tables``' note).

    python benchmarks/ns_tables.py --out packages/dmuon-ns/src/dmuon_ns/tables/nvidia-h200.json
    python benchmarks/ns_tables.py --out ... --add   # only the problems the file lacks

Needs a CUDA device. For every problem below, the autotuner's own measurement
(``_autotune.measure``: the cross-check against float64, then each candidate timed against
torch) of every kernel available here, in fp16, 5 Polar Express steps with a restart at 2, as
``NewtonSchulz()`` runs them; the file gets each problem's median times and rejections, with
the date, card and versions. ``--log`` also records the seconds each measurement took (the
first problems pay the compiles). Problems are (op, batch, m, n) after the front end's
transposition (m ≤ n): the issue's five shapes, the 2-D weights of Llama 3 (8B, 70B), Qwen
2.5 7B, Qwen3 (8B, 30B-A3B), DeepSeek-V3 and Kimi K2, batched as the optimizer batches them
(``ns_batch_bytes``: 64 MiB of bf16 by default until 2026-12-04, 256 MiB since) and alone,
and expert stacks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
from ns_bench import _installed

# (op, batch, m, n). Square matrices run direct NS, others Gram NS.
PROBLEMS: list[tuple[str, int, int, int]] = [
    # The shapes, alone and batched.
    ("gram", 1, 1024, 4096),
    ("gram", 1, 2048, 8192),
    ("direct", 1, 4096, 4096),
    ("gram", 1, 4096, 14336),
    ("gram", 1, 8192, 28672),
    # DeepSeek-V2-Lite / Moonlight experts: 64 × 1408 × 2048.
    ("gram", 64, 1408, 2048),
    ("gram", 8, 1408, 2048),
    ("gram", 8, 1024, 4096),
    ("gram", 32, 1024, 4096),
    ("direct", 2, 4096, 4096),
    ("gram", 2, 2048, 8192),
    # The same at the 256 MiB cap.
    ("gram", 8, 2048, 8192),
    ("direct", 8, 4096, 4096),
    ("gram", 2, 4096, 14336),
    # Llama 3.2 1B (its q and o, 16 layers: 32 matrices of 8 MiB in one call at the cap) and 3B.
    ("direct", 1, 2048, 2048),
    ("direct", 32, 2048, 2048),
    ("direct", 1, 3072, 3072),
    ("direct", 14, 3072, 3072),
    # Llama 3 70B; Qwen3 8B; Qwen 2.5 7B.
    ("direct", 1, 8192, 8192),
    ("gram", 1, 1024, 8192),
    ("gram", 4, 1024, 8192),
    ("gram", 16, 1024, 8192),
    ("gram", 1, 4096, 12288),
    ("direct", 1, 3584, 3584),
    ("direct", 2, 3584, 3584),
    ("gram", 1, 512, 3584),
    ("gram", 16, 512, 3584),
    ("gram", 1, 3584, 18944),
    # Qwen3 30B-A3B: attention, and experts (gate and up apart, and down: 768 × 2048).
    ("gram", 1, 2048, 4096),
    ("gram", 4, 2048, 4096),
    ("gram", 1, 512, 2048),
    ("gram", 32, 512, 2048),
    ("gram", 16, 768, 2048),
    ("gram", 128, 768, 2048),
    # DeepSeek-V3 and Kimi K2 (multi-head latent attention, dense and expert MLPs).
    ("gram", 1, 1536, 7168),
    ("gram", 1, 1536, 24576),
    ("gram", 1, 1536, 12288),
    ("gram", 1, 576, 7168),
    ("gram", 1, 512, 32768),
    ("gram", 1, 512, 16384),
    ("gram", 1, 7168, 16384),
    ("gram", 1, 7168, 8192),
    ("gram", 1, 7168, 18432),
    ("gram", 1, 256, 7168),
    ("gram", 1, 384, 7168),
    ("gram", 1, 2048, 7168),
    ("gram", 2, 2048, 7168),
    ("gram", 8, 2048, 7168),
]


def _versions() -> dict[str, str]:
    return {
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        **_installed(("triton", "quack-kernels", "nvidia-cutlass-dsl", "dmuon-ns")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the table file to write")
    parser.add_argument("--log", default=None, help="JSON lines: every measurement in full")
    parser.add_argument("--budget-s", type=float, default=600.0, help="stop starting problems")
    parser.add_argument(
        "--add",
        action="store_true",
        help="keep the problems --out already has and measure only the others; each new row"
        " carries its own date, command and versions",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ns_tables needs a CUDA device")
    from dmuon_ns import NewtonSchulz, _autotune
    from dmuon_ns._prepare import describe
    from dmuon_ns._registry import resolve

    device = torch.device("cuda")
    config = NewtonSchulz()
    kernels = resolve("auto", False, device, use_env=False).kernels
    print(f"# candidates: {[k.name for k in kernels]}", flush=True)
    log = open(args.log, "a") if args.log else None
    measured = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "candidates": [k.name for k in kernels],
        **_versions(),
    }
    kept: dict = {}
    if args.add and Path(args.out).exists():
        kept = json.loads(Path(args.out).read_text(encoding="utf-8"))
        if kept.get("device") != torch.cuda.get_device_name():
            raise SystemExit(f"--add: {args.out} is the table of {kept.get('device')!r}")
    have = {(r["op"], r["batch"], r["m"], r["n"]) for r in kept.get("problems", [])}
    rows = []
    start = time.perf_counter()
    for op, batch, m, n in [p for p in PROBLEMS if p not in have]:
        if time.perf_counter() - start > args.budget_s:
            print(f"# budget spent, skipping {op} {batch}x{m}x{n}", flush=True)
            continue
        problem = describe((batch, m, n), torch.float16, device)
        restarts = config.restarts if op == "gram" else ()
        verdict = _autotune.measure(kernels, problem, op, config.step_coefficients, restarts)
        row = {
            "op": op,
            "batch": batch,
            "m": m,
            "n": n,
            "dtype": "float16",
            "ms": verdict["times_ms"],
            "rejected": verdict["rejected"],
        }
        if kept:
            row["measured"] = measured  # not the file's: the rows it had keep that one
        rows.append(row)
        print(
            f"{op:>6} {batch:>3}x{m}x{n}: {verdict['kernel']:<6} {verdict['times_ms']}"
            f" rejected {list(verdict['rejected'])} in {verdict['seconds']:.2f} s",
            flush=True,
        )
        if log is not None:
            log.write(json.dumps({"problem": [op, batch, m, n], "verdict": verdict}) + "\n")
            log.flush()
        torch.cuda.empty_cache()
    table = {
        "format": 1,
        "device": torch.cuda.get_device_name(),
        "measured": kept.get("measured", measured),
        "problems": [*kept.get("problems", []), *rows],
    }
    Path(args.out).write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    print(f"# wrote {len(rows)} problems to {args.out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
