"""CUDA-graph replay of Newton–Schulz calls, one graph per key.

[Note: why graphs]
Newton–Schulz on a small matrix (1024×4096 and below) is a chain of a dozen short kernels, so
its time is mostly launch gaps. Capturing the chain once per (shape, dtype, batch, kernel)
and replaying it removes them. Large matrices gain little but lose nothing.

[Note: the aliasing rule]
``run_graphed`` returns a *fresh tensor* (a clone of the graph's static output), never the
static buffer itself: callers may keep, modify or hand on the result, and a later replay of
the same key cannot overwrite it. The clone is one memory-bound copy of the (m, n) output,
small next to the iteration's matrix products. The input is copied into the graph's static
input, so the caller's ``x`` is never aliased either.

[Note: capture failures]
Capture can fail for reasons outside our control (a kernel that synchronises, an allocator
setting, a capture already running on the stream). The first failure for a key is reported
once, through both ``logging`` and ``warnings``, and that key runs eagerly from then on; other
keys still try to capture.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["clear_graphs", "graph_keys", "run_graphed"]

logger = logging.getLogger(__name__)

# Warm-up runs on a side stream before capture: the first compiles (Triton, CuTe DSL) and
# autotunes library kernels, the next lets the caching allocator settle.
_WARMUP_RUNS = 2


@dataclass(frozen=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    static_input: Tensor
    static_output: Tensor


class _Eager:
    """Marker: capture failed for this key, run eagerly."""


_EAGER = _Eager()
_lock = threading.Lock()
_graphs: dict[Hashable, _Captured | _Eager] = {}


def run_graphed(fn: Callable[[Tensor], Tensor], x: Tensor, key: Hashable) -> Tensor:
    """``fn(x)`` through a CUDA graph captured on first use of ``key``.

    The graph key is ``key`` together with ``x``'s shape, dtype and device, so a key can never
    replay a graph captured for another input layout. ``fn`` must be a pure function of its
    input (the captured graph replays the same kernels on the same buffers). Non-CUDA inputs,
    and calls made while a capture is already running, simply run ``fn(x)``. See the module
    notes for the aliasing rule (the result is always a fresh tensor) and failure handling.
    """
    if x.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return fn(x)
    full_key = (key, tuple(x.shape), x.dtype, x.device)
    with _lock:
        entry = _graphs.get(full_key)
    if entry is None:
        entry = _capture_or_eager(fn, x, full_key)
        with _lock:
            _graphs[full_key] = entry
    if isinstance(entry, _Eager):
        return fn(x)
    entry.static_input.copy_(x)
    entry.graph.replay()
    return entry.static_output.clone()


def clear_graphs() -> None:
    """Drop every captured graph (and every eager fallback marker)."""
    with _lock:
        _graphs.clear()


def graph_keys() -> dict[Hashable, str]:
    """Each known key and whether it replays a graph (``"graph"``) or runs ``"eager"``."""
    with _lock:
        return {k: ("eager" if isinstance(v, _Eager) else "graph") for k, v in _graphs.items()}


def _capture_or_eager(
    fn: Callable[[Tensor], Tensor], x: Tensor, key: Hashable
) -> _Captured | _Eager:
    try:
        with torch.profiler.record_function("dmuon::ns_graph_capture"):
            return _capture(fn, x)
    except Exception as err:  # any capture problem degrades to eager for this key only
        message = (
            f"dmuon-ns: CUDA-graph capture failed for {key!r} ({type(err).__name__}: {err}); "
            "running this shape eagerly from now on"
        )
        logger.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        return _EAGER


def _capture(fn: Callable[[Tensor], Tensor], x: Tensor) -> _Captured:
    static_input = torch.empty_like(x, memory_format=torch.contiguous_format)
    static_input.copy_(x)
    side = torch.cuda.Stream(device=x.device)
    side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side):
        for _ in range(_WARMUP_RUNS):
            fn(static_input)
    torch.cuda.current_stream(x.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_output = fn(static_input)
    if not isinstance(static_output, Tensor):
        raise TypeError(f"fn must return a Tensor, got {type(static_output).__name__}")
    return _Captured(graph=graph, static_input=static_input, static_output=static_output)
