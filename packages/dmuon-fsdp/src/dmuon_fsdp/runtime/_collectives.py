"""The collectives dmuon issues: free functions, streams and groups in, a small result out.

The group and the hooks decide *when* a collective runs; this module decides *how*: the
broadcast of a pack, and the whole way of a gradient to its owner (pack, shard-axis reduce,
replicate-axis reduce, divide, the owner's ``.grad``). It is the one place that records the
bytes issued per mesh axis (:class:`~._comm.CommCounter`), so tests and diagnostics read the
same numbers the wire carried.

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

[Note: gradient reduction]

A pack's gradient is reduced when every one of its parameters has its local gradient
(``register_post_accumulate_grad_hook``) and the packs before it in its boundary's order have
left, or at the boundary's reduce point (the end of backward where it has none) for
parameters that got none: they count as zero (see [Note: reduce points] in :mod:`._order`).
The local gradients are copied into one flat buffer, the parameters' ``.grad`` is dropped
(FSDP2, AdamW and ``torch.nn.utils.clip_grad_norm_`` never see it), and the buffer is summed
over the shard group into the row's sender (stage one), then, in HSDP, over the sender's
shard column into the global owner (stage two), which divides once by
``G · R``. Summing first and dividing once at the end makes the result independent of Z2/Z3
and of sync/async publish; the only thing that changes it is the summation order of the reduce
itself (1-D vs HSDP).

The divisor is FSDP2's: where ``set_gradient_divide_factor`` gave the ``fully_shard`` module
that holds a parameter a factor (torchtitan sets 1.0 on every module and divides its loss by
the global token count instead), its gradient is divided by that factor, as FSDP2 divides the
module's own gradients; otherwise by ``G · R``, FSDP2's default. A gradient averaged while
FSDP2's are summed would be ``G · R`` times too small beside them: Muon's update would not
notice, but a clip over both routes, or the norm it reports, would (``DedicatedRuntime``
finds the module, see its ``_grad_divisors``).

[Note: a parameter without a gradient]

As ``torch.optim`` leaves a parameter whose ``.grad`` is ``None`` untouched (no momentum, no
weight decay), an owner sets ``DedicatedParam.grad`` only for a parameter that got a gradient
on some rank: a frozen one (``requires_grad=False``) or one no rank's forward used keeps its
weight and momentum bit for bit. A pack still travels whole (its missing gradients as zeros),
so that every rank issues the same collectives whatever its own backward reached, and behind
its gradients it carries one presence flag per parameter (1 where this rank's backward gave
the parameter a local gradient since its last reduce, ``DedicatedParam.saw_grad``), summed
with them: positive on the owner iff some rank used the parameter. The owner decides from
its own backward where it can: a parameter it saw itself is present. One it did not see but
that can train (an expert no token reached on the owner only, a branch only some ranks took)
is decided by the flag, which only the device knows: the owner keeps such a gradient aside,
and ``ReduceQueue.wait_all`` reads every flag kept aside in one host copy (the one host
synchronisation of this path, paid only by an owner with a trainable parameter it did not
see) before it adds the gradients that are present. Kept in order per parameter: once one
of its gradients waits for its flag, its later ones (a second backward before the step)
wait too, so that they add in the order of the backwards.

Pending reductions wait in one :class:`ReduceQueue`, in the order their packs completed. Stage
two is issued at deterministic points (never "when stage one happens to be done"), so every
member of a shard column issues the same sequence even when that group is shared with FSDP2
(``process_group_policy="shared"``): each new submission issues stage two of every queued
reduction but the newest (whose stage one was issued one pack earlier, so waiting for it rarely
blocks on CPU and never blocks the host on CUDA); the end of backward and
:meth:`ReduceQueue.wait_all` issue the rest.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from .._profile import span
from .._torch_internals import foreach_copy_, local_shard
from ..holder import DedicatedParam, Role
from ..topology import Axis, CommCounter, CommKind, DedicatedCommContext
from ._pack import Pack

__all__ = [
    "AllReduceQueue",
    "CollectiveResult",
    "Divisors",
    "GradListener",
    "PendingReduce",
    "ReduceQueue",
    "ReplicatedBucket",
    "all_reduce_sum",
    "broadcast",
    "finish_reduce",
    "keep_local_grads",
    "pack_grads",
    "reduce_over_replicas",
    "reduce_over_shards",
    "reduce_sum",
    "wait",
]

# What the owner divides a pack's summed gradients by: one number, or one per parameter (see
# [Note: gradient reduction]).
Divisors = Callable[[Pack], "float | list[float]"]


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
    return CollectiveResult(tensor, None, _event_after(stream))


def _event_after(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


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


def all_reduce_sum(
    tensor: torch.Tensor,
    group: ProcessGroup,
    stream: torch.cuda.Stream | None,
    counter: CommCounter,
    axis: Axis,
) -> CollectiveResult:
    """Sum ``tensor`` over ``group`` in place, on every rank."""
    counter.record(axis, CommKind.ALL_REDUCE, tensor.numel() * tensor.element_size())
    return _issue(tensor, stream, "all_reduce", op=dist.ReduceOp.SUM, group=group)


def wait(result: CollectiveResult) -> torch.Tensor:
    """Make the current stream (CUDA) or the host (CPU) wait until ``result.tensor`` is valid."""
    if result.work is not None:
        result.work.wait()
    if result.event is not None:
        torch.cuda.current_stream(result.tensor.device).wait_event(result.event)
    return result.tensor


def _wait_before_issue(result: CollectiveResult, stream: torch.cuda.Stream | None) -> torch.Tensor:
    """Order a follow-up collective on ``stream`` after ``result``: a stream wait on CUDA, a
    host wait on CPU (the caller only issues once ``result`` has completed there)."""
    if result.work is not None:
        result.work.wait()
    if result.event is not None and stream is not None:
        stream.wait_event(result.event)
    return result.tensor


# -- gradients: see [Note: gradient reduction] ----------------------------------------------------


class PendingReduce(NamedTuple):
    """One pack's gradient on its way to the global owner."""

    pack: Pack
    result: CollectiveResult  # the last stage issued
    needs_replicate_stage: bool  # HSDP sender whose stage two is not issued yet
    # Per parameter of the pack: whether this rank's backward gave it a local gradient.
    seen: tuple[bool, ...]


def pack_grads(pack: Pack, stream: torch.cuda.Stream | None) -> torch.Tensor:
    """Copy the local gradients of ``pack`` into one new flat buffer in their reduce dtype
    (zeros for a parameter without one), followed by the pack's presence flags (see [Note: a
    parameter without a gradient]), and drop the parameters' ``.grad``. On CUDA the copy
    runs on ``stream``."""
    grads = [(dp.numel, dp.take_local_grad()) for dp in pack.params]
    flags = [grad is not None for _, grad in grads]
    return _flatten_with_flags(grads, flags, _reduce_dtype(pack), pack.buffer.device, stream)


def _flatten_with_flags(
    grads: Sequence[tuple[int, torch.Tensor | None]],
    flags: Sequence[bool],
    dtype: torch.dtype,
    device: torch.device,
    stream: torch.cuda.Stream | None,
) -> torch.Tensor:
    """One new buffer for one collective: the gradients (``(numel, grad)`` each, zeros for a
    ``None`` one) one after the other, then a flag per gradient, 1 where ``flags`` says so,
    else 0. On CUDA the copy runs on ``stream``, after the current stream's work."""
    sizes = [size for size, _ in grads]
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        flat = torch.empty(sum(sizes) + len(grads), dtype=dtype, device=device)
        *outs, marks = flat.split([*sizes, len(grads)])
        marks.fill_(1)
        targets, sources = [], []
        for index, (out, (_, grad), flag) in enumerate(zip(outs, grads, flags, strict=True)):
            if grad is None:
                out.zero_()
            else:
                targets.append(out)
                sources.append(grad.reshape(-1))
                if stream is not None:
                    grad.record_stream(stream)
            if not flag:
                marks[index].zero_()
        # One launch for every copy (a copy_ each cost a launch per gradient; same bits).
        if targets:
            foreach_copy_(targets, sources)
    return flat


def reduce_over_shards(pack: Pack, comm: DedicatedCommContext) -> PendingReduce:
    """Stage one: sum the pack's local gradients over the shard group into the row's sender."""
    flat = pack_grads(pack, comm.reduce_stream)
    # Recorded per reduce: a second backward before the step submits the pack again.
    seen = tuple(dp.saw_grad for dp in pack.params)
    for dp in pack.params:
        dp.saw_grad = False
    if comm.layout.shard_size > 1:
        result = reduce_sum(
            flat, pack.sender, comm.shard_group, comm.reduce_stream, comm.counter, Axis.SHARD
        )
    else:
        result = CollectiveResult(flat, None, _event_after(comm.reduce_stream))
    return PendingReduce(pack, result, comm.layout.replicate_size > 1 and pack.is_sender, seen)


def reduce_over_replicas(pending: PendingReduce, comm: DedicatedCommContext) -> PendingReduce:
    """Stage two (HSDP): sum the row sender's partial sum over its shard column into the global
    owner."""
    assert pending.needs_replicate_stage and comm.replicate_group is not None
    stream = comm.replicate_reduce_stream
    flat = _wait_before_issue(pending.result, stream)
    result = reduce_sum(
        flat, pending.pack.owner_rank, comm.replicate_group, stream, comm.counter, Axis.REPLICATE
    )
    return pending._replace(result=result, needs_replicate_stage=False)


def finish_reduce(pending: PendingReduce, divisors: Divisors, undecided: Undecided) -> None:
    """Wait for the last stage and, on the global owner, add the sum divided by its divisor to
    the ``DedicatedParam.grad`` of each parameter this rank's backward gave a gradient (a view
    of the reduced buffer when it was unset); a trainable parameter it did not see waits in
    ``undecided`` for its presence flag (see [Note: a parameter without a gradient])."""
    assert not pending.needs_replicate_stage
    flat = wait(pending.result)
    pack = pending.pack
    if pack.role is not Role.OWNER:
        return
    grads = flat[: pack.numel]
    divisor = divisors(pack)
    if isinstance(divisor, list):
        for dp, by in zip(pack.params, divisor):
            grads[dp.offset : dp.offset + dp.numel].div_(by)
    else:
        grads.div_(divisor)
    for index, (dp, saw) in enumerate(zip(pack.params, pending.seen)):
        grad = grads[dp.offset : dp.offset + dp.numel].view(dp.local_shape)
        if dp in undecided:
            undecided.add(dp, grad, None if saw else flat[pack.numel + index])
        elif saw:
            dp.accumulate_grad(grad)
        elif dp.param.requires_grad:
            undecided.add(dp, grad, flat[pack.numel + index])


class Undecided:
    """The owner's reduced gradients that wait for their presence flag, in arrival order
    (``flag`` ``None``: present, but after one that waits); see [Note: a parameter without
    a gradient]."""

    def __init__(self) -> None:
        self._entries: list[tuple[DedicatedParam, torch.Tensor, torch.Tensor | None]] = []
        self._params: set[int] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, dp: DedicatedParam) -> bool:
        return id(dp) in self._params

    def add(self, dp: DedicatedParam, grad: torch.Tensor, flag: torch.Tensor | None) -> None:
        self._entries.append((dp, grad, flag))
        self._params.add(id(dp))

    def decide(self) -> None:
        """Read the flags (one host copy) and add each gradient some rank produced."""
        if not self._entries:
            return
        flags = [flag for _, _, flag in self._entries if flag is not None]
        used = iter((torch.stack(flags) > 0).tolist())
        for dp, grad, flag in self._entries:
            if flag is None or next(used):
                dp.accumulate_grad(grad)
        self._entries.clear()
        self._params.clear()


def _reduce_dtype(pack: Pack) -> torch.dtype:
    precision = pack.params[0].precision
    assert precision is not None
    return precision.reduce


def keep_local_grads(pack: Pack, divisors: Divisors) -> None:
    """A world of one rank: the local gradient is already the average, so it becomes
    ``DedicatedParam.grad`` without a copy (unless its reduce dtype differs, or FSDP2's
    gradient divide factor is not 1; ``.grad`` is still dropped). A parameter without one keeps
    its ``DedicatedParam.grad`` (see [Note: a parameter without a gradient])."""
    dtype = _reduce_dtype(pack)
    divisor = divisors(pack)
    by = divisor if isinstance(divisor, list) else [divisor] * len(pack.params)
    for dp, d in zip(pack.params, by):
        grad = dp.take_local_grad()
        if grad is not None:
            if grad.dtype != dtype:  # .to would return it as it is (0.7 µs a call on the host)
                grad = grad.to(dtype)
            dp.accumulate_grad(grad if d == 1 else grad / d)


class GradListener(Protocol):
    """Told during backward which parameters' gradients are final (see [Note: gradients
    final during backward]); ``stream`` is where those reduces are finished on CUDA."""

    stream: torch.cuda.Stream | None

    def __call__(self, params: Sequence[DedicatedParam]) -> None: ...


class ReduceQueue:
    """The pending gradient reductions of one runtime, in submission order (FIFO).

    [Note: gradients final during backward]
    Without a listener the owners' gradients become final in ``wait_all`` (the step). With
    one (``Muon(options=StepOptions(ns_overlap=True))``), each submission also finishes every
    older reduction whose last stage is issued (never the newest, which was issued just now:
    on CPU finishing it would block backward until it lands; on CUDA it is finished on the
    listener's stream, which waits for the reduce's event, so backward never waits), then
    tells the listener the parameters of those packs. It only finishes sooner what
    ``wait_all`` would finish: the same division, the same ``.grad``, the same collectives in
    the same order on every rank (stage two is issued exactly as without a listener).

    The queue holds its listener weakly: an optimizer deleted (``del optimizer``) is freed with
    its early results and stops hearing, as if it had never listened."""

    def __init__(self, comm: DedicatedCommContext, divisors: Divisors) -> None:
        self._comm = comm
        self._divisors = divisors
        self._pending: deque[PendingReduce] = deque()
        # How many of them wait for stage two (each call of issue_replicate_stages issues all
        # but at most the newest).
        self._unstaged = 0
        self._undecided = Undecided()
        self._listener: weakref.ref[GradListener] | None = None
        # The CUDA stream older reduces were finished on since the last wait_all (kept here:
        # the listener that owns it may be freed before the step waits for it).
        self._finished_on: torch.cuda.Stream | None = None

    @property
    def listener(self) -> GradListener | None:
        """The listener (see [Note: gradients final during backward]), ``None`` once freed."""
        return None if self._listener is None else self._listener()

    @listener.setter
    def listener(self, listener: GradListener | None) -> None:
        self._listener = None if listener is None else weakref.ref(listener)

    def __len__(self) -> int:
        return len(self._pending) + len(self._undecided)

    def submit(self, pack: Pack) -> None:
        """Start reducing ``pack``'s local gradients towards its owner."""
        with span("dmuon::reduce"):
            if self._comm.layout.world_size == 1:
                keep_local_grads(pack, self._divisors)
                listener = self.listener
                if listener is not None:
                    listener(pack.params)
                return
            pending = reduce_over_shards(pack, self._comm)
            self._pending.append(pending)
            self._unstaged += pending.needs_replicate_stage
            self.issue_replicate_stages(keep_newest=True)
        listener = self.listener
        if listener is not None:
            self._finish_older(listener)

    def _finish_older(self, listener: GradListener) -> None:
        """See [Note: gradients final during backward]."""
        while len(self._pending) > 1 and not self._pending[0].needs_replicate_stage:
            pending = self._pending.popleft()
            stream = listener.stream
            if stream is not None:
                pending.result.tensor.record_stream(stream)
                self._finished_on = stream
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                finish_reduce(pending, self._divisors, self._undecided)
            listener(pending.pack.params)

    def issue_replicate_stages(self, *, keep_newest: bool = False) -> None:
        """Issue stage two of the queued reductions that need it, oldest first; with
        ``keep_newest`` the newest of them waits for the next call (see [Note: gradient
        reduction]). The waiting ones are the newest that need it, so only the queue's end is
        read: a backward's submissions cost time linear in its packs, not quadratic."""
        due: list[int] = []
        index = len(self._pending)
        while len(due) < self._unstaged:
            index -= 1
            if self._pending[index].needs_replicate_stage:
                due.insert(0, index)
        if keep_newest:
            due = due[:-1]
        for index in due:
            self._pending[index] = reduce_over_replicas(self._pending[index], self._comm)
            self._unstaged -= 1

    def wait_all(self) -> None:
        """Finish every pending reduction: owned gradients are final afterwards."""
        self.issue_replicate_stages()
        while self._pending:
            finish_reduce(self._pending.popleft(), self._divisors, self._undecided)
        stream, self._finished_on = self._finished_on, None
        if len(self._undecided):
            if stream is not None:
                # Some flags were finished on the listener's stream.
                torch.cuda.current_stream(stream.device).wait_stream(stream)
            self._undecided.decide()


class ReplicatedBucket(NamedTuple):
    """The replicated parameters of one boundary on the replicated path, all-reduced together
    once its backward is done (see [Note: replicated parameters a rank left out])."""

    params: list[torch.Tensor]


class _SentBucket(NamedTuple):
    params: list[torch.Tensor]
    new: list[bool]  # whether this rank sent a gradient of this backward for each
    numel: int
    result: CollectiveResult


class AllReduceQueue:
    """Gradients of replicated parameters being summed over the shard group (the replicated
    path's counterpart of DDP's buckets), averaged when waited: at the end of the backward
    that issued them (``BoundaryHooks.hook_replicated``). A parameter outside every boundary
    goes alone, in place, as soon as its gradient is in; a boundary's go in one bucket per
    dtype.

    [Note: replicated parameters a rank left out]
    A boundary's replicated parameters (its norms and biases) travel in one flat buffer per
    dtype, the same on every rank whatever each rank's forward used: each parameter's
    ``.grad`` (zeros where it has none), and behind them one presence flag each (1 where this
    backward, or ``no_sync`` micro-batches before it, gave this rank a new gradient), summed
    with them. Waited, a parameter this rank flagged gets the average. One it did not flag is
    decided by the flags' sum, read in one host copy (paid only by a rank that holds such a
    parameter): the average where some rank flagged it; otherwise its ``.grad`` stays as it
    was: ``None`` where no rank used it, as DDP leaves it, or the average an earlier synced
    backward left (every rank holds it alike, so it is never averaged twice)."""

    def __init__(self, comm: DedicatedCommContext) -> None:
        self._comm = comm
        self._pending: list[CollectiveResult] = []
        self._buckets: list[_SentBucket] = []
        # Parameters (ids) whose whole gradient went again after their bucket (a late one):
        # the bucket does not write them.
        self._resent: set[int] = set()

    def submit(self, grad: torch.Tensor, resends: torch.Tensor | None = None) -> None:
        """All-reduce ``grad`` in place; ``resends``: the parameter whose bucket carried an
        earlier part of it (see [Note: reduce points] in :mod:`._order`)."""
        if resends is not None:
            self._resent.add(id(resends))
        grad = local_shard(grad)
        comm = self._comm
        if comm.layout.shard_size == 1:
            return
        stream = comm.reduce_stream
        if stream is not None:
            grad.record_stream(stream)
        self._pending.append(
            all_reduce_sum(grad, comm.shard_group, stream, comm.counter, Axis.SHARD)
        )

    def submit_bucket(self, bucket: ReplicatedBucket, new: Sequence[bool]) -> None:
        """All-reduce ``bucket``'s gradients (zeros where a parameter has none) and presence
        flags (``new``: whether this rank sends a gradient of this backward for each); see
        [Note: replicated parameters a rank left out]."""
        comm = self._comm
        if comm.layout.shard_size == 1:
            return  # one rank: each gradient is its own average already
        by_dtype: dict[torch.dtype, list[int]] = {}
        for index, param in enumerate(bucket.params):
            by_dtype.setdefault(param.dtype, []).append(index)
        for dtype, indices in by_dtype.items():
            params = [bucket.params[i] for i in indices]
            flags_of = [new[i] for i in indices]
            self._buckets.append(self._issue_bucket(params, flags_of, dtype))

    def _issue_bucket(
        self, params: list[torch.Tensor], new: list[bool], dtype: torch.dtype
    ) -> _SentBucket:
        comm = self._comm
        grads = [
            (local_shard(p).numel(), None if p.grad is None else local_shard(p.grad))
            for p in params
        ]
        device = local_shard(params[0]).device
        stream = comm.reduce_stream
        flat = _flatten_with_flags(grads, new, dtype, device, stream)
        copied = _event_after(stream)
        if copied is not None:
            # A late gradient adds to .grad in place: not before the copy has read it.
            torch.cuda.current_stream(device).wait_event(copied)
        result = all_reduce_sum(flat, comm.shard_group, stream, comm.counter, Axis.SHARD)
        numel = flat.numel() - len(params)
        return _SentBucket(params, list(new), numel, result)

    def discard(self) -> None:
        """Wait for what is in flight and write none of it (``zero_grad`` after a backward
        that was thrown away)."""
        for result in self._pending:
            wait(result)
        for bucket in self._buckets:
            wait(bucket.result)
        self._pending.clear()
        self._buckets.clear()
        self._resent.clear()

    def wait_all(self) -> None:
        divisor = self._comm.layout.shard_size
        for result in self._pending:
            wait(result).div_(divisor)
        self._pending.clear()
        undecided: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for bucket in self._buckets:
            flat = wait(bucket.result)
            flat[: bucket.numel].div_(divisor)
            flags = flat[bucket.numel :]
            offset = 0
            for index, (param, sent) in enumerate(zip(bucket.params, bucket.new)):
                local = local_shard(param)
                value = flat[offset : offset + local.numel()].view(local.shape)
                offset += local.numel()
                if id(param) in self._resent:
                    continue  # its whole gradient went again, and is averaged above
                if sent:
                    _set_grad(param, value)
                else:
                    undecided.append((param, value, flags[index]))
        self._buckets.clear()
        self._resent.clear()
        if undecided:
            used = (torch.stack([flag for _, _, flag in undecided]) > 0).tolist()
            for (param, value, _), some_rank_sent in zip(undecided, used):
                if some_rank_sent:
                    _set_grad(param, value)


def _set_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Make ``value`` (this rank's part) ``param``'s gradient: copied into the one it has, or,
    where it has none, a new one (a DTensor like ``param`` where it is one)."""
    if param.grad is not None:
        local_shard(param.grad).copy_(value)
    elif isinstance(param, DTensor):
        param.grad = DTensor.from_local(
            value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
    else:
        param.grad = value
