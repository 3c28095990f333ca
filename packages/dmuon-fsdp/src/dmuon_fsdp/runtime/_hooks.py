"""The hooks of the hook boundaries and of the parameters' gradients, and the forward order
they prefetch by; [Note: hooks and prefetch] lists every hook dmuon registers, those
``dedicate_params`` and ``replicate`` register for torch's paths too.

[Note: hooks and prefetch]

Per hook boundary (a module): a forward pre-hook (wait for this boundary's broadcast, launched
by the previous boundary's prefetch or now; launch the next boundary's; pass the forward's
inputs through the boundary's reduce point), a forward hook (Z3: free; register a hook on
every output that requires grad, the first of which to fire is the boundary's pre-backward),
and per dedicated parameter a post-accumulate-grad hook (count the pack's gradients; a
complete pack leaves in the boundary's order, a boundary whose packs all left is freed). The
reduce point's backward sends what is left of the boundary (see [Note: reduce points] in
:mod:`._order`). Each module that holds a dedicated parameter also gets a state-dict
pre-hook (see [Note: state dicts see the parameters]) and the refusals of torch's paths
([Note: torch's paths that cannot reach a dedicated weight] in holder/_guard):
``_fqn_modifiers``, and on the sharded path a load pre-hook and, with more than one rank per
shard group, a state-dict pre-hook. On the replicated path each replicated parameter gets a
post-accumulate-grad hook (``hook_replicated``), every module a load pre-hook that refuses
``assign=True`` ([Note: loads that replace parameters] in setup/_replicate), and each module
that holds dedicated parameters a load pre- and post-hook for the owners' masters. The first
pre-backward of a backward pass queues a final callback on the autograd engine that sends what
no reduce point sent, frees what is left, and issues the last replicate-axis reductions.

[Note: a backward that raised]
When backward raises (a hook's error, an out-of-memory), the autograd engine drops the
callbacks queued on it, so the final callback never runs. Its flag would stay set and no later
backward would queue another: a pack holding a parameter without a gradient (unused, frozen, an
expert that got no tokens) would never be reduced again, and every matrix of that pack would
silently stop training. So the first forward pre-hook of the next forward (never a recompute,
which runs inside backward) sees the flag still set, drops it, resets every boundary's backward
counters and frees what the aborted backward gathered. What the aborted backward had reduced
already stays in the owners' gradients, as FSDP2 keeps the shards it reduce-scattered: the
recovery is FSDP2's (``model.reset_iter_state()`` on the root), then ``optimizer.zero_grad()``.

[Note: a forward that raised]
A forward that raised (an out-of-memory, a bad batch failing inside a layer) leaves the
boundary it raised in gathered, and the next one gathering (its prefetch): no post-forward
hook frees them. The next forward would reuse them, but until then every peer keeps them, also
through a retry with a smaller batch, where they add to its peak. So ``zero_grad`` (which
every rank calls alike, and which the recovery of [Note: a backward that raised] includes)
releases what an iteration an exception cut short left: a forward whose boundaries did not
all finish, or a backward whose final callback is still due. Each frees its gathered weights
(waiting for broadcasts in flight, which every rank issued alike) and resets the backward
counters; the forward order recorded before stays. Outside such an iteration it does nothing
(a ``zero_grad`` between a forward and its backward keeps Z2's gathered weights).

That leaves the iteration ``zero_grad`` cannot tell from one whose backward is still to come:
under Z2 a forward that ran to its end keeps every boundary's weights for its backward, and a
loss that then raised (or a backward that raised before it reached a boundary) left them
gathered on every peer until the next forward or step. FSDP2's own recovery,
``model.reset_iter_state()`` on the root, tells: its user calls it on every rank after the
exception, and it reshards every FSDP2 parameter group, Z2's gathered ones included. So once
the model is a ``fully_shard`` root (checked at ``lazy_init``), its ``reset_iter_state`` is
wrapped, on that instance, to call FSDP2's and then reset dmuon's iteration the same way,
unconditionally: every boundary freed, the backward counters and the end-of-backward flag
reset. The recovery the docs give (``reset_iter_state``, then ``zero_grad``) then leaves no
dedicated weight gathered on a peer, whatever raised.

[Note: compiled autograd]
torch's compiled autograd cannot run dmuon's backward: its capture turns every leaf of the
graph into a fake tensor, reading each dedicated weight, which a peer does not hold between
forward and backward (Z3), and the captured graph calls the hooks, whose first queues the final
callback, which the autograd engine refuses inside a compiled-autograd graph (Z2). Those two
places alone would not refuse on every rank alike: the rank that holds every weight a graph
reads (one owner of a small model) passes the capture and runs the captured graph, where
FSDP2's pre-backward hook of the root, which runs before any of dmuon's, all-gathers the next
layer and waits for the peers that raised. So the refusal comes first from a point that every
rank reaches with the same graph and that issues nothing: before capturing, compiled autograd
asks every custom autograd node of the graph for its cache key (eager autograd never does),
and a boundary whose forward inputs need a gradient puts one of dmuon's there, its reduce
point, whose key raises one error that names compiled autograd. The two later checks stay for a
graph without one (a single boundary fed inputs that need no gradient, such as one layer after
a frozen embedding; the capture's own error then carries dmuon's as its cause). A marker on
such a boundary's outputs would cover it, but a custom function's outputs are views of its
inputs, which FSDP2 warns of (an in-place operation on one drops its pre-backward hook). Every
place raises before a hook changes anything: the recovery is that of [Note: a backward that
raised].

Prefetch follows the forward order recorded by the previous forward (the first forward has no
prefetch): forward prefetches the next boundary, backward the previous one. All ranks run the
same model, so every rank issues the same collectives in the same order; a boundary used in a
different order than recorded only costs a broadcast issued early, never a wrong weight.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._profile import PhaseTimer, span
from .._torch_internals import (
    active_ddp,
    compiled_autograd_on,
    ddp_reduced_params,
    disable_dynamo,
    in_backward,
    local_shard,
    queue_backward_callback,
    refused_by_compiled_autograd,
    tree_leaves,
    tree_map_tensors,
    will_run,
)
from ..holder import DedicatedParam, compiled_autograd_error, refuse_accelerate_clip
from ._collectives import AllReduceQueue, ReduceQueue, ReplicatedBucket
from ._group import DedicatedGroup
from ._order import ReduceOrder
from ._pack import Pack

__all__ = ["BoundaryHooks", "replicated_payload"]


class BoundaryHooks:
    """Owns the hook handles of one runtime and the state the hooks share.

    ``reduce_queue`` receives each pack whose local gradients are complete;
    ``reshard_after_forward`` is Z3 (``True``) or Z2; ``requires_gradient_sync`` is ``False``
    inside ``no_sync`` (see [Note: the step protocol] in :mod:`._runtime`), and
    ``fsdp_sync_off`` says whether FSDP2's own gradient sync is off on the whole model (see
    [Note: FSDP2's gradient sync] in :mod:`._no_sync`).
    """

    def __init__(
        self,
        groups: Sequence[DedicatedGroup],
        params: Sequence[DedicatedParam],
        reduce_queue: ReduceQueue,
        *,
        reshard_after_forward: bool,
        on_first_forward: Callable[[], None],
        check_alive: Callable[[], None],
        fsdp_sync_off: Callable[[], bool],
        tied_modules: Mapping[str, Sequence[nn.Module]] | None = None,
    ) -> None:
        self.groups = list(groups)
        self.params = list(params)
        self.reduce_queue = reduce_queue
        self.reshard_after_forward = reshard_after_forward
        self.requires_gradient_sync = True
        self._fsdp_sync_off = fsdp_sync_off
        # Whether the backward under way reduces: both flags, read once at its first hook.
        self._syncing = True
        # Whether a backward accumulated a dedicated gradient since the last step's check (see
        # [Note: a gradient set by hand] in :mod:`._runtime`).
        self.accumulated = False
        # Whether the backward under way creates a graph (create_graph=True): see [Note: a
        # backward that creates a graph].
        self._creates_graph = False
        # The last backward ran under no_sync and no synced one followed: its gradients are
        # accumulated on each rank but not reduced (see [Note: a step after no_sync]).
        self.unsynced_backward = False
        # A pipeline schedule ended its backward with gradient sync back on (FSDP2's
        # post-backward run by hand): the next step reduces what the backwards under no_sync
        # accumulated (see [Note: the pipeline schedule's reduce] in :mod:`._runtime`).
        self.reduce_due = False
        # A backward ended on this rank since the last step (``after_step`` clears it): the
        # refusal of a step that finds FSDP2's weights gathered tells an evaluation after
        # backward from a rank that ran no backward at all (its data ran out first).
        self.backward_since_step = False
        # The boundaries (indices) a backward under no_sync reached since the last synced one:
        # see [Note: boundaries the synced backward does not reach].
        self._unsynced: set[int] = set()
        self._on_first_forward = on_first_forward
        # Raises where the process groups were destroyed since (see [Note: a destroyed process
        # group] in topology._comm): every forward checks it first.
        self._check_alive = check_alive
        self.wait_timers: dict[str, PhaseTimer] | None = None
        # Per dedicated parameter: its boundary's index and its pack (set at the first forward).
        self._pack_of_param: list[tuple[int, Pack]] = []
        # A replicated parameter inside a boundary (id -> the boundary's index and bucket)
        # leaves in that boundary's bucket; one outside every boundary when its gradient is in.
        self._bucket_of_replicated: dict[int, tuple[int, ReplicatedBucket]] = {}
        # Replicated parameters (ids) whose gradient the backward under way accumulated.
        self._replicated_complete: set[int] = set()
        # No forward ran since the last backward ended: the next one starts counting the
        # boundaries' reduce points afresh.
        self._backward_ended = True
        # Items whose gradient came after their boundary sent them, sent again at the end of
        # backward: id -> (boundary, place in its order, item); see [Note: reduce points].
        self._late: dict[int, tuple[int, int, Pack | torch.Tensor]] = {}
        self._order: list[DedicatedGroup] = []  # forward order of the previous forward
        self._current: list[DedicatedGroup] = []  # forward order so far in this forward
        self._final_queued = False
        # Boundaries whose forward began and has not ended (see [Note: a forward that raised]).
        self._forwards_open = 0
        self._initialised = False
        # The DistributedDataParallel wrappers found running a forward, checked once each.
        self._ddp_checked: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._all_reduces: AllReduceQueue | None = None  # the replicated path's (hook_replicated)
        self._replicated: list[nn.Parameter] = []
        # Replicated parameters (ids) whose gradient a backward under no_sync accumulated since
        # the last synced one; the replicated parameters outside every boundary, and those of
        # them whose gradient the synced backward under way submitted.
        self._replicated_unsynced: set[int] = set()
        self._root_replicated: list[nn.Parameter] = []
        self._root_replicated_sent: set[int] = set()
        self._register_boundary_hooks(tied_modules or {})
        # Each dedicated parameter's gradient hooks, by index (``rebind`` moves them).
        self._grad_handles = [self._grad_hook(index) for index in range(len(self.params))]

    def _register_boundary_hooks(self, tied_modules: Mapping[str, Sequence[nn.Module]]) -> None:
        """Each boundary's forward pre-hook and forward hook, and the state-dict pre-hook of
        each module that registers one of its weights (``tied_modules``: a tied weight's other
        modules, by its name).

        [Note: weak hooks] Not every container a hook lands in is visible to Python's cycle
        collector (a tensor's hook dict is not), so a hook that held ``self`` (and through it
        the groups, the model and its weights) would keep a deleted model alive forever.
        Every hook on a module or a parameter holds only a weak reference to this object and
        an index (the pre-backward hook on a forward's outputs holds it while they live)."""
        weak_self = weakref.ref(self)
        for index, group in enumerate(self.groups):
            group.module.register_forward_pre_hook(
                _untraced_hook(weak_self, "_pre_forward", index), with_kwargs=True
            )
            group.module.register_forward_hook(_untraced_hook(weak_self, "_post_forward", index))
            before_state_dict = functools.partial(
                _weak_hook, weak_self, "_before_state_dict", index
            )
            # A tied weight's other modules too (a head tied to a dedicated embedding).
            modules = [
                module
                for dps in group.members
                for dp in dps
                for module in (dp.module, *tied_modules.get(dp.fqn, ()))
            ]
            for module in {id(module): module for module in modules}.values():
                module.register_state_dict_pre_hook(before_state_dict)

    def _grad_hook(self, index: int) -> tuple[RemovableHandle, ...]:
        """Parameter ``index``'s post-accumulate-grad hook; under a pipeline also a hook on
        each gradient computed for it, which widens the ``.grad`` that the gradient is about
        to be added to (see [Note: weight gradients a schedule writes])."""
        param = self.params[index].param
        weak_self = weakref.ref(self)
        handles = [
            param.register_post_accumulate_grad_hook(
                functools.partial(_weak_hook, weak_self, "_post_accumulate_grad", index)
            )
        ]
        if self.params[index].reduced_at_step:
            handles.append(
                param.register_hook(
                    functools.partial(_weak_hook, weak_self, "_widen_before", index)
                )
            )
        return tuple(handles)

    def _widen_before(self, index: int, grad: torch.Tensor) -> None:
        """A gradient of parameter ``index`` was computed (by a backward, or by a schedule's
        ``torch.autograd.grad`` of the weights): widen the ``.grad`` it will be added to."""
        del grad  # left as it is
        self.params[index].widen_local_grad()

    def hook_replicated(self, params: list[nn.Parameter], queue: AllReduceQueue) -> None:
        """The replicated path: each of ``params`` joins ``queue`` once its gradient is
        accumulated (not inside ``no_sync``), and the end of that backward waits for the queue
        and averages, so that ``.grad`` is final when ``backward()`` returns, as under DDP: a
        clip or a read of the gradient before ``step()`` sees the average, and a micro-batch
        without ``no_sync`` accumulates onto it."""
        self._all_reduces = queue
        self._replicated = list(params)
        weak_self = weakref.ref(self)
        for param in params:
            param.register_post_accumulate_grad_hook(
                functools.partial(_replicated_grad, weak_self, weakref.ref(queue))
            )

    def rebind(self, index: int) -> None:
        """``params[index].param`` is a new object (``to_empty`` replaced a meta parameter):
        move its gradient hooks there."""
        for handle in self._grad_handles[index]:
            handle.remove()
        self._grad_handles[index] = self._grad_hook(index)

    # -- forward ---------------------------------------------------------------------------------

    def _neighbour(self, group: DedicatedGroup, step: int) -> DedicatedGroup | None:
        try:
            index = self._order.index(group) + step
        except ValueError:
            return None
        return self._order[index] if 0 <= index < len(self._order) else None

    def _pre_forward(
        self, index: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self._check_alive()
        group = self.groups[index]
        ddp = active_ddp()
        if ddp is not None and ddp not in self._ddp_checked:
            # At every forward, not only the first: the first may have run outside it (an
            # evaluation of the bare model before the training loop calls the wrapper).
            _refuse_outer_ddp(ddp, self.params)
            self._ddp_checked.add(ddp)
        if not self._initialised:
            self._first_forward()
        if in_backward():
            # Activation checkpointing recomputes this forward inside backward: the weights
            # are needed again; order, counters and freeing belong to the real forward. A
            # forward that ran without grad (reentrant checkpointing) left the reduce point
            # to this recompute, whose graph the backward runs (a dead point, of a forward
            # whose graph was dropped, is not one).
            with span("dmuon::pre_forward_recompute"):
                group.unshard()
            adds_point = not group.live_points()
        else:
            if self._final_queued:
                # The last backward raised: the autograd engine dropped its final callback
                # (see [Note: a backward that raised]).
                self._free_iteration()
            if self._backward_ended:
                self._backward_ended = False
                for each in self.groups:
                    each.points.clear()
            self._forwards_open += 1
            self._unshard_for_forward(group)
            adds_point = True
        if group.input_dtype is not None:  # positional and keyword inputs, as FSDP2 casts
            args, kwargs = _cast_floats((args, kwargs), group.input_dtype)
        if adds_point and torch.is_grad_enabled():
            args, kwargs = self._with_reduce_point(index, args, kwargs)
        return args, kwargs

    def _with_reduce_point(
        self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The boundary's forward inputs passed through its reduce point (see [Note: reduce
        points] in :mod:`._order`); unchanged when none of them needs a gradient."""
        inputs = (args, kwargs)
        tensors = _needing_grad(inputs)
        if not tensors:
            return args, kwargs
        reached = functools.partial(_weak_hook, weakref.ref(self), "_reduce_point", index)
        passed = _ReducePoint.apply(reached, *tensors)
        # The points of forwards whose graph was dropped never run (nor count): forwards that
        # no backward follows (an evaluation with gradients enabled) would otherwise leave one
        # per forward until the next backward.
        group = self.groups[index]
        group.points = [*group.live_points(), weakref.ref(passed[0].grad_fn)]
        outputs = iter(passed)
        return tree_map_tensors(lambda t: next(outputs) if t.requires_grad else t, inputs)

    def time_forward_waits(self, device: torch.device | None, owner: object) -> None:
        """Time each boundary's wait for its broadcasts before its forward for ``owner``, the
        optimizer built last (``device=None``: stop timing), until ``owner`` is freed (the
        step profile; see [Note: the step profile] in ``_profile``)."""
        if device is None:
            self.wait_timers = None
            return
        timers = {group.fqn: PhaseTimer(device) for group in self.groups}
        self.wait_timers = timers
        weak_self = weakref.ref(self)

        def stop() -> None:
            hooks = weak_self()
            if hooks is not None and hooks.wait_timers is timers:
                hooks.wait_timers = None

        weakref.finalize(owner, stop).atexit = False

    def _unshard_for_forward(self, group: DedicatedGroup) -> None:
        timer = self.wait_timers.get(group.fqn) if self.wait_timers else None
        with span("dmuon::pre_forward"):
            if group in self._current:
                self._order, self._current = self._current, []
            self._current.append(group)
            group.reset_backward()
            # An HSDP publish writes the weights this forward reads (on column replicas), also
            # when nothing is broadcast (a shard size of one).
            group.wait_for_publish()
            group.unshard(async_op=True)
            following = self._neighbour(group, +1)
            if following is not None:
                with span("dmuon::prefetch"):
                    following.unshard(async_op=True)
            if timer is not None:
                timer.start()
            group.wait_for_unshard()
            if timer is not None:
                timer.mark("wait")

    def _post_forward(self, index: int, module: nn.Module, args: Any, output: Any) -> Any:
        group = self.groups[index]
        if group.output_dtype is not None:
            output = _cast_floats(output, group.output_dtype)
        if in_backward():
            return output  # recompute: the boundary is freed once its gradients are in
        self._forwards_open = max(self._forwards_open - 1, 0)
        with span("dmuon::post_forward"):
            if self.reshard_after_forward:
                group.reshard()
            if not torch.is_grad_enabled():
                return output
            tensors = _needing_grad(output)
            if tensors:
                group.needs_backward = True
            # Untraced, as all of dmuon's hooks: a compiled function that calls backward()
            # leaves dynamo on during it (see [Note: the step under torch.compile]).
            pre_backward = functools.partial(_untraced, self._pre_backward, group)
            for tensor in tensors:
                tensor.register_hook(pre_backward)
        return output

    def _before_state_dict(self, index: int, *args: Any) -> None:
        """[Note: state dicts see the parameters]
        A boundary can hold its weights outside its forward and backward: under Z2 after a
        forward that no backward followed (an evaluation), under either mode after a forward
        that raised or a backward that creates a graph. Each module then holds the compute
        copy, in the compute dtype, on peers and owner alike. ``state_dict()`` of a module
        holding dedicated parameters first drops the kept weights of that module's boundary,
        as FSDP2's own pre-hooks put its sharded parameters back: a read sees what it sees
        after a step (the owner's master; a peer's raises ``NotHeldError``), never the compute
        copy. Like FSDP2's, a later forward gathers again, so every rank calls it alike. A
        module that registers a tied dedicated weight under another name (a head tied to a
        dedicated embedding) carries the hook too: without it ``lm_head.state_dict(keep_vars=
        True)`` alone read the compute copy on every rank, while the embedding's module read
        the owner's master and raised on a peer.

        Which calls get here on the sharded path: with one rank per shard group (one
        process, HSDP with a shard size of one) ``state_dict()``, where this drops an owner's
        compute copy of mixed precision, which it would read otherwise; with more than one,
        only ``state_dict(keep_vars=True)`` (dmuon's checkpoints list the keys with it; a
        caller reads the parameters after it), since ``state_dict()`` is refused on every
        rank at the first module that holds a dedicated parameter, before this hook, and the
        functions of ``torch.distributed.checkpoint.state_dict`` before any traversal (see
        [Note: torch's paths that cannot reach a dedicated weight] in ``holder/_guard``).
        Neither reads a value that some rank lacks, so a traversal reaches the same modules on
        every rank, and dropping each visited module's boundary (FSDP2's hooks do the same for
        its modules) leaves every rank holding the same layers. On the replicated path a
        boundary keeps its weights resident and this does nothing. ``load_state_dict`` needs
        no such hook: on the sharded path it is refused for a dictionary that holds a
        dedicated weight, and one that does not writes none. Inside a backward (a state dict
        taken in one of its hooks) nothing is dropped: the backward under way reads those
        weights."""
        if not in_backward():
            self.groups[index].reshard()

    # -- backward --------------------------------------------------------------------------------

    def _pre_backward(self, group: DedicatedGroup, grad: torch.Tensor) -> None:
        if group.backward_started:
            return
        with span("dmuon::pre_backward"):
            self._queue_final_callback()
            group.backward_started = True
            group.unshard(async_op=True)
            previous = self._neighbour(group, -1)
            if previous is not None and previous.needs_backward and not previous.backward_started:
                with span("dmuon::prefetch"):
                    previous.unshard(async_op=True)
            group.wait_for_unshard()

    def _queue_final_callback(self) -> None:
        if not self._final_queued:
            if compiled_autograd_on():  # see [Note: compiled autograd]
                raise compiled_autograd_error()
            self._final_queued = True
            self._syncing = self.requires_gradient_sync and not self._fsdp_sync_off()
            # Grad mode inside a backward is its create_graph.
            self._creates_graph = torch.is_grad_enabled()
            self._order = list(self._current)
            # Untraced, as the pre-backward hook (see [Note: the step under torch.compile]).
            queue_backward_callback(functools.partial(_untraced, self._post_backward_final))

    def _post_accumulate_grad(self, index: int, param: torch.Tensor) -> None:
        # Usually queued by a pre-backward already; not when the forward ran without grad
        # (reentrant activation checkpointing) and only the recompute built the graph.
        self._queue_final_callback()
        self.accumulated = True
        if not self._syncing:  # [Note: accumulating in the reduce dtype] in holder/_precision
            self.params[index].widen_local_grad()
        boundary, pack = self._pack_of_param[index]
        if self._is_late(boundary, pack, pack):
            return
        group = self.groups[boundary]
        if group.count_grad(pack):
            with span("dmuon::post_backward"):
                self._send(group, group.order.complete(pack))

    def _is_late(
        self, boundary: int, item: Pack | torch.Tensor, sent_in: Pack | ReplicatedBucket
    ) -> bool:
        """Whether boundary ``boundary`` sent ``sent_in`` (``item``'s pack or bucket) in this
        backward already; if so, ``item`` is sent again at the end of backward (see [Note:
        reduce points] in :mod:`._order`)."""
        order = self.groups[boundary].order
        if not order.passed(sent_in):
            return False
        self._late[id(item)] = (boundary, order.index(sent_in), item)
        return True

    def _reduce_point(self, index: int) -> None:
        """The backward of boundary ``index``'s forward inputs is done: at its last reduce
        point, send every collective of the boundary not sent yet (see [Note: reduce
        points] in :mod:`._order`)."""
        group = self.groups[index]
        group.points_reached += 1
        if group.points_reached == 1:
            # The points of this boundary this backward runs: not those of a forward whose
            # graph was dropped, or that another backward takes.
            group.points_due = sum(
                1 for ref in group.points if (node := ref()) is not None and will_run(node)
            )
        if group.points_reached < group.points_due:
            return
        self._queue_final_callback()
        with span("dmuon::post_backward"):
            self._send(group, group.order.rest(), at_point=True)

    def _send(
        self,
        group: DedicatedGroup,
        items: list[Pack | ReplicatedBucket],
        at_point: bool = False,
    ) -> None:
        """Send ``items`` of ``group``'s order: a pack is reduced (a parameter without a
        gradient counts as zero), a bucket all-reduced. A boundary whose packs all left is
        freed; Z2 keeps its weights across ``no_sync`` micro-batches so that they are not
        broadcast again.

        [Note: a backward that creates a graph]
        A backward with ``create_graph=True`` (a gradient penalty's
        ``torch.autograd.grad(loss, inputs, create_graph=True)``, the first half of a double
        backward) builds a graph whose nodes read the boundary's weights, and the backward of
        that graph runs later. Freed at the end of the first backward, a peer's weights would
        have no storage there: the second backward would raise ``setStorage ... out of bounds
        for storage of size 0`` or crash with SIGSEGV, with FSDP2's own fix in place
        (``set_reshard_after_backward(False)`` around the first backward). So a backward that
        creates a graph leaves its boundaries gathered, on every rank alike; the next backward
        that sends them frees them, as ``step()`` and, under Z3, the next forward do.

        [Note: a boundary used again after its packs left]
        A boundary used more than once in the graph (two forwards before one backward, as
        a siamese or DPO loss has; a block called twice) can have all its packs sent before
        its last use's backward ran: under reentrant activation checkpointing inside the
        boundary (``checkpoint_wrapper(..., checkpoint_impl=CheckpointImpl.REENTRANT)``, or
        a checkpointed MLP) each use's recompute accumulates the gradients in a backward of
        its own, so the first use completes every pack. Freed then, the weights would be gone
        when the other use's recompute reads them (``NotHeldError`` or ``setStorage ... out of
        bounds`` on some ranks, the others waiting in the next collective). So a boundary with
        several reduce points in the graph is freed at the last of them that this backward
        runs (``at_point``), once its packs all left; one with a single use is freed as its
        last pack leaves."""
        sent_a_pack = False
        for item in items:
            if not isinstance(item, Pack):
                self._send_bucket(item)
                continue
            sent_a_pack = True
            if self._syncing:
                self.reduce_queue.submit(item)
        if (
            (sent_a_pack or at_point)
            and group.all_packs_sent
            and (self.reshard_after_forward or self._syncing)
            and not self._creates_graph
            and not _uses_pending(group)
        ):
            group.reshard()

    def _send_bucket(self, bucket: ReplicatedBucket) -> None:
        """All-reduce a boundary's replicated gradients, each flagged with whether this rank
        sends one of this backward or of ``no_sync`` micro-batches (see [Note: replicated
        parameters a rank left out] in :mod:`._collectives`); inside ``no_sync``, remember
        which it accumulated."""
        assert self._all_reduces is not None
        new = [
            p.grad is not None
            and (id(p) in self._replicated_complete or id(p) in self._replicated_unsynced)
            for p in bucket.params
        ]
        if not self._syncing:
            self._replicated_unsynced.update(id(p) for p, n in zip(bucket.params, new) if n)
            return
        self._all_reduces.submit_bucket(bucket, new)

    def _send_late(self) -> None:
        """Send what came after its boundary had sent it, in the boundaries' order and each
        boundary's: a pack again whole (what it sent already is zero now), a replicated
        parameter's gradient (see [Note: reduce points] in :mod:`._order`)."""
        for _, _, item in sorted(self._late.values(), key=lambda late: late[:2]):
            if isinstance(item, Pack):
                if self._syncing:
                    self.reduce_queue.submit(item)
            else:
                self._send_replicated(item, late=True)
        self._late.clear()

    def _replicated_grad_in(self, param: torch.Tensor) -> None:
        """The replicated path: ``param``'s gradient is accumulated. One outside every
        boundary is all-reduced now; one inside a boundary leaves with the boundary's bucket,
        or, where the bucket left already, again at the end of backward."""
        self._queue_final_callback()  # which waits for the queue (see hook_replicated)
        place = self._bucket_of_replicated.get(id(param))
        if place is None:
            self._send_replicated(param)
        elif not self._is_late(place[0], param, place[1]):
            self._replicated_complete.add(id(param))  # sent with its boundary's bucket
            self.groups[place[0]].replicated_grad_seen = True  # even if its backward never runs

    def _send_replicated(self, param: torch.Tensor, late: bool = False) -> None:
        """All-reduce the gradient this backward gave ``param`` (a parameter outside every
        boundary, or, ``late``, one whose boundary sent its bucket already: the whole
        gradient goes again, and the bucket does not write it); inside ``no_sync``, remember
        it for the synced backward."""
        assert self._all_reduces is not None
        if param.grad is None:
            return
        if not self._syncing:
            self._replicated_unsynced.add(id(param))
            return
        if self._replicated_unsynced and not late:  # the end of backward needs to know
            self._root_replicated_sent.add(id(param))
        self._all_reduces.submit(param.grad, resends=param if late else None)

    def _post_backward_final(self) -> None:
        """[Note: boundaries the synced backward does not reach]
        Inside ``no_sync`` a boundary's local gradients stay on its parameters until a synced
        backward reduces them. A synced backward that does not reach the boundary at all (a
        layer every rank skips in the last micro-batch: LayerDrop with a seed the ranks share,
        an early exit) reduces it here all the same, as it reduces a pack whose parameters got
        no gradient in it; otherwise those gradients would never reach their owners and the
        step would leave the layer's matrices as they were, without a word. Every rank skips
        alike, so every rank issues these reduces, in the boundaries' order. The same holds
        for a boundary's replicated parameter that gets a gradient from outside the boundary
        in a backward that never reaches the boundary itself (a norm of a dropped layer that a
        penalty reads): its bucket leaves here, or its average would never be taken and every
        rank would step its own gradient. Such a weight, like one outside every boundary, gets
        a gradient on every rank or on none (the ranks decide alone whether to send)."""
        with span("dmuon::post_backward_final"):
            self._final_queued = False
            self._backward_ended = True
            # The forward is over (one that raised and was never recovered no longer counts).
            self._forwards_open = 0
            self.unsynced_backward = not self._syncing
            self.backward_since_step = True
            for index, group in enumerate(self.groups):
                if not (group.backward_touched or (self._syncing and index in self._unsynced)):
                    continue
                if not self._syncing:
                    self._unsynced.add(index)
                self._send(group, group.order.rest())
                group.reset_backward()
            self._send_late()
            self._replicated_complete.clear()
            if self._syncing:
                self._unsynced.clear()
                self._send_replicated_left()
            # End of backward: on CPU, issue every replicate stage still waiting.
            self.reduce_queue.issue_replicate_stages()
            if self._all_reduces is not None:
                self._all_reduces.wait_all()  # the replicated gradients, averaged
            # Before any clip of this backward's gradients, however late accelerate was
            # imported: see [Note: torch's paths that cannot reach a dedicated weight].
            refuse_accelerate_clip()

    def _send_replicated_left(self) -> None:
        """The replicated path's part of [Note: boundaries the synced backward does not
        reach] for the parameters outside every boundary (a boundary's bucket carries its own,
        flagged as sent: see :meth:`_send_bucket`): one whose gradient micro-batches under
        ``no_sync`` accumulated and the synced backward did not send is all-reduced now, in
        the parameters' order, as on every rank."""
        if self._all_reduces is not None and self._replicated_unsynced:
            for param in self._root_replicated:
                key = id(param)
                left = key in self._replicated_unsynced and key not in self._root_replicated_sent
                if left and param.grad is not None:
                    self._all_reduces.submit(param.grad)
        self._replicated_unsynced.clear()
        self._root_replicated_sent.clear()

    def reduce_unsynced(self) -> None:
        """Reduce, as a synced backward's end would, every boundary that backwards under
        ``no_sync`` reached since the last synced one, in the boundaries' order (on every
        rank alike): the pipeline schedule's end of backward (see [Note: the pipeline
        schedule's reduce] in :mod:`._runtime`).

        [Note: weight gradients a schedule writes]
        The zero-bubble and V schedules (``ScheduleInterleavedZeroBubble``,
        ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``) split each micro-batch's backward in
        two: the inputs' gradients first (``torch.autograd.grad`` of the stage's inputs, which
        passes every boundary's hooks and reduce point but accumulates no weight gradient),
        then, later, the weights' (``torch.autograd.grad`` of the weights from the saved
        intermediate gradients, added to ``.grad`` by hand). So the weights' gradients reach
        ``.grad`` outside any backward dmuon follows, some after the last backward of the
        step, and a boundary's order can be left part-way by those split backwards. This
        reduce does not depend on either: it sends every pack of each boundary the schedule's
        backwards reached, from its first, and each pack takes its parameters' ``.grad`` as it
        is at the step, whatever wrote it, after the schedule divided it by the number of
        micro-batches. Under mixed precision a weight's first by-hand gradient lands in the
        parameter dtype; a hook on every gradient computed for the weight (``register_hook``,
        which fires in the schedule's ``torch.autograd.grad`` of the weights as in a backward)
        widens that ``.grad`` to the reduce dtype before the next one is added, so the
        micro-batches add up in the reduce dtype, as [Note: accumulating in the reduce dtype]
        in holder/_precision does for the others: bit for bit the local sums of
        ``ScheduleInterleaved1F1B`` on the same stages (``test_pipeline_split``). A widening at
        each backward's end would not do: ``ScheduleDualPipeV`` and
        ``ScheduleInterleavedZeroBubble`` run several micro-batches' weight backwards in a row,
        with no backward between them (a local sum came 2.4e-4 away in that test). FSDP2's own
        parameters (norms, embedding, head, expert stacks) are FSDP2's to sum: under these
        schedules in bf16 their reduced gradients came 1e-3 to 3e-3 (relative) away from those
        of ``ScheduleInterleaved1F1B`` in a user trial (torch 2.13), and dmuon leaves them so.

        The weights' backward needs the weights its layer's forward saved, after that layer's
        backward is over. ZeRO-2 (``reshard_after_forward=False``) keeps them gathered from a
        step's first forward to its reduce, as it keeps them across ``no_sync`` micro-batches.
        ZeRO-3 frees them after each forward and backward: there the backward of the stage's
        inputs, which looks up every weight's gradient accumulator first (``p.view_as(p)``),
        is refused on a peer, naming the fix (ZeRO-2 for ``dedicate_params`` and
        ``fully_shard`` alike, torchtitan's setting under a pipeline; FSDP2's own ZeRO-3
        trained 4e-2 to 9e-2 away from the whole model under ``ScheduleDualPipeV`` and
        ``ScheduleZBVZeroBubble`` in ``test_pipeline``'s setup, with torch 2.13)."""
        self.reduce_due = False
        if not self.unsynced_backward:
            return
        with span("dmuon::post_backward_final"):
            self._syncing = True
            self.unsynced_backward = False
            for index, group in enumerate(self.groups):
                if index in self._unsynced:
                    group.reset_backward()  # every pack, wherever backwards left the order
                    self._send(group, group.order.rest())
                    group.reset_backward()
            self._unsynced.clear()
            self._send_replicated_left()
            self.reduce_queue.issue_replicate_stages()
            if self._all_reduces is not None:
                self._all_reduces.wait_all()

    def forget_unsynced(self) -> None:
        """The local gradients of the backwards under ``no_sync`` were dropped (``zero_grad``):
        no boundary waits for a synced backward any more."""
        self.reduce_due = False
        self.unsynced_backward = False
        self._unsynced.clear()
        self._replicated_unsynced.clear()

    def release_aborted(self) -> None:
        """Free what a forward or backward that raised left gathered, and reset the
        per-iteration state; nothing outside such an iteration or inside a backward (see
        [Note: a forward that raised])."""
        if in_backward() or not (self._final_queued or self._forwards_open):
            return
        self._current = []  # the forward that raised recorded part of an order
        self._free_iteration()

    def reset_iteration(self) -> None:
        """FSDP2's ``reset_iter_state`` ran on the root: free every boundary's gathered
        weights and reset the per-iteration state, whatever cut the iteration short (see
        [Note: a forward that raised]); nothing inside a backward."""
        if in_backward():
            return
        self._current = []
        self._free_iteration()

    def _free_iteration(self) -> None:
        """Free every boundary's gathered weights and reset the per-iteration state (the
        end-of-backward flag, the backward counters, what waits to be sent late): what an
        iteration cut short left (see [Note: a backward that raised] and [Note: a forward that
        raised]). The forward order recorded before stays."""
        self._final_queued = False
        self._backward_ended = True
        self._forwards_open = 0
        self._late.clear()
        self._replicated_complete.clear()
        for group in self.groups:
            group.reset_backward()
            group.reshard()

    # -- setup checks ----------------------------------------------------------------------------

    def _first_forward(self) -> None:
        """The runtime's first-forward init (it checks that ``fully_shard`` left every
        dedicated parameter registered, and packs them), then learn which pack each
        parameter's gradient goes to, and the order each boundary's collectives leave in."""
        self._on_first_forward()
        where = {
            id(dp): (index, pack)
            for index, group in enumerate(self.groups)
            for pack in group.packs
            for dp in pack.params
        }
        self._pack_of_param = [where[id(dp)] for dp in self.params]
        self._set_reduce_orders()
        self._initialised = True

    def _set_reduce_orders(self) -> None:
        """Each boundary's fixed order (see [Note: reduce points] in :mod:`._order`): its
        packs, latest-used first, then on the replicated path one bucket of the replicated
        parameters inside it, latest-used first too; the replicated parameters outside every
        boundary are sent alone."""
        placed = _place_replicated(self.groups, self._replicated)
        for index, group in enumerate(self.groups):
            packs = _latest_used_first(group)
            mine: list[torch.Tensor] = [
                p for p in self._replicated if placed.get(id(p), (-1, 0))[0] == index
            ]
            mine.sort(key=lambda p: placed[id(p)][1], reverse=True)
            bucket = [ReplicatedBucket(mine)] if mine else []
            group.order = ReduceOrder([*packs, *bucket])
            for param in mine:
                self._bucket_of_replicated[id(param)] = (index, bucket[0])
        self._root_replicated = [p for p in self._replicated if id(p) not in placed]


def _refuse_outer_ddp(ddp: nn.Module, params: Sequence[DedicatedParam]) -> None:
    """A ``DistributedDataParallel`` built around the model *before* ``dedicate_params``
    (whose guard refuses a later one) runs this forward: its reducer all-reduces every
    gradient, the dedicated ones included, on top of dmuon's reduces, and training silently
    diverges from DDP's. Refuse it here, on every rank alike (every rank runs DDP's forward)."""
    mine = {id(dp.param) for dp in params}
    if any(id(p) in mine for p in ddp_reduced_params(ddp)):
        raise RuntimeError(
            "DistributedDataParallel cannot wrap a model with dedicated parameters: this "
            "forward runs inside a DistributedDataParallel built before dedicate_params, "
            "whose reducer would all-reduce the dedicated gradients on top of dmuon's "
            "reduces. Drop the DistributedDataParallel wrapper and call the model itself: "
            "dmuon.dedicate_params_ddp(model, mesh, predicate) + dmuon.replicate(model, mesh) "
            "is the replicated path; to shard, dedicate_params + fully_shard"
        )


def _weak_hook(weak_hooks: weakref.ref[BoundaryHooks], method: str, *args: Any) -> Any:
    """Call ``hooks.<method>(*args)`` if the hooks are still alive. Never traced by
    ``torch.compile``: dmuon's collectives run eagerly at a compiled block's edges (in eager
    mode this path imports nothing; the forward hooks are disabled callables themselves, see
    ``_untraced_hook``)."""
    hooks = weak_hooks()
    if hooks is None:
        return None
    if torch.compiler.is_compiling():
        return _untraced(getattr(hooks, method), *args)
    return getattr(hooks, method)(*args)


@disable_dynamo
def _untraced(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def _untraced_hook(
    weak_hooks: weakref.ref[BoundaryHooks], method: str, index: int
) -> Callable[..., Any]:
    """A module forward hook that calls ``hooks.<method>(index, ...)``, itself never traced.

    A block compiled in place (``block.compile(fullgraph=True)``, torchtitan's per-block
    compile) traces its own ``_call_impl`` and with it the block's hooks. Dynamo runs a hook
    that is itself disabled eagerly around the graph, as it runs FSDP2's, but a traced hook
    that calls a disabled function is a graph break, which ``fullgraph=True`` refuses. (Made
    with a reason, the hook imports the compiler at ``dedicate_params``; FSDP2's
    ``fully_shard`` imports it next.)

    [Note: a hook inside a checkpointed region] A boundary wrapped in activation checkpointing
    after ``dedicate_params`` (``checkpoint_wrapper`` put around ``layers.N``) has its hooks
    inside the checkpointed region: eager and ``fullgraph=False`` run them (dynamo runs that
    region eagerly), but under ``fullgraph=True`` dynamo must trace the region into one graph
    and refuses the hook. Its error quoted a skipped function of torch's file and advised
    against calling it; it quotes ``_HOOK_REASON`` instead, which names the fix: wrap before
    ``dedicate_params``, and the hooks go on the wrapper, outside the region."""

    def untraced(*args: Any) -> Any:
        return _weak_hook(weak_hooks, method, index, *args)

    return disable_dynamo(untraced, reason=_HOOK_REASON)


_HOOK_REASON = (
    "dmuon's forward hook of a hook boundary (the layer whose dedicated weights it gathers "
    "from their owners) runs eagerly, outside compiled graphs. A compiled graph that must hold "
    "it (fullgraph=True around activation checkpointing applied to the layer after "
    "dedicate_params) cannot: wrap the layers in checkpoint_wrapper before "
    "dmuon.dedicate_params, so that dmuon's hooks go on the wrapper, outside the checkpointed "
    "region; see dmuon's torch.compile guide"
)


def _replicated_grad(
    weak_hooks: weakref.ref[BoundaryHooks],
    weak_queue: weakref.ref[AllReduceQueue],
    param: torch.Tensor,
) -> None:
    hooks, queue = weak_hooks(), weak_queue()
    if hooks is None or queue is None or param.grad is None:
        return
    hooks._replicated_grad_in(param)


def _uses_pending(group: DedicatedGroup) -> bool:
    """Whether a boundary with several reduce points in the graph has some of them still to
    come in this backward (see [Note: a boundary used again after its packs left])."""
    live = len(group.live_points())
    if live < 2:
        return False
    due = group.points_due if group.points_reached else live
    return group.points_reached < due


def _needing_grad(tree: Any) -> list[torch.Tensor]:
    """The tensors of ``tree`` (searched as FSDP2 searches a forward's inputs and outputs)
    that require grad."""
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.requires_grad]


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with every floating-point tensor cast to ``dtype``."""
    return tree_map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


@refused_by_compiled_autograd(compiled_autograd_error)  # see [Note: compiled autograd]
class _ReducePoint(torch.autograd.Function):
    """The identity on a boundary's forward inputs; its backward, which the autograd engine
    runs once their gradients are computed, calls ``reached`` (see [Note: reduce points] in
    :mod:`._order`). Compiled autograd refuses a graph that holds one."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, reached: Callable[[], None], *inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.reached = reached
        return inputs

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, *grads: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        ctx.reached()
        return (None, *grads)


def _place_replicated(
    groups: Sequence[DedicatedGroup], params: Sequence[nn.Parameter]
) -> dict[int, tuple[int, int]]:
    """Each replicated parameter inside a boundary (by id): the index of the innermost
    boundary whose module holds it, and its module's position in that module's walk."""
    wanted = {id(p) for p in params}
    found: dict[int, tuple[int, int, int]] = {}  # id -> (modules in the boundary, index, position)
    for index, group in enumerate(groups):
        modules = list(group.module.modules())
        for position, module in enumerate(modules):
            for param in module.parameters(recurse=False):
                key = id(param)
                if key in wanted and (key not in found or len(modules) < found[key][0]):
                    found[key] = (len(modules), index, position)
    return {key: (index, position) for key, (_, index, position) in found.items()}


def replicated_payload(groups: Sequence[DedicatedGroup], params: Sequence[nn.Parameter]) -> int:
    """The bytes the replicated path's all-reduces of ``params``' gradients carry in a synced
    backward that gives each of them one: per boundary and dtype one bucket of the gradients
    and a presence flag each, and each parameter outside every boundary alone (see [Note:
    replicated parameters a rank left out])."""
    placed = _place_replicated(groups, params)
    buckets: dict[tuple[int, torch.dtype], int] = {}
    nbytes = 0
    for param in params:
        local = local_shard(param)
        if id(param) in placed:
            key = (placed[id(param)][0], param.dtype)
            buckets[key] = buckets.get(key, 0) + local.numel() + 1
        else:
            nbytes += local.numel() * local.element_size()
    return nbytes + sum(numel * dtype.itemsize for (_, dtype), numel in buckets.items())


def _latest_used_first(group: DedicatedGroup) -> list[Pack]:
    """``group``'s packs in the order they leave (see [Note: reduce points] in :mod:`._order`):
    latest-used first (the module walked last first, as backward reaches them); ties keep the
    packs' order."""
    position = {id(module): i for i, module in enumerate(group.module.modules())}
    return sorted(
        group.packs,
        key=lambda pack: min(position.get(id(dp.module), 0) for dp in pack.params),
        reverse=True,
    )
