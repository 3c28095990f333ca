"""The "triton" NS kernel: the Gram and direct iterations on the Triton products of
``_triton_kernels`` (symmetric m×m products on one triangle of tiles, fused epilogues).

Importing this module registers the kernel; Triton itself is imported only when the kernel
first runs, so ``unavailable_reason`` can explain a missing install instead of failing.

[Note: the same iteration as the torch kernel]
The loop mirrors ``_torch_kernel.gram_iterations`` step for step (``Z' = bR + cR²``, the ``a``
term fused into the next product's epilogue, restarts that rebuild ``R`` from ``X ← Q·X``),
so both kernels round at the same places and the autotuner's accuracy bar compares like with
like. The first ``Q = Z' + aI`` is a second output of the launch that makes ``Z'``, formed
from the *rounded* ``Z'``: ``Q`` and the ``R`` update must see the same ``Z'``. Forming ``Q``
from the unrounded fp32 tile looks more accurate per step, yet it doubled the final error
(H200, 3×333×1000 fp16: 3.8e-3 against torch's 1.9e-3, reproduced on CPU by an fp64
emulation with fp16 rounding after every product), because the Gram form relies on ``Q`` and
``R`` being built from the same polynomials. What does differ, in Triton's favour, is that
every m×m iterate is exactly symmetric (about 10% lower final error in that emulation).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence

import torch
from torch import Tensor

from dmuon_ns._registry import register_kernel

__all__ = ["TRITON_KERNEL", "TritonKernel"]

_INSTALL_HINT = "pip install 'dmuon-ns[triton]'"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class TritonKernel:
    """Gram/direct NS on Triton symmetric products; CUDA (SM80+), or the CPU interpreter."""

    name = "triton"

    def unavailable_reason(self, device: torch.device) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return f"triton is not installed: {_INSTALL_HINT}"
        if device.type == "cuda":
            if not torch.cuda.is_available():
                return "needs a CUDA device, and torch sees none"
            major, minor = torch.cuda.get_device_capability(device)
            if major < 8:
                return f"needs a CUDA device of SM80 or newer, this one is SM{major}{minor}"
            return None
        if device.type == "cpu" and _interpreting():
            return None
        return f"needs a CUDA device (got {device.type}; TRITON_INTERPRET=1 runs it on CPU)"

    def gram(
        self,
        x: Tensor,
        coefficients: Sequence[tuple[float, float, float]],
        restart_iterations: Sequence[int],
        out_dtype: torch.dtype | None = None,
    ) -> Tensor:
        from dmuon_ns._triton_kernels import matmul, sym_matmul

        restarts = frozenset(restart_iterations)
        last = len(coefficients) - 1
        r, _ = sym_matmul(x, x.mT)
        q: Tensor | None = None
        for i, (a, b, c) in enumerate(coefficients):
            if i in restarts and i != 0 and q is not None:
                x = matmul(q, x)
                r, _ = sym_matmul(x, x.mT)
                q = None
            if q is None:
                z, q = sym_matmul(r, r, c=r, alpha=c, beta=b, diag2=a)
            else:
                z, _ = sym_matmul(r, r, c=r, alpha=c, beta=b)
                q, _ = sym_matmul(q, z, c=q, beta=a)
            if i < last and (i + 1) not in restarts:
                rz, _ = sym_matmul(r, z, c=r, beta=a)  # R·(aI + Z')
                r, _ = sym_matmul(z, rz, c=rz, beta=a)  # (aI + Z')·R·(aI + Z')
        if q is None:
            raise ValueError("coefficients must hold at least one (a, b, c) row")
        return matmul(q, x, out_dtype=out_dtype)

    def direct(
        self,
        x: Tensor,
        coefficients: Sequence[tuple[float, float, float]],
        out_dtype: torch.dtype | None = None,
    ) -> Tensor:
        from dmuon_ns._triton_kernels import matmul, sym_matmul

        last = len(coefficients) - 1
        for i, (a, b, c) in enumerate(coefficients):
            r, _ = sym_matmul(x, x.mT)
            z, _ = sym_matmul(r, r, c=r, alpha=c, beta=b)  # b·R + c·R²
            x = matmul(z, x, c=x, beta=a, out_dtype=out_dtype if i == last else None)
        return x

    def __repr__(self) -> str:
        return "TritonKernel()"


TRITON_KERNEL = TritonKernel()
register_kernel(TRITON_KERNEL)
