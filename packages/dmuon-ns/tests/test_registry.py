"""Kernel registry: precedence, the environment override, unavailable kernels, status."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch
from torch import Tensor

import dmuon_ns
from dmuon_ns import (
    QUINTIC_COEFFICIENTS,
    NewtonSchulz,
    NSKernelUnavailableError,
    _registry,
    get_backend_status,
    get_ns_backend,
    newton_schulz,
    register_kernel,
)
from dmuon_ns._torch_kernel import TORCH_KERNEL
from dmuon_testing.typed_dicts import check_returns

CPU = torch.device("cpu")


class RecordingKernel:
    """Delegates to the torch kernel and records what the front end hands it."""

    def __init__(self, name: str, unavailable: str | None = None) -> None:
        self.name = name
        self.unavailable = unavailable
        self.calls: list[tuple[str, tuple[int, ...], torch.dtype, int, tuple[int, ...]]] = []

    def unavailable_reason(self, device: torch.device) -> str | None:
        return self.unavailable

    def _check(self, x: Tensor) -> None:
        assert x.ndim == 3 and x.shape[-2] <= x.shape[-1] and x.is_contiguous()
        norms = torch.linalg.vector_norm(x.float(), dim=(-2, -1))
        assert bool((norms <= 1.001).all())

    def gram(
        self,
        x: Tensor,
        coefficients: Sequence[tuple[float, float, float]],
        restarts: Sequence[int],
        out_dtype: torch.dtype | None = None,
    ) -> Tensor:
        self._check(x)
        self.calls.append(("gram", tuple(x.shape), x.dtype, len(coefficients), tuple(restarts)))
        return TORCH_KERNEL.gram(x, coefficients, restarts, out_dtype)

    def direct(
        self,
        x: Tensor,
        coefficients: Sequence[tuple[float, float, float]],
        out_dtype: torch.dtype | None = None,
    ) -> Tensor:
        self._check(x)
        self.calls.append(("direct", tuple(x.shape), x.dtype, len(coefficients), ()))
        return TORCH_KERNEL.direct(x, coefficients, out_dtype)


@pytest.fixture
def fake() -> Iterator[RecordingKernel]:
    kernel = RecordingKernel("fake")
    register_kernel(kernel)
    yield kernel
    _registry._kernels.pop("fake", None)
    _registry.clear_resolution_cache()


@pytest.fixture
def broken() -> Iterator[RecordingKernel]:
    kernel = RecordingKernel("broken", unavailable="needs the frobnicator; pip install frob")
    register_kernel(kernel)
    yield kernel
    _registry._kernels.pop("broken", None)
    _registry.clear_resolution_cache()


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # Neither the override nor the Triton interpreter (which makes Triton usable on CPU).
    monkeypatch.delenv(_registry.KERNEL_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _registry.clear_resolution_cache()
    yield
    _registry.clear_resolution_cache()


def test_an_empty_batch_reaches_no_kernel(fake: RecordingKernel) -> None:
    # On CUDA such a problem reached the autotuner, whose table lookup divided by the batch
    # (ZeroDivisionError at 0x1024x4096) and whose sample indexed into it (IndexError from
    # tune(), and from every tune_pending() after the call that met it).
    out = newton_schulz(torch.randn(0, 80, 24, dtype=torch.float64), kernel="fake")
    assert out.shape == (0, 80, 24) and out.dtype == torch.float64
    pair = newton_schulz([torch.randn(0, 8, 8), torch.randn(0, 8, 8)], kernel="fake")
    assert [tuple(y.shape) for y in pair] == [(0, 8, 8), (0, 8, 8)]
    assert fake.calls == []
    assert NewtonSchulz(kernel="fake").tune([torch.empty(0, 24, 80), torch.empty(24, 80)]) == {
        "gram 1x24x80 float16": "fake"
    }
    with pytest.raises(NSKernelUnavailableError):  # resolved first, as for any input
        newton_schulz(torch.randn(0, 8, 8), kernel="triton")


def test_registered_kernel_gets_the_prepared_input(fake: RecordingKernel) -> None:
    g = torch.randn(2, 80, 24, dtype=torch.float64)
    out = newton_schulz(g, kernel="fake", steps=7)
    assert out.dtype == torch.float64 and out.shape == g.shape
    assert fake.calls == [("gram", (2, 24, 80), torch.float16, 7, (2,))]
    newton_schulz(torch.randn(16, 16), kernel="fake", dtype=torch.bfloat16)
    assert fake.calls[-1] == ("direct", (1, 16, 16), torch.bfloat16, 5, ())
    # Same math as the torch kernel at the same iteration dtype (the torch kernel's own default
    # on the CPU is fp32): same result.
    assert torch.equal(out, newton_schulz(g, kernel="torch", steps=7, dtype=torch.float16))


def test_precedence(fake: RecordingKernel, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _registry.resolve("auto", False, CPU).rule == "auto"
    assert _registry.resolve("auto", True, CPU).rule == "deterministic"
    assert _registry.resolve("fake", True, CPU).kernels == (fake,)
    monkeypatch.setenv("DMUON_NS_KERNEL", "fake")
    # The environment beats deterministic=True and auto ...
    for deterministic in (False, True):
        resolution = _registry.resolve("auto", deterministic, CPU)
        assert resolution.kernels == (fake,) and resolution.rule == "DMUON_NS_KERNEL"
    # ... and an explicit kernel= beats the environment.
    resolution = _registry.resolve("torch", False, CPU)
    assert resolution.kernels == (TORCH_KERNEL,) and resolution.rule == "kernel="
    newton_schulz(torch.randn(8, 24))
    assert len(fake.calls) == 1
    newton_schulz(torch.randn(8, 24), kernel="torch")
    assert len(fake.calls) == 1
    # fp32 iterations run torch whatever the environment says (no other kernel takes them),
    # on CUDA too, where auto would otherwise offer the accelerated kernels.
    for device in (CPU, torch.device("cuda")):
        resolution = NewtonSchulz(dtype=torch.float32)._resolution(device)
        assert resolution.kernels == (TORCH_KERNEL,) and resolution.rule == "dtype"
    newton_schulz(torch.randn(8, 24), dtype=torch.float32)
    assert len(fake.calls) == 1
    monkeypatch.setenv("DMUON_NS_KERNEL", "auto")
    assert _registry.resolve("auto", True, CPU).rule == "deterministic"


def test_unknown_kernel_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DMUON_NS_KERNEL", "cublaslt")
    with pytest.raises(ValueError, match="DMUON_NS_KERNEL environment variable: unknown NS kernel"):
        newton_schulz(torch.randn(4, 8))


def test_unavailable_kernel_fails_fast(broken: RecordingKernel, monkeypatch) -> None:
    with pytest.raises(NSKernelUnavailableError, match=r"pip install frob.*kernel=.auto."):
        newton_schulz(torch.randn(4, 8), kernel="broken")
    monkeypatch.setenv("DMUON_NS_KERNEL", "broken")
    with pytest.raises(NSKernelUnavailableError, match=r"needs the frobnicator.*unset DMUON_NS"):
        newton_schulz(torch.randn(4, 8))
    assert broken.calls == []


def test_optional_kernels_unavailable_on_cpu() -> None:
    for name in ("triton", "quack"):
        with pytest.raises(NSKernelUnavailableError, match=f"NS kernel '{name}'"):
            newton_schulz(torch.randn(4, 8), kernel=name)


@pytest.fixture
def optional_kernel(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    """Declare an optional kernel "extra" living in the given module, not yet loaded."""

    def declare(module: str) -> None:
        monkeypatch.setitem(_registry._OPTIONAL_KERNELS, "extra", (module, "pip install extra"))
        monkeypatch.setattr(_registry, "_optional_loaded", False)

    yield declare
    _registry._import_failures.pop("extra", None)


def test_an_optional_kernel_that_cannot_be_imported_is_unavailable(optional_kernel) -> None:
    optional_kernel("dmuon_ns._no_such_kernel_module")
    reason = _registry.kernel_status(CPU)["extra"]
    assert reason is not None and "could not be imported" in reason
    assert reason.endswith("install with pip install extra")


def test_an_optional_kernel_module_with_a_bug_raises(optional_kernel, tmp_path, monkeypatch):
    (tmp_path / "dmuon_buggy_kernel.py").write_text("raise KeyError('a bug at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    optional_kernel("dmuon_buggy_kernel")
    with pytest.raises(KeyError, match="a bug at import"):
        _registry.kernel_status(CPU)


def test_register_kernel_validates() -> None:
    with pytest.raises(
        ValueError, match=r"kernel\.name must be a non-empty string other than .auto."
    ):
        register_kernel(RecordingKernel("auto"))
    with pytest.raises(ValueError, match="must implement unavailable_reason"):
        register_kernel(type("K", (), {"name": "k"})())  # type: ignore[arg-type]


def test_backend_status_on_cpu(broken: RecordingKernel) -> None:
    status = get_backend_status("cpu")
    assert status["sm"] is None and status["device"] == "cpu"
    assert status["auto_choice"] == "torch" and status["auto_candidates"] == ["torch"]
    assert "need CUDA" in status["auto_reason"]
    kernels = status["kernels"]
    assert kernels["torch"] == {"available": True, "reason": None}
    assert kernels["broken"] == {
        "available": False,
        "reason": "needs the frobnicator; pip install frob",
    }
    for name in ("triton", "quack"):
        assert kernels[name]["available"] is False
        assert isinstance(kernels[name]["reason"], str) and kernels[name]["reason"]
    # Its declared type (a TypedDict) names every key and its value's type, for mypy.
    check_returns(get_backend_status, status)


def test_backend_status_reports_the_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DMUON_NS_KERNEL", "torch")
    status = get_backend_status("cpu")
    assert status["env_override"] == "torch" and status["auto_choice"] == "torch"


def test_ns_backend_line() -> None:
    line = get_ns_backend(device="cpu")
    assert line.startswith("gram NS") and "kernel torch" in line and "| cpu |" in line
    assert "5 steps of Polar Express coefficients in float32 |" in line
    assert "need CUDA" in line
    quintic = NewtonSchulz(
        backend="direct",
        deterministic=True,
        coefficients=QUINTIC_COEFFICIENTS,
        steps=6,
        dtype=torch.bfloat16,
    )
    line = get_ns_backend(quintic, "cpu")
    assert line.startswith("direct NS, 6 steps of quintic coefficients in bfloat16 |")
    assert "deterministic=True" in line
    line = get_ns_backend(NewtonSchulz(coefficients=[(3.0, -3.0, 1.0)]), "cpu")
    assert "5 steps of custom coefficients" in line
    line = get_ns_backend(NewtonSchulz(kernel="triton"), "cpu")
    assert "kernel triton unavailable" in line
    assert "\n" not in line


def test_import_does_no_work() -> None:
    """Importing dmuon_ns loads no optional kernel module and queries no device."""
    code = (
        "import sys, torch\n"
        "torch.cuda.is_available = lambda: (_ for _ in ()).throw(AssertionError('queried'))\n"
        "import dmuon_ns\n"
        "bad = [m for m in sys.modules if m.startswith(('triton', 'quack', 'cutlass'))"
        " or m in ('dmuon_ns._triton_backend', 'dmuon_ns._quack_backend',"
        " 'dmuon_ns._autotune', 'dmuon_ns._measure', 'dmuon_ns._verdict_cache',"
        " 'dmuon_ns._graphs')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert dmuon_ns.__version__
