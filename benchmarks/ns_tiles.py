"""Measure the Triton tile table ``dmuon_ns`` ships for this card (``_triton_tiles``' note).

    python benchmarks/ns_tiles.py --out packages/dmuon-ns/src/dmuon_ns/tables/nvidia-h200-tiles.json

Needs a CUDA device and Triton. For every problem of ``ns_tables.PROBLEMS`` it runs Newton–Schulz
on the Triton kernel once (fp16, 5 Polar Express steps, as ``NewtonSchulz()`` runs them, no
CUDA graph) and records each matrix product the iterations ask for: symmetric or plain, its
epilogue, batch, ``m × k`` by ``k × n``, operand and output dtypes. Each distinct product is
then timed with every tile candidate of ``_triton_kernels`` (Triton's ``do_bench``, median),
on operands laid out as in the run (a Gram matrix's ``Xᵀ`` is a strided view). The file gets
the candidates and, per product, each one's median ms, with the date, card and versions.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import time
from pathlib import Path

import torch
from ns_tables import PROBLEMS

import dmuon_ns
from dmuon_ns import _triton_kernels as kernels

Product = tuple[bool, bool, bool, int, int, int, int, tuple[int, ...], tuple[int, ...], str, str]


def _record(op: str, batch: int, m: int, n: int) -> set[Product]:
    """The products one NS call of the problem runs on the Triton kernel."""
    seen: set[Product] = set()
    original = kernels.matmul

    def recording(a, b, *, c=None, alpha=1.0, beta=0.0, diag=0.0, symmetric=False, **kw):
        out = original(a, b, c=c, alpha=alpha, beta=beta, diag=diag, symmetric=symmetric, **kw)
        seen.add(
            (
                symmetric,
                c is not None,
                diag != 0.0,
                a.shape[0],
                a.shape[1],
                b.shape[2],
                a.shape[2],
                tuple(a.stride()),
                tuple(b.stride()),
                str(a.dtype).removeprefix("torch."),
                str(out.dtype).removeprefix("torch."),
            )
        )
        return out

    kernels.matmul = recording
    try:
        ns = dmuon_ns.NewtonSchulz(
            backend=op, kernel="triton", dtype=torch.float16, cuda_graphs=False
        )
        g = torch.randn(batch, m, n, device="cuda", dtype=torch.bfloat16)
        ns(g)
        torch.cuda.synchronize()
    finally:
        kernels.matmul = original
    return seen


def _time(product: Product) -> list[float]:
    """Median ms of the product with each tile candidate."""
    symmetric, has_c, has_diag, batch, m, n, k, a_stride, b_stride, dtype, out_dtype = product
    dt, out_dt = getattr(torch, dtype), getattr(torch, out_dtype)
    a = torch.empty_strided((batch, m, k), a_stride, device="cuda", dtype=dt).normal_()
    b = torch.empty_strided((batch, k, n), b_stride, device="cuda", dtype=dt).normal_()
    if symmetric:  # a symmetric product's operands are the iterates: keep them symmetric
        b = a.mT if b_stride == tuple(a.mT.stride()) else b
    c = torch.randn(batch, m, n, device="cuda", dtype=out_dt) if has_c else None
    candidates = kernels.SYM_TILES if symmetric else kernels.MM_TILES
    times = []
    for config in candidates:

        def run(config=config):
            kernels.matmul(
                a,
                b,
                c=c,
                beta=0.5 if has_c else 0.0,
                diag=1.5 if has_diag else 0.0,
                symmetric=symmetric,
                out_dtype=out_dt,
                config=config,
            )

        times.append(float(kernels.triton.testing.do_bench(run, warmup=10, rep=40)))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    start = time.perf_counter()
    products: set[Product] = set()
    for op, batch, m, n in PROBLEMS:
        products |= _record(op, batch, m, n)
    rows = []
    for product in sorted(products):
        symmetric, has_c, has_diag, batch, m, n, k, _, _, dtype, out_dtype = product
        rows.append(
            {
                "symmetric": symmetric,
                "has_c": has_c,
                "has_diag": has_diag,
                "batch": batch,
                "m": m,
                "n": n,
                "k": k,
                "dtype": dtype,
                "out_dtype": out_dtype,
                "ms": [round(t, 5) for t in _time(product)],
            }
        )
    table = {
        "format": 1,
        "device": torch.cuda.get_device_name(),
        "measured": {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": "python benchmarks/ns_tiles.py --out " + str(args.out),
            "torch": torch.__version__,
            "triton": importlib.metadata.version("triton"),
            "seconds": round(time.perf_counter() - start, 1),
        },
        "candidates": {
            "symmetric": [dataclasses.asdict(t) for t in kernels.SYM_TILES],
            "plain": [dataclasses.asdict(t) for t in kernels.MM_TILES],
        },
        "products": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{len(rows)} products, {table['measured']['seconds']} s -> {args.out}")


if __name__ == "__main__":
    main()
