"""Triton matrix products for Newton–Schulz: one batched kernel with fused epilogues, run as a
symmetric product that computes one triangle of tiles or as a plain product (the final ``Q·X``).

[Note: symmetric products]
Every m×m matrix of the Gram iteration is a polynomial in ``R = X·Xᵀ`` (``P = aI + bR + cR²``,
``Q``, ``R·P``, ``P·(R·P)``), so every product of two of them is symmetric. The symmetric
product launches one program per tile of the lower triangle, ``(i, j)`` with ``i >= j``, and
stores the tile at ``(i, j)`` and its transpose at ``(j, i)``: half the tiles of a full
product, and an output that is symmetric bit for bit. A diagonal tile copies its lower
triangle onto its upper one, so every element is the sum its lower-triangle position computes,
in the same K order whatever the tile size: the autotuner's pick, which can differ between
processes, does not change a bit of the result, which a resumed run relies on (averaging a
diagonal tile with its transpose would: the sum of two roundings depends on the tile;
``test_gpu_kernels`` holds the configs to one result). The epilogue folds in
``alpha·A·B + beta·C + diag·I`` in fp32 before the single rounding to the storage dtype; the
mirrored tile reuses ``C(i, j)ᵀ``, which is right because ``C`` is one of the symmetric
iterates.

[Note: tile order]
Lower-triangle tiles are numbered row by row (row ``i`` holds ``i + 1`` tiles), so programs
that run together share the row panel of ``A``; the plain product groups ``GROUP_M`` row
tiles per column sweep for the same reason. The batch is the second grid axis.

All inputs are fp16 or bf16 with arbitrary strides (so ``Xᵀ`` is passed as a strided view, no
copy); accumulation is fp32; any size works (tails are masked). On CPU the kernels run in
Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton is imported).
"""

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
import triton.testing
from torch import Tensor

from dmuon_ns._environment import triton_interpreting
from dmuon_ns._triton_tiles import Product, TileRow, load_tiles, nearest_tile

__all__ = [
    "MM_TILES",
    "SYM_TILES",
    "TRITON_PRODUCTS",
    "TileConfig",
    "TritonProducts",
    "matmul",
    "scale_cast",
]

# Triton decides between compiling and interpreting when it decorates a kernel, at import: the
# kernels here follow the decision made then.
_INTERPRETING = triton_interpreting()
_MAX_GRID_Z = 65535  # CUDA's limit on a grid's third dimension


@dataclass(frozen=True)
class TileConfig:
    """Launch parameters: the autotuner's candidates, or fixed ones (tests, the interpreter).
    A symmetric product uses square ``block_m`` × ``block_m`` output tiles; a plain one
    ``block_m`` × ``block_n``."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8

    def __post_init__(self) -> None:
        for field in ("block_m", "block_n", "block_k"):
            value = getattr(self, field)
            if value < 16 or value & (value - 1):
                raise ValueError(f"TileConfig.{field} must be a power of two >= 16, got {value}")

    def meta(self, symmetric: bool) -> dict[str, int]:
        """The kernel's tile parameters (a symmetric product has square tiles, no row groups)."""
        return {
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_m if symmetric else self.block_n,
            "BLOCK_K": self.block_k,
            "GROUP_M": 1 if symmetric else self.group_m,
        }

    def autotune_config(self, symmetric: bool) -> triton.Config:
        """These parameters as one candidate of Triton's autotuner."""
        return triton.Config(
            self.meta(symmetric), num_warps=self.num_warps, num_stages=self.num_stages
        )


@triton.jit
def _product_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    out_ptr,
    NB,
    M,
    N,
    K,
    s_ab,
    s_am,
    s_ak,
    s_bb,
    s_bk,
    s_bn,
    s_cb,
    s_cm,
    s_cn,
    s_ob,
    s_om,
    s_on,
    alpha,
    beta,
    diag,
    SYMMETRIC: tl.constexpr,
    HAS_C: tl.constexpr,
    HAS_DIAG: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    K_TILES: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One output tile of ``alpha·A·B + beta·C + diag·I`` per program; the batch is grid axis 1.

    ``SYMMETRIC``: a square tile of the lower triangle, stored with its mirror ([Note: symmetric
    products]); otherwise a tile of the full product, ``GROUP_M`` row tiles per column sweep.
    """
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    if SYMMETRIC:
        tl.static_assert(BLOCK_M == BLOCK_N, "symmetric products use square tiles")
        i, j = _lower_triangle_tile(pid)
    else:
        i, j = _grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_i = i * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_j = j * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + batch * s_ab + offs_i[:, None] * s_am + offs_k[None, :] * s_ak
    b_ptrs = b_ptr + batch * s_bb + offs_k[:, None] * s_bk + offs_j[None, :] * s_bn
    mask_i = offs_i < M
    mask_j = offs_j < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, K_TILES if K_TILES > 0 else tl.cdiv(K, BLOCK_K)):
        k_ok = (kt * BLOCK_K + offs_k) < K
        a = tl.load(a_ptrs, mask=mask_i[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & mask_j[None, :], other=0.0)
        if INTERPRET:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk

    if SYMMETRIC:
        if i == j:
            acc = tl.where(offs_i[:, None] >= offs_j[None, :], acc, tl.trans(acc))
    acc = acc * alpha
    mask = mask_i[:, None] & mask_j[None, :]
    if HAS_C:
        c_ptrs = c_ptr + batch * s_cb + offs_i[:, None] * s_cm + offs_j[None, :] * s_cn
        acc += beta * tl.load(c_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DIAG:
        acc += tl.where(offs_i[:, None] == offs_j[None, :], diag, 0.0)
    out_base = out_ptr + batch * s_ob
    out = _to_storage(acc, out_base, INTERPRET)
    tl.store(out_base + offs_i[:, None] * s_om + offs_j[None, :] * s_on, out, mask=mask)
    if SYMMETRIC:
        if i != j:
            tl.store(
                out_base + offs_j[:, None] * s_om + offs_i[None, :] * s_on,
                tl.trans(out),
                mask=mask_j[:, None] & mask_i[None, :],
            )


@triton.jit
def _lower_triangle_tile(pid):
    """Row and column of the lower-triangle tile ``pid`` ([Note: tile order])."""
    # Row i of the lower triangle starts at tile i(i+1)/2; invert with a float sqrt and
    # correct the rounding by one step either way.
    i = ((tl.sqrt(8.0 * pid.to(tl.float32) + 1.0) - 1.0) * 0.5).to(tl.int32)
    i = tl.where((i + 1) * (i + 2) // 2 <= pid, i + 1, i)
    i = tl.where(i * (i + 1) // 2 > pid, i - 1, i)
    return i, pid - i * (i + 1) // 2


@triton.jit
def _grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Row and column tile of program ``pid``, ``GROUP_M`` row tiles per column sweep."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def _to_storage(acc, ptr, INTERPRET: tl.constexpr):
    """Round the fp32 tile to the storage dtype of ``ptr``, to nearest even.

    Triton's interpreter truncates fp32 → bf16 (compiled code rounds to nearest even), so
    there the rounding is done on the bits first and the final cast is exact.
    """
    if INTERPRET:
        if ptr.dtype.element_ty == tl.bfloat16:
            bits = acc.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            acc = bits.to(tl.float32, bitcast=True)
    return acc.to(ptr.dtype.element_ty)


# [Note: tile autotuning]
# On the GPU each product runs the tiles the card's shipped tile table picks ([Note: shipped
# tiles] in _triton_tiles); on a card without one it picks them with Triton's autotuner, once
# per (batch, M, K or N, epilogue, dtype): small Gram sides need small tiles to give the chip enough programs,
# large ones want 128-wide tiles and deep pipelines. The lists are short because every entry
# is compiled once per epilogue variant on first use. Each candidate is timed for ~25 ms
# (Triton's default is ~125 ms: a new shape then cost seconds of timing in its first call),
# and the choices are kept in Triton's on-disk cache, so a machine times a product once.
SYM_TILES = (
    TileConfig(block_m=128, block_k=64, num_warps=8, num_stages=3),
    TileConfig(block_m=128, block_k=64, num_warps=8, num_stages=4),
    TileConfig(block_m=64, block_k=64, num_warps=4, num_stages=4),
    TileConfig(block_m=64, block_k=128, num_warps=4, num_stages=3),
)
MM_TILES = (
    TileConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, group_m=8),
    TileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, group_m=8),
    TileConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4, group_m=8),
)
_TUNING_KEY = ["NB", "M", "N", "K", "HAS_C", "HAS_DIAG"]


def _short_bench(fn: Any, quantiles: Any = None) -> Any:
    """Triton's benchmark with a short warm-up and timing (see the tile note)."""
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


_sym_tuned = triton.autotune(
    configs=[tiles.autotune_config(symmetric=True) for tiles in SYM_TILES],
    key=_TUNING_KEY,
    do_bench=_short_bench,
    cache_results=True,
)(_product_kernel)
_mm_tuned = triton.autotune(
    configs=[tiles.autotune_config(symmetric=False) for tiles in MM_TILES],
    key=_TUNING_KEY,
    do_bench=_short_bench,
    cache_results=True,
)(_product_kernel)


@functools.cache
def _shipped_rows(device: torch.device) -> tuple[TileRow, ...]:
    """The tile table of ``device``'s card, measured with these candidates (see [Note:
    shipped tiles] in ``_triton_tiles``); none for another card."""
    name = torch.cuda.get_device_name(device)
    return load_tiles(name, {"symmetric": SYM_TILES, "plain": MM_TILES})


def _shipped_tile(
    a: Tensor, out: Tensor, symmetric: bool, has_c: bool, has_diag: bool
) -> TileConfig | None:
    """The tiles the shipped table picks for this product, or ``None`` (the autotuner's)."""
    batch, m, k = a.shape
    product = Product(
        symmetric, has_c, has_diag, batch, m, out.shape[2], k, _name(a.dtype), _name(out.dtype)
    )
    return _pick_tile(a.device, product)


@functools.cache
def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.cache
def _pick_tile(device: torch.device, product: Product) -> TileConfig | None:
    """:func:`_shipped_tile`'s answer, looked up once per product (an eager NS call runs a
    dozen products, each a scan of the table otherwise)."""
    rows = _shipped_rows(device)
    if not rows:
        return None
    index = nearest_tile(rows, product)
    if index is None:
        return None
    return (SYM_TILES if product.symmetric else MM_TILES)[index]


# Small tiles for the CPU interpreter, which spends milliseconds per operation of every program.
_INTERPRETER_CONFIG = TileConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=1)


def _programs(m: int, n: int, meta: dict[str, int], symmetric: bool) -> int:
    """Programs per matrix: one per tile of the lower triangle, or of the whole product."""
    tiles_m = triton.cdiv(m, meta["BLOCK_M"])
    if symmetric:
        return tiles_m * (tiles_m + 1) // 2
    return tiles_m * triton.cdiv(n, meta["BLOCK_N"])


def _static_k_tiles(k: int, block_k: int) -> int:
    """The K-loop trip count as a compile-time constant, in Triton's interpreter only.

    [Note: interpreter loop bounds]
    Under ``TRITON_INTERPRET=1`` with NumPy 2.4, ``range()`` over a runtime kernel argument
    fails (the interpreter converts a 1-element array with ``int()``). Passing the trip count
    as a constexpr there sidesteps it; compiled kernels get 0 and loop over the runtime ``K``,
    so one binary serves every K. The same interpreter multiplies bf16 blocks wrongly (NumPy
    has no bf16), so there ``INTERPRET`` widens both operands first; the products of two fp16 or
    bf16 numbers are exact in fp32, so only the summation order differs from the tensor cores.
    """
    return triton.cdiv(k, block_k) if _INTERPRETING else 0


def _check_operands(a: Tensor, b: Tensor, c: Tensor | None, *, symmetric: bool) -> None:
    if a.ndim != 3 or b.ndim != 3:
        raise ValueError(f"a and b must be 3-D (batch, rows, cols), got {a.ndim}-D and {b.ndim}-D")
    if a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"a {tuple(a.shape)} and b {tuple(b.shape)} do not multiply")
    if symmetric and b.shape[2] != a.shape[1]:
        raise ValueError(
            f"a symmetric product needs a square result, got a {tuple(a.shape)}"
            f" and b {tuple(b.shape)}"
        )
    out_shape = (a.shape[0], a.shape[1], b.shape[2])
    if a.dtype not in (torch.float16, torch.bfloat16) or b.dtype != a.dtype:
        raise ValueError(f"a and b must both be float16 or bfloat16, got {a.dtype} and {b.dtype}")
    if c is not None and tuple(c.shape) != out_shape:
        raise ValueError(f"c must have the output shape {out_shape}, got {tuple(c.shape)}")


def matmul(
    a: Tensor,
    b: Tensor,
    *,
    c: Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    diag: float = 0.0,
    symmetric: bool = False,
    out_dtype: torch.dtype | None = None,
    config: TileConfig | None = None,
) -> Tensor:
    """``alpha·a·b + beta·c + diag·I`` for ``a`` (batch, m, k) and ``b`` (batch, k, n), any
    strides (e.g. ``a.mT`` for a Gram matrix), rounded once to ``out_dtype`` (default: the
    operands' dtype).

    ``symmetric=True`` says that ``a·b`` is symmetric (m = n, ``c`` symmetric or ``None``):
    only the lower triangle of tiles is computed, see the module notes. ``config`` fixes the
    tiles; by default the GPU autotunes them (see the tile note) and the interpreter uses
    64-wide ones.
    """
    _check_operands(a, b, c, symmetric=symmetric)
    batch, m, k = a.shape
    n = b.shape[2]
    out = torch.empty((batch, m, n), dtype=out_dtype or a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    c_arg = c if c is not None else out
    args = (
        a,
        b,
        c_arg,
        out,
        batch,
        m,
        n,
        k,
        *a.stride(),
        *b.stride(),
        *c_arg.stride(),
        *out.stride(),
        float(alpha),
        float(beta),
        float(diag),
    )
    flags = dict(SYMMETRIC=symmetric, HAS_C=c is not None, HAS_DIAG=diag != 0.0)
    if config is None and not _INTERPRETING:
        config = _shipped_tile(a, out, symmetric, c is not None, diag != 0.0)
        if config is None:  # no shipped tile: Triton's autotuner picks one
            tuned = _sym_tuned if symmetric else _mm_tuned

            def grid(meta: dict[str, int]) -> tuple[int, int]:
                return (_programs(m, n, meta, symmetric), batch)

            tuned[grid](*args, **flags, K_TILES=0, INTERPRET=False)
            return out
    cfg = config or _INTERPRETER_CONFIG
    meta = cfg.meta(symmetric)
    _product_kernel[(_programs(m, n, meta, symmetric), batch)](
        *args,
        **flags,
        **meta,
        K_TILES=_static_k_tiles(k, cfg.block_k),
        INTERPRET=_INTERPRETING,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


class TritonProducts:
    """These products as the ``_iterations.Products`` the shared NS loops run on."""

    def gram(self, x: Tensor) -> Tensor:
        return matmul(x, x.mT, symmetric=True)

    def sym(self, a: Tensor, b: Tensor, c: Tensor, *, alpha: float = 1.0, beta: float) -> Tensor:
        return matmul(a, b, c=c, alpha=alpha, beta=beta, symmetric=True)

    def mm(self, a: Tensor, b: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
        return matmul(a, b, out_dtype=out_dtype)

    def mm_add(
        self, a: Tensor, b: Tensor, c: Tensor, beta: float, out_dtype: torch.dtype | None = None
    ) -> Tensor:
        return matmul(a, b, c=c, beta=beta, out_dtype=out_dtype)


TRITON_PRODUCTS = TritonProducts()


@triton.jit
def _scale_cast_kernel(
    x_ptr,
    norm_ptr,
    out_ptr,
    eps,
    M,
    N,
    s_xb,
    s_xm,
    s_xn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    tile_n = tl.program_id(0)
    tile_m = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    x_ptrs = x_ptr + batch * s_xb + offs_m[:, None] * s_xm + offs_n[None, :] * s_xn
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    # torch's (norm + eps).reciprocal(): an fp32 add and an IEEE division, rounded the same way.
    scale = tl.math.div_rn(1.0, tl.load(norm_ptr + batch) + eps)
    out_ptrs = out_ptr + batch * M * N + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out_ptrs, _to_storage(x * scale, out_ptr, INTERPRET), mask=mask)


def scale_cast(x: Tensor, norm: Tensor, eps: float, out: Tensor) -> Tensor:
    """``out[b] = x[b] · 1/(norm[b] + eps)`` in fp32, rounded once to ``out``'s dtype; one pass.

    ``x`` is (batch, m, n) with any strides (a transposed view is read in place and written
    in ``out``'s contiguous layout), ``norm`` an fp32 tensor of ``batch`` elements, ``out`` a
    contiguous (batch, m, n) fp16/bf16/fp32 tensor. The front end's normalisation, bit for bit
    ``torch.mul(x, (norm + eps).reciprocal()[:, None, None])`` in one launch where torch takes
    three (and a mixed-dtype ``torch.mul`` takes torch's generic casting loop, ~3× slower on
    an H200).
    """
    batch, m, n = x.shape
    if out.shape != x.shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(x.shape)} tensor")
    if norm.dtype != torch.float32 or norm.numel() != batch:
        raise ValueError(f"norm must hold {batch} float32 values, got {norm.numel()} {norm.dtype}")
    if x.numel() == 0:
        return out
    block_m, block_n = 32, 128
    # The batch is the grid's z axis, which CUDA caps: a larger batch takes several launches.
    for start in range(0, batch, _MAX_GRID_Z):
        stop = min(start + _MAX_GRID_Z, batch)
        grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), stop - start)
        _scale_cast_kernel[grid](
            x[start:stop],
            norm[start:stop],
            out[start:stop],
            float(eps),
            m,
            n,
            *x.stride(),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            INTERPRET=_INTERPRETING,
            num_warps=4,
        )
    return out
