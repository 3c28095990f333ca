"""Test helpers for dmuon-ns and the packages built on it: a float64 NS reference and error
measures.

``reference_newton_schulz`` runs the iterations the front end runs (same normalisation
formula, same transposition, same per-step coefficients, same restarts, Gram or direct by the
same rule) in float64 with plain matrix products written out here, not through any kernel:
it is the independent reference that fast paths are compared against.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Unpack

import torch
from torch import Tensor

from dmuon_ns._config import NewtonSchulz
from dmuon_ns._newton_schulz import NSKeywords, takes_newton_schulz_keywords
from dmuon_ns._prepare import check_matrix

__all__ = [
    "orthogonality_error",
    "reference_newton_schulz",
    "relative_error",
    "singular_values",
]


class _ReferenceKeywords(NSKeywords, total=False):
    backend: str
    restart_iterations: Sequence[int] | None


@takes_newton_schulz_keywords
def reference_newton_schulz(G: Tensor, **options: Unpack[_ReferenceKeywords]) -> Tensor:
    """NS of ``G`` (..., rows, cols) in float64; returns float64 in ``G``'s shape.

    Arguments mean what they mean for ``newton_schulz``. In exact arithmetic the Gram and
    direct forms agree; in float64 they agree to ~1e-12, which the tests check.
    """
    check_matrix(G)
    config = NewtonSchulz(**options)
    rows, cols = G.shape[-2], G.shape[-1]
    x = G.detach().to(torch.float64).reshape(-1, rows, cols)
    if rows > cols:
        x = x.mT
    x = x / (torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) + config.eps)
    eye = torch.eye(x.shape[-2], dtype=torch.float64, device=x.device)
    if config.backend == "gram" and rows != cols:
        restarts = set(config.restarts)
        r = x @ x.mT
        q = eye.expand_as(r)
        for i, (a, b, c) in enumerate(config.step_coefficients):
            if i in restarts:
                x = q @ x
                r = x @ x.mT
                q = eye.expand_as(r)
            z = a * eye + b * r + c * (r @ r)
            q = z @ q
            r = z @ r @ z
        x = q @ x
    else:
        for a, b, c in config.step_coefficients:
            r = x @ x.mT
            x = (a * eye + b * r + c * (r @ r)) @ x
    if rows > cols:
        x = x.mT
    return x.reshape(G.shape)


def relative_error(actual: Tensor, expected: Tensor) -> float:
    """max over matrices of ‖actual − expected‖_F / ‖expected‖_F, in float64 (0/0 → 0);
    ``ValueError`` unless the two have one shape (a wrong-shaped result is no small error)."""
    if actual.shape != expected.shape:
        raise ValueError(
            f"relative_error: actual has shape {tuple(actual.shape)} and expected"
            f" {tuple(expected.shape)}; compare tensors of one shape"
        )
    a = actual.detach().to(torch.float64).reshape(-1, *actual.shape[-2:])
    e = expected.detach().to(torch.float64).reshape(-1, *expected.shape[-2:]).to(a.device)
    num = torch.linalg.vector_norm(a - e, dim=(-2, -1))
    den = torch.linalg.vector_norm(e, dim=(-2, -1))
    ratio = torch.where(den > 0, num / den.clamp_min(1e-300), num)
    return float(ratio.max())


def singular_values(x: Tensor) -> Tensor:
    """Singular values (float64, descending) of every matrix in ``x`` (..., rows, cols)."""
    return torch.linalg.svdvals(x.detach().to(torch.float64))


def orthogonality_error(x: Tensor) -> float:
    """max over matrices of ‖Y·Yᵀ − I‖_F / √k with Y the wide orientation of each matrix and
    k its short side: 0 for a semi-orthogonal matrix, RMS deviation of σ² from 1 otherwise."""
    y = x.detach().to(torch.float64).reshape(-1, *x.shape[-2:])
    if y.shape[-2] > y.shape[-1]:
        y = y.mT
    k = y.shape[-2]
    gram = y @ y.mT
    eye = torch.eye(k, dtype=torch.float64, device=y.device)
    return float((torch.linalg.vector_norm(gram - eye, dim=(-2, -1)) / k**0.5).max())
