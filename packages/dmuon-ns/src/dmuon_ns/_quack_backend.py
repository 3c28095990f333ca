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
squares, 3 rounds of which the last is 4 squares (2.06 rounds of work). 128×128 ping-pong
tiles without a cluster waste less of the last round (528 tiles on 132 slots: exactly 4
rounds) but run each round at a lower rate, and which wins depends on the product: on an H200
(``SYM_TILE_MEASUREMENTS``: 15 products of the benchmark, MoE and Llama shapes, timed with
both shapes) 128×128 took R·R + C of 128 experts of 768 rows from 165 to 145 µs and a
1024×4096 Gram matrix from 45 to 26 µs, while 128×256 stays faster at m = 8192 (2.76 against
4.18 ms at K = 28672, where 128×128 rounds slow down) and for 128 Gram matrices of 768×2048.
A product takes the shape with the least estimated time, rounds × the time of one round, where
a round's time is that of the measured product nearest in m, K and whether it is a Gram matrix
(then in batch), scaled by K (ties to quack's own). Every shape computes each output element
in the same K order, so X·Xᵀ and R·R (exactly symmetric) come out bit for bit the same; a
product that is symmetric only in exact arithmetic (Q·Z') differs by rounding in the mirrored
half, as it would between any two tilings. The choice goes through quack's dispatch-level
``gemm_symmetric``, which takes the tile shape. That function is below quack's documented
interface, so it is used only from the quack releases it was written and measured against
(``_TILED_QUACK_RELEASES``); under another release, or on another architecture, quack's
interface runs with its own tiles.

Two more shapes were faster at some products and are not used: 192×192 (X·Xᵀ at 2 × 2048×8192
in 108 µs against 140: 132 squares, one round) and 64×128 in clusters of two (a 1024×4096
Gram matrix in 20 µs). The first aborted the process inside CuTe DSL's compiler (4.8.1,
``std::bad_variant_access``: no exception handler can catch it) for a product with C and a
transposed B, and neither has been through these loops and the bit-for-bit test on a GPU
(benchmarks/HISTORY.md, "The symmetric tile shapes").

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
from dmuon_ns._registry import cuda_capability_reason, install_hint, register_kernel

__all__ = ["QUACK_KERNEL", "QuackKernel"]

_SMALL_GRAM_SIDE = 256
_TMA_ALIGN_BYTES = 16
# quack-kernels releases whose dispatch-level ``gemm_symmetric`` takes the tile arguments used
# below (see the tile note): 0.6.x, measured with 0.6.5.
_TILED_QUACK_RELEASES = ("0.6.",)


class SymTiles(NamedTuple):
    """One SM90 tile shape of quack's symmetric product (see the module note): clusters of
    ``cluster_m`` CTAs of ``tile_m``×``tile_n`` cover one ``tile_n`` square each."""

    name: str
    tile_m: int
    tile_n: int
    cluster_m: int
    pingpong: bool

    def rounds(self, batch: int, m: int, sms: int) -> int:
        side = math.ceil(m / self.tile_n)
        tiles = batch * side * (side + 1) // 2
        return math.ceil(tiles / (sms // self.cluster_m))


QUACK_SM90_TILES = SymTiles("128x256 c2", 128, 256, 2, pingpong=False)
SM90_SYM_TILES = (QUACK_SM90_TILES, SymTiles("128x128 pingpong", 128, 128, 1, pingpong=True))


class SymProduct(NamedTuple):
    """A symmetric product of (batch, m, k) operands: a Gram matrix ``x·xᵀ`` (``gram``), or
    ``alpha·a·b + beta·c``."""

    batch: int
    m: int
    k: int
    gram: bool


# µs of each SM90_SYM_TILES shape, in order, per product: NVIDIA H200 (132 SMs), quack-kernels
# 0.6.5, fp16 row-major operands, triton.testing.do_bench medians, 2026-12-04 20:03-20:08 UTC
# (benchmarks/HISTORY.md, "The symmetric tile shapes").
SYM_TILE_MEASUREMENTS: tuple[tuple[SymProduct, tuple[float, ...]], ...] = (
    (SymProduct(128, 768, 768, False), (165.2, 145.4)),
    (SymProduct(128, 768, 2048, True), (306.0, 320.5)),
    (SymProduct(2, 2048, 2048, False), (65.4, 41.5)),
    (SymProduct(2, 2048, 8192, True), (174.2, 140.2)),
    (SymProduct(8, 2048, 2048, False), (144.2, 119.5)),
    (SymProduct(48, 2048, 2048, False), (733.4, 695.1)),
    (SymProduct(32, 512, 512, False), (34.3, 26.3)),
    (SymProduct(32, 512, 2048, True), (54.3, 48.9)),
    (SymProduct(1, 4096, 4096, False), (146.5, 117.6)),
    (SymProduct(1, 4096, 14336, True), (468.2, 368.7)),
    (SymProduct(2, 4096, 4096, False), (276.3, 236.1)),
    (SymProduct(1, 1024, 1024, False), (22.4, 14.5)),
    (SymProduct(1, 1024, 4096, True), (45.4, 25.6)),
    (SymProduct(1, 8192, 8192, False), (800.3, 1007.2)),
    (SymProduct(1, 8192, 28672, True), (2763.6, 4178.5)),
)
_MEASURED_SMS = 132


def _distance(a: SymProduct, b: SymProduct) -> float:
    """How far apart two products are for a round's time: m and K on a log scale, one unit
    for a Gram matrix against a product that adds C (a round's epilogue reads C), and the
    batch, which the rounds already count, weighed lightly (it moves a round's time only
    through the caches)."""
    shape = abs(math.log2(a.m / b.m)) + abs(math.log2(a.k / b.k)) + float(a.gram != b.gram)
    return shape + abs(math.log2(a.batch / b.batch)) / 8


def estimated_us(tiles: SymTiles, product: SymProduct, sms: int) -> float:
    """``product``'s time on ``tiles``: its rounds × the time of one round of the nearest
    measured product, scaled by K (see the module note)."""
    index = SM90_SYM_TILES.index(tiles)
    near, times = min(SYM_TILE_MEASUREMENTS, key=lambda entry: _distance(product, entry[0]))
    per_round = times[index] / tiles.rounds(near.batch, near.m, _MEASURED_SMS)
    return tiles.rounds(product.batch, product.m, sms) * per_round * product.k / near.k


@functools.cache
def pick_sym_tiles(product: SymProduct, sms: int) -> SymTiles:
    """The SM90 tile shape with the least estimated time (ties: quack's own)."""
    return min(SM90_SYM_TILES, key=lambda tiles: estimated_us(tiles, product, sms))


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
        batch, m, k = a.shape
        gram = c is None and alpha == 1.0 and b.mT.is_contiguous()
        tiles = pick_sym_tiles(SymProduct(batch, m, k, gram), sms)
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


@functools.cache
def _quack() -> Products:
    """quack's products, made (and quack imported) at the first problem that runs on them."""
    return _QuackProducts()


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
                return f"{module} is not installed: {install_hint('quack')}"
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
