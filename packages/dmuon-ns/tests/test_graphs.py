"""CUDA-graph replay, the parts that run without a GPU: eager pass-through off CUDA, and the
once-per-key loud fallback when capture fails (the GPU tests cover real capture/replay)."""

from __future__ import annotations

import logging

import pytest
import torch

from dmuon_ns import _graphs
from dmuon_ns._iterations import LastProduct
from dmuon_ns._prepare import prepare


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

    source = prepare(torch.randn(2, 3, 4), torch.float32, 1e-7)
    out = _graphs.run_graphed(fn, source, key="k")
    (x,) = calls
    assert torch.equal(x, source.write()) and torch.equal(out, x * 2)
    assert _graphs.graph_keys() == {}


def test_an_eager_run_finishes_the_last_product():
    def fn(t):
        return LastProduct(torch.mul, (t, t), torch.float64)

    source = prepare(torch.randn(2, 3, 4), torch.float32, 1e-7)
    out = _graphs.run_graphed(fn, source, key="k")
    x = source.write()
    assert out.dtype == torch.float64 and torch.equal(out, (x * x).double())


def test_failed_capture_warns_once_and_falls_back_to_eager(monkeypatch, caplog):
    def broken_capture(fn, x, variant, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(_graphs, "_capture", broken_capture)
    source = prepare(torch.randn(1, 2, 2), torch.float32, 1e-7)
    with caplog.at_level(logging.WARNING, logger="dmuon_ns._graphs"):
        with pytest.warns(RuntimeWarning, match="CUDA-graph capture failed") as caught:
            entry = _graphs._capture_or_eager(lambda t: t, source, ("k", (2, 2)), None, _no_pool())
        assert [w.filename for w in caught] == [__file__]  # the caller's line
    assert isinstance(entry, _graphs._Eager)
    assert sum("capture failed" in r.getMessage() for r in caplog.records) == 1
    assert "operation not permitted" in caplog.records[0].getMessage()


class _OnCuda:
    """A prepared input that claims a CUDA device (``run_graphed`` captures only those)."""

    def __init__(self, prepared):
        self.prepared = prepared
        self.shape, self.dtype = prepared.shape, prepared.dtype
        self.device = torch.device("cuda")

    def write(self, out=None):
        return self.prepared.write(out)


def test_an_error_that_is_not_a_capture_failure_propagates(monkeypatch):
    def buggy_capture(fn, x, variant, pool):
        raise KeyError("a bug in the captured function")

    monkeypatch.setattr(_graphs, "_capture", buggy_capture)
    source = prepare(torch.randn(1, 2, 2), torch.float32, 1e-7)
    with pytest.raises(KeyError, match="a bug"):
        _graphs._capture_or_eager(lambda t: t, source, ("k", "bug"), None, _no_pool())


class _FakeGraph:
    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


class _FakePool(_graphs._Pool):
    """The shared pool without CUDA: nothing to order between streams."""

    def after_last_call(self) -> None:
        self.calls.append("wait")

    def call_enqueued(self) -> None:
        self.calls.append("record")


def _no_pool() -> _FakePool:
    """A pool for a capture that a stand-in makes fail before it uses one."""
    pool = _FakePool(torch.device("cuda"), handle=None)
    pool.calls = []
    return pool


def test_a_key_holds_one_graph_and_a_new_variant_replaces_it(monkeypatch):
    # Capture and replay need CUDA; here a fake graph stands in for them, and the source
    # claims a CUDA device, so what is tested is which graph a call uses.
    captured, pool = [], _FakePool(torch.device("cuda"), handle=None)
    pool.calls = []
    eager_runs = []

    def capture(fn, source, variant, pool):
        static_input = torch.empty(source.shape, dtype=source.dtype)
        entry = _graphs._Captured(_FakeGraph(), static_input, static_input * 2, variant)
        captured.append((entry, pool))
        return entry

    def fn(t):
        eager_runs.append(t)
        return t * 2

    monkeypatch.setattr(_graphs, "_capture", capture)
    monkeypatch.setattr(_graphs, "_pool", lambda device: pool)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    source = _OnCuda(prepare(torch.randn(2, 3, 4), torch.float32, 1e-7))
    outs = [
        _graphs.run_graphed(fn, source, "problem", variant=variant)
        for variant in ("torch", "torch", "quack", "quack")
    ]
    # A variant's first call runs eagerly and returns that result (the capture follows it);
    # later calls replay. The fake graph's output is its static input doubled, as captured.
    assert torch.equal(outs[0], source.write() * 2) and torch.equal(outs[2], outs[0])
    assert len(eager_runs) == 2
    assert [entry.variant for entry, _ in captured] == ["torch", "quack"]
    assert [entry.graph.replays for entry, _ in captured] == [1, 1]
    assert all(used is pool for _, used in captured)  # every graph captures into one pool
    assert pool.calls == ["wait", "record"] * 4  # each call ordered after the pool's last
    (entry,) = _graphs._graphs.values()  # the torch graph is gone with its buffers
    assert entry is captured[1][0]
