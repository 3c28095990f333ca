"""Tile choices shipped with the package, so that a new process compiles one tile per product.

[Note: shipped tiles]
Without a choice, each Triton product picks its tiles with Triton's autotuner
(``_triton_kernels``' [Note: tile autotuning]), which compiles every candidate for every specialisation it
meets before timing them: on a bare H200 the first step of an 8-layer H=4096 Llama stack spent
11.8 s there (22.1 s for a 16-layer H=2048 one), all inside the first ``optimizer.step()``.
A tile table (``tables/<card>-tiles.json``, written by ``benchmarks/ns_tiles.py`` on the card
it names) holds, for every product the NS problems of the kernel table run (symmetric or
plain, epilogue, batch, ``m``, ``n``, ``k``, dtypes), each candidate's measured time. A product
then runs the fastest candidate of the nearest measured product of the same kind and operand
dtype (distance: the sum of the absolute log-ratios of ``m``, ``n`` and ``k``, a quarter of
the batch's, and 1 for another output dtype: the table measures bf16 NS inputs, and an fp32
input's last product writes fp32), launched directly: one compile per tile it uses, no timing
inside a call. A card without a table, or a table whose candidates are not the kernels'
current ones, leaves every product to Triton's autotuner.

Tiles never change a bit of a product (``_triton_kernels``' [Note: symmetric products]: the
same K order whatever the tile), so the table decides speed only.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

__all__ = ["Product", "TileRow", "load_tiles", "nearest_tile", "parse_tiles", "tiles_file"]

FORMAT_VERSION = 1
_FILES = {
    "NVIDIA H200": "nvidia-h200-tiles.json",
    "NVIDIA H100 80GB HBM3": "nvidia-h100-tiles.json",
}


class Product(NamedTuple):
    """A product the Triton kernel runs: its kind, sizes and dtypes (torch's names, without
    ``torch.``)."""

    symmetric: bool
    has_c: bool
    has_diag: bool
    batch: int
    m: int
    n: int
    k: int
    dtype: str
    out_dtype: str


class TileRow(NamedTuple):
    """One measured product and each candidate's median ms on it."""

    product: Product
    ms: tuple[float, ...]


def tiles_file(device_name: str) -> str | None:
    """The file name of ``device_name``'s tile table, or ``None`` when that card has none."""
    return _FILES.get(device_name)


def parse_tiles(data: Any, where: str, candidates: dict[str, Sequence[Any]]) -> tuple[TileRow, ...]:
    """The rows of a tile table's JSON object, or none when its candidates are not
    ``candidates`` (``{"symmetric": [...], "plain": [...]}``, dataclasses of the kernels' tile
    lists); ``ValueError`` naming ``where`` when malformed."""
    if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
        raise ValueError(f"{where}: not a format-{FORMAT_VERSION} dmuon-ns tile table")
    current = {kind: [dataclasses.asdict(t) for t in tiles] for kind, tiles in candidates.items()}
    if data.get("candidates") != current:
        return ()
    rows = []
    for row in data.get("products", []):
        try:
            kind = "symmetric" if row["symmetric"] else "plain"
            ms = tuple(float(t) for t in row["ms"])
            if len(ms) != len(current[kind]):
                raise ValueError(f"{len(ms)} times for {len(current[kind])} candidates")
            product = Product(
                bool(row["symmetric"]),
                bool(row["has_c"]),
                bool(row["has_diag"]),
                int(row["batch"]),
                int(row["m"]),
                int(row["n"]),
                int(row["k"]),
                str(row["dtype"]),
                str(row["out_dtype"]),
            )
            rows.append(TileRow(product, ms))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{where}: malformed product {row!r} ({err})") from err
    return tuple(rows)


def load_tiles(device_name: str, candidates: dict[str, Sequence[Any]]) -> tuple[TileRow, ...]:
    """Every row of ``device_name``'s tile table (none for a card without one, or one measured
    with other ``candidates``; see :func:`parse_tiles`)."""
    name = tiles_file(device_name)
    if name is None:
        return ()
    source = importlib.resources.files("dmuon_ns").joinpath("tables", name)
    if not source.is_file():
        return ()
    return parse_tiles(json.loads(source.read_text("utf-8")), name, candidates)


def nearest_tile(rows: Sequence[TileRow], product: Product) -> int | None:
    """The index of the fastest candidate of the nearest measured product of ``product``'s
    kind (see the note), or ``None`` when none of this kind was measured."""

    def kind(p: Product) -> tuple[bool, bool, bool, str]:
        return p.symmetric, p.has_c, p.has_diag, p.dtype

    same = [r for r in rows if kind(r.product) == kind(product)]
    if not same:
        return None

    def distance(row: TileRow) -> float:
        near = row.product
        sizes = ((near.m, product.m), (near.n, product.n), (near.k, product.k))
        logs = sum(abs(math.log(a / b)) for a, b in sizes)
        batch = 0.25 * abs(math.log(near.batch / product.batch))
        return logs + batch + (near.out_dtype != product.out_dtype)

    best = min(same, key=distance)
    return min(range(len(best.ms)), key=best.ms.__getitem__)
