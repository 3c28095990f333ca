"""Every hook dmuon registers, and the forward order it prefetches by.

[Note: hooks and prefetch]

Per hook boundary (a module): a forward pre-hook (wait for this boundary's broadcast, launched
by the previous boundary's prefetch or now; launch the next boundary's), a forward hook (Z3:
free; register a hook on every output that requires grad, the first of which to fire is the
boundary's pre-backward), and per dedicated parameter a post-accumulate-grad hook (count the
pack's gradients; a complete pack is reduced, a complete boundary freed). The first
pre-backward of a backward pass queues a final callback on the autograd engine that handles
packs whose parameters got no gradient, frees what is left, and issues the last replicate-axis
reductions.

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

Prefetch follows the forward order recorded by the previous forward (the first forward has no
prefetch): forward prefetches the next boundary, backward the previous one. All ranks run the
same model, so every rank issues the same collectives in the same order; a boundary used in a
different order than recorded only costs a broadcast issued early, never a wrong weight.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._profile import PhaseTimer, span
from .._torch_internals import (
    disable_dynamo,
    in_backward,
    queue_backward_callback,
    tree_leaves,
    tree_map_tensors,
)
from ..holder import DedicatedParam
from ._collectives import AllReduceQueue, ReduceQueue
from ._group import DedicatedGroup
from ._pack import Pack

__all__ = ["BoundaryHooks"]


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
        fsdp_sync_off: Callable[[], bool],
    ) -> None:
        self.groups = list(groups)
        self.params = list(params)
        self.reduce_queue = reduce_queue
        self.reshard_after_forward = reshard_after_forward
        self.requires_gradient_sync = True
        self._fsdp_sync_off = fsdp_sync_off
        # Whether the backward under way reduces: both flags, read once at its first hook.
        self._syncing = True
        # The last backward ran under no_sync and no synced one followed: its gradients are
        # accumulated on each rank but not reduced (see [Note: a step after no_sync]).
        self.unsynced_backward = False
        # The boundaries (indices) a backward under no_sync reached since the last synced one:
        # see [Note: boundaries the synced backward does not reach].
        self._unsynced: set[int] = set()
        self._on_first_forward = on_first_forward
        self.wait_timers: dict[str, PhaseTimer] | None = None
        self._pack_of_param: list[tuple[DedicatedGroup, Pack]] = []  # set at the first forward
        self._order: list[DedicatedGroup] = []  # forward order of the previous forward
        self._current: list[DedicatedGroup] = []  # forward order so far in this forward
        self._final_queued = False
        self._initialised = False
        self._all_reduces: AllReduceQueue | None = None  # the replicated path's (hook_replicated)
        self._replicated: list[nn.Parameter] = []
        # Replicated parameters (ids) whose gradient a backward under no_sync accumulated since
        # the last synced one, and those whose gradient the synced backward under way submitted.
        self._replicated_unsynced: set[int] = set()
        self._replicated_sent: set[int] = set()
        self._handles: list[RemovableHandle] = []
        # [Note: weak hooks] Not every container a hook lands in is visible to Python's cycle
        # collector (a tensor's hook dict is not), so a hook that held ``self`` (and through it
        # the groups, the model and its weights) would keep a deleted model alive forever.
        # Every hook holds only a weak reference to this object and an index.
        weak_self = weakref.ref(self)
        for index, group in enumerate(self.groups):
            self._handles.append(
                group.module.register_forward_pre_hook(
                    functools.partial(_weak_hook, weak_self, "_pre_forward", index)
                )
            )
            self._handles.append(
                group.module.register_forward_hook(
                    functools.partial(_weak_hook, weak_self, "_post_forward", index)
                )
            )
            before_state_dict = functools.partial(_weak_hook, weak_self, "_state_dict", index)
            for module in {
                id(dp.module): dp.module for dps in group.members for dp in dps
            }.values():
                self._handles.append(module.register_state_dict_pre_hook(before_state_dict))
                self._handles.append(module.register_load_state_dict_pre_hook(before_state_dict))
        self._grad_handles = [self._grad_hook(index) for index in range(len(self.params))]

    def _grad_hook(self, index: int) -> RemovableHandle:
        return self.params[index].param.register_post_accumulate_grad_hook(
            functools.partial(_weak_hook, weakref.ref(self), "_post_accumulate_grad", index)
        )

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
            self._grad_handles.append(
                param.register_post_accumulate_grad_hook(
                    functools.partial(_replicated_grad, weak_self, weakref.ref(queue))
                )
            )

    def rebind(self, index: int) -> None:
        """``params[index].param`` is a new object (``to_empty`` replaced a meta parameter):
        move its gradient hook there."""
        self._grad_handles[index].remove()
        self._grad_handles[index] = self._grad_hook(index)

    def remove(self) -> None:
        for handle in [*self._handles, *self._grad_handles]:
            handle.remove()
        self._handles.clear()
        self._grad_handles.clear()

    # -- forward ---------------------------------------------------------------------------------

    def _neighbour(self, group: DedicatedGroup, step: int) -> DedicatedGroup | None:
        try:
            index = self._order.index(group) + step
        except ValueError:
            return None
        return self._order[index] if 0 <= index < len(self._order) else None

    def _pre_forward(self, index: int, module: nn.Module, args: Any) -> Any:
        group = self.groups[index]
        if not self._initialised:
            self._first_forward()
        if in_backward():
            # Activation checkpointing recomputes this forward inside backward: the weights
            # are needed again; order, counters and freeing belong to the real forward.
            with span("dmuon::pre_forward_recompute"):
                group.unshard()
        else:
            if self._final_queued:
                self._recover_from_aborted_backward()
            self._unshard_for_forward(group)
        if group.input_dtype is not None:
            return _cast_floats(args, group.input_dtype)
        return None

    def time_forward_waits(self, device: torch.device) -> None:
        """Time each boundary's wait for its broadcasts before its forward (the step
        profile; see [Note: the step profile] in ``_profile``)."""
        self.wait_timers = {group.fqn: PhaseTimer(device) for group in self.groups}

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
        with span("dmuon::post_forward"):
            if self.reshard_after_forward:
                group.reshard()
            if not torch.is_grad_enabled():
                return output
            tensors = [
                t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if tensors:
                group.needs_backward = True
            for tensor in tensors:
                tensor.register_hook(functools.partial(self._pre_backward, group))
        return output

    def _state_dict(self, index: int, *args: Any) -> None:
        """[Note: state dicts see the parameters]
        Z2 keeps a boundary's weights after a forward without a backward (an evaluation)
        until the next step, as FSDP2 keeps its own gathered: each module then holds the
        compute copy, in the compute dtype, on peers and owner alike. ``state_dict()`` and
        ``load_state_dict()`` of a module holding dedicated parameters first drop those kept
        weights, as FSDP2's own pre-hooks put its sharded parameters back: a read sees what
        it sees after a step (the owner's master; a peer's raises ``NotHeldError``), never
        the compute copy, and a load never writes into a copy about to be freed. Like FSDP2's,
        a later forward gathers again, so every rank calls them alike."""
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
            self._final_queued = True
            self._syncing = self.requires_gradient_sync and not self._fsdp_sync_off()
            self._order = list(self._current)
            queue_backward_callback(self._post_backward_final)

    def _post_accumulate_grad(self, index: int, param: torch.Tensor) -> None:
        # Usually queued by a pre-backward already; not when the forward ran without grad
        # (reentrant activation checkpointing) and only the recompute built the graph.
        self._queue_final_callback()
        group, pack = self._pack_of_param[index]
        if group.count_grad(pack):
            with span("dmuon::post_backward"):
                self._pack_done(group, pack)

    def _pack_done(self, group: DedicatedGroup, pack: Pack) -> None:
        if not group.finish_pack(pack):
            return
        if self._syncing:
            self.reduce_queue.submit(pack)
        # Z2 keeps its weights across no_sync micro-batches so that they are not broadcast
        # again; otherwise a boundary's weights are freed once its backward is done.
        if group.all_packs_finished and (self.reshard_after_forward or self._syncing):
            group.reshard()

    def _post_backward_final(self) -> None:
        """[Note: boundaries the synced backward does not reach]
        Inside ``no_sync`` a boundary's local gradients stay on its parameters until a synced
        backward reduces them. A synced backward that does not reach the boundary at all (a
        layer every rank skips in the last micro-batch: LayerDrop with a seed the ranks share,
        an early exit) reduces it here all the same, as it reduces a pack whose parameters got
        no gradient in it; otherwise those gradients would never reach their owners and the
        step would leave the layer's matrices as they were, without a word. Every rank skips
        alike, so every rank issues these reduces, in the boundaries' order."""
        with span("dmuon::post_backward_final"):
            self._final_queued = False
            self.unsynced_backward = not self._syncing
            for index, group in enumerate(self.groups):
                if not (group.backward_touched or (self._syncing and index in self._unsynced)):
                    continue
                if not self._syncing:
                    self._unsynced.add(index)
                for pack in group.packs:
                    self._pack_done(group, pack)  # packs with unused params count as zero
                group.reset_backward()
            if self._syncing:
                self._unsynced.clear()
                self._send_replicated_left()
            # End of backward: on CPU, issue every replicate stage still waiting.
            self.reduce_queue.issue_replicate_stages()
            if self._all_reduces is not None:
                self._all_reduces.wait_all()  # the replicated gradients, averaged

    def _send_replicated_left(self) -> None:
        """The replicated path's part of [Note: boundaries the synced backward does not
        reach]: a replicated parameter whose gradient micro-batches under ``no_sync``
        accumulated and the synced backward did not add to is all-reduced now, in the
        parameters' order, as on every rank."""
        if self._all_reduces is not None and self._replicated_unsynced:
            left = self._replicated_unsynced - self._replicated_sent
            for param in self._replicated:
                if id(param) in left and param.grad is not None:
                    self._all_reduces.submit(param.grad)
        self._replicated_unsynced.clear()
        self._replicated_sent.clear()

    def forget_unsynced(self) -> None:
        """The local gradients of the backwards under ``no_sync`` were dropped (``zero_grad``):
        no boundary waits for a synced backward any more."""
        self.unsynced_backward = False
        self._unsynced.clear()
        self._replicated_unsynced.clear()

    def _recover_from_aborted_backward(self) -> None:
        """A forward (not a recompute) begins while the final callback of the last backward
        is still due: that backward raised, and the autograd engine dropped the callbacks
        queued on it (see [Note: a backward that raised])."""
        self._final_queued = False
        for group in self.groups:
            group.reset_backward()
            group.reshard()

    # -- setup checks ----------------------------------------------------------------------------

    def _first_forward(self) -> None:
        """The runtime's first-forward init (it checks that ``fully_shard`` left every
        dedicated parameter registered, and packs them), then learn which pack each
        parameter's gradient goes to."""
        self._on_first_forward()
        where = {id(dp): (g, pack) for g in self.groups for pack in g.packs for dp in pack.params}
        self._pack_of_param = [where[id(dp)] for dp in self.params]
        self._initialised = True


def _weak_hook(weak_hooks: weakref.ref[BoundaryHooks], method: str, *args: Any) -> Any:
    """Call ``hooks.<method>(*args)`` if the hooks are still alive. Never traced by
    ``torch.compile``: dmuon's collectives run eagerly at a compiled block's edges (and in
    eager mode nothing imports the compiler)."""
    hooks = weak_hooks()
    if hooks is None:
        return None
    if torch.compiler.is_compiling():
        return _untraced(getattr(hooks, method), *args)
    return getattr(hooks, method)(*args)


@disable_dynamo
def _untraced(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def _replicated_grad(
    weak_hooks: weakref.ref[BoundaryHooks],
    weak_queue: weakref.ref[AllReduceQueue],
    param: torch.Tensor,
) -> None:
    hooks, queue = weak_hooks(), weak_queue()
    if hooks is None or queue is None or param.grad is None:
        return
    hooks._queue_final_callback()  # which waits for the queue (see hook_replicated)
    if hooks._syncing:
        if hooks._replicated_unsynced:  # only then does the end of backward need to know
            hooks._replicated_sent.add(id(param))
        queue.submit(param.grad)
    else:
        hooks._replicated_unsynced.add(id(param))


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with every floating-point tensor cast to ``dtype``."""
    return tree_map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, tree)
