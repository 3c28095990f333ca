"""The two NS loops, written once over a small set of products that each kernel supplies.

[Note: the Gram iteration]
For a wide ``X`` (m ≤ n) with ``R = X·Xᵀ``, one quintic step is ``X ← Z·X`` with
``Z = aI + bR + cR²``. Every ``Z`` is a polynomial in ``R``, so the steps can run on the
m×m side alone: keep ``Q`` (the product of the ``Z`` so far) and the Gram matrix of the
current iterate, ``R ← Z·R·Z`` (``X·Xᵀ`` of ``Z·X``), and apply ``Q·X`` once at the end.
That is ~3 m×m×m products per step instead of two m×m×n ones and one m×n×m, a large saving
when n ≫ m. Every m×m operand is a polynomial in ``R``, so every m×m product is symmetric.

Half precision is the catch: ``R`` is updated by repeated products instead of recomputed
from ``X``, and its rounding errors compound step by step. A *restart* at iteration ``i``
materialises ``X ← Q·X``, recomputes ``R = X·Xᵀ`` from it and resets ``Q = I`` before step
``i`` runs, so the error grows from a fresh start (the Gram Newton–Schulz reference,
Dao-AILab/gram-newton-schulz, restarts at iteration 2 by default). A restart at iteration 0
would be the starting state; the front end rejects it.

[Note: m×m lifetimes]
Every m×m matrix is dropped as soon as the loop has read it for the last time: the old ``R``
before the new one is formed, ``R·Z'`` right after, ``Z'`` at the end of its step (unless it
became the first ``Q``), and ``R`` after the step before a restart or the last step, which do
not update it. So each product is formed beside three m×m matrices at most (``R``, ``Q`` and
``Z'``, or ``Q``, ``Z'`` and ``R·Z'``), and a restart's ``Q·X`` beside ``Q`` alone: then the
iterate, the restarted iterate and one m×m matrix are alive. Three more m×m matrices kept alive
there would be 1.1 times the input's size for a stack of 768×2048 experts
(``tests/test_iterations.py`` counts them).

[Note: fused epilogues]
``aI + Z'`` with ``Z' = bR + cR²`` is never formed in half precision where it can be avoided:
adding ``a`` (up to ~8) to a diagonal whose entries are ~b/m would round them away. Instead
the ``a`` term rides in the epilogue of the next product, accumulated in fp32:
``Q·(aI + Z') = a·Q + Q·Z'`` and ``R·(aI + Z') = a·R + R·Z'`` are one product each. Only the
first ``Q`` after a start or restart (no product to fuse into) is ``Z' + aI``, formed from the
*rounded* ``Z'``: ``Q`` and the ``R`` update must see the same ``Z'`` (forming ``Q`` from the
unrounded fp32 tile doubled the final error on an H200, 3×333×1000 fp16). It is formed in
place, by adding ``a`` to ``Z'``'s diagonal once the ``R`` update has read ``Z'`` for the last
time (stream order keeps the two apart): a copy of ``Z'`` would be a pass over an m×m matrix
and its memory, at every start and restart.

[Note: the result dtype]
The caller's dtype is best written by the last product itself (Triton and quack round their
fp32 accumulator straight to it: no pass over the result). A library that cannot (cuBLAS
writes its operands' dtype) returns the iteration dtype, and ``LastProduct.finish`` casts
after the loop has returned: by then only the last product's operands (``Q`` and the current
``X``) are alive, not the loop's other iterates; a cast inside the loop would hold them all at
the step's memory peak.

[Note: the last product]
The loops return their last product unrun, as a ``LastProduct`` (the product and its
operands); ``finish()`` runs it. Callers that run it at once see no difference. The CUDA-graph
path (``_graphs``) replays everything before it and runs it after the replay, outside the
graph: its result is then a fresh tensor of the caller's, where a product inside the graph
would write the graph's static output and need a copy out of it (a pass over the result:
~22 µs at 2048×8192 on an H200, benchmarks/HISTORY.md profile 4).

[Note: the input is handed over]
The loops take their input as a ``Tensor`` or as an ``Owned`` one. A caller that passes a
tensor keeps a reference to it, so the input lives until the loop returns. The dispatcher's
eager path hands its freshly written input over in an ``Owned`` instead: the loop then holds
the only reference, and the input is freed when the loop no longer reads it (at the Gram
form's first restart, or after the direct form's first step). The Gram form's last product
then has the restarted iterate and the result alive, not the input as well: at 8192×28672
that is 448 MiB less at the peak.

[Note: one loop, several kernels]
The torch, Triton and quack kernels differ only in how they multiply, so each hands these
loops a ``Products`` object and all of them round at the same places: the autotuner's
accuracy bar compares like with like, and the quack kernel run on torch products is the torch
kernel bit for bit (a CPU test holds it to that).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from dmuon_ns._coefficients import CoefficientRows
from dmuon_ns._prepare import ScalePass, scale_with_torch

__all__ = [
    "TORCH_PRODUCTS",
    "LastProduct",
    "LoopKernel",
    "Owned",
    "Products",
    "TorchProducts",
    "as_dtype",
    "direct_iterations",
    "finished",
    "gram_iterations",
]


class Products(Protocol):
    """The batched (batch, rows, cols) products the loops are made of."""

    def gram(self, x: Tensor) -> Tensor:
        """``x·xᵀ``, in ``x``'s dtype."""
        ...

    def sym(self, a: Tensor, b: Tensor, c: Tensor, *, alpha: float = 1.0, beta: float) -> Tensor:
        """``alpha·a·b + beta·c`` for a product ``a·b`` known to be symmetric."""
        ...

    def mm(self, a: Tensor, b: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
        """``a·b``, rounded once to ``out_dtype`` where the library can write it (see
        [Note: the result dtype]); otherwise in the operands' dtype."""
        ...

    def mm_add(
        self, a: Tensor, b: Tensor, c: Tensor, beta: float, out_dtype: torch.dtype | None = None
    ) -> Tensor:
        """``a·b + beta·c``, in ``out_dtype`` where the library can write it, as ``mm``."""
        ...


class TorchProducts:
    """``bmm``/``baddbmm`` on any device; the reference every other kernel is held to."""

    def gram(self, x: Tensor) -> Tensor:
        return torch.bmm(x, x.mT)

    def sym(self, a: Tensor, b: Tensor, c: Tensor, *, alpha: float = 1.0, beta: float) -> Tensor:
        return torch.baddbmm(c, a, b, beta=beta, alpha=alpha)

    def mm(self, a: Tensor, b: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
        return torch.bmm(a, b)  # cuBLAS writes the operands' dtype: the kernel casts later

    def mm_add(
        self, a: Tensor, b: Tensor, c: Tensor, beta: float, out_dtype: torch.dtype | None = None
    ) -> Tensor:
        return torch.baddbmm(c, a, b, beta=beta)


TORCH_PRODUCTS = TorchProducts()


class Owned:
    """An input handed over to a loop, which takes the only reference to it (see [Note: the
    input is handed over])."""

    __slots__ = ("_tensor",)

    def __init__(self, tensor: Tensor) -> None:
        self._tensor: Tensor | None = tensor

    def peek(self) -> Tensor:
        """The tensor, still owned here (for a look at its shape and dtype)."""
        if self._tensor is None:
            raise RuntimeError("an Owned input is taken once")
        return self._tensor

    def take(self) -> Tensor:
        """The tensor, once; the holder keeps no reference to it."""
        tensor, self._tensor = self._tensor, None
        if tensor is None:
            raise RuntimeError("an Owned input is taken once")
        return tensor


def _taken(x: Tensor | Owned) -> Tensor:
    return x.take() if isinstance(x, Owned) else x


class LastProduct(NamedTuple):
    """A loop's final product, not yet run (see [Note: the last product])."""

    product: Callable[..., Tensor]  # called with the operands
    operands: tuple[Tensor, ...]
    out_dtype: torch.dtype | None

    def finish(self) -> Tensor:
        """Run the product; the result in ``out_dtype`` (see [Note: the result dtype])."""
        return as_dtype(self.product(*self.operands), self.out_dtype)


def finished(output: Tensor | LastProduct) -> Tensor:
    """A kernel call's result: ``output`` itself, or its last product run."""
    return output.finish() if isinstance(output, LastProduct) else output


def gram_iterations(
    products: Products,
    x: Tensor | Owned,
    coefficients: CoefficientRows,
    restart_iterations: Sequence[int],
    out_dtype: torch.dtype | None = None,
    *,
    r: Tensor | None = None,
) -> LastProduct:
    """Gram NS of ``x`` (batch, m, n), m ≤ n (see the notes), up to its last product ``Q·x``,
    which ``finish()`` writes in ``out_dtype``.

    ``r`` is ``x``'s Gram matrix when the caller already has it (the distributed form reduces
    it across ranks); by default ``products.gram(x)``.
    """
    if not coefficients:
        raise ValueError("coefficients must hold at least one (a, b, c) row")
    x = _taken(x)
    restarts = frozenset(restart_iterations)
    last = len(coefficients) - 1
    r = products.gram(x) if r is None else r
    q: Tensor | None = None
    for i, (a, b, c) in enumerate(coefficients):
        if r is None:  # a restart (the step before dropped R): X ← Q·X, then R and Q afresh
            assert q is not None
            x = products.mm(q, x)
            q = None
            r = products.gram(x)
        z = products.sym(r, r, r, alpha=c, beta=b)  # Z' = b·R + c·R²
        if q is not None:
            q = products.sym(q, z, q, beta=a)  # Q·(aI + Z')
        if i < last and (i + 1) not in restarts:
            rz = products.sym(r, z, r, beta=a)  # R·(aI + Z')
            del r  # read for the last time: freed before the new R is formed
            r = products.sym(z, rz, rz, beta=a)  # (aI + Z')·R·(aI + Z')
            del rz
        else:  # the next step restarts from X, or there is none: R is not read again
            r = None
        if q is None:  # the first Q, Z' + aI, in place: Z' is not read again
            q = z
            q.diagonal(dim1=-2, dim2=-1).add_(a)
        del z
    assert q is not None
    return LastProduct(functools.partial(products.mm, out_dtype=out_dtype), (q, x), out_dtype)


def direct_iterations(
    products: Products,
    x: Tensor | Owned,
    coefficients: CoefficientRows,
    out_dtype: torch.dtype | None = None,
) -> LastProduct:
    """Direct NS, ``X ← a·X + (b·R + c·R²)·X`` with ``R = X·Xᵀ``, up to the last step's
    ``a·X + Z'·X``, which ``finish()`` writes in ``out_dtype``."""
    if not coefficients:
        raise ValueError("coefficients must hold at least one (a, b, c) row")
    x = _taken(x)
    *steps, (a, b, c) = coefficients
    for a_i, b_i, c_i in steps:
        x = products.mm_add(_direct_z(products, x, b_i, c_i), x, x, a_i)  # a·X + Z'·X
    last = functools.partial(products.mm_add, beta=a, out_dtype=out_dtype)
    return LastProduct(last, (_direct_z(products, x, b, c), x, x), out_dtype)


def _direct_z(products: Products, x: Tensor, b: float, c: float) -> Tensor:
    """``Z' = b·R + c·R²`` with ``R = X·Xᵀ``."""
    r = products.gram(x)
    return products.sym(r, r, r, alpha=c, beta=b)


def as_dtype(y: Tensor, out_dtype: torch.dtype | None) -> Tensor:
    """``y`` in ``out_dtype`` (``None``: as it is); see [Note: the result dtype]."""
    return y if out_dtype is None or y.dtype == out_dtype else y.to(out_dtype)


class LoopKernel:
    """An ``NSKernel`` made of the shared loops: a subclass sets ``name`` and says where it
    runs (``unavailable_reason``), which products an input runs on (``products_for``) and,
    where it has its own, the scaling pass of its input (``scale_pass``).
    ``gram`` and ``direct`` are ``loop`` finished at once; the dispatcher calls ``loop`` (see
    [Note: the last product]), so a subclass changes the products, not those methods."""

    name: str

    def unavailable_reason(self, device: torch.device) -> str | None:
        raise NotImplementedError

    def products_for(self, x: Tensor) -> Products:
        raise NotImplementedError

    def scale_pass(self, source: Tensor, norm: Tensor) -> ScalePass:
        """How the front end scales and casts this kernel's input ``source`` (the raw
        (batch, m, n) view, with its ``norm``): torch ops, unless a subclass has its own pass
        (``_prepare``'s [Note: the scaling pass follows the kernel])."""
        return scale_with_torch

    def failure_types(self) -> tuple[type[Exception], ...]:
        """The exceptions by which this kernel says it cannot run a problem (the autotuner
        rejects the kernel for that problem and reports why; anything else propagates)."""
        return (RuntimeError, ValueError)

    def gram(
        self,
        x: Tensor,
        coefficients: CoefficientRows,
        restarts: Sequence[int],
        out_dtype: torch.dtype | None = None,
    ) -> Tensor:
        return self.loop("gram", x, coefficients, restarts, out_dtype).finish()

    def direct(
        self,
        x: Tensor,
        coefficients: CoefficientRows,
        out_dtype: torch.dtype | None = None,
    ) -> Tensor:
        return self.loop("direct", x, coefficients, (), out_dtype).finish()

    def loop(
        self,
        op: str,
        x: Tensor | Owned,
        coefficients: CoefficientRows,
        restart_iterations: Sequence[int],
        out_dtype: torch.dtype | None = None,
    ) -> LastProduct:
        """``op`` ("gram" or "direct") up to its last product (see [Note: the last product]);
        ``x`` may be handed over (see [Note: the input is handed over])."""
        products = self.products_for(x.peek() if isinstance(x, Owned) else x)
        if op == "gram":
            return gram_iterations(products, x, coefficients, restart_iterations, out_dtype)
        if op == "direct":
            return direct_iterations(products, x, coefficients, out_dtype)
        raise ValueError(f"op must be 'gram' or 'direct', got {op!r}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
