"""The "quack" NS kernel: the Gram and direct iterations on quack-kernels' CuTe DSL products
(``gemm_symmetric`` for the symmetric m×m products and Gram matrices, ``gemm`` / ``gemm_add``
for the rest), run by the shared loops of ``_iterations``.

quack-kernels is an optional extra (``cute``: quack-kernels and nvidia-cutlass-dsl), imported
only when the kernel first runs; it is never vendored. Importing this module only registers
the kernel.

[Note: problems quack does not take]
quack's symmetric product works on square tiles of up to 256 rows; for m ≤ 256 the whole
problem is a single tile and the library's launch cost dominates, so (as the Gram
Newton–Schulz reference does) those problems run on torch products inside this kernel. So do
shapes whose rows are not 16-byte aligned (m or n not a multiple of 8 in fp16/bf16): quack
loads through TMA and rejects them (seen on an H200 for 3×333×1000). Either way the loop is
the same, so the autotuner's accuracy bar compares like with like.

[Note: the symmetric tile shape]
quack's symmetric product is persistent: a fixed number of CTAs (clusters) walk the tiles of
one triangle in rounds, so a problem runs ⌈tiles / slots⌉ rounds, and a last round that is
nearly empty costs as much as a full one. On SM90 quack always uses 128×256 tiles in clusters
of two (a 256×256 square per cluster, 66 slots on an H200's 132 SMs): at m = 4096 that is 136
squares, 3 rounds of which the last is 4 squares (2.06 rounds of work). 128×128 tiles without
a cluster give 528 tiles on 132 slots, exactly 4 rounds, each costing 0.61 of a big round
(measured at 8192, where both fill every round). So per (batch, m) we pick the shape with the
fewest estimated rounds × cost, ties to quack's own: on an H200 the m = 4096 products ran
13-18 % faster (0.141 → 0.123 ms for R·R, 0.458 → 0.376 ms for X·Xᵀ at n = 14336; 2048 and
8192 keep the default). Every shape computes each output element in the same K order, so
X·Xᵀ and R·R (exactly symmetric) come out bit for bit the same; a product that is symmetric
only in exact arithmetic (Q·Z') differs by rounding in the mirrored half, as it would
between any two tilings. The choice goes through quack's dispatch-level ``gemm_symmetric``,
which takes the tile shape. That function is below quack's documented interface, so it is
used only from the quack releases it was written and measured against
(``_TILED_QUACK_RELEASES``); under another release, or on another architecture, quack's
interface runs with its own tiles.

[Note: no tuning inside quack]
quack's ``gemm`` and ``gemm_add`` autotune by default: the first call of every new shape
compiles and times each of their SM90 configurations (tens of them), with copies of the
operands to defeat the L2 cache. Inside an NS call that is a stall of many seconds at an
unpredictable point, and transient memory several times the operands'. This kernel calls them
with ``tuned=False``: the configuration comes from quack's heuristic (nvMatmulHeuristics where
it is installed, quack's SM90 default otherwise), as the Gram Newton–Schulz reference calls
them, and a new shape costs at most the compile of a configuration not compiled before. The
symmetric products, most of the work, take the tile shape of the note above.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from dmuon_ns._iterations import TORCH_PRODUCTS, LoopKernel, Products, TorchProducts
from dmuon_ns._prepare import ScalePass, scale_with_torch
from dmuon_ns._registry import cuda_capability_reason, register_kernel

__all__ = ["QUACK_KERNEL", "QuackKernel"]

# What dmuon-ns's ``cute`` extra installs.
_INSTALL_HINT = "pip install 'quack-kernels>=0.6.5' 'nvidia-cutlass-dsl>=4.8.1'"
_SMALL_GRAM_SIDE = 256
_TMA_ALIGN_BYTES = 16
# quack-kernels releases whose dispatch-level ``gemm_symmetric`` takes the tile arguments used
# below (see the tile note): 0.6.x, measured with 0.6.5.
_TILED_QUACK_RELEASES = ("0.6.",)


class SymTiles(NamedTuple):
    """One SM90 tile shape of quack's symmetric product (see the module note)."""

    tile_m: int
    tile_n: int
    cluster_m: int
    pingpong: bool
    round_cost: float  # time of one round of tiles, relative to quack's default shape

    def rounds(self, batch: int, m: int, sms: int) -> int:
        side = math.ceil(m / (self.tile_m * self.cluster_m))
        tiles = batch * side * (side + 1) // 2
        return math.ceil(tiles / (sms // self.cluster_m))


QUACK_SM90_TILES = SymTiles(128, 256, 2, pingpong=False, round_cost=1.0)
SM90_SYM_TILES = (QUACK_SM90_TILES, SymTiles(128, 128, 1, pingpong=True, round_cost=0.61))


def pick_sym_tiles(batch: int, m: int, sms: int) -> SymTiles:
    """The SM90 tile shape with the fewest estimated rounds × cost (ties: quack's own)."""
    return min(SM90_SYM_TILES, key=lambda t: t.rounds(batch, m, sms) * t.round_cost)


@functools.cache
def _sm90_count(device: torch.device) -> int | None:
    """The device's SM count when it is an SM90 part (the shapes were measured there)."""
    properties = torch.cuda.get_device_properties(device)
    return properties.multi_processor_count if properties.major == 9 else None


class _QuackProducts(TorchProducts):
    """quack's products; the first ``Q`` is torch's copy-plus-diagonal of quack's ``Z'``."""

    def __init__(self) -> None:
        from quack.gemm_interface import gemm, gemm_add, gemm_symmetric

        self._gemm: Any = gemm
        self._gemm_add: Any = gemm_add
        self._gemm_symmetric: Any = gemm_symmetric
        self._tiled_symmetric: Any = _tiled_symmetric()

    def gram(self, x: Tensor) -> Tensor:
        return self._symmetric(x, x.mT, None, alpha=1.0, beta=1.0)

    def sym(self, a: Tensor, b: Tensor, c: Tensor, *, alpha: float = 1.0, beta: float) -> Tensor:
        return self._symmetric(a, b, c, alpha=alpha, beta=beta)

    def _symmetric(
        self, a: Tensor, b: Tensor, c: Tensor | None, *, alpha: float, beta: float
    ) -> Tensor:
        """``alpha·a·b + beta·c`` (no ``c``: ``a·b``), batched, on the tile shape of the note."""
        sms = _sm90_count(a.device) if self._tiled_symmetric is not None else None
        if sms is None:
            out: Tensor = self._gemm_symmetric(a, b, C=c, alpha=alpha, beta=beta)
            return out
        batch, m = a.shape[0], a.shape[1]
        tiles = pick_sym_tiles(batch, m, sms)
        out = torch.empty(batch, m, m, dtype=a.dtype, device=a.device)
        # The dispatch level takes B operand-shaped, (batch, m, k): the interface's ``b.mT``.
        self._tiled_symmetric(
            a,
            b.mT,
            out,
            c,
            None,
            tile_M=tiles.tile_m,
            tile_N=tiles.tile_n,
            cluster_M=tiles.cluster_m,
            cluster_N=1,
            pingpong=tiles.pingpong,
            persistent=True,
            is_dynamic_persistent=False,
            max_swizzle_size=8,
            alpha=alpha,
            beta=beta,
        )
        return out

    def mm(self, a: Tensor, b: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
        out: Tensor = self._gemm(a, b, out_dtype=out_dtype, tuned=False)  # see the note
        return out

    def mm_add(
        self, a: Tensor, b: Tensor, c: Tensor, beta: float, out_dtype: torch.dtype | None = None
    ) -> Tensor:
        out: Tensor = self._gemm_add(a, b, c, beta=beta, out_dtype=out_dtype, tuned=False)
        return out


def _tiled_symmetric() -> Any:
    """quack's dispatch-level symmetric product, or ``None`` where this module must leave the
    tiles to quack's interface (see the tile note)."""
    try:
        release = importlib.metadata.version("quack-kernels")
    except importlib.metadata.PackageNotFoundError:
        return None
    if not release.startswith(_TILED_QUACK_RELEASES):
        return None
    try:
        from quack.gemm_symmetric import gemm_symmetric
    except ImportError:
        return None
    return gemm_symmetric


_quack_products: _QuackProducts | None = None


def _quack() -> Products:
    global _quack_products
    if _quack_products is None:
        _quack_products = _QuackProducts()
    return _quack_products


def _products_for(x: Tensor) -> Products:
    """quack's products, or torch's for the problems of the module note."""
    m, n = x.shape[-2], x.shape[-1]
    row_bytes = (m * x.element_size(), n * x.element_size())
    unaligned = any(size % _TMA_ALIGN_BYTES for size in row_bytes)
    return TORCH_PRODUCTS if m <= _SMALL_GRAM_SIDE or unaligned else _quack()


class QuackKernel(LoopKernel):
    """Gram/direct NS on quack-kernels (CuTe DSL); CUDA SM90+ with the ``cute`` extra."""

    name = "quack"

    def unavailable_reason(self, device: torch.device) -> str | None:
        for module in ("quack", "cutlass"):
            if importlib.util.find_spec(module) is None:
                return f"{module} is not installed: {_INSTALL_HINT}"
        if device.type != "cuda":
            return f"needs a CUDA device of SM90 or newer (got {device.type})"
        return cuda_capability_reason(device, 9)

    def products_for(self, x: Tensor) -> Products:
        return _products_for(x)

    def scale_pass(self, source: Tensor, norm: Tensor) -> ScalePass:
        # quack has no elementwise pass of its own; Triton's one-pass scaling runs where Triton
        # is installed (it comes with torch's CUDA wheels), torch ops where it is not.
        if importlib.util.find_spec("triton") is None:
            return scale_with_torch
        from dmuon_ns._triton_backend import triton_scale_pass

        return triton_scale_pass(norm)

    def failure_types(self) -> tuple[type[Exception], ...]:
        try:
            from cutlass.base_dsl.common import DSLBaseError  # CuTe DSL compile and launch
        except ImportError:  # a CuTe DSL release that keeps its errors elsewhere
            return super().failure_types()
        return (*super().failure_types(), DSLBaseError)


QUACK_KERNEL = QuackKernel()
register_kernel(QUACK_KERNEL)
