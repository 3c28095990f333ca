"""Every accelerated kernel on the GPU (run on the H200: ``pytest -m gpu``): accuracy against
float64 relative to plain torch, finite results on hard inputs, autotune and graph replay."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import dmuon_ns
from dmuon_ns import (
    POLAR_EXPRESS_COEFFICIENTS,
    NewtonSchulz,
    _graphs,
    _registry,
    newton_schulz,
    register_kernel,
)
from dmuon_ns._iterations import LastProduct
from dmuon_ns._registry import kernel_status
from dmuon_ns._torch_kernel import TORCH_KERNEL
from dmuon_ns.testing import reference_newton_schulz, relative_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

COEFFS = tuple(tuple(row) for row in POLAR_EXPRESS_COEFFICIENTS[:5])
# m ≤ 256 and m > 256 (quack switches products there), odd sizes, a batch.
SHAPES = [(1, 1024, 4096), (3, 333, 1000), (2, 200, 520)]
KINDS = ["random", "low_rank", "ill_conditioned"]


def _kernel(name):
    import importlib

    status = kernel_status(torch.device("cuda"))
    if status.get(name) is not None:
        pytest.skip(f"{name}: {status[name]}")
    module = {"triton": "dmuon_ns._triton_backend", "quack": "dmuon_ns._quack_backend"}[name]
    return getattr(importlib.import_module(module), f"{name.upper()}_KERNEL")


def _input(kind, shape, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    batch, m, n = shape
    if kind == "random":
        g = torch.randn(shape, device="cuda", generator=gen)
    elif kind == "low_rank":
        rank = 4
        g = torch.randn(batch, m, rank, device="cuda", generator=gen) @ torch.randn(
            batch, rank, n, device="cuda", generator=gen
        )
    else:  # singular values spanning 1 .. 1e-6
        u, _ = torch.linalg.qr(torch.randn(batch, m, m, device="cuda", generator=gen))
        v, _ = torch.linalg.qr(torch.randn(batch, n, m, device="cuda", generator=gen))
        s = torch.logspace(0, -6, m, device="cuda")
        g = u @ torch.diag_embed(s) @ v.mT
    x = g / (torch.linalg.matrix_norm(g, keepdim=True) + 1e-7)
    return x.to(dtype).contiguous()


@pytest.mark.parametrize("name", ["triton", "quack"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", ["gram", "direct"])
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_error_within_twice_torch(name, dtype, op, kind):
    kernel = _kernel(name)
    for shape in SHAPES:
        x = _input(kind, shape, dtype)
        if op == "gram":
            ours = kernel.gram(x, COEFFS, (2,))
            plain = TORCH_KERNEL.gram(x, COEFFS, (2,))
        else:
            ours = kernel.direct(x, COEFFS)
            plain = TORCH_KERNEL.direct(x, COEFFS)
        assert ours.shape == x.shape and ours.dtype == dtype
        assert torch.isfinite(ours).all(), (name, shape, kind)
        reference = reference_newton_schulz(x.double(), backend=op)
        ours_err, plain_err = relative_error(ours, reference), relative_error(plain, reference)
        assert ours_err <= 2 * plain_err + 1e-6, (name, shape, kind, ours_err, plain_err)


@pytest.mark.parametrize("name", ["torch", "triton", "quack"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_output_singular_values_lie_in_the_band(name, dtype, kind):
    # The README's band (as test_newton_schulz holds the CPU to): every output singular value
    # in [0, top]; those from input singular values ≥ 0.002·‖G‖_F in [0.84, top].
    kernel = TORCH_KERNEL if name == "torch" else _kernel(name)
    top = 1.15 if dtype == torch.float16 else 1.7
    for shape in SHAPES:
        x = _input(kind, shape, dtype)
        for op in ("gram", "direct"):
            out = kernel.gram(x, COEFFS, (2,)) if op == "gram" else kernel.direct(x, COEFFS)
            sigma = torch.linalg.svdvals(out.double())
            assert float(sigma.min()) >= 0 and float(sigma.max()) <= top, (name, shape, op)
            inside = (torch.linalg.svdvals(x.double()) >= 0.002).sum(-1)  # x is normalised
            for b in range(shape[0]):
                k = int(inside[b])
                assert float(sigma[b, k - 1]) >= 0.84, (name, shape, op, b)


def test_auto_picks_an_available_kernel_and_is_accurate(tmp_path, monkeypatch):
    from dmuon_ns import _autotune
    from dmuon_ns._environment import CACHE_DIR_ENV

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    _autotune.clear_cache()
    g = torch.randn(1536, 6144, device="cuda")  # a shape no shipped table holds
    reference = reference_newton_schulz(g)
    # No call measures anything: without a verdict the problem runs torch.
    for _ in range(3):
        assert relative_error(newton_schulz(g), reference) < 1.5e-2
    assert _autotune.verdicts() == {}
    ns = NewtonSchulz()
    (chosen,) = ns.tune(g).values()
    usable = {k for k, reason in kernel_status(torch.device("cuda")).items() if reason is None}
    verdicts = _autotune.verdicts()
    assert verdicts, "auto with several usable kernels must autotune"
    for verdict in verdicts.values():
        assert verdict["kernel"] in usable
        assert verdict["kernel"] not in verdict["rejected"]
    assert chosen in usable and (tmp_path / "verdicts.json").exists()
    assert relative_error(ns(g), reference) < 1.5e-2


def test_fp32_iterations_run_torch_on_cuda_and_beat_fp16():
    g = torch.randn(384, 1536, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    reference = reference_newton_schulz(g)
    fp32 = NewtonSchulz(dtype=torch.float32)
    assert fp32._resolution(g.device).kernels == (TORCH_KERNEL,)
    assert "float32 | kernel torch" in dmuon_ns.get_ns_backend(fp32, device=g.device)
    fp32_error = relative_error(fp32(g), reference)
    assert fp32_error < 1e-4 < 1e-3 < relative_error(newton_schulz(g), reference)


def test_a_shipped_table_decides_from_the_first_call(tmp_path, monkeypatch):
    from dmuon_ns import _autotune, _tables
    from dmuon_ns._environment import CACHE_DIR_ENV

    entries = _tables.load(torch.cuda.get_device_name())
    if not entries:
        pytest.skip(f"no shipped table for {torch.cuda.get_device_name()}")
    usable = [k for k, reason in kernel_status(torch.device("cuda")).items() if reason is None]
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    _autotune.clear_cache()
    g = torch.randn(2048, 8192, device="cuda")
    entry = _tables.entry_for(entries, "gram", 1, 2048, 8192, "float16")
    assert entry is not None, "the table covers the issue's shapes"
    expected = _tables.verdict_kernel(
        entry, [n for n in ("quack", "triton", "torch") if n in usable]
    )
    out = newton_schulz(g)
    (verdict,) = _autotune.verdicts().values()
    assert verdict["kernel"] == expected and verdict["table"] == "gram 1x2048x8192 float16"
    assert relative_error(out, reference_newton_schulz(g)) < 1.5e-2
    assert not (tmp_path / "verdicts.json").exists()  # nothing was measured


def test_an_eager_call_frees_its_input_once_read():
    # The eager path hands the scaled input over to the loop (_iterations' note), so the Gram
    # form's last product has the restarted iterate and the result alive, not the input too:
    # with the torch kernel (fp16 result, then the cast to the input's bf16) at most three
    # m×n fp16 buffers and a few m×m ones above the caller's input.
    m, n = 2048, 8192
    g = torch.randn(m, n, device="cuda").to(torch.bfloat16)
    ns = NewtonSchulz(kernel="torch", cuda_graphs=False)
    ns(g)  # cuBLAS's workspace and handles
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = ns(g)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    big, small = m * n * 2, m * m * 2
    assert peak <= 3 * big + 5 * small, (peak / 2**20, big / 2**20, small / 2**20)
    assert out.shape == g.shape


def test_no_call_measures_and_tune_pending_settles(tmp_path, monkeypatch):
    import time

    from dmuon_ns import _autotune
    from dmuon_ns._environment import CACHE_DIR_ENV

    usable = [k for k, reason in kernel_status(torch.device("cuda")).items() if reason is None]
    if len(usable) < 2:
        pytest.skip(f"auto has nothing to choose from: {usable}")
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    _autotune.clear_cache()
    newton_schulz(torch.randn(64, 256, device="cuda"))  # CUDA context, cuBLAS handles
    g = torch.randn(1536, 6144, device="cuda")  # a shape no shipped table holds
    reference = reference_newton_schulz(g)
    for _ in range(5):  # the first call captures its graph; none compiles or measures
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = newton_schulz(g)
        torch.cuda.synchronize()
        assert time.perf_counter() - start < 2.0
        assert relative_error(out, reference) < 1.5e-2
    assert _autotune.verdicts() == {}
    start = time.perf_counter()
    settled = dmuon_ns.tune_pending()
    seconds = time.perf_counter() - start
    assert settled["gram 1x1536x6144 float16"] in usable
    (verdict,) = [v for k, v in _autotune.verdicts().items() if "|1x1536x6144|" in k]
    assert verdict["kernel"] not in verdict["rejected"]
    assert relative_error(newton_schulz(g), reference) < 1.5e-2
    print(f"tune_pending settled 1x1536x6144 in {seconds:.2f} s")


class _OpaqueKernel:
    """A registered kernel not made of the shared loops: its whole call is graphed and each
    result cloned out of the graph."""

    name = "opaque-torch"

    def unavailable_reason(self, device):
        return None

    def gram(self, x, coefficients, restart_iterations, out_dtype=None):
        return TORCH_KERNEL.gram(x, coefficients, restart_iterations, out_dtype)

    def direct(self, x, coefficients, out_dtype=None):
        return TORCH_KERNEL.direct(x, coefficients, out_dtype)


@pytest.fixture
def opaque_kernel():
    register_kernel(_OpaqueKernel())
    yield
    _registry._kernels.pop(_OpaqueKernel.name, None)
    _registry.clear_resolution_cache()


class _BrokenKernel(_OpaqueKernel):
    """A registered kernel whose every run fails as a kernel that cannot run says so."""

    name = "broken-gpu"

    def gram(self, x, coefficients, restart_iterations, out_dtype=None):
        raise RuntimeError("no kernel image for this device")


def test_a_verdict_kernel_that_fails_falls_back_to_torch(monkeypatch, tmp_path):
    from dmuon_ns import _autotune, _tables
    from dmuon_ns._environment import CACHE_DIR_ENV

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    register_kernel(_BrokenKernel())
    _registry.clear_resolution_cache()
    _autotune.clear_cache()
    try:
        names = [k.name for k in _registry.resolve("auto", False, torch.device("cuda")).kernels]
        row = {"op": "gram", "batch": 1, "m": 256, "n": 1024, "dtype": "float16"}
        row["ms"] = {name: 0.1 if name == _BrokenKernel.name else 1.0 for name in names}
        entries = _tables.parse({"format": 1, "problems": [row]}, "test")
        monkeypatch.setattr(_tables, "load", lambda device_name: entries)
        g = torch.randn(256, 1024, device="cuda")
        reference = reference_newton_schulz(g)
        with pytest.warns(RuntimeWarning, match="broken-gpu.*table verdict.*no kernel image"):
            out = newton_schulz(g)
        assert relative_error(out, reference) < 1.5e-2
        assert relative_error(newton_schulz(g), reference) < 1.5e-2  # torch from now on
    finally:
        _registry._kernels.pop(_BrokenKernel.name, None)
        _registry.clear_resolution_cache()
        _autotune.clear_cache()
        _graphs.clear_graphs()


@pytest.mark.parametrize("name", ["torch", "triton", "quack", _OpaqueKernel.name])
def test_graph_replay_equals_eager(name, request):
    if name == _OpaqueKernel.name:
        request.getfixturevalue("opaque_kernel")
    elif name != "torch":
        _kernel(name)
    gs = [
        torch.randn(3, 512, 1536, device="cuda"),
        torch.randn(700, 300, device="cuda"),
        torch.randn(2, 384, 384, device="cuda"),  # square: direct NS
    ]
    eager = NewtonSchulz(kernel=name, cuda_graphs=False)
    graphed = NewtonSchulz(kernel=name, cuda_graphs=True)
    _graphs.clear_graphs()
    for g in gs:
        expected = eager(g)
        first = graphed(g)  # capture + replay
        again = graphed(g.clone())  # pure replay
        assert torch.equal(first, expected), name
        assert torch.equal(again, expected), name
        # New data reaches the graph, and the result is a fresh tensor: a later replay never
        # overwrites it.
        kept, h = again.clone(), torch.randn_like(g)
        assert torch.equal(graphed(h), eager(h)), name
        assert torch.equal(again, kept)
    # A loop kernel's graph ends before its last product, which runs after each replay;
    # another kernel's graph holds the result, which each call clones.
    captured = list(_graphs._graphs.values())
    assert len(captured) == len(gs)
    output_type = Tensor if name == _OpaqueKernel.name else LastProduct
    assert all(isinstance(c.static_output, output_type) for c in captured), name


@pytest.mark.parametrize("name", ["torch", "triton", "quack"])
@pytest.mark.parametrize("op", ["gram", "direct"])
def test_out_dtype_is_the_last_product_rounded_once(name, op):
    kernel = TORCH_KERNEL if name == "torch" else _kernel(name)
    x = _input("random", (2, 333, 1000), torch.float16)
    run = kernel.gram if op == "gram" else kernel.direct
    args = (x, COEFFS, (2,)) if op == "gram" else (x, COEFFS)
    own = run(*args)
    for out_dtype in (torch.bfloat16, torch.float32):
        out = run(*args, out_dtype=out_dtype)
        assert out.dtype == out_dtype and out.shape == x.shape
        # Same iteration, only the final rounding differs: within one fp16 ulp of the
        # kernel's own fp16 output (relative 2^-10), plus bf16's own rounding.
        tol = 2**-10 + (2**-8 if out_dtype == torch.bfloat16 else 0.0)
        diff = (out.double() - own.double()).abs()
        assert float(diff.max()) <= tol * float(own.double().abs().max()), (name, out_dtype)


@pytest.mark.parametrize("transposed", [False, True])
def test_front_end_normalisation_on_cuda_matches_the_cpu_formula(transposed):
    from dmuon_ns._prepare import prepare

    g = torch.randn(3, 300, 700, device="cuda").to(torch.bfloat16) * 50
    g = g.mT if transposed else g
    prepared = prepare(g, torch.float16, 1e-7)
    x_gpu, x_cpu = prepared.write(), prepare(g.cpu(), torch.float16, 1e-7).write()
    assert prepared.transposed == transposed and x_gpu.is_contiguous()
    # The fp32 norms differ in summation order (a few parts in 1e6 over 210k elements), so
    # elements near an fp16 rounding boundary may land one ulp apart, never more.
    diff = (x_gpu.cpu().double() - x_cpu.double()).abs()
    assert float(diff.max()) <= 2**-10 * float(x_cpu.double().abs().max())
    # Given the same norm, the one-pass Triton scaling is torch's formula, bit for bit.
    x = g.mT if transposed else g
    scale = torch.linalg.vector_norm(x, dim=(-2, -1), dtype=torch.float32).add_(1e-7)
    expected = torch.mul(x, scale.reciprocal_()[:, None, None]).to(torch.float16)
    assert torch.equal(x_gpu, expected)


def test_quack_tile_shapes_agree_bit_for_bit_on_exactly_symmetric_products(monkeypatch):
    _kernel("quack")
    from dmuon_ns import _quack_backend

    products = _quack_backend._QuackProducts()
    if (
        products._tiled_symmetric is None
        or _quack_backend._sm90_count(torch.device("cuda")) is None
    ):
        pytest.skip("the tile choice applies to SM90 with quack's dispatch-level product")
    x = _input("random", (2, 1024, 3072), torch.float16)
    r = products._gemm_symmetric(x, x.mT)  # quack's interface, its own tile shape
    rr = products._gemm_symmetric(r, r, C=r, alpha=0.3, beta=0.5)
    for tiles in _quack_backend.SM90_SYM_TILES:
        monkeypatch.setattr(_quack_backend, "pick_sym_tiles", lambda *_, tiles=tiles: tiles)
        assert torch.equal(products.gram(x), r), tiles
        assert torch.equal(products.sym(r, r, r, alpha=0.3, beta=0.5), rr), tiles


def test_triton_symmetric_result_does_not_depend_on_the_autotuned_tiles():
    # Each process autotunes on its own; a resumed run must compute the same bits whichever
    # of the symmetric kernel's tile configs it picked.
    _kernel("triton")
    from dmuon_ns._triton_kernels import TileConfig, matmul

    x = _input("random", (2, 1000, 3000), torch.float16)
    r = matmul(x, x.mT, symmetric=True)
    # r·z is symmetric only in exact arithmetic.
    z = matmul(r, r, c=r, alpha=2.0, beta=-1.0, symmetric=True)
    configs = [
        TileConfig(block_m=128, block_k=64, num_warps=8, num_stages=3),
        TileConfig(block_m=64, block_k=64, num_warps=4, num_stages=4),
        TileConfig(block_m=64, block_k=128, num_warps=4, num_stages=3),
    ]
    results = [matmul(r, z, c=r, alpha=0.7, beta=-1.3, symmetric=True, config=c) for c in configs]
    assert all(torch.equal(results[0], other) for other in results[1:])


def test_the_shipped_tiles_run_without_the_autotuner(monkeypatch):
    # On a card with a tile table every product of the shapes runs the table's tiles
    # (_triton_tiles' note): Triton's autotuner, which compiles every candidate, never runs.
    pytest.importorskip("triton")
    from dmuon_ns import _triton_kernels, _triton_tiles

    if _triton_tiles.tiles_file(torch.cuda.get_device_name()) is None:
        pytest.skip(f"no shipped tile table for {torch.cuda.get_device_name()}")

    def refuse(*args, **kwargs):
        raise AssertionError("the autotuner ran")

    monkeypatch.setattr(_triton_kernels._sym_tuned, "run", refuse)
    monkeypatch.setattr(_triton_kernels._mm_tuned, "run", refuse)
    ns = NewtonSchulz(kernel="triton", cuda_graphs=False)
    for m, n in ((1024, 4096), (2048, 8192), (4096, 14336), (4096, 4096)):
        g = torch.randn(m, n, device="cuda")
        assert relative_error(ns(g), reference_newton_schulz(g)) < 1.5e-2
