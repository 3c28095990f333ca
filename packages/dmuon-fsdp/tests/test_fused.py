"""The fused momentum and update kernels (Triton's interpreter on CPU) against the torch ops
they replace: the same values up to one rounding, and a skipped step stores exactly the old
values."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

_BODY = textwrap.dedent(
    """
    import torch
    from dmuon_fsdp._fused import fused_available, momentum_into, update_weight
    from dmuon_fsdp._muon_math import momentum_update, weight_decay_and_update

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for nesterov in (True, False):
            buf = torch.randn(33, 70, generator=gen).to(dtype)
            grad = torch.randn(33, 70, generator=gen)  # fp32 grads, a bf16 buffer: mixed dtypes
            out = torch.empty(33, 70, dtype=dtype)
            assert fused_available(buf, grad, out)
            ref_buf, ref_out = buf.clone(), torch.empty_like(out)
            momentum_update(ref_buf, grad.to(dtype), 0.9, nesterov, ref_out)
            skip = torch.zeros((), dtype=torch.bool)
            momentum_into(buf, grad, out, skip, 0.9, nesterov)
            tol = dict(rtol=1e-2, atol=1e-2) if dtype is torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(buf, ref_buf, **tol)
            torch.testing.assert_close(out, ref_out, **tol)
            # A skipped step: the buffer keeps its bits, even with a NaN gradient.
            before = buf.clone()
            momentum_into(buf, torch.full_like(grad, float("nan")), out, skip | True, 0.9, nesterov)
            assert torch.equal(buf, before)

        # The update, with a transposed NS result as tall matrices give.
        p = torch.randn(40, 24, generator=gen).to(dtype)
        update = torch.randn(24, 40, generator=gen).to(dtype).t()
        assert not update.is_contiguous() and fused_available(p)
        ref = p.clone()
        weight_decay_and_update(ref, update, lr=0.02, weight_decay=0.1, scale=1.5)
        update_weight(p, update, torch.zeros((), dtype=torch.bool), 1 - 0.02 * 0.1, -0.02 * 1.5)
        tol = dict(rtol=1e-2, atol=1e-2) if dtype is torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(p, ref, **tol)
        before = p.clone()
        update_weight(p, update * float("nan"), torch.ones((), dtype=torch.bool), 0.5, -1.0)
        assert torch.equal(p, before)
    # Not contiguous: the torch ops run instead.
    assert not fused_available(torch.zeros(4, 4).t())
    print("ok")
    """
)


def test_fused_kernels_match_the_torch_ops_and_skip_exactly() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _BODY], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().endswith("ok")
