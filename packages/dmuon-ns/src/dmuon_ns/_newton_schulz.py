"""The function front end: ``newton_schulz`` and its two fixed-algorithm spellings.

Each call builds a ``NewtonSchulz`` (validated, cheap) and applies it; code that calls NS in a
loop can build the config once and call it instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

import torch
from torch import Tensor

from dmuon_ns._config import NewtonSchulz, NSBackend

__all__ = ["direct_newton_schulz", "gram_newton_schulz", "newton_schulz", "tune_pending"]

TensorOrList = Tensor | list[Tensor] | tuple[Tensor, ...]


@overload
def newton_schulz(
    G: Tensor,
    *,
    steps: int = ...,
    coefficients: Sequence[Sequence[float]] | None = ...,
    backend: NSBackend | str = ...,
    kernel: str = ...,
    restart_iterations: Sequence[int] | None = ...,
    dtype: torch.dtype | None = ...,
    eps: float = ...,
    deterministic: bool = ...,
) -> Tensor: ...
@overload
def newton_schulz(
    G: list[Tensor] | tuple[Tensor, ...],
    *,
    steps: int = ...,
    coefficients: Sequence[Sequence[float]] | None = ...,
    backend: NSBackend | str = ...,
    kernel: str = ...,
    restart_iterations: Sequence[int] | None = ...,
    dtype: torch.dtype | None = ...,
    eps: float = ...,
    deterministic: bool = ...,
) -> list[Tensor]: ...
def newton_schulz(
    G: TensorOrList,
    *,
    steps: int = 5,
    coefficients: Sequence[Sequence[float]] | None = None,
    backend: NSBackend | str = "gram",
    kernel: str = "auto",
    restart_iterations: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    eps: float = 1e-7,
    deterministic: bool = False,
) -> Tensor | list[Tensor]:
    """Orthogonalize ``G`` (≈ U·Vᵀ of its SVD) with ``steps`` quintic Newton–Schulz steps.

    ``G``: a tensor of shape (..., rows, cols), tall or wide, or a list of such tensors (a
    list comes back as a list; same-shape entries run as one batch). The result has ``G``'s
    shape and dtype. ``backend="gram"`` (default) runs Gram NS on non-square matrices and
    direct NS on square ones; ``"direct"`` always runs direct NS. See ``NewtonSchulz`` for the
    other arguments.
    """
    config = NewtonSchulz(
        backend=backend,
        kernel=kernel,
        coefficients=coefficients,
        restart_iterations=restart_iterations,
        deterministic=deterministic,
        steps=steps,
        dtype=dtype,
        eps=eps,
    )
    return config(G)


@overload
def gram_newton_schulz(
    G: Tensor,
    *,
    steps: int = ...,
    coefficients: Sequence[Sequence[float]] | None = ...,
    kernel: str = ...,
    restart_iterations: Sequence[int] | None = ...,
    dtype: torch.dtype | None = ...,
    eps: float = ...,
    deterministic: bool = ...,
) -> Tensor: ...
@overload
def gram_newton_schulz(
    G: list[Tensor] | tuple[Tensor, ...],
    *,
    steps: int = ...,
    coefficients: Sequence[Sequence[float]] | None = ...,
    kernel: str = ...,
    restart_iterations: Sequence[int] | None = ...,
    dtype: torch.dtype | None = ...,
    eps: float = ...,
    deterministic: bool = ...,
) -> list[Tensor]: ...
def gram_newton_schulz(
    G: TensorOrList,
    *,
    steps: int = 5,
    coefficients: Sequence[Sequence[float]] | None = None,
    kernel: str = "auto",
    restart_iterations: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    eps: float = 1e-7,
    deterministic: bool = False,
) -> Tensor | list[Tensor]:
    """``newton_schulz(G, backend="gram", ...)`` (square matrices still run direct NS)."""
    return newton_schulz(
        G,
        steps=steps,
        coefficients=coefficients,
        backend=NSBackend.GRAM,
        kernel=kernel,
        restart_iterations=restart_iterations,
        dtype=dtype,
        eps=eps,
        deterministic=deterministic,
    )


@overload
def direct_newton_schulz(
    G: Tensor,
    *,
    steps: int = ...,
    coefficients: Sequence[Sequence[float]] | None = ...,
    kernel: str = ...,
    dtype: torch.dtype | None = ...,
    eps: float = ...,
    deterministic: bool = ...,
) -> Tensor: ...
@overload
def direct_newton_schulz(
    G: list[Tensor] | tuple[Tensor, ...],
    *,
    steps: int = ...,
    coefficients: Sequence[Sequence[float]] | None = ...,
    kernel: str = ...,
    dtype: torch.dtype | None = ...,
    eps: float = ...,
    deterministic: bool = ...,
) -> list[Tensor]: ...
def direct_newton_schulz(
    G: TensorOrList,
    *,
    steps: int = 5,
    coefficients: Sequence[Sequence[float]] | None = None,
    kernel: str = "auto",
    dtype: torch.dtype | None = None,
    eps: float = 1e-7,
    deterministic: bool = False,
) -> Tensor | list[Tensor]:
    """``newton_schulz(G, backend="direct", ...)``: X ← aX + (bR + cR²)X with R = X·Xᵀ."""
    return newton_schulz(
        G,
        steps=steps,
        coefficients=coefficients,
        backend=NSBackend.DIRECT,
        kernel=kernel,
        dtype=dtype,
        eps=eps,
        deterministic=deterministic,
    )


def tune_pending() -> dict[str, str]:
    """Finish now every kernel choice that ``kernel="auto"`` left open.

    On CUDA, auto measures a new problem's candidate kernels over the calls after its first one,
    a bounded share of the time at a time (``_autotune``'s [Note: cold start]). Call this
    where a stall is welcome, e.g. after a training loop's first step, to measure what is left
    of every problem seen so far at once. Returns ``{"<op> <batch>x<m>x<n> <iteration dtype>":
    kernel name}`` for every problem auto has seen (empty on the CPU, where torch is the only
    kernel). ``NewtonSchulz.tune(g)`` does the same for given tensors before their first call.
    """
    from dmuon_ns import _autotune  # CUDA-only machinery, loaded on that path only

    return _autotune.tune_pending()
