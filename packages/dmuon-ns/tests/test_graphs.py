"""CUDA-graph replay, the parts that run without a GPU: eager pass-through off CUDA, and the
once-per-key loud fallback when capture fails (the GPU tests cover real capture/replay)."""

from __future__ import annotations

import logging

import pytest
import torch

from dmuon_ns import _graphs


@pytest.fixture(autouse=True)
def _fresh_graphs():
    _graphs.clear_graphs()
    yield
    _graphs.clear_graphs()


def test_cpu_inputs_run_eagerly_without_capture():
    calls = []

    def fn(t):
        calls.append(t)
        return t * 2

    x = torch.randn(3, 4)
    out = _graphs.run_graphed(fn, x, key="k")
    assert torch.equal(out, x * 2)
    assert calls == [x]
    assert _graphs.graph_keys() == {}


def test_failed_capture_warns_once_and_falls_back_to_eager(monkeypatch, caplog):
    def broken_capture(fn, x):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(_graphs, "_capture", broken_capture)
    x = torch.randn(2, 2)
    with caplog.at_level(logging.WARNING, logger="dmuon_ns._graphs"):
        with pytest.warns(RuntimeWarning, match="CUDA-graph capture failed"):
            entry = _graphs._capture_or_eager(lambda t: t, x, ("k", (2, 2)))
    assert isinstance(entry, _graphs._Eager)
    assert sum("capture failed" in r.getMessage() for r in caplog.records) == 1
    assert "operation not permitted" in caplog.records[0].getMessage()


def test_capture_without_cuda_degrades_to_eager():
    # The real capture needs CUDA; on CPU it fails (no CUDA stream), which must also degrade
    # to eager with a warning rather than raise.
    with pytest.warns(RuntimeWarning, match="CUDA-graph capture failed"):
        entry = _graphs._capture_or_eager(lambda t: t, torch.randn(2), "k")
    assert isinstance(entry, _graphs._Eager)
