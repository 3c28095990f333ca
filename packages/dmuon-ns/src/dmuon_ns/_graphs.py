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

One call of a key runs at a time (a lock per graph, from writing the input until the last
product or the clone is enqueued), and calls sharing a key must be on one stream, as in a
training loop: a replay on another stream could overwrite the static buffers while an earlier
call's last product still reads them.

[Note: one graph per key]
A key holds one graph at a time, tagged with the ``variant`` that ``fn`` runs. The dispatcher's
key is the problem (op, coefficients, dtypes, shape) and the kernels it may run on, its variant
the kernel picked: a kernel asked for by name has a key of its own, while under ``auto`` the
pick moves from the provisional kernel to the verdict's (``_autotune``'s [Note: cold start]).
A call with another variant captures anew and drops the old graph with its buffers, which
would otherwise hold twice the problem's size for the life of the process, never to be
replayed.

[Note: capture failures]
Capture can fail for reasons outside our control (a kernel that synchronises, an allocator
setting, a capture already running on the stream, no CUDA at all); CUDA and torch report all
of them as ``RuntimeError``. The first failure for a key is reported once, through both
``logging`` and ``warnings``, and that key runs eagerly from then on; other keys still try to
capture. Any other exception (a kernel library's own error type, a wrong return type) is not
a capture problem and propagates. ``_capture`` makes its side stream before anything else on
the device: without a usable CUDA that is the call that fails, with a ``RuntimeError`` on
every torch build (a CPU build's allocator would raise ``AssertionError`` for a CUDA tensor).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from dmuon_ns._iterations import LastProduct, finished
from dmuon_ns._registry import Problem

__all__ = ["GraphInput", "clear_graphs", "graph_keys", "run_graphed"]

logger = logging.getLogger(__name__)

# Warm-up runs on a side stream before capture: the first compiles (Triton, CuTe DSL) and
# autotunes library kernels, the next lets the caching allocator settle.
_WARMUP_RUNS = 2


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
    lock: threading.Lock = field(default_factory=threading.Lock)  # see [Note: input and output]


@dataclass(frozen=True)
class _Eager:
    """Marker: capture failed for this key and variant, run eagerly."""

    variant: Hashable


_lock = threading.Lock()
_graphs: dict[Hashable, _Captured | _Eager] = {}


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
        entry = _capture_or_eager(fn, source, full_key, variant)
        with _lock:
            _graphs[full_key] = entry  # a graph of another variant is dropped here
    if isinstance(entry, _Eager):
        return finished(fn(source.write()))
    with entry.lock:
        source.write(entry.static_input)
        entry.graph.replay()
        output = entry.static_output
        return output.finish() if isinstance(output, LastProduct) else output.clone()


def clear_graphs() -> None:
    """Drop every captured graph (and every eager fallback marker)."""
    with _lock:
        _graphs.clear()


def graph_keys() -> dict[Hashable, str]:
    """Each known key and whether it replays a graph (``"graph"``) or runs ``"eager"``."""
    with _lock:
        return {k: ("eager" if isinstance(v, _Eager) else "graph") for k, v in _graphs.items()}


def _capture_or_eager(
    fn: Callable[[Tensor], Output], source: GraphInput, key: Hashable, variant: Hashable = None
) -> _Captured | _Eager:
    try:
        with torch.profiler.record_function("dmuon::ns_graph_capture"):
            return _capture(fn, source, variant)
    except RuntimeError as err:  # how CUDA reports a capture it cannot make; see the note
        message = (
            f"dmuon-ns: CUDA-graph capture failed for {key!r} ({type(err).__name__}: {err}); "
            "running this shape eagerly from now on"
        )
        logger.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        return _Eager(variant)


def _capture(fn: Callable[[Tensor], Output], source: GraphInput, variant: Hashable) -> _Captured:
    side = torch.cuda.Stream(device=source.device)  # first: see [Note: capture failures]
    static_input = source.write(torch.empty(source.shape, dtype=source.dtype, device=source.device))
    side.wait_stream(torch.cuda.current_stream(source.device))
    with torch.cuda.stream(side):
        for _ in range(_WARMUP_RUNS):
            finished(fn(static_input))  # the last product too: it runs eagerly after replays
    torch.cuda.current_stream(source.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_output = fn(static_input)
    if not isinstance(static_output, Tensor | LastProduct):
        raise TypeError(
            f"fn must return a Tensor or a LastProduct, got {type(static_output).__name__}"
        )
    return _Captured(graph, static_input, static_output, variant)
