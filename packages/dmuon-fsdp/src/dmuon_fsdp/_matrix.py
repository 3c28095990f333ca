"""What Muon steps: the one rule that turns a parameter's shape into matrices.

[Note: what Muon steps]
Muon orthogonalises matrices. Every Muon-route parameter is seen through a :class:`MatrixView`:
a stack of ``batch`` matrices of ``rows × cols`` each, and nothing else in ``dmuon_fsdp`` looks
at the number of dimensions of a Muon parameter:

- a 2-D weight ``(out, in)`` is a stack of one;
- a 3-D expert stack ``(E, out, in)`` (experts on dim 0) is ``E`` matrices, one per expert;
- a fused GLU expert stack holds two matrices per expert, orthogonalised apart by default
  (:class:`Glu`): Hugging Face's concatenated ``gate_up_proj (E, 2I, H)`` (rows ``[gate;
  up]``) is ``2E`` matrices ``(I, H)``, and GPT-OSS's interleaved, transposed ``(E, H, 2I)``
  (``[..., ::2]`` gate, ``[..., 1::2]`` up) is ``2E`` matrices ``(H, I)``;
- ``transposed`` says a stack stores ``(in, out)`` (GPT-OSS), or a 2-D weight does (Hugging
  Face's ``Conv1D``, GPT-2's): NS does not care (NS of a transpose is the transpose of NS), the
  learning-rate scale uses the logical ``(out, in)``; a declared split still cuts the stored
  rows;
- a convolution kernel (``nn.Conv1d``/``Conv2d``/``Conv3d``'s ``(out, in/groups, *k)``) is
  one matrix ``(out, in/groups·∏k)``, each output channel's filter bank a row, as Keller
  Jordan's Muon flattens conv filters (``kernel``): its NS input and update are views of the
  flattened kernel, and its learning-rate scale is the flattened matrix's. A 3-D kernel
  (``Conv1d``) is told from an expert stack by its module, never by its shape;
- a 2-D weight with a declared split (a fused ``[q; k; v]`` or ``[gate; up]`` projection, see
  [Note: declared splits] in ``dmuon_ownership``) is its *pieces* (:func:`pieces_of`):
  consecutive row blocks, each a view of its own (``rows × cols`` matrices, one or one per
  head), stepped as if it were a parameter of its own (its NS batch is its shape's, its
  learning-rate scale its matrices'), while momentum and weight decay, being elementwise,
  see the whole weight as before.

It is asked by ``dedicate_params``, which validates a selected parameter
(:meth:`MatrixView.of` raises, naming the parameter and the fix, for a shape it cannot step);
by the owner planner, whose cost is Newton–Schulz work per matrix times ``batch``; by the
step, which puts each matrix of a tensor laid out as the parameter (the weight, its gradient,
its momentum, or this rank's shard of any of them: :meth:`MatrixView.matrices`) into its
shape's NS batch, and scales the learning rate per matrix (:meth:`MatrixView.lr_scale`); and
by checkpoints, which keep the parameter's full ``shape`` (a view changes no storage or
layout, so the checkpoint layout does not depend on it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

from torch import Tensor, nn

from dmuon_ownership import MatrixSplit

__all__ = [
    "Glu",
    "LrScaling",
    "MatrixView",
    "NSFunction",
    "Piece",
    "describe_pieces",
    "is_conv_kernel",
    "lr_scale",
    "matrices_of",
    "matrix_shape",
    "pieces_of",
]

# Orthogonalises every matrix of a (batch, m, n) stack; returns a tensor of the same shape.
NSFunction = Callable[[Tensor], Tensor]


class Glu(StrEnum):
    """How a fused GLU expert stack holds its gate and up matrices (see [Note: what Muon
    steps])."""

    NONE = "none"  # one matrix per (out, in) slice, or the fused matrix orthogonalised jointly
    CONCAT = "concat"  # rows [gate; up] of each expert: (E, 2I, H)
    INTERLEAVED = "interleaved"  # last dim alternates gate and up: (E, H, 2I)


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
    glu: Glu = Glu.NONE
    transposed: bool = False  # stored (in, out): the learning-rate scale swaps rows and cols
    kernel: bool = False  # a convolution kernel (out, in/groups, *k): one (out, rest) matrix

    @classmethod
    def of(
        cls,
        shape: Sequence[int],
        name: str = "",
        *,
        glu: Glu | str = Glu.NONE,
        transposed: bool = False,
        kernel: bool = False,
    ) -> MatrixView:
        """The view of a parameter of ``shape`` (``kernel``: a convolution kernel, see
        :func:`is_conv_kernel`); raises a ``ValueError`` naming ``name`` when Muon cannot step
        it."""
        dims = tuple(int(d) for d in shape)
        glu = Glu(glu)
        if kernel:
            return cls(dims, 1, dims[0], math.prod(dims[1:]), kernel=True)
        if len(dims) not in (2, 3) and not name:
            raise ValueError(f"Muon needs a 2-D shape (m, n), got {dims}")
        if len(dims) not in (2, 3):
            raise ValueError(
                f"predicate selected {name!r} (shape {dims}) for the Muon route, but Muon needs "
                "a 2-D matrix (out, in) or a 3-D expert stack (E, out, in); exclude it in the "
                "predicate (e.g. add `and p.ndim == 2`) or route it to 'adamw' with param_policy"
                " (the kernel of an nn.Conv1d, Conv2d or Conv3d is taken as one matrix (out,"
                " in/groups·∏kernel))"
            )
        experts, rows, cols = (1, *dims) if len(dims) == 2 else dims
        if glu is Glu.NONE:
            return cls(dims, experts, rows, cols, glu, transposed)
        split = 1 if glu is Glu.INTERLEAVED else 0  # the dim that holds gate and up
        size = (rows, cols)[split]
        if size % 2:
            raise ValueError(
                f"{name or 'a parameter'} (shape {dims}) is a {glu.value} GLU stack, but its "
                f"{'last' if split else 'row'} dim {size} is odd, so it holds no gate/up "
                "pair; set its layout with param_policy (glu='joint') or fix the model flags"
            )
        halves = (rows // 2, cols) if split == 0 else (rows, cols // 2)
        return cls(dims, 2 * experts, *halves, glu, transposed)

    @property
    def experts(self) -> int | None:
        """The number of experts of a 3-D stack (experts on dim 0); ``None`` for a 2-D
        weight."""
        return self.shape[0] if len(self.shape) == 3 and not self.kernel else None

    @property
    def split(self) -> str | None:
        """How a parameter's matrices are cut out of it beyond its experts, in words
        (``None``: each 2-D slice is one matrix)."""
        if self.glu is Glu.CONCAT:
            return "gate and up apart (rows [gate; up])"
        if self.glu is Glu.INTERLEAVED:
            return "gate and up apart (interleaved last dim)"
        return None

    @property
    def matrix_shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def stack_shape(self) -> tuple[int, int, int]:
        return self.batch, self.rows, self.cols

    def lr_scale(self, scaling: LrScaling | str) -> float:
        """The factor that multiplies the Muon learning rate for each matrix of the stack."""
        scaling = LrScaling(scaling)
        m, n = (self.cols, self.rows) if self.transposed else (self.rows, self.cols)
        if scaling is LrScaling.MOONLIGHT:
            return 0.2 * math.sqrt(max(m, n))
        if scaling is LrScaling.ORIGINAL:
            return math.sqrt(max(1.0, m / n))
        return 1.0

    def count(self, local_shape: Sequence[int]) -> int:
        """How many matrices a tensor of ``local_shape`` holds (this rank's shard of the
        parameter, split on the expert dim; 0 for an empty shard)."""
        return math.prod(local_shape) // (self.rows * self.cols)

    def matrices(self, t: Tensor) -> list[Tensor]:
        """The matrices of ``t``, laid out as the parameter or as this rank's shard of it
        along the expert dim, each a ``rows × cols`` view (writes reach ``t``); the same
        order for every tensor of one parameter."""
        if t.dim() == 2 and self.batch == 1 and self.glu is Glu.NONE:
            return [t]
        if self.glu is Glu.INTERLEAVED:
            halves = t.unflatten(-1, (self.cols, 2)).unbind(-1)  # gate, up: strided views
            return [m for half in halves for m in half.view(-1, self.rows, self.cols).unbind(0)]
        return list(t.view(-1, self.rows, self.cols).unbind(0))


def is_conv_kernel(module: nn.Module, name: str) -> bool:
    """Whether ``module.<name>`` is the kernel of an ``nn.Conv1d``, ``Conv2d`` or ``Conv3d``,
    which Muon steps as one matrix (see [Note: what Muon steps]). Transposed convolutions store
    ``(in, out/groups, *k)`` and are not taken."""
    return name == "weight" and isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d)


def lr_scale(shape: Sequence[int], scaling: LrScaling | str) -> float:
    """The Muon learning-rate factor of each matrix of a parameter of ``shape``."""
    return MatrixView.of(shape).lr_scale(scaling)


def is_single_matrix(shape: Sequence[int]) -> bool:
    """Whether a tensor of ``shape`` is one 2-D matrix (a projection weight), not a vector,
    a stack or a scalar."""
    return len(shape) == 2


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """``(rows, cols)`` of each matrix of a tensor of ``shape`` (a parameter, a TP shard of
    one, or a stack)."""
    rows, cols = shape[-2:]
    return int(rows), int(cols)


def matrices_of(t: Tensor) -> list[Tensor]:
    """The matrices of ``t`` as :meth:`MatrixView.matrices` gives them for a plain weight or
    stack (no GLU): a 2-D tensor is its own one matrix."""
    return [t] if t.dim() == 2 else list(t.view(-1, *t.shape[-2:]).unbind(0))


class Piece(NamedTuple):
    """One piece of a 2-D weight with a declared split: its rows ``[start, stop)``, as
    ``view``'s matrices (a ``(count · rows, cols)`` block: ``count`` matrices of ``rows``
    rows)."""

    name: str  # "q", "k", "v", or "rows a:b"
    start: int
    view: MatrixView

    @property
    def stop(self) -> int:
        return self.start + self.view.shape[0]


def pieces_of(shape: Sequence[int], name: str, split: MatrixSplit) -> tuple[Piece, ...]:
    """The pieces ``split`` cuts a 2-D weight of ``shape`` into, in row order (see [Note:
    what Muon steps]); raises a ``ValueError`` naming ``name`` and the fix when it does not
    fit the shape."""
    cols = int(shape[-1])
    return tuple(
        Piece(b.name, b.start, MatrixView((b.matrices * b.rows, cols), b.matrices, b.rows, cols))
        for b in split.blocks(shape, name)
    )


def describe_pieces(pieces: Sequence[Piece]) -> str:
    """A split's pieces in words: ``"q 1 x (16, 16), k 1 x (8, 16), v 1 x (8, 16)"``."""
    return ", ".join(f"{p.name} {p.view.batch} x ({p.view.rows}, {p.view.cols})" for p in pieces)
