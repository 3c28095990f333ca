"""Independent references: torch.nn.utils.clip_grad_norm_ on copies of the grads."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def torch_clip(
    grads: Sequence[Tensor], max_norm: float | None, norm_type: float = 2.0
) -> tuple[Tensor, list[Tensor]]:
    """(total norm, clipped copies) as torch computes them; ``max_norm=None`` only measures."""
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    if max_norm is None:
        total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
    else:
        total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, foreach=True)
    return total, [p.grad for p in params]


def float64_norm(grads: Sequence[Tensor], norm_type: float = 2.0) -> float:
    flat = torch.cat([g.detach().double().reshape(-1) for g in grads]) if grads else torch.zeros(1)
    return float(torch.linalg.vector_norm(flat.double(), norm_type))


def assert_close(got: Tensor, want: Tensor, *, rtol: float, equal_nan: bool = False) -> None:
    """``|got - want| <= rtol * |want|`` elementwise (exact when ``rtol=0``), same dtype and
    shape. Written out because ``torch.testing.assert_close`` costs seconds of imports on its
    first call, a real share of this package's CPU test budget."""
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    if got.is_sparse:
        got, want = got.to_dense(), want.to_dense()
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    same_nan = g.isnan() & w.isnan() if equal_nan else torch.zeros_like(g, dtype=torch.bool)
    same_inf = (g == w) & g.isinf()
    ok = ((g - w).abs() <= rtol * w.abs()) | same_nan | same_inf
    if not bool(ok.all()):
        bad = (~ok).nonzero()[0].tolist()
        idx = tuple(bad)
        worst = float(((g - w).abs() / w.abs()).nan_to_num(nan=float("inf"))[~ok].max())
        raise AssertionError(
            f"{int((~ok).sum())} of {g.numel()} elements differ beyond rtol={rtol}; first at "
            f"{idx}: got {float(g[idx])}, want {float(w[idx])}; worst relative error {worst:.3g}"
        )
