"""What Muon steps: the one rule that turns a parameter's shape into matrices.

[Note: what Muon steps]
Muon orthogonalises matrices. Every Muon-route parameter is seen through a :class:`MatrixView`:
a stack of ``batch`` matrices of ``rows × cols`` each (a 2-D weight is a stack of one), and
nothing else in ``dmuon_fsdp`` looks at the number of dimensions of a Muon parameter. It is
asked by

- ``dedicate_params``, which validates a selected parameter (:meth:`MatrixView.of` raises,
  naming the parameter and the fix, for a shape it cannot step);
- the owner planner, whose cost is Newton–Schulz work per matrix times ``batch``;
- the step, which puts each matrix of a parameter (:func:`matrices_of`) into its shape's NS
  batch and scales the learning rate per matrix (:meth:`MatrixView.lr_scale`);
- checkpoints, which keep the parameter's full ``shape`` (a view never changes storage or
  layout, so the checkpoint layout does not depend on it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from torch import Tensor

__all__ = ["LrScaling", "MatrixView", "lr_scale", "matrices_of", "matrix_shape"]


class LrScaling(StrEnum):
    """How the Muon learning rate is scaled per matrix of shape ``(m, n)``."""

    # 0.2·√max(m, n): the update's RMS matches AdamW's, so AdamW learning rates carry over
    # (Moonlight, arXiv:2502.16982); torch.optim.Muon's "match_rms_adamw".
    MOONLIGHT = "moonlight"
    # √max(1, m/n): Keller Jordan's original scaling, torch.optim.Muon's "original" (also
    # accepted under the name "spectral").
    ORIGINAL = "original"
    NONE = "none"

    @classmethod
    def _missing_(cls, value: object) -> LrScaling | None:
        return cls.ORIGINAL if value == "spectral" else None


@dataclass(frozen=True)
class MatrixView:
    """A Muon parameter as ``batch`` matrices of ``rows × cols`` (see [Note: what Muon
    steps])."""

    shape: tuple[int, ...]  # the parameter's full shape
    batch: int
    rows: int
    cols: int

    @classmethod
    def of(cls, shape: Sequence[int], name: str = "") -> MatrixView:
        """The view of a parameter of ``shape``; raises a ``ValueError`` naming ``name`` when
        Muon cannot step it."""
        dims = tuple(int(d) for d in shape)
        if len(dims) != 2 and not name:
            raise ValueError(f"Muon needs a 2-D shape (m, n), got {dims}")
        if len(dims) != 2:
            raise ValueError(
                f"predicate selected {name!r} (shape {dims}) for the Muon route, but Muon needs "
                "a 2-D matrix; exclude it in the predicate (e.g. add `and p.ndim == 2`) or route "
                "it to 'adamw' with param_policy"
            )
        return cls(dims, 1, dims[0], dims[1])

    @property
    def matrix_shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def stack_shape(self) -> tuple[int, int, int]:
        return self.batch, self.rows, self.cols

    def lr_scale(self, scaling: LrScaling | str) -> float:
        """The factor that multiplies the Muon learning rate for each matrix of the stack."""
        scaling = LrScaling(scaling)
        m, n = self.rows, self.cols
        if scaling is LrScaling.MOONLIGHT:
            return 0.2 * math.sqrt(max(m, n))
        if scaling is LrScaling.ORIGINAL:
            return math.sqrt(max(1.0, m / n))
        return 1.0


def lr_scale(shape: Sequence[int], scaling: LrScaling | str) -> float:
    """The Muon learning-rate factor of each matrix of a parameter of ``shape``."""
    return MatrixView.of(shape).lr_scale(scaling)


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """``(rows, cols)`` of each matrix of a tensor of ``shape`` (a parameter, a TP shard of
    one, or a stack)."""
    rows, cols = shape[-2:]
    return int(rows), int(cols)


def matrices_of(t: Tensor) -> list[Tensor]:
    """The matrices of ``t`` (a weight, gradient or momentum laid out as its parameter, or this
    rank's shard of one), each a ``rows × cols`` view: a 2-D tensor is its own one matrix."""
    return [t] if t.dim() == 2 else list(t.view(-1, *t.shape[-2:]).unbind(0))
