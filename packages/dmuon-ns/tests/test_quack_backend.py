"""The quack kernel without a GPU: its install hints, and its iteration (run on the batched
torch products it uses for small Gram sides) against the torch kernel, bit for bit."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dmuon_ns import POLAR_EXPRESS_COEFFICIENTS
from dmuon_ns import _quack_backend as quack_backend
from dmuon_ns._iterations import TORCH_PRODUCTS
from dmuon_ns._quack_backend import QUACK_KERNEL
from dmuon_ns._torch_kernel import TORCH_KERNEL
from dmuon_ns._triton_backend import TRITON_KERNEL

COEFFS = tuple(tuple(row) for row in POLAR_EXPRESS_COEFFICIENTS[:5])


@pytest.mark.skipif(importlib.util.find_spec("quack") is not None, reason="quack is installed")
def test_missing_quack_names_the_extra():
    reason = QUACK_KERNEL.unavailable_reason(torch.device("cpu"))
    assert (
        reason is not None
        and "pip install 'quack-kernels>=0.6.5' 'nvidia-cutlass-dsl>=4.8.1'" in reason
    )


def test_quack_needs_cuda(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    reason = QUACK_KERNEL.unavailable_reason(torch.device("cpu"))
    assert reason is not None and "SM90" in reason


def test_triton_without_gpu_or_interpreter_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reason = TRITON_KERNEL.unavailable_reason(torch.device("cpu"))
    if importlib.util.find_spec("triton") is None:
        assert reason is not None and "pip install 'triton>=3.4'" in reason
    else:
        assert reason is not None and "needs a CUDA device" in reason


@pytest.mark.parametrize("restarts", [(2,), (), (1, 3)])
def test_gram_iteration_is_the_torch_kernels(restarts, monkeypatch):
    monkeypatch.setattr(quack_backend, "_products_for", lambda x: TORCH_PRODUCTS)
    g = torch.randn(2, 24, 56)
    x = (g / torch.linalg.matrix_norm(g, keepdim=True)).to(torch.bfloat16)
    expected = TORCH_KERNEL.gram(x, COEFFS, restarts)
    assert torch.equal(QUACK_KERNEL.gram(x, COEFFS, restarts), expected)


def test_direct_iteration_is_the_torch_kernels(monkeypatch):
    monkeypatch.setattr(quack_backend, "_products_for", lambda x: TORCH_PRODUCTS)
    g = torch.randn(2, 24, 24)
    x = (g / torch.linalg.matrix_norm(g, keepdim=True)).to(torch.bfloat16)
    assert torch.equal(QUACK_KERNEL.direct(x, COEFFS), TORCH_KERNEL.direct(x, COEFFS))


def test_small_or_unaligned_problems_stay_on_torch_products(monkeypatch):
    # quack's TMA loads need 16-byte aligned rows; 333 fp16 columns are not (an H200 run
    # raised "strides ... expected to be divisible by 8"). Only aligned problems with a Gram
    # side above one tile ask for quack, which is then imported (here: a sentinel).
    sentinel = object()
    monkeypatch.setattr(quack_backend, "_quack", lambda: sentinel)
    for shape, expected in [
        ((3, 333, 1000), TORCH_PRODUCTS),
        ((1, 512, 1001), TORCH_PRODUCTS),
        ((2, 256, 4096), TORCH_PRODUCTS),
        ((1, 264, 1000), sentinel),
    ]:
        x = torch.empty(shape, dtype=torch.float16)
        assert quack_backend._products_for(x) is expected, shape


def test_symmetric_tiles_take_the_least_estimated_time():
    # At a measured product the estimate is the measurement, so the pick is its fastest shape.
    shapes = quack_backend.SM90_SYM_TILES
    for product, times in quack_backend.SYM_TILE_MEASUREMENTS:
        for tiles, us in zip(shapes, times, strict=True):
            assert quack_backend.estimated_us(tiles, product, 132) == pytest.approx(us)
        fastest = shapes[times.index(min(times))]
        assert quack_backend.pick_sym_tiles(product, 132) is fastest, product
    # Elsewhere the rounds are the product's own. H200: 132 SMs. At m = 4096 quack's
    # 256-squares need 3 rounds for 2.06 rounds of work, 128-tiles exactly 4 cheaper ones.
    default, small = shapes
    assert default.rounds(1, 4096, 132) == 3 and small.rounds(1, 4096, 132) == 4
    gram = quack_backend.SymProduct(1, 4096, 8192, gram=True)
    assert quack_backend.pick_sym_tiles(gram, 132) is small
    # Fewer SMs move the boundary. Two such Gram matrices: 5 big rounds on 132 SMs or on
    # 114 (H100 PCIe), against 8 small ones on 132 and 10 on 114.
    two = quack_backend.SymProduct(2, 4096, 14336, gram=True)
    assert default.rounds(2, 4096, 132) == default.rounds(2, 4096, 114) == 5
    assert small.rounds(2, 4096, 132) == 8 and small.rounds(2, 4096, 114) == 10
    assert quack_backend.pick_sym_tiles(two, 132) is small
    assert quack_backend.pick_sym_tiles(two, 114) is default
    # A round's time is scaled by K from the nearest measured product (here 1 × 4096×14336).
    assert quack_backend.estimated_us(small, gram, 132) == pytest.approx(368.7 * 8192 / 14336)


@pytest.mark.parametrize(
    ("release", "tiled"), [("0.6.5", True), ("0.6.9", True), ("0.7.0", False), (None, False)]
)
def test_quack_tiles_are_chosen_only_under_the_releases_they_were_measured_on(
    release, tiled, monkeypatch
):
    import importlib.metadata
    import sys
    import types

    def version(name):
        if name != "quack-kernels" or release is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return release

    dispatch_level = types.ModuleType("quack.gemm_symmetric")
    dispatch_level.gemm_symmetric = object()
    monkeypatch.setitem(sys.modules, "quack", types.ModuleType("quack"))
    monkeypatch.setitem(sys.modules, "quack.gemm_symmetric", dispatch_level)
    monkeypatch.setattr(importlib.metadata, "version", version)
    expected = dispatch_level.gemm_symmetric if tiled else None
    assert quack_backend._tiled_symmetric() is expected


def test_quack_products_never_autotune():
    # quack's own autotuner would time tens of configurations at every new shape's first call
    # (the backend's note): every plain product asks for its untuned configuration.
    calls = []

    def record(name):
        def product(*args, **kwargs):
            calls.append((name, kwargs))
            return torch.zeros(1)

        return product

    products = object.__new__(quack_backend._QuackProducts)  # no quack needed for the calls
    products._gemm, products._gemm_add = record("gemm"), record("gemm_add")
    a = torch.zeros(1, 4, 4)
    products.mm(a, a)
    products.mm(a, a, out_dtype=torch.bfloat16)
    products.mm_add(a, a, a, 0.5)
    assert [name for name, _ in calls] == ["gemm", "gemm", "gemm_add"]
    assert all(kwargs["tuned"] is False for _, kwargs in calls)
