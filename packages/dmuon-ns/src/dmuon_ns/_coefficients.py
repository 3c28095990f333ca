"""Quintic Newton–Schulz coefficient sets and their validation.

Every step of NS applies the odd quintic ``p(x) = a·x + b·x³ + c·x⁵`` to the singular values of
the (normalised) iterate, written for matrices as ``X ← (aI + bR + cR²)·X`` with ``R = X·Xᵀ``.
A coefficient set is a sequence of ``(a, b, c)`` rows, one per step.

[Note: which coefficients, and what happens past the end of a set]
``POLAR_EXPRESS_COEFFICIENTS`` (the default) are the per-iteration polynomials published with
Polar Express (Amsel, Persson, Musco, Gower, arXiv:2505.16932) for its default setting
(lower singular value bound 1e-3, degree 5). Each optimised row is divided by a safety factor
of 1.05 as ``(a/1.05, b/1.05³, c/1.05⁵)``, that is ``p(x/1.05)``: singular values up to 1.05
(fp16 rounding pushes the top ones above 1) are still mapped into the convergent region.
The paper's final row ``(1.875, -1.25, 0.375)`` is the classical quintic whose fixed point
is exactly 1; it is left unscaled, as in the paper's own code, because scaling it would move
that fixed point to ≈0.9997 (each further step would then shrink the result). The first five
rows, the ones the default ``steps=5`` uses, equal the set of the Gram Newton–Schulz
reference implementation.

``YOU_COEFFICIENTS`` are Jiacheng You's five tuned rows (x.com/YouJiacheng/status/
1905861218138804534), the set that the Gram Newton–Schulz reference, Dion and modded-nanogpt
ship under that name; his earlier six-step set (x.com/YouJiacheng/status/1893704552689303901,
rows ``k/1024``) is ``YOU_SIX_STEP_COEFFICIENTS``. ``QUINTIC_COEFFICIENTS`` is Keller Jordan's
original single row, repeated for every step.

A set shorter than ``steps`` is extended with its last row: every set above ends in a row
meant to be repeated (a converged polynomial), and the classic quintic is a one-row set.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

Coefficients = tuple[tuple[float, float, float], ...]
# What a kernel and the loops take: one (a, b, c) row per step, any sequence.
CoefficientRows = Sequence[tuple[float, float, float]]

_SAFETY = 1.05

_POLAR_EXPRESS_PUBLISHED: Coefficients = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)

POLAR_EXPRESS_COEFFICIENTS: Coefficients = (
    *((a / _SAFETY, b / _SAFETY**3, c / _SAFETY**5) for a, b, c in _POLAR_EXPRESS_PUBLISHED[:-1]),
    _POLAR_EXPRESS_PUBLISHED[-1],
)

YOU_COEFFICIENTS: Coefficients = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)

YOU_SIX_STEP_COEFFICIENTS: Coefficients = (
    (3955 / 1024, -8306 / 1024, 5008 / 1024),
    (3735 / 1024, -6681 / 1024, 3463 / 1024),
    (3799 / 1024, -6499 / 1024, 3211 / 1024),
    (4019 / 1024, -6385 / 1024, 2906 / 1024),
    (2677 / 1024, -3029 / 1024, 1162 / 1024),
    (2172 / 1024, -1833 / 1024, 682 / 1024),
)

QUINTIC_COEFFICIENTS: Coefficients = ((3.4445, -4.7750, 2.0315),)


def validate_coefficients(
    coefficients: Sequence[Sequence[float]] | None, *, name: str = "coefficients"
) -> Coefficients:
    """Return ``coefficients`` as a tuple of float triples (``None`` → Polar Express), or raise
    ``ValueError`` naming the first bad row."""
    if coefficients is None:
        return POLAR_EXPRESS_COEFFICIENTS
    if isinstance(coefficients, str | bytes) or not isinstance(coefficients, Sequence):
        raise ValueError(
            f"{name} must be a sequence of (a, b, c) rows, e.g. [(3.4445, -4.7750, 2.0315)],"
            f" got {type(coefficients).__name__}"
        )
    if len(coefficients) == 0:
        raise ValueError(f"{name} must hold at least one (a, b, c) row, got an empty sequence")
    rows = []
    for i, row in enumerate(coefficients):
        if isinstance(row, str | bytes) or not isinstance(row, Sequence) or len(row) != 3:
            raise ValueError(
                f"{name}[{i}] must be a triple (a, b, c) of floats, got {row!r};"
                " each row gives one step's quintic a·x + b·x³ + c·x⁵" + _one_flat_row(coefficients)
            )
        values: list[float] = []
        for value in row:
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"{name}[{i}] must hold real numbers, got {row!r}")
            if not math.isfinite(float(value)):
                raise ValueError(f"{name}[{i}] must hold finite numbers, got {row!r}")
            values.append(float(value))
        rows.append((values[0], values[1], values[2]))
    return tuple(rows)


def _one_flat_row(coefficients: Sequence[object]) -> str:
    """The fix for a set given as one flat ``(a, b, c)``, as ``torch.optim.Muon`` takes its
    ``ns_coefficients`` (one row for every step); ``""`` for anything else."""
    row = [
        float(v) for v in coefficients if isinstance(v, numbers.Real) and not isinstance(v, bool)
    ]
    if len(coefficients) != 3 or len(row) != 3:
        return ""
    return (
        f". A flat (a, b, c) is one row, the form of torch.optim.Muon's ns_coefficients: pass"
        f" [{tuple(row)!r}], which every step repeats"
    )


def coefficients_for_steps(coefficients: Coefficients, steps: int) -> Coefficients:
    """Exactly ``steps`` rows: the set cut to length, or extended with its last row."""
    if steps <= len(coefficients):
        return coefficients[:steps]
    return coefficients + (coefficients[-1],) * (steps - len(coefficients))
