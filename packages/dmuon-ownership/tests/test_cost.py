"""The cost model against an independent count of the GEMMs each NS variant runs."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dmuon_ownership import Route, elementwise_cost, ns_cost, ns_flops


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
