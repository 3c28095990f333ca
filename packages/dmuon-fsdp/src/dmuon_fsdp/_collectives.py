"""The collectives dmuon issues: free functions, streams and groups in, a small result out.

The group modules decide *when* a collective runs; this module decides *how*, and it is the one
place that counts the bytes issued per mesh axis (:class:`CommCounter`), so tests and
diagnostics read the same numbers the wire carried.

[Note: issuing on CPU and on CUDA]

On CUDA a collective runs with ``async_op=False`` inside a dedicated comm stream that first
waits for the issuing (compute) stream; the NCCL process group then orders its kernel on that
stream without blocking the host, and an event recorded on the comm stream afterwards is what
consumers wait on (``current_stream().wait_event``): no host synchronisation on the hot path.
A buffer that a collective writes is allocated inside the comm stream by the caller, so the
caching allocator associates it with that stream; a comm stream always waits for the compute
stream before it issues, which orders a reuse of freed memory after every read of it that was
queued before the free (FSDP2 relies on the same ordering).

On CPU (gloo) there are no streams: the same call is issued with ``async_op=True`` and the
returned work handle is waited on instead of an event.
"""

from __future__ import annotations

from collections import defaultdict
from enum import StrEnum
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "Axis",
    "CollectiveResult",
    "CommCounter",
    "CommKind",
    "broadcast",
    "reduce_sum",
    "wait",
]


class Axis(StrEnum):
    """The mesh axis a collective runs on."""

    SHARD = "shard"
    REPLICATE = "replicate"


class CommKind(StrEnum):
    """What a collective is for; SPEC section 1 counts bytes per kind and axis."""

    BROADCAST = "broadcast"  # owner -> shard peers, before forward / backward
    REDUCE = "reduce"  # gradient sum towards the owner
    PUBLISH = "publish"  # HSDP: updated weight, global owner -> replicate peers


class CommCounter:
    """Payload bytes and call counts of every collective issued, keyed by (axis, kind).

    The payload of a broadcast or reduce is the size of the tensor it carries (what SPEC
    section 1 calls one element travelling once per round); the wire cost per rank is that
    times (n - 1) / n for a group of n ranks, which callers derive themselves.
    """

    def __init__(self) -> None:
        self._bytes: dict[tuple[Axis, CommKind], int] = defaultdict(int)
        self._calls: dict[tuple[Axis, CommKind], int] = defaultdict(int)

    def record(self, axis: Axis, kind: CommKind, nbytes: int) -> None:
        self._bytes[(axis, kind)] += nbytes
        self._calls[(axis, kind)] += 1

    def bytes(self, axis: Axis | str, kind: CommKind | str | None = None) -> int:
        """Bytes issued on ``axis`` (of one ``kind``, or of every kind when ``None``)."""
        axis = Axis(axis)
        if kind is None:
            return sum(v for (a, _), v in self._bytes.items() if a is axis)
        return self._bytes.get((axis, CommKind(kind)), 0)

    def calls(self, axis: Axis | str, kind: CommKind | str) -> int:
        return self._calls.get((Axis(axis), CommKind(kind)), 0)

    def reset(self) -> None:
        self._bytes.clear()
        self._calls.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        """JSON-friendly ``{"shard/broadcast": {"bytes": ..., "calls": ...}, ...}``."""
        return {
            f"{axis}/{kind}": {
                "bytes": self._bytes[(axis, kind)],
                "calls": self._calls[(axis, kind)],
            }
            for (axis, kind) in sorted(self._bytes)
        }


class CollectiveResult(NamedTuple):
    """The tensor a collective fills, and what to wait on before reading it: ``work`` on CPU,
    ``event`` on CUDA (exactly one of them is set; neither when no collective was needed)."""

    tensor: torch.Tensor
    work: dist.Work | None
    event: torch.cuda.Event | None


def _issue(
    tensor: torch.Tensor,
    stream: torch.cuda.Stream | None,
    call: str,
    **kwargs: object,
) -> CollectiveResult:
    fn = getattr(dist, call)
    if stream is None:
        work = fn(tensor, async_op=True, **kwargs)
        return CollectiveResult(tensor, work, None)
    # See [Note: issuing on CPU and on CUDA].
    stream.wait_stream(torch.cuda.current_stream(tensor.device))
    with torch.cuda.stream(stream):
        fn(tensor, async_op=False, **kwargs)
        event = torch.cuda.Event()
        event.record(stream)
    return CollectiveResult(tensor, None, event)


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group: ProcessGroup,
    stream: torch.cuda.Stream | None,
    counter: CommCounter,
    axis: Axis,
    kind: CommKind = CommKind.BROADCAST,
) -> CollectiveResult:
    """Broadcast ``tensor`` in place from global rank ``src`` over ``group``."""
    counter.record(axis, kind, tensor.numel() * tensor.element_size())
    return _issue(tensor, stream, "broadcast", src=src, group=group)


def reduce_sum(
    tensor: torch.Tensor,
    dst: int,
    group: ProcessGroup,
    stream: torch.cuda.Stream | None,
    counter: CommCounter,
    axis: Axis,
) -> CollectiveResult:
    """Sum ``tensor`` over ``group`` in place into global rank ``dst`` (others: undefined)."""
    counter.record(axis, CommKind.REDUCE, tensor.numel() * tensor.element_size())
    return _issue(tensor, stream, "reduce", dst=dst, op=dist.ReduceOp.SUM, group=group)


def wait(result: CollectiveResult) -> torch.Tensor:
    """Make the current stream (CUDA) or the host (CPU) wait until ``result.tensor`` is valid."""
    if result.work is not None:
        result.work.wait()
    if result.event is not None:
        torch.cuda.current_stream(result.tensor.device).wait_event(result.event)
    return result.tensor
