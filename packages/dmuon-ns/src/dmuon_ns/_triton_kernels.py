"""Triton matrix products for Newton–Schulz: a symmetric product that computes one triangle
of tiles, and a plain product for the final ``Q·X``; both batched, with fused epilogues.

[Note: symmetric products]
Every m×m matrix of the Gram iteration is a polynomial in ``R = X·Xᵀ`` (``P = aI + bR + cR²``,
``Q``, ``R·P``, ``P·(R·P)``), so every product of two of them is symmetric. The symmetric
kernel launches one program per tile of the lower triangle, ``(i, j)`` with ``i >= j``, and
stores the tile at ``(i, j)`` and its transpose at ``(j, i)``: half the tiles of a full
product, and an output that is symmetric bit for bit. Diagonal tiles are averaged with their
own transpose so that they are exactly symmetric too. The epilogue folds in
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

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["TileConfig", "matmul", "sym_matmul"]


@dataclass(frozen=True)
class TileConfig:
    """Launch parameters. ``block`` is the square output tile of the symmetric kernel and
    the ``block_m`` × ``block_n`` tile of the plain one."""

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


@triton.jit
def _sym_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    out_ptr,
    M,
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
    HAS_C: tl.constexpr,
    HAS_DIAG: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    # Row i of the lower triangle starts at tile i(i+1)/2; invert with a float sqrt and
    # correct the rounding by one step either way.
    i = ((tl.sqrt(8.0 * pid.to(tl.float32) + 1.0) - 1.0) * 0.5).to(tl.int32)
    i = tl.where((i + 1) * (i + 2) // 2 <= pid, i + 1, i)
    i = tl.where(i * (i + 1) // 2 > pid, i - 1, i)
    j = pid - i * (i + 1) // 2

    offs_i = i * BLOCK + tl.arange(0, BLOCK)
    offs_j = j * BLOCK + tl.arange(0, BLOCK)
    offs_k = tl.arange(0, BLOCK_K)
    a_base = a_ptr + batch * s_ab
    b_base = b_ptr + batch * s_bb
    a_ptrs = a_base + offs_i[:, None] * s_am + offs_k[None, :] * s_ak
    b_ptrs = b_base + offs_k[:, None] * s_bk + offs_j[None, :] * s_bn
    mask_i = offs_i < M
    mask_j = offs_j < M
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        a = tl.load(a_ptrs, mask=mask_i[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & mask_j[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk

    if i == j:
        acc = (acc + tl.trans(acc)) * 0.5
    acc = acc * alpha
    mask = mask_i[:, None] & mask_j[None, :]
    if HAS_C:
        c_ptrs = c_ptr + batch * s_cb + offs_i[:, None] * s_cm + offs_j[None, :] * s_cn
        acc += beta * tl.load(c_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DIAG:
        acc += tl.where(offs_i[:, None] == offs_j[None, :], diag, 0.0)
    out = acc.to(out_ptr.dtype.element_ty)
    out_base = out_ptr + batch * s_ob
    tl.store(out_base + offs_i[:, None] * s_om + offs_j[None, :] * s_on, out, mask=mask)
    if i != j:
        mask_t = mask_j[:, None] & mask_i[None, :]
        out_t = tl.trans(out)
        tl.store(out_base + offs_j[:, None] * s_om + offs_i[None, :] * s_on, out_t, mask=mask_t)


@triton.jit
def _mm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    out_ptr,
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
    HAS_C: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % group_rows
    tile_n = (pid % per_group) // group_rows

    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + batch * s_ab + offs_m[:, None] * s_am + offs_k[None, :] * s_ak
    b_ptrs = b_ptr + batch * s_bb + offs_k[:, None] * s_bk + offs_n[None, :] * s_bn
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk

    acc = acc * alpha
    mask = mask_m[:, None] & mask_n[None, :]
    if HAS_C:
        c_ptrs = c_ptr + batch * s_cb + offs_m[:, None] * s_cm + offs_n[None, :] * s_cn
        acc += beta * tl.load(c_ptrs, mask=mask, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + batch * s_ob + offs_m[:, None] * s_om + offs_n[None, :] * s_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check_operands(a: Tensor, b: Tensor, c: Tensor | None, out_shape: tuple[int, ...]) -> None:
    if a.ndim != 3 or b.ndim != 3:
        raise ValueError(f"a and b must be 3-D (batch, rows, cols), got {a.ndim}-D and {b.ndim}-D")
    if a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"a {tuple(a.shape)} and b {tuple(b.shape)} do not multiply")
    if a.dtype not in (torch.float16, torch.bfloat16) or b.dtype != a.dtype:
        raise ValueError(f"a and b must both be float16 or bfloat16, got {a.dtype} and {b.dtype}")
    if c is not None and tuple(c.shape) != out_shape:
        raise ValueError(f"c must have the output shape {out_shape}, got {tuple(c.shape)}")


def sym_matmul(
    a: Tensor,
    b: Tensor,
    *,
    c: Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    diag: float = 0.0,
    config: TileConfig | None = None,
) -> Tensor:
    """``alpha·a·b + beta·c + diag·I`` for a product ``a·b`` known to be symmetric.

    ``a`` is (batch, m, k), ``b`` is (batch, k, m) (any strides, e.g. ``a.mT`` for a Gram
    matrix), ``c`` (batch, m, m) symmetric or ``None``. Only the lower triangle of tiles is
    computed; see the module notes.
    """
    batch, m, k = a.shape
    _check_operands(a, b, c, (batch, m, m))
    cfg = config or TileConfig()
    out = torch.empty((batch, m, m), dtype=a.dtype, device=a.device)
    if batch == 0 or m == 0:
        return out
    tiles = triton.cdiv(m, cfg.block_m)
    c_arg = c if c is not None else out
    _sym_kernel[(tiles * (tiles + 1) // 2, batch)](
        a,
        b,
        c_arg,
        out,
        m,
        k,
        *a.stride(),
        *b.stride(),
        *c_arg.stride(),
        *out.stride(),
        float(alpha),
        float(beta),
        float(diag),
        HAS_C=c is not None,
        HAS_DIAG=diag != 0.0,
        BLOCK=cfg.block_m,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def matmul(
    a: Tensor,
    b: Tensor,
    *,
    c: Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    config: TileConfig | None = None,
) -> Tensor:
    """``alpha·a·b + beta·c`` for ``a`` (batch, m, k) and ``b`` (batch, k, n), any strides."""
    batch, m, k = a.shape
    n = b.shape[2]
    _check_operands(a, b, c, (batch, m, n))
    cfg = config or TileConfig()
    out = torch.empty((batch, m, n), dtype=a.dtype, device=a.device)
    if batch == 0 or m == 0 or n == 0:
        return out
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    c_arg = c if c is not None else out
    _mm_kernel[(tiles, batch)](
        a,
        b,
        c_arg,
        out,
        m,
        n,
        k,
        *a.stride(),
        *b.stride(),
        *c_arg.stride(),
        *out.stride(),
        float(alpha),
        float(beta),
        HAS_C=c is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
