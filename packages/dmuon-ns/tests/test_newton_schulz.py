"""Accuracy of every front-end function against the float64 reference, batching, lists and
numerical robustness, on the torch kernel (CPU)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dmuon_ns
from dmuon_ns import (
    POLAR_EXPRESS_COEFFICIENTS,
    QUINTIC_COEFFICIENTS,
    YOU_COEFFICIENTS,
    NewtonSchulz,
    direct_newton_schulz,
    gram_newton_schulz,
    newton_schulz,
)
from dmuon_ns._coefficients import coefficients_for_steps
from dmuon_ns.testing import (
    orthogonality_error,
    reference_newton_schulz,
    relative_error,
    singular_values,
)

TOLERANCE = 1.5e-2
# Ours may be at most this many times worse than the plain fp16 implementation below.
RATIO = 3.0
SHAPES = {
    "tall": (128, 48),
    "wide": (48, 128),
    "square": (64, 64),
    "batched": (2, 3, 24, 72),
    "batched_tall": (3, 80, 40),
}


def _plain_fp16(g: torch.Tensor, backend: str, steps: int = 5, restarts=(2,), coeffs=None):
    """The same algorithm as plainly as it can be written: fp16 products, nothing fused."""
    return _plain(g, backend, torch.float16, steps, restarts, coeffs)


def _plain(g, backend, dtype, steps=5, restarts=(2,), coeffs=None):
    """``_plain_fp16`` at any iteration dtype."""
    rows, cols = g.shape[-2:]
    x = g.reshape(-1, rows, cols).float()
    if rows > cols:
        x = x.mT
    x = (x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)).to(dtype)
    eye = torch.eye(x.shape[-2], dtype=dtype)
    rows_abc = coefficients_for_steps(coeffs or POLAR_EXPRESS_COEFFICIENTS, steps)
    if backend == "gram" and rows != cols:
        r, q = x @ x.mT, eye.expand(x.shape[0], -1, -1)
        for i, (a, b, c) in enumerate(rows_abc):
            if i in restarts:
                x, q = q @ x, eye.expand(x.shape[0], -1, -1)
                r = x @ x.mT
            z = a * eye + b * r + c * (r @ r)
            q, r = z @ q, z @ r @ z
        x = q @ x
    else:
        for a, b, c in rows_abc:
            r = x @ x.mT
            x = a * x + (b * r + c * (r @ r)) @ x
    if rows > cols:
        x = x.mT
    return x.reshape(g.shape)


FUNCTIONS = {
    "newton_schulz": (lambda g, **kw: newton_schulz(g, **kw), "gram"),
    "gram_newton_schulz": (lambda g, **kw: gram_newton_schulz(g, **kw), "gram"),
    "direct_newton_schulz": (lambda g, **kw: direct_newton_schulz(g, **kw), "direct"),
    "NewtonSchulz(gram)": (lambda g, **kw: NewtonSchulz(**kw)(g), "gram"),
    "NewtonSchulz(direct)": (lambda g, **kw: NewtonSchulz(backend="direct", **kw)(g), "direct"),
}


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("fn", list(FUNCTIONS), ids=list(FUNCTIONS))
def test_matches_float64_reference(fn: str, shape: tuple[int, ...]) -> None:
    call, backend = FUNCTIONS[fn]
    g = torch.randn(shape, generator=torch.Generator().manual_seed(hash(shape) % 1000))
    out = call(g)
    assert out.shape == g.shape and out.dtype == g.dtype
    reference = reference_newton_schulz(g, backend=backend)
    err = relative_error(out, reference)
    plain = relative_error(_plain_fp16(g, backend), reference)
    assert err <= TOLERANCE, f"{fn} {shape}: error {err:.2e}"
    assert err <= RATIO * plain, f"{fn} {shape}: error {err:.2e} vs plain fp16 {plain:.2e}"


# The CPU's iteration dtypes against float64: the default (fp32 on the CPU) and bf16.
#
# bf16 is held to the plain algorithm at its own dtype, as fp16 is above. fp32 is held to an
# absolute bar and to being far better than plain fp16: against plain fp32 it loses a factor
# of 2-14 (measured on these shapes, 1e-6 against 1e-5), because the fused epilogues
# (``Q·Z' + a·Q``, written for half precision: ``_iterations``' [Note: fused epilogues]) cancel
# terms of size ~a where the plain ``(aI + Z')·Q`` rounds only once at that size.
CPU_DTYPES = {"default": (None, 1e-4), "bfloat16": (torch.bfloat16, 8 * TOLERANCE)}


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("dtype", list(CPU_DTYPES), ids=list(CPU_DTYPES))
def test_cpu_iteration_dtypes_match_float64_reference(dtype: str, shape) -> None:
    requested, bar = CPU_DTYPES[dtype]
    g = torch.randn(shape, generator=torch.Generator().manual_seed(hash(shape) % 1000))
    for backend in ("gram", "direct"):
        out = newton_schulz(g, backend=backend, dtype=requested)
        assert out.shape == g.shape and out.dtype == g.dtype
        reference = reference_newton_schulz(g, backend=backend)
        err = relative_error(out, reference)
        assert err <= bar, f"{dtype} {backend} {shape}: error {err:.2e}"
        if requested is None:
            plain = relative_error(_plain_fp16(g, backend), reference)
            assert err <= plain / 100, f"fp32 {backend}: {err:.2e} vs plain fp16 {plain:.2e}"
        else:
            plain = relative_error(_plain(g, backend, requested), reference)
            assert err <= RATIO * plain, f"{dtype} {backend}: {err:.2e} vs plain {plain:.2e}"


def test_the_cpu_default_is_fp32_and_an_explicit_dtype_is_honoured() -> None:
    from dmuon_ns._prepare import iteration_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert iteration_dtype(None, cpu, ["torch"]) == torch.float32
    assert iteration_dtype(None, cuda, ["torch"]) == torch.float16
    assert iteration_dtype(None, cuda, ["quack", "triton", "torch"]) == torch.float16
    assert iteration_dtype(None, cpu, ["triton"]) == torch.float16  # takes fp16/bf16 only
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert iteration_dtype(dtype, cpu, ["torch"]) == dtype
    # End to end: fp32 lands far closer to float64 than either half precision can.
    g = torch.randn(48, 128, generator=torch.Generator().manual_seed(13))
    reference = reference_newton_schulz(g)
    errors = {
        dtype: relative_error(newton_schulz(g, dtype=dtype), reference)
        for dtype in (None, torch.float16, torch.bfloat16)
    }
    assert errors[None] < 1e-4 < 1e-3 < errors[torch.float16] < errors[torch.bfloat16]
    # Asked for by name, fp32 is the CPU's default run, bit for bit; an autocast region
    # around the call changes nothing (it would run the products in bf16).
    assert torch.equal(newton_schulz(g, dtype=torch.float32), newton_schulz(g))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(newton_schulz(g, dtype=torch.float32), newton_schulz(g))


@pytest.mark.parametrize(
    ("coefficients", "steps", "restarts"),
    [
        (YOU_COEFFICIENTS, 5, [2]),
        (QUINTIC_COEFFICIENTS, 5, [3]),
        (POLAR_EXPRESS_COEFFICIENTS, 8, [2, 5]),
        (POLAR_EXPRESS_COEFFICIENTS, 4, []),
    ],
)
def test_coefficients_steps_and_restarts(coefficients, steps, restarts) -> None:
    g = torch.randn(40, 120, generator=torch.Generator().manual_seed(steps))
    kw = {"coefficients": coefficients, "steps": steps, "restart_iterations": restarts}
    out = gram_newton_schulz(g, **kw)
    reference = reference_newton_schulz(g, **kw)
    plain = relative_error(_plain_fp16(g, "gram", steps, tuple(restarts), coefficients), reference)
    err = relative_error(out, reference)
    assert err <= TOLERANCE and err <= RATIO * plain


def test_restarts_change_the_rounding_not_the_math() -> None:
    g = torch.randn(32, 128, generator=torch.Generator().manual_seed(3))
    a = reference_newton_schulz(g, restart_iterations=[])
    b = reference_newton_schulz(g, restart_iterations=[1, 2, 3, 4])
    assert relative_error(a, b) < 1e-12
    fast_a = gram_newton_schulz(g, restart_iterations=[])
    fast_b = gram_newton_schulz(g, restart_iterations=[1, 3])
    assert not torch.equal(fast_a, fast_b)


def test_relative_error_refuses_tensors_of_two_shapes() -> None:
    # Both were flattened to stacks of matrices and broadcast: a (3, 5) result measured
    # against a (2, 3, 5) reference read as an error of 0.
    with pytest.raises(ValueError, match=r"actual has shape \(3, 5\) and expected \(2, 3, 5\)"):
        relative_error(torch.ones(3, 5), torch.ones(2, 3, 5))


def test_reference_agrees_with_svd() -> None:
    """The reference equals U·p(Σ)·Vᵀ, p the composed scalar polynomials (independent check)."""
    g = torch.randn(2, 24, 56, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    sigma = s / (torch.linalg.vector_norm(g, dim=(-2, -1), keepdim=True)[..., 0] + 1e-7)
    for a, b, c in coefficients_for_steps(POLAR_EXPRESS_COEFFICIENTS, 5):
        sigma = a * sigma + b * sigma**3 + c * sigma**5
    expected = u @ torch.diag_embed(sigma) @ vh
    for backend in ("gram", "direct"):
        assert relative_error(reference_newton_schulz(g, backend=backend), expected) < 1e-12
        # Tall input: same result, transposed.
        tall = reference_newton_schulz(g.mT, backend=backend)
        assert relative_error(tall, expected.mT) < 1e-12


def test_batched_equals_per_matrix_bitwise() -> None:
    g = torch.randn(4, 40, 72, generator=torch.Generator().manual_seed(6))
    for backend in ("gram", "direct"):
        batched = newton_schulz(g, backend=backend)
        single = torch.stack([newton_schulz(m, backend=backend) for m in g])
        assert torch.equal(batched, single)
    square = torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(7))
    assert torch.equal(newton_schulz(square), torch.stack([newton_schulz(m) for m in square]))


def test_list_input_equals_per_matrix() -> None:
    gen = torch.Generator().manual_seed(8)
    items = [
        torch.randn(32, 64, generator=gen),
        torch.randn(64, 32, generator=gen),
        torch.randn(32, 64, generator=gen),
        torch.randn(16, 16, generator=gen).to(torch.bfloat16),
        torch.randn(2, 16, 48, generator=gen),
    ]
    ns = NewtonSchulz()
    out = ns(items)
    assert isinstance(out, list) and len(out) == len(items)
    for got, g in zip(out, items, strict=True):
        assert got.shape == g.shape and got.dtype == g.dtype
        assert torch.equal(got, ns(g))
    assert newton_schulz(tuple(items[:2]))[1].shape == (64, 32)
    assert ns([]) == []


def test_output_dtype_follows_input_and_bf16_iteration() -> None:
    g = torch.randn(24, 64, generator=torch.Generator().manual_seed(9))
    reference = reference_newton_schulz(g)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        out = newton_schulz(g.to(dtype))
        assert out.dtype == dtype
        assert relative_error(out, reference) <= TOLERANCE
    bf16 = newton_schulz(g, dtype=torch.bfloat16)
    assert bf16.dtype == torch.float32
    # bf16 carries 3 fewer mantissa bits than fp16: looser, but still close.
    assert relative_error(bf16, reference) <= 8 * TOLERANCE


def test_zero_input_gives_zeros() -> None:
    for shape in [(16, 48), (48, 16), (16, 16), (2, 8, 24)]:
        for backend in ("gram", "direct"):
            out = newton_schulz(torch.zeros(shape), backend=backend)
            assert torch.equal(out, torch.zeros(shape))


def test_one_zero_matrix_in_a_batch() -> None:
    g = torch.randn(3, 16, 40, generator=torch.Generator().manual_seed(10))
    g[1] = 0
    out = newton_schulz(g)
    assert torch.equal(out[1], torch.zeros(16, 40))
    assert torch.equal(out[0], newton_schulz(g[0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_overflowing_norm_gives_zeros_and_a_nonfinite_entry_nan(dtype: torch.dtype) -> None:
    # As the README says: the fp32 norm of entries ~1e19 is inf, so the scale is 0; a NaN or
    # an infinity spreads over its own matrix only.
    g = torch.randn(3, 16, 40, generator=torch.Generator().manual_seed(11))
    g[1, 0, 0] = math.inf
    g[2] *= 1e19
    g = g.to(dtype)
    for backend in ("gram", "direct"):
        out = newton_schulz(g, backend=backend)
        assert torch.equal(out[0], newton_schulz(g[0], backend=backend))
        assert bool(out[1].isnan().all())
        assert torch.equal(out[2], torch.zeros(16, 40, dtype=dtype))


def _inputs(kind: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    m, n = shape
    if kind == "random":
        return torch.randn(shape, generator=gen)
    if kind == "low_rank":
        return torch.randn(m, 3, generator=gen) @ torch.randn(3, n, generator=gen)
    # Ill-conditioned: singular values from 1 down to 1e-8, and a huge overall scale.
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, k, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64))
    s = torch.logspace(0, -8, k, dtype=torch.float64)
    return (1e4 * u @ torch.diag(s) @ v.T).float()


@pytest.mark.parametrize("kind", ["random", "low_rank", "ill_conditioned"])
@pytest.mark.parametrize("shape", [(24, 96), (96, 24), (40, 40)])
def test_finite_on_hard_inputs(kind: str, shape: tuple[int, int]) -> None:
    g = _inputs(kind, shape, seed=11)
    reference = reference_newton_schulz(g)
    for backend in ("gram", "direct"):
        out = newton_schulz(g, backend=backend)
        assert torch.isfinite(out).all(), f"{kind} {shape} {backend}"
        # The top of the spectrum is orthogonalized: σ_max near 1, never blown up.
        top = singular_values(out)[0]
        assert 0.5 < top < 1.3
        # Tiny and zero singular values are where fp16 and float64 legitimately differ (the
        # polynomials amplify rounding noise there), so the bar is the plain fp16 algorithm.
        plain = relative_error(_plain_fp16(g, backend), reference)
        assert relative_error(out, reference) <= RATIO * plain


# The singular-value band the README states, per iteration dtype: every singular value of the
# output lies in [0, TOP]; those coming from input singular values of at least BAND_FROM · ‖G‖_F
# lie in [BOTTOM, TOP]. fp16 is the CUDA default, fp32 (None) the CPU's.
BAND_FROM, BOTTOM = 0.002, 0.84
TOP = {None: 1.125, torch.float16: 1.15, torch.bfloat16: 1.7}


def test_the_band_in_exact_arithmetic() -> None:
    # NS maps each singular value σ of the normalised input to p(σ), p the composed polynomial.
    sigma = torch.cat(
        [torch.logspace(-8, 0, 100_001, dtype=torch.float64), torch.linspace(0, 1, 100_001)]
    )
    p = sigma.clone()
    for a, b, c in coefficients_for_steps(POLAR_EXPRESS_COEFFICIENTS, 5):
        p = a * p + b * p**3 + c * p**5
    assert 0 <= float(p.min()) and float(p.max()) <= 1.124
    assert float(p[sigma >= BAND_FROM].min()) >= 0.846


@pytest.mark.parametrize("dtype", list(TOP), ids=["default", "float16", "bfloat16"])
@pytest.mark.parametrize("kind", ["random", "low_rank", "ill_conditioned"])
def test_output_singular_values_lie_in_the_band(kind: str, dtype) -> None:
    for shape, seed, backend in itertools.product(
        [(24, 96), (96, 24), (40, 40), (64, 256), (128, 128)], (0, 1), ("gram", "direct")
    ):
        g = _inputs(kind, shape, seed)
        out = singular_values(newton_schulz(g, backend=backend, dtype=dtype))
        assert float(out.min()) >= 0 and float(out.max()) <= TOP[dtype], (shape, backend)
        normalised = singular_values(g) / torch.linalg.vector_norm(g.double())
        # `inside` outputs come from those singular values, each at least BOTTOM, so the
        # `inside`-th largest output is too (NS keeps the singular vectors, not the order).
        inside = int((normalised >= BAND_FROM).sum())
        assert float(out[inside - 1]) >= BOTTOM, (shape, seed, backend, float(out[inside - 1]))


def test_orthogonalizes_well_conditioned_input() -> None:
    g = torch.randn(32, 128, generator=torch.Generator().manual_seed(12))
    assert orthogonality_error(g / g.norm()) > 0.9
    assert orthogonality_error(newton_schulz(g, steps=8)) < 0.05


@settings(max_examples=12, deadline=None, database=None)
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 40),
    batch=st.integers(1, 3),
    backend=st.sampled_from(["gram", "direct"]),
)
def test_any_shape(rows: int, cols: int, batch: int, backend: str) -> None:
    g = torch.randn(batch, rows, cols, generator=torch.Generator().manual_seed(rows * 41 + cols))
    out = newton_schulz(g, backend=backend)
    assert out.shape == g.shape and torch.isfinite(out).all()
    reference = reference_newton_schulz(g, backend=backend)
    plain = relative_error(_plain_fp16(g, backend), reference)
    assert relative_error(out, reference) <= max(RATIO * plain, 1e-3)


def test_tune_names_the_kernel_of_each_problem_a_call_would_run() -> None:
    a, b = torch.empty(24, 80), torch.empty(80, 24)
    square = torch.empty(3, 16, 16, dtype=torch.bfloat16)
    # On the CPU torch is the only candidate: nothing is measured, each problem is named.
    assert NewtonSchulz().tune([a, a, b, square]) == {
        "gram 2x24x80 float32": "torch",  # a and a run as one batch, b alone (transposed)
        "gram 1x24x80 float32": "torch",
        "direct 3x16x16 float32": "torch",
    }
    assert NewtonSchulz(dtype=torch.bfloat16).tune(b) == {"gram 1x24x80 bfloat16": "torch"}


def test_a_described_problem_is_what_prepare_makes() -> None:
    from dmuon_ns._prepare import describe, prepare

    for shape in [(24, 80), (80, 24), (2, 3, 24, 80), (2, 80, 24), (16, 16)]:
        prepared = prepare(torch.randn(shape), torch.float16, 1e-7)
        described = describe(shape, torch.float16, torch.device("cpu"))
        assert (described.shape, described.dtype, described.device) == (
            prepared.write().shape,
            torch.float16,
            torch.device("cpu"),
        )


def test_public_names() -> None:
    expected = {
        "newton_schulz",
        "gram_newton_schulz",
        "direct_newton_schulz",
        "gram_newton_schulz_distributed",
        "NewtonSchulz",
        "POLAR_EXPRESS_COEFFICIENTS",
        "YOU_COEFFICIENTS",
        "QUINTIC_COEFFICIENTS",
        "get_ns_backend",
        "get_backend_status",
        "register_kernel",
        "NSKernel",
    }
    assert expected <= set(dmuon_ns.__all__)
    assert all(hasattr(dmuon_ns, name) for name in dmuon_ns.__all__)
