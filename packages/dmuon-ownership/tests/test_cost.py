"""The cost model against an independent count of the GEMMs each NS variant runs."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dmuon_ownership import Route, elementwise_cost, ns_cost, ns_flops, tp_gram_pays
from dmuon_ownership._cost import TP_LINK_BALANCE


def _gemm(a: int, b: int, c: int) -> int:
    return 2 * a * b * c  # (a, b) @ (b, c)


def _reference_flops(rows: int, cols: int, steps: int, restarts: int) -> int:
    """Enumerate the matmuls of the NS variant the runtime runs on this shape."""
    m, n = sorted((rows, cols))
    gemms: list[tuple[int, int, int]] = []
    if m == n:  # direct NS
        for _ in range(steps):
            gemms += [(m, n, m), (m, m, m), (m, m, n)]  # X Xᵀ, A·A, B·X
    else:  # Gram NS
        gemms.append((m, n, m))  # R = X Xᵀ
        for _ in range(steps):
            gemms += [(m, m, m)] * 4  # R², Q·Z, Z·R, (ZR)·Z
        for _ in range(restarts):
            gemms += [(m, m, n), (m, n, m)]  # X = QX, R = XXᵀ
        gemms.append((m, m, n))  # final QX
    return sum(_gemm(*g) for g in gemms)


@given(
    st.integers(1, 5000),
    st.integers(1, 5000),
    st.integers(1, 8),
    st.integers(0, 2),
)
def test_ns_flops_matches_gemm_count(rows: int, cols: int, steps: int, restarts: int) -> None:
    assert ns_flops(rows, cols, steps, restarts=restarts) == _reference_flops(
        rows, cols, steps, restarts
    )
    assert ns_flops(rows, cols, steps, restarts=restarts) == ns_flops(
        cols, rows, steps, restarts=restarts
    )


def test_ns_cost_ratios_follow_the_matmuls_not_the_element_count() -> None:
    square = ns_cost((4096, 4096))
    mlp = ns_cost((14336, 4096))
    assert mlp == ns_cost((4096, 14336))
    # Gram NS: 68 m³ against direct NS on the square: 30 m³ (elementwise terms add a little).
    assert 2.2 < mlp / square < 2.35
    assert mlp / square < (14336 * 4096) / (4096 * 4096)


def test_ns_cost_batch_and_adamw() -> None:
    assert ns_cost((3, 64, 128)) == 3 * ns_flops(64, 128) + elementwise_cost(
        3 * 64 * 128, Route.MUON
    )
    assert ns_cost((10,), "adamw") == 2 * ns_cost((5,), "adamw") == 2 * ns_cost((5, 1), "adamw")
    assert ns_cost((7, 3), Route.SHARDED_ADAMW) == elementwise_cost(21, Route.SHARDED_ADAMW)
    assert ns_cost((0, 5)) == 0.0
    assert math.isfinite(ns_cost((131072, 131072)))


def test_ns_cost_errors() -> None:
    with pytest.raises(ValueError, match=r"ns_cost: route 'muon' needs a matrix, got shape \(5,\)"):
        ns_cost((5,))
    with pytest.raises(ValueError, match=r"ns_cost: route: unknown route 'sgd'; use one of 'muon'"):
        ns_cost((5, 5), "sgd")
    with pytest.raises(ValueError, match=r"ns_flops: need steps >= 1 and restarts >= 0, got 0, 1"):
        ns_flops(4, 4, 0)


def _tp_rank_time(short: int, long: int, tp: int, itemsize: int, gram: bool) -> float:
    """One rank's share of orthogonalising a short x long matrix split over ``tp`` ranks on
    its long side, in FLOPs (bytes one way on its link at TP_LINK_BALANCE FLOP per byte),
    counted message by message: gathered on each TP owner in turn (one matrix per owner),
    or distributed Gram NS (ring all-reduces of the fp32 Gram matrix, input and restart)."""
    shard = short * long // tp * itemsize
    if gram:
        ring = 2 * (tp - 1) * (short * short * 4 / tp)  # reduce-scatter + all-gather chunks
        block = 4 * short * short * (long // tp) * 2 + 8 * short**3 * 5
        return 2 * ring * TP_LINK_BALANCE + block
    received = 0.0
    for owner in range(tp):  # rank 0's bytes in: the others' shards when it owns, else its update
        received += (tp - 1) * shard if owner == 0 else shard
    return received / tp * TP_LINK_BALANCE + ns_flops(short, long) / tp


@given(st.integers(1, 64), st.integers(1, 64), st.sampled_from([2, 4, 8]), st.sampled_from([2, 4]))
def test_tp_gram_pays_where_it_takes_a_rank_less_time(a: int, b: int, tp: int, itemsize: int):
    short, long = 64 * min(a, b), 64 * tp * max(a, b)
    faster = _tp_rank_time(short, long, tp, itemsize, True) < _tp_rank_time(
        short, long, tp, itemsize, False
    )
    assert tp_gram_pays(short, long, tp, itemsize=itemsize) == faster


def test_tp_gram_pays_only_for_wide_matrices_of_modest_width() -> None:
    assert tp_gram_pays(1024, 50304, 2, itemsize=4)  # a small model's head at TP 2
    assert not tp_gram_pays(8192, 28672, 8, itemsize=4)  # a 70B MLP at TP 8
    assert not tp_gram_pays(4096, 128256, 8, itemsize=4)
    assert not tp_gram_pays(1024, 50304, 1, itemsize=4)  # nothing to split
