"""Where a step's time goes: phase marks that cost no host sync.

[Note: the step profile]

``StepOptions(profile=True)`` splits every ``step()`` into phases that cover it from its first
line to its last: the checks and pre-step hooks, waiting for the gradient reduces, the non-finite check, each Newton–Schulz call (one per shape batch, named by its
shape), the Muon update, AdamW, and the publish of the owners' updates (HSDP and the replicated
path). A phase is the span between two marks. On CUDA a mark is an event recorded on the
current stream, so marking never waits for the device; the times are read (and the events synchronised) only
when someone asks, by ``Muon.step_profile()``. On CPU a mark is the host clock, and with gloo's
synchronous kernels that is the phase's cost. Marking changes no arithmetic, so a profiled run
computes the same bits as an unprofiled one.

Hooks time their forward waits the same way (``collect_forward_unshard_profile``): per
boundary, the span of waiting for its broadcasts before its forward. The model's hooks time
them for the ``Muon`` built last with the profile, while it lives: once it is freed (or a
``Muon`` without the profile is built on the model) the forwards record nothing and the
waits read ``None``, as a profiled optimizer deleted would otherwise leave a mark per boundary
in every later forward (an event on CUDA).

[Note: profiler ranges]
The hooks, the reduce queue and the step name their work for ``torch.profiler`` traces
("dmuon::pre_forward", "dmuon::reduce", ...) through :func:`span`. ``record_function`` costs
about 20 µs of host time per use even when no profiler runs, and a step of a 30-layer model
enters some 200 of them; so ``span`` opens one only while a profiler is running (one cheap
query), and otherwise nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Any

import torch
from torch.autograd.profiler import record_function

from ._torch_internals import profiler_enabled

__all__ = ["PhaseTimer", "no_mark", "span"]

_NOTHING = contextlib.nullcontext()


def span(name: str) -> contextlib.AbstractContextManager[Any]:
    """A ``torch.profiler`` range named ``name`` while a profiler runs, else a no-op (see
    [Note: profiler ranges])."""
    if profiler_enabled():
        return record_function(name)
    return _NOTHING


def no_mark(name: str) -> None:
    """The ``mark`` of a step without the step profile: closes no phase."""
    return None


class PhaseTimer:
    """Marks on one device; :meth:`phases` sums the spans between consecutive marks by the
    name of the mark that closes each span."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks: list[tuple[str, Any]] = []

    def start(self) -> None:
        self._marks.clear()
        self.mark("")

    def mark(self, name: str) -> None:
        """Close the phase running since the previous mark, naming it ``name``."""
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append((name, event))
        else:
            self._marks.append((name, time.perf_counter()))

    def phases(self) -> dict[str, float]:
        """Milliseconds per phase name (waits for the recorded events on CUDA)."""
        out: dict[str, float] = defaultdict(float)
        for (_, start), (name, end) in zip(self._marks, self._marks[1:]):
            if self._cuda:
                end.synchronize()
                out[name] += start.elapsed_time(end)
            else:
                out[name] += (end - start) * 1e3
        return dict(out)
