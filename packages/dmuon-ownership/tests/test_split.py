"""Declared splits: a MatrixSplit validates itself, cuts a weight into consecutive row blocks
(or refuses, naming the weight and the fix), comes from a policy as a dict, and the planner
charges a split weight the sum of its pieces' work (see [Note: declared splits])."""

from __future__ import annotations

import math

import pytest

from dmuon_ownership import (
    MatrixSplit,
    RowBlock,
    WorkItem,
    ns_cost,
    plan_owners,
    resolve_param_policy,
)


def test_a_qkv_split_gives_q_k_and_v_or_every_head() -> None:
    gqa = MatrixSplit(4, 2)
    assert gqa == MatrixSplit(heads=4, kv_heads=2)
    assert gqa.blocks((32, 16), "qkv") == (
        RowBlock("q", 0, 1, 16),
        RowBlock("k", 16, 1, 8),
        RowBlock("v", 24, 1, 8),
    )
    assert [b.stop for b in gqa.blocks((32, 16), "qkv")] == [16, 24, 32]
    heads = MatrixSplit(heads=4, kv_heads=2, head_dim=4, per_head=True).blocks((32, 16), "qkv")
    assert heads == (RowBlock("q", 0, 4, 4), RowBlock("k", 16, 2, 4), RowBlock("v", 24, 2, 4))
    assert MatrixSplit(heads=2).kv_heads == 2  # multi-head attention
    assert MatrixSplit(heads=2).blocks((6, 5), "w") == tuple(
        RowBlock(part, 2 * i, 1, 2) for i, part in enumerate("qkv")
    )


def test_a_row_split_gives_its_blocks_or_their_heads() -> None:
    assert MatrixSplit(rows=(24, 24)).blocks((48, 16), "gate_up") == (
        RowBlock("rows 0:24", 0, 1, 24),
        RowBlock("rows 24:48", 24, 1, 24),
    )
    per_head = MatrixSplit(rows=[48], head_dim=4, per_head=True)  # type: ignore[arg-type]
    assert per_head.rows == (48,)
    assert per_head.blocks((48, 16), "w") == (RowBlock("rows 0:48", 0, 12, 4),)
    assert str(per_head) == "MatrixSplit(rows=(48,), head_dim=4, per_head=True)"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, r"MatrixSplit needs either rows=\(\.\.\.\) .* not neither"),
        ({"rows": (2, 2), "heads": 2}, r"MatrixSplit needs either .* not both"),
        ({"heads": 0}, r"MatrixSplit.heads must be an int >= 1, got 0"),
        ({"heads": 4, "kv_heads": True}, r"MatrixSplit.kv_heads must be an int >= 1, got True"),
        ({"heads": 4, "kv_heads": 3}, r"MatrixSplit: kv_heads=3 does not divide heads=4"),
        ({"heads": 4, "per_head": 1}, r"MatrixSplit.per_head must be True or False, got 1"),
        ({"rows": ()}, r"MatrixSplit.rows must be a non-empty sequence of ints >= 1"),
        ({"rows": 16}, r"MatrixSplit.rows must be a non-empty sequence of ints >= 1 .*, got 16"),
        ({"rows": (8, 0)}, r"MatrixSplit.rows must be a non-empty sequence"),
        ({"rows": (8, 8), "kv_heads": 2}, r"MatrixSplit: kv_heads goes with heads"),
        ({"rows": (8, 8), "per_head": True}, r"per_head=True\) needs head_dim"),
        ({"rows": (8, 8), "head_dim": 4}, r"cuts the blocks into heads only with per_head=True"),
        ({"rows": (8,)}, r"MatrixSplit\(rows=\(8,\)\) has one block, the whole weight"),
    ],
)
def test_a_split_validates_itself(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MatrixSplit(**kwargs)  # type: ignore[arg-type]


def test_a_split_that_does_not_fit_the_shape_names_the_weight() -> None:
    gqa = MatrixSplit(heads=4, kv_heads=2)
    with pytest.raises(ValueError, match=r"'w' \(shape \(2, 32, 16\)\) has a declared split"):
        gqa.blocks((2, 32, 16), "w")
    with pytest.raises(ValueError, match=r"'w' has 30 rows, which its declared split's 8 heads"):
        gqa.blocks((30, 16), "w")


def test_a_policy_declares_a_split_as_a_dict() -> None:
    policy = {"overrides": [{"name": ["qkv"], "set": {"split": {"heads": 4, "kv_heads": 2}}}]}
    assert resolve_param_policy("layers.0.qkv.weight", policy).split == MatrixSplit(4, 2)
    assert resolve_param_policy("layers.0.o.weight", policy).split is None
    rows = {"defaults": {"split": {"rows": [8, 8]}}}
    assert resolve_param_policy("x", rows).split == MatrixSplit(rows=(8, 8))
    with pytest.raises(ValueError, match=r"param_policy\['defaults'\]\['split'\]: split must be"):
        resolve_param_policy("x", {"defaults": {"split": "qkv"}})
    with pytest.raises(ValueError, match=r"unknown split field\(s\) \['heads_dim'\]"):
        resolve_param_policy("x", {"defaults": {"split": {"heads": 4, "heads_dim": 8}}})


def test_the_planner_charges_a_split_weight_its_pieces() -> None:
    pieces = ((1, 16, 16), (2, 8, 16))  # q, then k and v
    split = WorkItem("qkv", (32, 16), "layers.0", matrices=pieces)  # type: ignore[arg-type]
    assert split.stacks == pieces and WorkItem("o", (16, 16), "").stacks == ((16, 16),)
    whole = WorkItem("qkv", (32, 16), "layers.0")
    alone = [plan_owners([item], 1).loads[0] for item in (split, whole)]
    assert alone[0] == math.fsum(ns_cost(p) for p in pieces) < alone[1] == ns_cost((32, 16))
    # The separate weights cost as much as the split one.
    separate = [
        WorkItem(name, shape, "layers.0")
        for name, shape in (("q", (16, 16)), ("k", (8, 16)), ("v", (8, 16)))
    ]
    assert sum(plan_owners(separate, 1, small_param_threshold=0).loads) == alone[0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"matrices": ((1, 16),)}, r"matrices must be \(count, rows, cols\) triples of ints"),
        ({"matrices": 3}, r"matrices must be \(count, rows, cols\) triples"),
        ({"matrices": ((1, 16, 16),)}, r"hold 256 elements, but its shape \(32, 16\) holds 512"),
        (
            {"matrices": ((2, 16, 16),), "route": "adamw"},
            r"\(a declared split\) are what Muon orthogonalises, but its route is 'adamw'",
        ),
    ],
)
def test_work_item_matrices_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WorkItem("w", (32, 16), "layers.0", **kwargs)  # type: ignore[arg-type]
