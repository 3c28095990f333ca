"""The function front end: ``newton_schulz`` and its two fixed-algorithm spellings.

Each call builds a ``NewtonSchulz`` (validated, cheap) and applies it; code that calls NS in a
loop can build the config once and call it instead.

[Note: one list of NS keywords]
The functions that orthogonalize (these three, ``gram_newton_schulz_distributed``,
``testing.reference_newton_schulz``) take subsets of the same keyword-only arguments, which
mean what ``NewtonSchulz``'s fields mean. ``newton_schulz`` spells them out once, with their
defaults. Every other one takes ``**options`` typed by a ``TypedDict`` that names its subset
(what type checkers read), and ``takes_newton_schulz_keywords`` gives it the signature that
``help()`` and the API reference show (those types, ``newton_schulz``'s defaults and order) and
a ``TypeError`` for any other keyword, as a spelled-out signature would raise. Keywords left
out are not passed on, so ``NewtonSchulz``'s defaults (the same values) apply.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Sequence
from typing import Concatenate, ParamSpec, Protocol, TypedDict, TypeVar, Unpack, overload

import torch
from torch import Tensor

from dmuon_ns._config import NewtonSchulz, NSBackend

__all__ = [
    "NSKeywords",
    "direct_newton_schulz",
    "gram_newton_schulz",
    "newton_schulz",
    "takes_newton_schulz_keywords",
    "tune_pending",
]

TensorOrList = Tensor | list[Tensor] | tuple[Tensor, ...]
_P = ParamSpec("_P")
_F = TypeVar("_F", bound=Callable[..., object])


class _FrontEnd(Protocol[_P]):
    """An NS front end as type checkers see it: a tensor in, a tensor out; a list or a tuple
    in, a list out."""

    @overload
    def __call__(self, G: Tensor, *args: _P.args, **kwargs: _P.kwargs) -> Tensor: ...
    @overload
    def __call__(
        self, G: list[Tensor] | tuple[Tensor, ...], *args: _P.args, **kwargs: _P.kwargs
    ) -> list[Tensor]: ...


def _front_end(fn: Callable[Concatenate[TensorOrList, _P], Tensor | list[Tensor]]) -> _FrontEnd[_P]:
    """Type ``fn(G, ...)`` as returning a list for a list or tuple ``G``, a tensor for a tensor
    (``fn`` itself is returned)."""
    return typing.cast(_FrontEnd[_P], fn)


@_front_end
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

    Args:
        G: a real floating tensor (float16, bfloat16, float32 or float64) of shape
            ``(..., rows, cols)``, at least 2-D with at least one row and one column, each
            trailing matrix orthogonalised on its own (a batch of none gives an empty
            result); or a list or tuple of such tensors, which comes back as a list in the
            same order.
        steps: the number of Newton–Schulz steps, an int >= 1.
        coefficients: the ``(a, b, c)`` row of each step, a non-empty sequence of triples of
            finite numbers (extended with its last row when shorter than ``steps``); ``None``:
            ``POLAR_EXPRESS_COEFFICIENTS``.
        backend: ``"gram"`` (Gram NS, direct on square matrices) or ``"direct"``.
        kernel: ``"auto"`` or a kernel name (``"torch"``, ``"triton"``, ``"quack"``, or one
            registered with :func:`register_kernel`); see :class:`NewtonSchulz`.
        restart_iterations: the Gram form's restarts, ints in ``[1, steps - 1]``; ``None``:
            ``(2,)`` where ``steps > 2``.
        dtype: the iteration dtype, ``torch.float16``, ``torch.bfloat16`` or ``torch.float32``
            (the torch kernel only); ``None``: fp32 where the torch kernel runs on the CPU,
            fp16 elsewhere.
        eps: a finite float > 0 added to each matrix's Frobenius norm before scaling by it.
        deterministic: ``True``: the plain torch kernel unless a kernel is named.
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


class NSKeywords(TypedDict, total=False):
    """The keywords every NS function takes ([Note: one list of NS keywords])."""

    steps: int
    coefficients: Sequence[Sequence[float]] | None
    eps: float


class _DirectKeywords(NSKeywords, total=False):
    kernel: str
    dtype: torch.dtype | None
    deterministic: bool


class _GramKeywords(_DirectKeywords, total=False):
    restart_iterations: Sequence[int] | None


def takes_newton_schulz_keywords(fn: _F) -> _F:
    """Give ``fn(..., **options: Unpack[K])`` the keyword-only parameters of ``newton_schulz``
    that the ``TypedDict`` ``K`` names (typed as ``K`` types them, with ``newton_schulz``'s
    defaults and in its order), and reject any other keyword ([Note: one list of NS
    keywords])."""
    own = inspect.signature(fn)
    var_keyword = next(p for p in own.parameters.values() if p.kind is p.VAR_KEYWORD)
    (keywords,) = typing.get_args(typing.get_type_hints(fn)[var_keyword.name])
    types = keywords.__annotations__
    offered = inspect.signature(newton_schulz).parameters
    if not types.keys() <= offered.keys():
        raise AssertionError(f"{fn.__qualname__}: newton_schulz has no {types.keys() - offered}")
    parameters = [p for p in own.parameters.values() if p is not var_keyword]
    for name, p in offered.items():
        if name in types:
            parameters.append(p.replace(annotation=_spelled(types[name])))
    signature = own.replace(parameters=parameters)

    @functools.wraps(fn)
    def checked(*args: object, **kwargs: object) -> object:
        if not kwargs.keys() <= types.keys():
            try:
                signature.bind(*args, **kwargs)
            except TypeError as exc:  # Python's own words for the call, named as Python names it
                raise TypeError(f"{fn.__qualname__}() {exc}") from None
        return fn(*args, **kwargs)

    checked.__signature__ = signature  # type: ignore[attr-defined]
    return typing.cast(_F, checked)


def _spelled(annotation: object) -> object:
    """An annotation as its module wrote it (a string under ``from __future__ import
    annotations``, which a ``TypedDict`` keeps as a ``ForwardRef``)."""
    return annotation.__forward_arg__ if isinstance(annotation, typing.ForwardRef) else annotation


@_front_end
@takes_newton_schulz_keywords
def gram_newton_schulz(G: TensorOrList, **options: Unpack[_GramKeywords]) -> Tensor | list[Tensor]:
    """``newton_schulz(G, backend="gram", ...)`` (square matrices still run direct NS).

    Args:
        G: the matrices, as for :func:`newton_schulz`.
        steps: the number of Newton–Schulz steps, as for :func:`newton_schulz`.
        coefficients: the ``(a, b, c)`` row of each step, as for :func:`newton_schulz`.
        kernel: ``"auto"`` or a kernel name, as for :func:`newton_schulz`.
        restart_iterations: the steps before which the Gram matrix is recomputed, ints in
            ``[1, steps - 1]``; ``None``: ``(2,)`` where ``steps > 2``.
        dtype: the iteration dtype, as for :func:`newton_schulz`.
        eps: the norm's guard, as for :func:`newton_schulz`.
        deterministic: ``True``: the plain torch kernel unless a kernel is named.
    """
    return newton_schulz(G, backend=NSBackend.GRAM, **options)


@_front_end
@takes_newton_schulz_keywords
def direct_newton_schulz(
    G: TensorOrList, **options: Unpack[_DirectKeywords]
) -> Tensor | list[Tensor]:
    """``newton_schulz(G, backend="direct", ...)``: X ← aX + (bR + cR²)X with R = X·Xᵀ.

    Args:
        G: the matrices, as for :func:`newton_schulz`.
        steps: the number of Newton–Schulz steps, as for :func:`newton_schulz`.
        coefficients: the ``(a, b, c)`` row of each step, as for :func:`newton_schulz`.
        kernel: ``"auto"`` or a kernel name, as for :func:`newton_schulz`.
        dtype: the iteration dtype, as for :func:`newton_schulz`.
        eps: the norm's guard, as for :func:`newton_schulz`.
        deterministic: ``True``: the plain torch kernel unless a kernel is named.
    """
    return newton_schulz(G, backend=NSBackend.DIRECT, **options)


def tune_pending() -> dict[str, str]:
    """Measure now every problem that ``kernel="auto"`` found no verdict for.

    On CUDA, auto runs a problem on the kernel of its verdict (measured earlier on this
    machine, or shipped in the device's table for common shapes) and on torch where there is
    none; no NS call measures anything (``_autotune``'s notes). Call this where a stall is
    welcome, e.g. after a training loop's first step, to measure every problem seen so far that
    has no verdict (a few seconds each) and run its fastest kernel from the next call on.
    Returns ``{"<op> <batch>x<m>x<n> <iteration dtype>": kernel name}`` for every problem auto
    has seen (empty on the CPU, where torch is the only kernel). ``NewtonSchulz.tune(g)`` does
    the same for given tensors before their first call.
    """
    from dmuon_ns import _autotune  # CUDA-only machinery, loaded on that path only

    return _autotune.tune_pending()
