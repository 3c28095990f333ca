"""The Triton products and the "triton" kernel at small, odd sizes.

Without a GPU they run in Triton's interpreter: ``TRITON_INTERPRET=1`` is set here, before
anything imports Triton (no other test module imports it at collection time). With a GPU the
same tests run compiled on it.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from dmuon_ns import POLAR_EXPRESS_COEFFICIENTS, NewtonSchulz, _registry, newton_schulz  # noqa: E402
from dmuon_ns import _triton_kernels as triton_kernels  # noqa: E402
from dmuon_ns._torch_kernel import TORCH_KERNEL  # noqa: E402
from dmuon_ns._triton_backend import TRITON_KERNEL  # noqa: E402
from dmuon_ns._triton_kernels import (  # noqa: E402
    _INTERPRETING,
    TileConfig,
    matmul,
    scale_cast,
)
from dmuon_ns.testing import reference_newton_schulz, relative_error  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
COEFFS = tuple(tuple(row) for row in POLAR_EXPRESS_COEFFICIENTS[:5])
# 16-wide tiles: a 33-row output spans three tile rows, so the triangle mapping, the mirrored
# stores and the masked tails are all exercised.
SMALL = TileConfig(block_m=16, block_n=32, block_k=16, num_warps=4, num_stages=1, group_m=2)
DTYPES = [torch.float16, torch.bfloat16]


def test_the_interpreter_is_really_in_use_without_a_gpu():
    assert _INTERPRETING == (not ON_GPU)
    assert TRITON_KERNEL.unavailable_reason(DEVICE) is None


def _rand(*shape, dtype):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def _err(actual, expected):
    return float((actual.double() - expected).norm() / expected.norm())


@pytest.mark.parametrize("dtype", DTYPES)
def test_gram_product_is_symmetric_and_matches_float64(dtype):
    x = _rand(2, 33, 70, dtype=dtype)
    r = matmul(x, x.mT, symmetric=True, config=SMALL)
    assert r.dtype == dtype and r.shape == (2, 33, 33)
    assert torch.equal(r, r.mT)
    expected = x.double() @ x.double().mT
    # One rounding of the fp32 sum to the storage dtype: half an ulp, relative.
    assert _err(r, expected) < (2e-3 if dtype == torch.float16 else 1.5e-2)
    # Element-exact against the same sums rounded once by torch (fp32 accumulate).
    assert torch.allclose(
        r.float(), (x.float() @ x.float().mT).to(dtype).float(), rtol=1e-2, atol=1e-3
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_symmetric_epilogue(dtype):
    base = _rand(2, 45, 45, dtype=torch.float32)
    s = ((base + base.mT) / 8).to(dtype)
    t = ((base @ base.mT) / 200).to(dtype)  # symmetric and commuting with nothing in particular
    out = matmul(s, s, c=t, alpha=0.7, beta=-1.3, diag=0.25, symmetric=True, config=SMALL)
    eye = torch.eye(45, dtype=torch.float64, device=DEVICE)
    sd, td = s.double(), t.double()
    expected = 0.7 * sd @ sd - 1.3 * td + 0.25 * eye
    assert torch.equal(out, out.mT)
    assert _err(out, expected) < (3e-3 if dtype == torch.float16 else 2e-2)


def test_symmetric_result_does_not_depend_on_the_tile_size():
    # The autotuner may pick another tile size in another process (a resumed run): a diagonal
    # tile must give each element the very sum an off-diagonal tile would. Eighths make every
    # sum exact, so only which sum lands where can differ (the interpreter's NumPy products
    # may round in another order for another block shape); s and z do not commute, so the
    # two triangles of s·z differ and averaging them would show.
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randint(-8, 9, (2, 45, 45), generator=gen).float() / 8 for _ in range(2))
    s, z = (a + a.mT).half().to(DEVICE), (b + b.mT).half().to(DEVICE)
    results = [
        matmul(
            s,
            z,
            c=s,
            alpha=0.7,
            beta=-1.3,
            diag=0.25,
            symmetric=True,
            config=TileConfig(block_m=block, block_k=16, num_warps=4, num_stages=1),
        )
        for block in (16, 32, 64)
    ]
    assert all(torch.equal(results[0], other) for other in results[1:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_product_with_epilogue_and_strided_operands(dtype):
    a = _rand(2, 33, 47, dtype=dtype)
    b = _rand(2, 70, 47, dtype=dtype).mT  # (2, 47, 70), not contiguous
    c = _rand(2, 33, 70, dtype=dtype)
    out = matmul(a, b, c=c, alpha=1.5, beta=-0.5, config=SMALL)
    expected = 1.5 * a.double() @ b.double() - 0.5 * c.double()
    assert out.shape == (2, 33, 70)
    assert _err(out, expected) < (2e-3 if dtype == torch.float16 else 1.5e-2)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_plain_product_writes_the_requested_dtype_from_one_rounding(out_dtype):
    a = _rand(2, 33, 47, dtype=torch.float16)
    b = _rand(2, 47, 70, dtype=torch.float16)
    out = matmul(a, b, out_dtype=out_dtype, config=SMALL)
    assert out.dtype == out_dtype
    # The fp32 accumulator is rounded once, straight to out_dtype: never through fp16 first.
    exact = (a.double() @ b.double()).to(out_dtype)
    via_fp16 = (a.double() @ b.double()).half().to(out_dtype)
    assert _err(out, exact.double()) <= _err(via_fp16, exact.double()) + 1e-6
    assert float((out.double() - exact.double()).abs().max()) <= (
        float(exact.double().abs().max()) * (2**-8 if out_dtype == torch.bfloat16 else 1e-6)
    )


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("transposed", [False, True])
def test_scale_cast_equals_torch_mul_bit_for_bit(out_dtype, transposed):
    g = _rand(3, 70, 45, dtype=torch.bfloat16)
    x = g.mT if transposed else g  # the front end hands a tall matrix's transpose, strided
    norm = torch.tensor([0.5, 3.0, 7.0], device=DEVICE) * torch.pi
    out = torch.empty(x.shape, dtype=out_dtype, device=DEVICE)
    assert scale_cast(x, norm, 1e-7, out) is out
    # The front end's torch formula: fp32 scale, fp32 product, one rounding.
    expected = torch.mul(x, norm.add(1e-7).reciprocal()[:, None, None]).to(out_dtype)
    assert out.is_contiguous()
    assert torch.equal(out, expected)


def test_scale_cast_rejects_bad_arguments():
    x = _rand(2, 8, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="contiguous"):
        scale_cast(x, torch.ones(2, device=DEVICE), 1e-7, torch.empty(2, 16, 8, device=DEVICE))
    with pytest.raises(ValueError, match="float32"):
        scale_cast(x, torch.ones(3, device=DEVICE), 1e-7, torch.empty_like(x))


def test_bad_operands_raise():
    x = _rand(2, 8, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="do not multiply"):
        matmul(x, x, config=SMALL)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        matmul(x.float(), x.float().mT, symmetric=True, config=SMALL)
    with pytest.raises(ValueError, match="must be 3-D"):
        matmul(x[0], x[0].mT, config=SMALL)
    with pytest.raises(ValueError, match="power of two"):
        TileConfig(block_k=24)


@pytest.mark.parametrize(
    ("op", "dtype", "shape"),
    [("gram", torch.float16, (3, 33, 70)), ("direct", torch.bfloat16, (2, 33, 70))],
)
def test_triton_kernel_matches_reference_as_well_as_torch(op, dtype, shape):
    # A fixed input: over random ones the gram ratio below spans 1.1-1.9 and, rarely, passes 2.
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    x = (g / torch.linalg.matrix_norm(g, keepdim=True)).to(dtype)
    if op == "gram":
        ours = TRITON_KERNEL.gram(x, COEFFS, (2,))
        plain = TORCH_KERNEL.gram(x, COEFFS, (2,))
    else:
        ours = TRITON_KERNEL.direct(x, COEFFS)
        plain = TORCH_KERNEL.direct(x, COEFFS)
    reference = reference_newton_schulz(x.float(), backend=op)
    assert ours.shape == x.shape and ours.dtype == dtype
    assert torch.isfinite(ours).all()
    ours_err, plain_err = relative_error(ours, reference), relative_error(plain, reference)
    assert ours_err <= 2 * plain_err, (ours_err, plain_err)
    # Writing the caller's dtype from the last product is that product rounded once more
    # coarsely, never a different iteration.
    run = TRITON_KERNEL.gram if op == "gram" else TRITON_KERNEL.direct
    args = (x, COEFFS, (2,)) if op == "gram" else (x, COEFFS)
    wide = run(*args, out_dtype=torch.float32)
    assert wide.dtype == torch.float32
    assert torch.equal(wide.to(dtype), ours)


def test_front_end_runs_the_triton_kernel_by_name():
    g = torch.randn(70, 33, generator=torch.Generator().manual_seed(0)).to(DEVICE)  # tall
    out = newton_schulz(g, kernel="triton")
    reference = reference_newton_schulz(g)
    assert out.shape == g.shape
    assert relative_error(out, reference) < 1.5e-2


# Every Triton kernel dmuon-ns launches, under the names ``_triton_kernels`` calls them by.
TRITON_LAUNCHERS = ("_product_kernel", "_sym_tuned", "_mm_tuned", "_scale_cast_kernel")


@pytest.fixture
def triton_launches(monkeypatch):
    """The names of the Triton kernels launched while the test runs, in order."""
    launched = []

    class Counted:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.kernel[grid]

    for name in TRITON_LAUNCHERS:
        monkeypatch.setattr(triton_kernels, name, Counted(name, getattr(triton_kernels, name)))
    return launched


@pytest.mark.parametrize(
    "choice",
    [{"kernel": "torch"}, {"deterministic": True}, {"env": "torch"}],
    ids=["kernel=torch", "deterministic", "DMUON_NS_KERNEL=torch"],
)
def test_the_torch_kernel_launches_no_triton_kernel(choice, triton_launches, monkeypatch):
    # The scaling pass too is the torch kernel's: torch ops, on the GPU as on the CPU.
    monkeypatch.delenv("DMUON_NS_KERNEL", raising=False)
    if "env" in choice:
        monkeypatch.setenv("DMUON_NS_KERNEL", choice.pop("env"))
    _registry.clear_resolution_cache()
    g = torch.randn(2, 70, 33, generator=torch.Generator().manual_seed(0)).to(
        DEVICE
    )  # tall, batched
    out = newton_schulz([g, g[0].T.contiguous()], **choice)
    assert triton_launches == []
    assert relative_error(out[0], reference_newton_schulz(g)) < 1.5e-2
    _registry.clear_resolution_cache()


def test_the_triton_kernel_scales_its_input_with_triton(triton_launches):
    # Eager, so that one call is one scaling pass (a CUDA graph's capture writes its input too).
    ns = NewtonSchulz(kernel="triton", cuda_graphs=False)
    g = torch.randn(2, 70, 33, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    out = ns(g)
    assert triton_launches[0] == "_scale_cast_kernel"
    assert triton_launches.count("_scale_cast_kernel") == 1
    assert relative_error(out, reference_newton_schulz(g)) < 1.5e-2
    # float64 input is scaled in float64 (torch ops), then iterates on Triton products.
    triton_launches.clear()
    ns(g.double())
    assert triton_launches and "_scale_cast_kernel" not in triton_launches


def test_scale_cast_takes_a_batch_larger_than_one_grid(monkeypatch):
    monkeypatch.setattr(triton_kernels, "_MAX_GRID_Z", 2)  # CUDA's 65535, scaled down
    x = _rand(5, 8, 24, dtype=torch.bfloat16).mT
    norm = torch.arange(1.0, 6.0, device=DEVICE)
    out = torch.empty(x.shape, dtype=torch.float16, device=DEVICE)
    scale_cast(x, norm, 1e-7, out)
    assert torch.equal(out, torch.mul(x, norm.add(1e-7).reciprocal()[:, None, None]).half())


def test_the_autotuner_measures_the_real_triton_kernel(tmp_path, monkeypatch):
    # The measurement path end to end on a real candidate: compiled on a GPU (CUDA-graph
    # timing included), interpreted on the CPU.
    from dmuon_ns import _autotune
    from dmuon_ns._prepare import describe

    monkeypatch.setenv("DMUON_NS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_autotune, "_TIMING_S", 0.01)
    _autotune.clear_cache()
    problem = describe((2, 33, 70), torch.float16, DEVICE)
    kernels = [TRITON_KERNEL, TORCH_KERNEL]
    chosen = _autotune.choose(kernels, problem, "gram", COEFFS, (2,), now=True)
    (verdict,) = _autotune.verdicts().values()
    assert verdict["rejected"] == {} and set(verdict["times_ms"]) == {"triton", "torch"}
    assert verdict["errors"]["triton"] <= 2 * verdict["errors"]["torch"]
    assert chosen.name == verdict["kernel"] and (tmp_path / "verdicts.json").exists()
    _autotune.clear_cache()
