"""The kernel tables shipped with the package: their format, the lookup rules, and what the
H200 table covers (no GPU needed: the tables are data)."""

from __future__ import annotations

import importlib.resources
import json

import pytest

from dmuon_ns import _tables


def _entries(*rows):
    return _tables.parse({"format": _tables.FORMAT_VERSION, "problems": list(rows)}, "test")


def _row(batch, ms, rejected=None, m=64, n=256, op="gram"):
    row = {"op": op, "batch": batch, "m": m, "n": n, "dtype": "float16", "ms": ms}
    return row | ({"rejected": rejected} if rejected else {})


def test_the_nearest_batch_answers_ties_to_the_smaller():
    entries = _entries(_row(1, {"torch": 1.0}), _row(4, {"torch": 2.0}), _row(16, {"torch": 3.0}))
    nearest = {
        b: _tables.entry_for(entries, "gram", b, 64, 256, "float16").batch for b in range(1, 33)
    }
    assert nearest[1] == 1 and nearest[2] == 1  # 2/1 = 4/2: the smaller
    assert nearest[3] == 4 and nearest[8] == 4 and nearest[9] == 16 and nearest[32] == 16
    assert _tables.entry_for(entries, "direct", 1, 64, 256, "float16") is None
    assert _tables.entry_for(entries, "gram", 1, 64, 256, "bfloat16") is None


def test_the_fastest_covered_candidate_wins():
    entry = _entries(_row(1, {"quack": 0.5, "triton": 0.6, "torch": 0.7}))[0]
    assert _tables.verdict_kernel(entry, ["quack", "triton", "torch"]) == "quack"
    assert _tables.verdict_kernel(entry, ["triton", "torch"]) == "triton"
    assert _tables.verdict_kernel(entry, ["mine", "torch"]) is None  # never compared
    rejected = _entries(_row(1, {"torch": 0.7}, rejected={"quack": "non-finite output"}))[0]
    assert _tables.verdict_kernel(rejected, ["quack", "torch"]) == "torch"
    tie = _entries(_row(1, {"a": 0.5, "b": 0.5}))[0]
    assert _tables.verdict_kernel(tie, ["b", "a"]) == "b"  # the earlier in priority order


@pytest.mark.parametrize(
    "data",
    [
        {"format": 2, "problems": []},
        {"format": 1, "problems": [{"op": "gram", "batch": 1}]},
        {"format": 1, "problems": [_row("one", {"torch": 1.0})]},
    ],
)
def test_a_malformed_table_is_an_error_naming_the_file(data):
    with pytest.raises(ValueError, match=r"^broken\.json: "):
        _tables.parse(data, "broken.json")


@pytest.mark.parametrize(
    ("card", "file", "date"),
    [
        ("NVIDIA H200", "nvidia-h200.json", "2026-12-04"),
        ("NVIDIA H100 80GB HBM3", "nvidia-h100.json", "2026-12-05"),
    ],
)
def test_each_card_table_covers_the_common_shapes_for_every_kernel(card, file, date):
    assert _tables.table_file(card) == file
    assert _tables.table_file("NVIDIA H100 PCIe") is None  # measured cards only
    text = importlib.resources.files("dmuon_ns").joinpath("tables", file)
    data = json.loads(text.read_text("utf-8"))
    assert data["device"] == card and data["measured"]["date"].startswith(date)
    entries = _tables.load(card)
    assert len(entries) == len(data["problems"]) >= 40
    for entry in entries:
        assert set(entry.ms) | set(entry.rejected) == {"quack", "triton", "torch"}, entry
        assert entry.m <= entry.n and (entry.op == "direct") == (entry.m == entry.n), entry
    for op, batch, m, n in [
        ("gram", 1, 1024, 4096),
        ("gram", 1, 2048, 8192),
        ("direct", 1, 4096, 4096),
        ("gram", 1, 4096, 14336),
        ("gram", 1, 8192, 28672),
        ("gram", 64, 1408, 2048),
    ]:
        entry = _tables.entry_for(entries, op, batch, m, n, "float16")
        assert entry is not None and entry.batch == batch, (op, batch, m, n)
