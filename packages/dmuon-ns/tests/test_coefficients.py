"""Coefficient sets: the published numbers, the safety factor, validation and extension."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dmuon_ns import (
    POLAR_EXPRESS_COEFFICIENTS,
    QUINTIC_COEFFICIENTS,
    YOU_COEFFICIENTS,
    YOU_SIX_STEP_COEFFICIENTS,
)
from dmuon_ns._coefficients import coefficients_for_steps, validate_coefficients

# Polar Express (arXiv:2505.16932), first published row and the final classical quintic.
_PE_FIRST = (8.28721201814563, -23.595886519098837, 17.300387312530933)


def _compose(coefficients, sigma, steps):
    x = np.asarray(sigma, dtype=np.float64)
    for a, b, c in coefficients_for_steps(coefficients, steps):
        x = a * x + b * x**3 + c * x**5
    return x


def test_polar_express_safety_factor() -> None:
    a, b, c = POLAR_EXPRESS_COEFFICIENTS[0]
    assert a == pytest.approx(_PE_FIRST[0] / 1.05, rel=1e-15)
    assert b == pytest.approx(_PE_FIRST[1] / 1.05**3, rel=1e-15)
    assert c == pytest.approx(_PE_FIRST[2] / 1.05**5, rel=1e-15)
    # p(x/1.05): the scaled first polynomial maps 1.05 where the published one maps 1.
    assert a * 1.05 + b * 1.05**3 + c * 1.05**5 == pytest.approx(sum(_PE_FIRST), rel=1e-12)
    assert POLAR_EXPRESS_COEFFICIENTS[-1] == (1.875, -1.25, 0.375)
    assert len(POLAR_EXPRESS_COEFFICIENTS) == 8


def test_sets_map_unit_interval_towards_one() -> None:
    sigma = np.geomspace(1e-3, 1.0, 200)
    pe = _compose(POLAR_EXPRESS_COEFFICIENTS, sigma, 5)
    assert pe.min() > 0.7 and pe.max() < 1.15
    # Past the published rows the unscaled final quintic converges to exactly 1.
    assert np.abs(_compose(POLAR_EXPRESS_COEFFICIENTS, sigma, 12) - 1).max() < 1e-6
    # Each set is tuned for its own smallest singular value; check it from there up.
    you = _compose(YOU_COEFFICIENTS, sigma[sigma > 4e-3], 5)
    assert you.min() > 0.6 and you.max() < 1.25
    six = _compose(YOU_SIX_STEP_COEFFICIENTS, sigma, 6)
    assert six.min() > 0.6 and six.max() < 1.25
    classic = _compose(QUINTIC_COEFFICIENTS, sigma[sigma > 0.05], 5)
    assert classic.min() > 0.6 and classic.max() < 1.25


def test_extension_reuses_last_row() -> None:
    rows = ((1.0, 2.0, 3.0), (4.0, 5.0, 6.0))
    assert coefficients_for_steps(rows, 1) == ((1.0, 2.0, 3.0),)
    assert coefficients_for_steps(rows, 4) == rows + ((4.0, 5.0, 6.0),) * 2


def test_validate_accepts_lists_and_numpy() -> None:
    rows = validate_coefficients([[1, 2, 3], (np.float32(4.5), 5.0, -6)])
    assert rows == ((1.0, 2.0, 3.0), (4.5, 5.0, -6.0))
    assert all(isinstance(v, float) for row in rows for v in row)
    assert validate_coefficients(None) is POLAR_EXPRESS_COEFFICIENTS


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ([(1.0, 2.0)], r"coefficients\[0\] must be a triple"),
        ([(1.0, 2.0, 3.0), (1.0, 2.0, 3.0, 4.0)], r"coefficients\[1\] must be a triple"),
        ([], "at least one"),
        ("abc", "sequence of"),
        ([(1.0, math.nan, 3.0)], "finite"),
        ([(1.0, math.inf, 3.0)], "finite"),
        ([(1.0, "x", 3.0)], "real numbers"),
        ([(1.0, True, 3.0)], "real numbers"),
        ([1.0, 2.0, 3.0], r"coefficients\[0\] must be a triple"),
    ],
)
def test_validate_rejects(bad, match) -> None:
    with pytest.raises(ValueError, match=match):
        validate_coefficients(bad)


def test_a_flat_triple_is_refused_naming_the_one_row_it_means() -> None:
    """torch.optim.Muon's ns_coefficients is one flat (a, b, c) for every step; given as
    dmuon's coefficients it is refused with the row to pass instead. A set of two numbers
    is no such row and gets no such hint."""
    with pytest.raises(ValueError, match=r"pass \[\(3\.4445, -4\.775, 2\.0315\)\], which"):
        validate_coefficients((3.4445, -4.775, 2.0315))
    with pytest.raises(ValueError, match=r"coefficients\[0\] must be a triple") as error:
        validate_coefficients([1.0, 2.0])
    assert "flat" not in str(error.value)
