"""Input checks and the shape/dtype work around every kernel call.

[Note: what the front end does before a kernel sees the input]
1. flatten leading dims into one batch dim;
2. move the small side first (a tall (r, c), r > c, is transposed to (c, r)), so that the
   Gram matrix ``X·Xᵀ`` is the small one and the direct form's products are cheapest;
3. find each matrix's Frobenius norm in fp32 (half-precision sums of squares overflow
   easily); its scale is 1 / (norm + eps), and as the Frobenius norm bounds the spectral
   norm, every singular value of the scaled matrix lies in [0, 1], where the NS polynomials
   are designed to work;
4. scale and cast to the iteration dtype, contiguous: the one copy of the input, made by
   ``Prepared.write`` straight into the kernel's input: a new tensor, or the static input of
   the CUDA graph that replays the call, which then needs no copy of its own.

``restore`` undoes 1 and 2; the kernels already return the input's dtype (fp16, bf16, fp32),
written by their last product or cast after their loop (``_iterations``' [Note: the result
dtype]), so its cast only acts for float64. A zero matrix stays zero:
0 · 1/(0 + eps) = 0, and every NS polynomial maps 0 to 0.

[Note: the scaling pass follows the kernel]
Step 4 is part of the kernel that runs: the dispatcher sets ``Prepared.scale_pass`` from the
kernel it picked (``LoopKernel.scale_pass``). The torch kernel, and any registered kernel
that is not a ``LoopKernel``, scales with torch ops (``scale_with_torch``), so
``kernel="torch"`` and ``deterministic=True`` launch no Triton kernel at all. The Triton and
quack kernels scale in one Triton pass that also forms the scale (``scale_cast``), which
computes torch's formula bit for bit: the pass changes the speed, never the result.

[Note: the iteration dtype]
``dtype=None`` (the default) lets the kernel and device that run the call pick the dtype
the iterations run in: fp32 where the torch kernel runs on the CPU, fp16 everywhere else (CUDA,
and every other kernel, whose products take fp16 and bf16 only). An explicit ``torch.float16``
or ``torch.bfloat16`` is always honoured; an explicit ``torch.float32`` runs the torch kernel
(``_registry``'s [Note: kernel precedence]), on any device.

Why fp32 on the CPU, measured with ``benchmarks/ns_cpu_bench.py`` (BENCHMARKS.md,
"Newton–Schulz on the CPU": a 2-core AMD EPYC with AVX-512 BF16, torch 2.13, one thread, Gram
NS, 5 Polar Express steps): at 256×1024 fp16 took 444 ms, bf16 8.1 ms, fp32 14.0 ms; at
1024×4096 bf16 0.35 s, fp32 0.89 s, fp16 about a minute. CPU BLAS has no fp16 product, so
torch runs fp16 through a generic loop, 30-55× slower. bf16 is 1.4-2.5× faster than fp32 on
this CPU, which multiplies bf16 natively (one without AVX-512 BF16 or AMX has to convert to
fp32 and can gain little), but its result is 6× further from the float64 reference than fp16's
(relative error 2.8e-2 against 4.9e-3 at 256×1024) and leaves the singular-value band the
README states (σ_max up to 1.56 on ill-conditioned inputs). fp32 is the fast BLAS path on every
CPU and lands far closer to the reference (5.5e-6 at 256×1024, where fp16 gives 4.9e-3;
1.3e-4 at 1024×4096). It costs memory: NS's temporaries take twice the bytes of fp16's (a Muon
step on the CPU then peaks ~1.2× above ``torch.optim.Muon``'s, which iterates in bf16). bf16
stays one argument away (``dtype=torch.bfloat16``) where speed or memory matter more.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "Described",
    "Prepared",
    "ScalePass",
    "check_matrix",
    "describe",
    "iteration_dtype",
    "prepare",
    "problem_name",
    "restore",
    "scale_with_torch",
]

ScalePass = Callable[[Tensor, Tensor, float, Tensor], object]
"""Step 4 of the note: ``(source, norm, eps, out)`` writes ``source · 1/(norm + eps)`` into
``out``, per matrix, computed in ``norm``'s dtype and rounded once to ``out``'s."""


def scale_with_torch(source: Tensor, norm: Tensor, eps: float, out: Tensor) -> None:
    """The scaling pass in torch ops (on any device; see [Note: the scaling pass follows the
    kernel])."""
    scale = norm.add(eps).reciprocal_()
    torch.mul(source, scale[:, None, None], out=out)


class Prepared(NamedTuple):
    """An input after steps 1-3 of the note; ``write`` does step 4. ``shape``, ``dtype`` and
    ``device`` describe the kernel's input that ``write`` produces."""

    source: Tensor  # (batch, m, n), m <= n: a view of the input
    norm: Tensor  # (batch,) fp32: the Frobenius norm of each matrix
    eps: float  # each matrix is scaled by 1 / (norm + eps)
    dtype: torch.dtype  # the iteration dtype
    input_shape: torch.Size
    input_dtype: torch.dtype
    transposed: bool  # the input was tall and ``source`` is its transpose
    scale_pass: ScalePass = scale_with_torch  # set from the kernel that runs (see the note)

    @property
    def shape(self) -> torch.Size:
        return self.source.shape

    @property
    def device(self) -> torch.device:
        return self.source.device

    def write(self, out: Tensor | None = None) -> Tensor:
        """Step 4: the scaled input in the iteration dtype, contiguous, written into ``out``
        (a CUDA graph's static input, say: see ``_graphs``) or into a new tensor."""
        if out is None:
            out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        elif (out.shape, out.dtype, out.device) != (self.shape, self.dtype, self.device) or (
            not out.is_contiguous()
        ):
            layout = "contiguous" if out.is_contiguous() else "non-contiguous"
            raise ValueError(
                f"out must be a contiguous {self.dtype} tensor of shape {tuple(self.shape)} on"
                f" {self.device}, got a {layout} {out.dtype} tensor of shape"
                f" {tuple(out.shape)} on {out.device}"
            )
        self.scale_pass(self.source, self.norm, self.eps, out)
        return out


def without_autocast(device: torch.device) -> AbstractContextManager[object]:
    """A region where the products run in the iteration dtype even inside the caller's
    ``torch.autocast`` (which would turn the torch kernel's fp32 or fp16 products into bf16
    ones); nothing when autocast is off, as it is outside such a region."""
    if device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return nullcontext()


def iteration_dtype(
    requested: torch.dtype | None, device: torch.device, kernels: Sequence[str]
) -> torch.dtype:
    """The dtype NS iterates in on ``device`` with the candidate ``kernels`` (names): the
    ``requested`` one, else the default of [Note: the iteration dtype]."""
    if requested is not None:
        return requested
    if device.type == "cpu" and tuple(kernels) == ("torch",):
        return torch.float32
    return torch.float16


class Described(NamedTuple):
    """The kernel's input that ``prepare`` and ``write`` would make of a tensor, described
    without the tensor (to settle the kernel ahead of a call)."""

    shape: torch.Size  # (batch, m, n), m <= n
    dtype: torch.dtype  # the iteration dtype
    device: torch.device


def describe(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Described:
    """``Described`` for an input of ``shape`` (..., rows, cols) iterated in ``dtype``."""
    rows, cols = shape[-2], shape[-1]
    batch = math.prod(shape[:-2])
    return Described(torch.Size((batch, min(rows, cols), max(rows, cols))), dtype, device)


def problem_name(op: str, shape: Sequence[int], dtype: torch.dtype) -> str:
    """``"<op> <batch>x<m>x<n> <dtype>"``, how ``tune`` and ``tune_pending`` name a problem
    (``shape`` and ``dtype``: the kernel's input, as ``describe`` gives them)."""
    return f"{op} {'x'.join(str(s) for s in shape)} {str(dtype).removeprefix('torch.')}"


def check_matrix(g: object, what: str = "G") -> Tensor:
    """Raise ``ValueError`` unless ``g`` is a real floating tensor of ≥ 2 dims, non-empty."""
    if not isinstance(g, Tensor):
        raise ValueError(
            f"{what} must be a torch.Tensor (or a list of them), got {type(g).__name__}"
        )
    if g.ndim < 2:
        raise ValueError(
            f"{what} must have at least 2 dims (a matrix or a batch of matrices), got shape"
            f" {tuple(g.shape)}; reshape it to (rows, cols) first"
        )
    if g.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(
            f"{what} must have a real floating dtype (float16, bfloat16, float32, float64),"
            f" got {g.dtype}; cast it with .float() first"
        )
    if g.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{what} requires grad, and NS has no backward: pass {what}.detach() (a gradient"
            " or a momentum never requires grad), or call it under torch.no_grad()"
        )
    if g.shape[-1] == 0 or g.shape[-2] == 0:
        raise ValueError(
            f"{what} is an empty matrix of shape {tuple(g.shape)}; NS needs at least one row"
            " and one column"
        )
    return g


def prepare(g: Tensor, dtype: torch.dtype, eps: float) -> Prepared:
    """Steps 1-3 of the note above (``g`` already passed ``check_matrix``); step 4, the one
    copy of the input, waits for ``Prepared.write`` and its destination."""
    rows, cols = g.shape[-2], g.shape[-1]
    x = g.reshape(-1, rows, cols)
    transposed = rows > cols
    if transposed:
        x = x.mT
    # Two passes over the input, none over an fp32 copy of it: the norm reads ``x`` once and
    # accumulates in fp32; ``write`` reads it again, multiplies in fp32 and writes the
    # iteration dtype in the small-side-first layout.
    acc = torch.promote_types(x.dtype, torch.float32)
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), dtype=acc)
    return Prepared(x, norm, eps, dtype, g.shape, g.dtype, transposed)


def restore(y: Tensor, prepared: Prepared) -> Tensor:
    """The kernel's (batch, m, n) result in the input's shape and dtype."""
    if prepared.transposed:
        y = y.mT
    return y.to(prepared.input_dtype).reshape(prepared.input_shape)
