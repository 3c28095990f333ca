"""The Triton tile tables shipped with the package: their format, the nearest-product rule, and
what the H200 and H100 tables cover (no GPU needed: the tables are data)."""

from __future__ import annotations

import dataclasses
import importlib.resources
import json

import pytest

from dmuon_ns import _triton_tiles


@dataclasses.dataclass(frozen=True)
class Tile:
    block_m: int


KINDS = {"symmetric": [Tile(64), Tile(128)], "plain": [Tile(128)]}


def _table(*rows, candidates=None):
    data = {
        "format": _triton_tiles.FORMAT_VERSION,
        "candidates": candidates
        or {k: [dataclasses.asdict(t) for t in ts] for k, ts in KINDS.items()},
        "products": list(rows),
    }
    return _triton_tiles.parse_tiles(data, "test", KINDS)


def _row(m, k, ms, batch=1, symmetric=True, has_c=False):
    return {
        "symmetric": symmetric,
        "has_c": has_c,
        "has_diag": False,
        "batch": batch,
        "m": m,
        "n": m if symmetric else 4 * m,
        "k": k,
        "dtype": "float16",
        "out_dtype": "float16",
        "ms": ms,
    }


def _pick(rows, m, k, batch=1, symmetric=True, has_c=False, dtype="float16"):
    n = m if symmetric else 4 * m
    product = _triton_tiles.Product(symmetric, has_c, False, batch, m, n, k, dtype, dtype)
    return _triton_tiles.nearest_tile(rows, product)


def test_the_nearest_product_of_the_same_kind_picks_its_fastest_tile():
    rows = _table(_row(256, 1024, [0.1, 0.2]), _row(4096, 16384, [0.9, 0.5]))
    assert _pick(rows, 256, 1024) == 0
    assert _pick(rows, 512, 2048) == 0  # nearer the small product (log distance)
    assert _pick(rows, 2048, 8192) == 1
    assert _pick(rows, 8192, 32768) == 1
    assert _pick(rows, 256, 1024, has_c=True) is None  # no product of that kind measured
    assert _pick(rows, 256, 1024, dtype="bfloat16") is None
    # Another output dtype counts as distance 1 (an fp32 input's last product writes fp32).
    out32 = _row(256, 1024, [0.3, 0.1]) | {"out_dtype": "float32"}
    rows = _table(_row(256, 1024, [0.1, 0.2]), out32)
    assert _pick(rows, 256, 1024) == 0
    fp32 = dict(symmetric=True, has_c=False, has_diag=False, batch=1, m=256, n=256, k=1024)
    to32 = _triton_tiles.Product(**fp32, dtype="float16", out_dtype="float32")
    to16 = _triton_tiles.Product(**fp32, dtype="float16", out_dtype="bfloat16")
    assert _triton_tiles.nearest_tile(rows, to32) == 1
    assert _triton_tiles.nearest_tile(rows, to16) == 0


def test_other_candidates_leave_the_products_to_the_autotuner():
    stale = {"symmetric": [{"block_m": 32}], "plain": [{"block_m": 128}]}
    assert _table(_row(256, 1024, [0.1]), candidates=stale) == ()


def test_a_malformed_table_names_the_file():
    with pytest.raises(ValueError, match="not a format-1"):
        _triton_tiles.parse_tiles({"format": 99}, "x.json", KINDS)
    with pytest.raises(ValueError, match="test: malformed product"):
        _table(_row(256, 1024, [0.1]))  # one time for two candidates
    assert _triton_tiles.tiles_file("NVIDIA H200") == "nvidia-h200-tiles.json"
    assert _triton_tiles.tiles_file("Some GPU") is None


@pytest.mark.parametrize("card", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_each_card_tile_table_covers_every_kind_with_the_current_candidates(card):
    pytest.importorskip("triton")
    from dmuon_ns import _triton_kernels

    name = _triton_tiles.tiles_file(card)
    assert name is not None, card
    text = importlib.resources.files("dmuon_ns").joinpath("tables", name).read_text("utf-8")
    candidates = {"symmetric": _triton_kernels.SYM_TILES, "plain": _triton_kernels.MM_TILES}
    rows = _triton_tiles.parse_tiles(json.loads(text), name, candidates)
    assert rows, f"measured with other candidates: rerun benchmarks/ns_tiles.py on the {card}"
    kinds = {(r.product.symmetric, r.product.has_c, r.product.has_diag) for r in rows}
    # The Gram iteration's products: X·Xᵀ, the symmetric ones with C and a diagonal, Q·X.
    assert (True, False, False) in kinds and (False, False, False) in kinds
    assert all(
        len(r.ms) == len(candidates["symmetric" if r.product.symmetric else "plain"]) for r in rows
    )
