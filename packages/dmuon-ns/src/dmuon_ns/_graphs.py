"""CUDA-graph replay of Newton–Schulz calls, one graph per key.

[Note: why graphs]
Newton–Schulz on a small matrix (1024×4096 and below) is a chain of a dozen short kernels, so
its time is mostly launch gaps. Capturing the chain once per (shape, dtype, batch, kernel)
and replaying it removes them. Large matrices gain little but lose nothing.

[Note: input and output]
The graph's static input is written by the caller's ``GraphInput.write`` (the front end's
scaling pass, ``_prepare``): the input is made once, in place, with no copy into the graph
(such a copy is ~22 µs of a 0.78 ms call at 2048×8192 on an H200).

``run_graphed`` returns a *fresh tensor*, never a static buffer: callers may keep, modify or
hand on the result, and a later replay of the same key cannot overwrite it. When ``fn``
returns a ``LastProduct`` (the NS loops do: ``_iterations``' [Note: the last product]) the
graph ends before that product, whose operands are the graph's outputs, and each call runs it
after the replay into a new tensor. Any other ``fn`` returns a tensor, and each call clones
the graph's static output. Either way the caller's buffers are never aliased.

[Note: one pool for every graph]
Every NS graph on a device captures into one private memory pool. What a graph frees during
its capture (the loop's intermediates) goes back to the pool, and later captures reuse it, so
the intermediates of all shapes share one workspace, as large as the largest; each graph
keeps only its static input and its outputs (the last product's operands) for itself, and a
replaced graph's are freed. Sharing is safe because the graphs never run at once: a replay
overwrites another graph's intermediates and possibly its outputs, so a call holds the
pool's lock from writing its input until its last product (or clone) is enqueued, and a call
on another stream than the pool's last one first waits for the last call's work on the GPU
(an event recorded after each call), whatever the streams of the callers.

A key's first call (and a new variant's) runs eagerly, on the caller's stream, and returns
that result; the capture follows it. The eager run does what a warm-up before a capture is
for: Triton's compiles and tile autotuning, CuTe DSL's compiles, the libraries' lazy
initialisation, none of which may happen inside a capture. It runs in the ordinary allocator,
so no memory stays cached on a side stream, and nothing runs twice.

[Note: one graph per key]
A key holds one graph at a time, tagged with the ``variant`` that ``fn`` runs. The dispatcher's
key is the problem (op, coefficients, dtypes, shape) and the kernels it may run on, its variant
the kernel picked: a kernel asked for by name has a key of its own, while under ``auto`` the
pick moves when ``tune`` measures the problem or a verdict's kernel fails (``_autotune``'s
notes). A call with another variant drops the old graph with its buffers, which would
otherwise stay allocated for the life of the process, never to be replayed, and captures
anew.

[Note: capture failures]
Capture can fail for reasons outside our control (a kernel that synchronises, an allocator
setting, a capture already running on the stream); CUDA and torch report all of them as
``RuntimeError``. The first failure for a key is reported once, through both ``logging`` and
``warnings``, and that key runs eagerly from then on; other keys still try to capture. Any
other exception (a kernel library's own error type, a wrong return type) is not a capture
problem and propagates. Only CUDA inputs reach a capture, so the device works by then: the
pool's handle, made before the call's eager run, is not a capture step and its errors
propagate like any other CUDA call's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from dmuon_ns._iterations import LastProduct, finished
from dmuon_ns._profiling import span
from dmuon_ns._registry import Problem
from dmuon_ns._warnings import warn

__all__ = ["GraphInput", "clear_graphs", "graph_keys", "run_graphed"]

logger = logging.getLogger(__name__)


class GraphInput(Problem, Protocol):
    """A call's input, described (``shape``, ``dtype``, ``device``) and written on demand
    (``_prepare.Prepared`` is one)."""

    def write(self, out: Tensor | None = None) -> Tensor:
        """The input, written into ``out`` (contiguous, of ``shape`` and ``dtype``) or into a
        new tensor."""
        ...


Output = Tensor | LastProduct


@dataclass(frozen=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    static_input: Tensor
    static_output: Output
    variant: Hashable  # see [Note: one graph per key]


@dataclass
class _Pool:
    """The memory pool every NS graph on one device captures into ([Note: one pool for every
    graph]), its lock and the event recorded after the last call's work."""

    device: torch.device
    handle: Any  # torch.cuda.graph_pool_handle()
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: torch.cuda.Event | None = None
    stream: torch.cuda.Stream | None = None

    def after_last_call(self) -> None:
        """Order this call after the pool's last one when it comes from another stream."""
        stream = torch.cuda.current_stream(self.device)
        if self.done is not None and self.stream != stream:
            stream.wait_event(self.done)

    def call_enqueued(self) -> None:
        """Record the end of this call's work for the next call (see the note)."""
        stream = torch.cuda.current_stream(self.device)
        if self.done is None:
            self.done = torch.cuda.Event()
        self.done.record(stream)
        self.stream = stream


@dataclass(frozen=True)
class _Eager:
    """Marker: capture failed for this key and variant, run eagerly."""

    variant: Hashable


_lock = threading.Lock()
_graphs: dict[Hashable, _Captured | _Eager] = {}
_pools: dict[torch.device, _Pool] = {}


def run_graphed(
    fn: Callable[[Tensor], Output], source: GraphInput, key: Hashable, variant: Hashable = None
) -> Tensor:
    """``fn`` of the input ``source`` writes, through a CUDA graph captured on first use of
    ``key`` with this ``variant``.

    The graph key is ``key`` together with the input's shape, dtype and device, so a key can
    never replay a graph captured for another input layout; ``variant`` names what ``fn`` runs
    (see [Note: one graph per key]). ``fn`` must be a pure function of its input (the captured
    graph replays the same kernels on the same buffers). Non-CUDA inputs, and calls made while
    a capture is already running, simply run ``fn``. See the module notes for the input and
    output (always a fresh tensor) and for failure handling.
    """
    if source.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return finished(fn(source.write()))
    full_key = (key, tuple(source.shape), source.dtype, source.device)
    with _lock:
        entry = _graphs.get(full_key)
    if entry is None or entry.variant != variant:
        return _run_then_capture(fn, source, full_key, variant)
    if isinstance(entry, _Eager):
        return finished(fn(source.write()))
    return _replay(entry, source)


def _run_then_capture(
    fn: Callable[[Tensor], Output], source: GraphInput, key: Hashable, variant: Hashable
) -> Tensor:
    """A key's first call with this variant: run eagerly, then capture for the calls after
    (see [Note: one pool for every graph] and [Note: one graph per key])."""
    with _lock:
        _graphs.pop(key, None)  # another variant's buffers go before the capture
    pool = _pool(source.device)
    with pool.lock:  # the capture may reuse what the pool's graphs read and write
        pool.after_last_call()
        result = finished(fn(source.write()))
        entry = _capture_or_eager(fn, source, key, variant, pool)
        pool.call_enqueued()
    with _lock:
        _graphs[key] = entry
    return result


def _replay(entry: _Captured, source: GraphInput) -> Tensor:
    """A later call: the input written into the graph's, the graph replayed, a fresh result
    (see [Note: input and output])."""
    pool = _pool(source.device)
    with pool.lock:
        pool.after_last_call()
        source.write(entry.static_input)
        entry.graph.replay()
        output = entry.static_output
        result = output.finish() if isinstance(output, LastProduct) else output.clone()
        pool.call_enqueued()
    return result


def _pool(device: torch.device) -> _Pool:
    """The device's pool, made at its first capture."""
    with _lock:
        pool = _pools.get(device)
        if pool is None:
            pool = _pools[device] = _Pool(device, torch.cuda.graph_pool_handle())
        return pool


def clear_graphs() -> None:
    """Drop every captured graph (and every eager fallback marker) and the pools they shared."""
    with _lock:
        _graphs.clear()
        _pools.clear()


def graph_keys() -> dict[Hashable, str]:
    """Each known key and whether it replays a graph (``"graph"``) or runs ``"eager"``."""
    with _lock:
        return {k: ("eager" if isinstance(v, _Eager) else "graph") for k, v in _graphs.items()}


def _capture_or_eager(
    fn: Callable[[Tensor], Output],
    source: GraphInput,
    key: Hashable,
    variant: Hashable,
    pool: _Pool,
) -> _Captured | _Eager:
    try:
        with span("dmuon::ns_graph_capture"):
            return _capture(fn, source, variant, pool)
    except RuntimeError as err:  # how CUDA reports a capture it cannot make; see the note
        message = (
            f"dmuon-ns: CUDA-graph capture failed for {key!r} ({type(err).__name__}: {err}); "
            "running this shape eagerly from now on"
        )
        logger.warning(message)
        warn(message, RuntimeWarning)
        return _Eager(variant)


def _capture(
    fn: Callable[[Tensor], Output], source: GraphInput, variant: Hashable, pool: _Pool
) -> _Captured:
    """Capture ``fn`` on a static input, after the call's eager run (see [Note: one pool for
    every graph]); the input's contents do not matter to a capture, which runs nothing."""
    static_input = torch.empty(source.shape, dtype=source.dtype, device=source.device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool.handle):
        static_output = fn(static_input)
    if not isinstance(static_output, Tensor | LastProduct):
        raise TypeError(
            f"fn must return a Tensor or a LastProduct, got {type(static_output).__name__}"
        )
    return _Captured(graph, static_input, static_output, variant)
