"""``NewtonSchulz``: one validated, immutable description of how to orthogonalize.

[Note: Gram or direct, per matrix]
``backend="gram"`` runs Gram NS on every non-square matrix and direct NS on square ones:
with m = n the Gram form does the same products as the direct one plus its bookkeeping, so it
cannot win. ``backend="direct"`` always runs the direct form. Both compute the same
polynomial of the same normalised input; they differ only in rounding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, overload

import torch
from torch import Tensor

from dmuon_ns._coefficients import Coefficients, coefficients_for_steps, validate_coefficients
from dmuon_ns._orthogonalize import orthogonalize, orthogonalize_many, tune
from dmuon_ns._registry import Resolution, kernel_names, resolve, unknown_kernel

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["DEFAULT_RESTART_ITERATIONS", "NSBackend", "NewtonSchulz"]

DEFAULT_RESTART_ITERATIONS: tuple[int, ...] = (2,)
_ITERATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class NSBackend(StrEnum):
    """Which NS algorithm runs (the kernel that runs it is chosen separately)."""

    GRAM = "gram"
    DIRECT = "direct"


@dataclass(frozen=True)
class NewtonSchulz:
    """How to orthogonalize: algorithm, kernel, coefficients, steps, precision.

    Call it on a tensor (2-D or batched over leading dims) or on a list of tensors::

        ns = NewtonSchulz(backend="gram", steps=5)
        update = ns(momentum)

    ``dtype`` is the dtype the iterations run in: ``torch.float16``, ``torch.bfloat16``,
    ``torch.float32`` (the torch kernel's products only: a reference run, a precision check),
    or ``None`` (default) for the fast one where the call runs: fp32 where the torch kernel
    runs on the CPU, fp16 otherwise (``_prepare``'s [Note: the iteration dtype]); the result
    has the input's dtype either way.
    ``coefficients`` defaults to ``POLAR_EXPRESS_COEFFICIENTS`` (a set shorter than ``steps``
    repeats its last row); ``restart_iterations`` defaults to ``(2,)`` (the Gram form's
    restarts, ignored by the direct form). ``kernel`` is ``"auto"`` or a registered kernel
    name; ``deterministic=True`` means the plain torch kernel unless a kernel is named (a named
    kernel first, then ``DMUON_NS_KERNEL``, then ``deterministic``, then auto). ``cuda_graphs``
    replays CUDA inputs through a captured graph per problem shape (inputs of at most 64 MiB;
    larger ones gain nothing from replay and run eagerly).

    Args:
        backend: the algorithm: ``"gram"`` runs Gram Newton–Schulz on non-square matrices and
            direct NS on square ones; ``"direct"`` always runs direct NS. Both compute the same
            polynomial and differ only in rounding. Another value raises ``ValueError``.
        kernel: the kernel that runs it: ``"auto"`` (the ``DMUON_NS_KERNEL`` environment
            variable if set, else the torch kernel off CUDA; on CUDA the kernel of the problem's
            verdict, measured by ``tune``/``tune_pending`` or shipped in the device's table,
            and torch where there is none: no call measures) or a registered kernel name
            (``"torch"``, ``"triton"``, ``"quack"``, or one of your own registered with
            :func:`~dmuon_ns.register_kernel` in this process), which must then be able to run on the
            input's device (an error with the install hint otherwise). An unknown name raises
            ``ValueError``.
        coefficients: the ``(a, b, c)`` row of each step, step ``i`` computing
            ``X ← a·X + (b·R + c·R²)·X`` with ``R = X·Xᵀ``: a non-empty sequence of triples of
            finite numbers, cut to ``steps`` rows or extended with its last one; ``None``:
            ``POLAR_EXPRESS_COEFFICIENTS``.
        restart_iterations: the steps before which the Gram form recomputes its Gram matrix
            from the current iterate (bounding the error that builds up in half precision):
            ints in ``[1, steps - 1]``; ``None``: ``(2,)`` where ``steps > 2``, else none.
            Ignored by direct NS.
        deterministic: ``True`` runs the plain torch kernel (no autotuning whose choice could
            differ between runs or machines) unless ``kernel`` or ``DMUON_NS_KERNEL`` names a
            kernel; ``False`` lets ``"auto"`` choose.
        steps: the number of Newton–Schulz steps, an int >= 1 (5 is standard).
        dtype: the dtype the iterations run in, ``torch.float16``, ``torch.bfloat16`` or
            ``torch.float32`` (which runs the torch kernel: the others multiply fp16 and bf16
            only); ``None``: fp32 where the torch kernel runs on the CPU, fp16 elsewhere. The
            result has the input's dtype either way.
        cuda_graphs: ``True`` replays CUDA inputs of at most 64 MiB through a CUDA graph
            captured once per problem shape (fewer launches); ``False`` always runs eagerly.
            No effect off CUDA.
        eps: a finite float > 0: each matrix is scaled by ``1 / (‖G‖_F + eps)`` before the
            iterations, so that a zero matrix stays zero. Added to the norm, as in Keller
            Jordan's Muon: ``torch.optim.Muon``'s ``eps`` is a floor, ``1 / max(‖G‖_F, eps)``,
            and its value does not carry over (leave this one at its default; the tuning
            guide's "Moving from torch.optim.Muon").
    """

    backend: NSBackend | str = NSBackend.GRAM
    kernel: str = "auto"
    coefficients: Sequence[Sequence[float]] | None = None
    restart_iterations: Sequence[int] | None = None
    deterministic: bool = False
    steps: int = 5
    dtype: torch.dtype | None = None
    cuda_graphs: bool = True
    eps: float = 1e-7
    # Derived at construction: exactly one coefficient row per step, and the restarts in use.
    step_coefficients: Coefficients = field(init=False, repr=False, compare=False)
    restarts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        backend = self.backend
        if not isinstance(backend, str) or backend not in NSBackend._value2member_map_:
            raise ValueError(f"backend must be 'gram' or 'direct', got {backend!r}")
        set_ = object.__setattr__
        set_(self, "backend", NSBackend(backend))
        if not isinstance(self.kernel, str):
            raise ValueError(f"kernel must be a string such as 'auto', got {self.kernel!r}")
        if self.kernel != "auto" and self.kernel not in kernel_names():
            raise unknown_kernel("kernel", self.kernel)
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps must be a positive int, got {self.steps!r}")
        if self.dtype is not None and self.dtype not in _ITERATION_DTYPES:
            raise ValueError(
                f"dtype is the iteration dtype and must be torch.float16, torch.bfloat16 or"
                f" torch.float32, or None for the default (fp32 where the torch kernel runs on"
                f" the CPU, fp16 elsewhere), got {self.dtype!r}"
            )
        if self.dtype == torch.float32 and self.kernel not in ("auto", "torch"):
            raise ValueError(
                f"dtype=torch.float32 iterates on the 'torch' kernel only, the one dmuon-ns"
                f" runs fp32 products on; got kernel={self.kernel!r}. Pass kernel='torch' (or"
                f" 'auto'), or dtype=torch.bfloat16 for {self.kernel!r}"
            )
        eps = self.eps
        if (
            isinstance(eps, bool)
            or not isinstance(eps, int | float)
            or not (math.isfinite(eps) and eps > 0)
        ):
            raise ValueError(
                f"eps must be a positive finite float (it keeps a zero matrix at zero), got {eps!r}"
            )
        coefficients = validate_coefficients(self.coefficients)
        set_(self, "coefficients", coefficients)
        set_(self, "step_coefficients", coefficients_for_steps(coefficients, self.steps))
        restarts = _validate_restarts(self.restart_iterations, self.steps)
        set_(self, "restart_iterations", restarts)
        set_(self, "restarts", restarts)
        for flag in ("deterministic", "cuda_graphs"):  # a string such as "no" would be truthy
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")

    @overload
    def __call__(self, g: Tensor) -> Tensor: ...
    @overload
    def __call__(self, g: list[Tensor] | tuple[Tensor, ...]) -> list[Tensor]: ...
    def __call__(self, g: Tensor | list[Tensor] | tuple[Tensor, ...]) -> Tensor | list[Tensor]:
        """Orthogonalize ``g``; a list comes back as a list, in order."""
        if isinstance(g, list | tuple):
            return orthogonalize_many(self, g)
        return orthogonalize(self, g)

    def tune(self, g: Tensor | list[Tensor] | tuple[Tensor, ...]) -> dict[str, str]:
        """Settle now which kernel runs each problem that ``self(g)`` would run.

        With ``kernel="auto"`` on CUDA a problem runs the verdict's kernel, measured earlier on
        this machine or shipped in the device's table, and torch where there is none; no call
        measures anything (``_autotune``'s notes). This measures, now, every problem of ``g``
        that has no verdict (a few seconds each), and keeps the verdicts on disk for later
        processes. Only the shapes, dtypes and devices of ``g`` are read, so ``torch.empty``
        tensors will do. Returns ``{"<op> <batch>x<m>x<n> <iteration dtype>": kernel name}``,
        one entry per problem.
        """
        return tune(self, [g] if isinstance(g, Tensor) else list(g))

    def _resolution(self, device: torch.device) -> Resolution:
        """The kernel(s) this config runs on ``device`` (``_registry``'s [Note: kernel
        precedence])."""
        return resolve(self.kernel, self.deterministic, device, fp32=self.dtype == torch.float32)


def _validate_restarts(restarts: Iterable[int] | None, steps: int) -> tuple[int, ...]:
    if restarts is None:
        # The default restart only applies where it falls inside the iteration.
        return tuple(i for i in DEFAULT_RESTART_ITERATIONS if 0 < i < steps)
    if isinstance(restarts, str | bytes) or not isinstance(restarts, Sequence):
        raise ValueError(
            f"restart_iterations must be a sequence of ints such as [2], got {restarts!r}"
        )
    out = []
    for i in restarts:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 < i < steps:
            raise ValueError(
                f"restart_iterations entries must be ints in [1, steps - 1] = [1, {steps - 1}]"
                f" (a restart at i recomputes the Gram matrix before step i), got {restarts!r}"
            )
        out.append(i)
    return tuple(sorted(set(out)))
