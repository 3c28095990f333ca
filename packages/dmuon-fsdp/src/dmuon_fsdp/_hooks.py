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

Prefetch follows the forward order recorded by the previous forward (the first forward has no
prefetch): forward prefetches the next boundary, backward the previous one. All ranks run the
same model, so every rank issues the same collectives in the same order; a boundary used in a
different order than recorded only costs a broadcast issued early, never a wrong weight.
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd.profiler import record_function
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from ._group import DedicatedGroup, GroupState, Pack
from ._param import DedicatedParam

if TYPE_CHECKING:
    from ._runtime import DedicatedRuntime

__all__ = ["BoundaryHooks"]


class BoundaryHooks:
    """Owns the hook handles of one runtime and the state the hooks share."""

    def __init__(self, runtime: DedicatedRuntime) -> None:
        self.runtime = runtime
        self._order: list[DedicatedGroup] = []  # forward order of the previous forward
        self._current: list[DedicatedGroup] = []  # forward order so far in this forward
        self._final_queued = False
        self._checked_registration = False
        self._handles: list[RemovableHandle] = []
        # [Note: weak hooks] Not every container a hook lands in is visible to Python's cycle
        # collector (a tensor's hook dict is not), so a hook that held ``self`` (and through it
        # the runtime, the model and its weights) would keep a deleted model alive forever.
        # Every hook holds only a weak reference to this object and an index.
        weak_self = weakref.ref(self)
        for index, group in enumerate(runtime.groups):
            self._handles.append(
                group.module.register_forward_pre_hook(
                    functools.partial(_weak_hook, weak_self, "_pre_forward", "groups", index)
                )
            )
            self._handles.append(
                group.module.register_forward_hook(
                    functools.partial(_weak_hook, weak_self, "_post_forward", "groups", index)
                )
            )
        for index, dp in enumerate(runtime.params):
            self._handles.append(
                dp.param.register_post_accumulate_grad_hook(
                    functools.partial(
                        _weak_hook, weak_self, "_post_accumulate_grad", "params", index
                    )
                )
            )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- forward ---------------------------------------------------------------------------------

    def _neighbour(self, group: DedicatedGroup, step: int) -> DedicatedGroup | None:
        try:
            index = self._order.index(group) + step
        except ValueError:
            return None
        return self._order[index] if 0 <= index < len(self._order) else None

    def _pre_forward(self, group: DedicatedGroup, module: nn.Module, args: Any) -> None:
        if not self._checked_registration:
            self._check_registration()
        if _in_backward():
            # Activation checkpointing recomputes this forward inside backward: the weights
            # are needed again; order, counters and freeing belong to the real forward.
            with record_function("dmuon::pre_forward_recompute"):
                group.unshard()
            return
        with record_function("dmuon::pre_forward"):
            if group in self._current:
                self._order, self._current = self._current, []
            self._current.append(group)
            group.reset_backward()
            # An HSDP publish writes the weights this forward reads (on column replicas), also
            # when nothing is broadcast (a shard size of one).
            group.wait_publishes()
            if group.state is GroupState.FREED:
                group.to_broadcasting()
            following = self._neighbour(group, +1)
            if following is not None and following.state is GroupState.FREED:
                with record_function("dmuon::prefetch"):
                    following.to_broadcasting()
            if group.state is GroupState.BROADCASTING:
                group.to_ready()

    def _post_forward(
        self, group: DedicatedGroup, module: nn.Module, args: Any, output: Any
    ) -> None:
        if _in_backward():
            return  # recompute: the boundary is freed once its gradients are in
        with record_function("dmuon::post_forward"):
            if self.runtime.reshard_after_forward:
                group.to_freed()
            if not torch.is_grad_enabled():
                return
            tensors = [
                t
                for t in tree_flatten(output)[0]
                if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if tensors:
                group.needs_backward = True
            for tensor in tensors:
                tensor.register_hook(functools.partial(self._pre_backward, group))

    # -- backward --------------------------------------------------------------------------------

    def _pre_backward(self, group: DedicatedGroup, grad: torch.Tensor) -> None:
        if group.backward_started:
            return
        with record_function("dmuon::pre_backward"):
            self._queue_final_callback()
            group.backward_started = True
            if group.state is GroupState.FREED:
                group.to_broadcasting()
            previous = self._neighbour(group, -1)
            if (
                previous is not None
                and previous.needs_backward
                and not previous.backward_started
                and previous.state is GroupState.FREED
            ):
                with record_function("dmuon::prefetch"):
                    previous.to_broadcasting()
            if group.state is GroupState.BROADCASTING:
                group.to_ready()

    def _queue_final_callback(self) -> None:
        if not self._final_queued:
            self._final_queued = True
            self._order = list(self._current)
            torch.autograd.Variable._execution_engine.queue_callback(self._post_backward_final)

    def _post_accumulate_grad(self, dp: DedicatedParam, param: torch.Tensor) -> None:
        # Usually queued by a pre-backward already; not when the forward ran without grad
        # (reentrant activation checkpointing) and only the recompute built the graph.
        self._queue_final_callback()
        runtime = self.runtime
        pack = runtime.pack_of(dp)
        pack.grads_seen += 1
        if pack.grads_seen == len(pack.params):
            with record_function("dmuon::post_backward"):
                self._pack_done(runtime.group_of(dp), pack)

    def _pack_done(self, group: DedicatedGroup, pack: Pack) -> None:
        if pack.handled:
            return
        pack.handled = True
        if self.runtime.sync_grads:
            self.runtime.launch_reduce(group, pack)
        if all(p.handled for p in group.packs):
            self._free_after_backward(group)

    def _free_after_backward(self, group: DedicatedGroup) -> None:
        # Z2 keeps its weights across no_sync micro-batches; see [Note: the step protocol].
        if not (self.runtime.reshard_after_forward or self.runtime.sync_grads):
            return
        if group.state is GroupState.BROADCASTING:
            group.to_ready()
        if group.state is GroupState.READY:
            group.to_freed()

    def _post_backward_final(self) -> None:
        with record_function("dmuon::post_backward_final"):
            self._final_queued = False
            for group in self.runtime.groups:
                started = group.needs_backward or any(p.grads_seen for p in group.packs)
                if not started:
                    continue
                for pack in group.packs:
                    self._pack_done(group, pack)  # packs with unused params count as zero
                group.reset_backward()
            self.runtime.finish_backward()

    # -- setup checks ----------------------------------------------------------------------------

    def _check_registration(self) -> None:
        """FSDP2 replaces the parameters it manages on their modules: catch a dedicated
        parameter that it took (e.g. a fully_shard without dmuon's integration)."""
        self._checked_registration = True
        for dp in self.runtime.params:
            if dp.module._parameters.get(dp.name) is not dp.param:
                raise RuntimeError(
                    f"dedicated parameter {dp.fqn!r} is no longer registered on its module; "
                    "something replaced it after dedicate_params (fully_shard without "
                    "dmuon.install_patch()?). Call dedicate_params before fully_shard and do not "
                    "reassign dedicated parameters"
                )


def _weak_hook(
    weak_hooks: weakref.ref[BoundaryHooks], method: str, table: str, index: int, *args: Any
) -> Any:
    """Call ``hooks.<method>(runtime.<table>[index], *args)`` if the hooks are still alive."""
    hooks = weak_hooks()
    if hooks is None:
        return None
    return getattr(hooks, method)(getattr(hooks.runtime, table)[index], *args)


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1
