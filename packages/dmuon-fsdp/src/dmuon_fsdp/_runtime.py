"""The dedicated runtime: the one object ``dedicate_params`` attaches to a model.

The optimizer, checkpoint and diagnostics talk to the runtime only through the surface
listed in ARCHITECTURE.md ("dmuon-fsdp inside"): ``params``, ``owned``, ``coord``,
``world_group``, ``global_rank``, ``wait_all_reduces``, ``after_step`` and ``drain``. It owns
the groups (:mod:`._group`), the queue of pending gradient reductions
(:class:`~._collectives.ReduceQueue`) and the hooks (:mod:`._hooks`), which are handed both.

[Note: the step protocol]

1. forward: each boundary broadcasts its packs (prefetching the next boundary), Z3 frees them
   after the boundary's forward;
2. backward: Z3 re-broadcasts before the boundary's backward; when a pack's local gradients
   are complete they are reduced towards the global owner (two stages in HSDP); peer buffers
   are freed once the boundary's backward is done (Z2 and Z3 alike: Z2 kept them only to skip
   the backward broadcast). Under ``no_sync`` nothing is reduced, and Z2 keeps its buffers so
   that the next micro-batch does not broadcast again;
3. ``optimizer.step()``: ``wait_all_reduces()`` makes ``DedicatedParam.grad`` final on the
   owner; the optimizer updates ``DedicatedParam.full`` in place; ``after_step(async_)``
   invalidates any weights still kept elsewhere and, in HSDP, publishes the owner's packs to
   its shard column (waited at that boundary's next forward when ``async_``).
"""

from __future__ import annotations

import logging

from torch import nn
from torch.autograd.profiler import record_function
from torch.distributed import ProcessGroup

from dmuon_ownership import Owner, Plan

from ._collectives import ReduceQueue
from ._comm import CommCounter, DedicatedCommContext
from ._config import DedicateConfig
from ._group import DedicatedGroup
from ._hooks import BoundaryHooks
from ._mesh import MeshLayout
from ._param import DedicatedParam

__all__ = ["DedicatedRuntime", "get_runtime"]

logger = logging.getLogger(__name__)

RUNTIME_ATTR = "_dmuon_runtime"


class DedicatedRuntime:
    """Dedicated ownership of a model's Muon-target parameters (see [Note: the step protocol])."""

    def __init__(
        self,
        config: DedicateConfig,
        layout: MeshLayout,
        comm: DedicatedCommContext,
        plan: Plan,
        params: list[DedicatedParam],
        groups: list[DedicatedGroup],
    ) -> None:
        self.config = config
        self.layout = layout
        self.comm_ctx = comm
        self.plan = plan
        self.params = params
        self.groups = groups
        self.owned = [dp for dp in params if dp.is_owner]
        self.reduce_queue = ReduceQueue(comm)
        self.hooks = BoundaryHooks(
            groups,
            params,
            self.reduce_queue,
            reshard_after_forward=config.reshard_after_forward,
        )

    # -- the contract surface ------------------------------------------------------------------

    @property
    def coord(self) -> Owner:
        return self.layout.coord

    @property
    def world_group(self) -> ProcessGroup:
        return self.comm_ctx.world_group

    @property
    def counter(self) -> CommCounter:
        return self.comm_ctx.counter

    @property
    def reshard_after_forward(self) -> bool:
        return self.config.reshard_after_forward

    def global_rank(self, owner: Owner) -> int:
        return self.layout.global_rank(owner)

    @property
    def requires_gradient_sync(self) -> bool:
        return self.hooks.requires_gradient_sync

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Whether the next backward passes reduce dedicated gradients to their owners
        (``False``: accumulate locally, as ``no_sync`` does; the next synced backward reduces
        the sum). Mirrors FSDP2's ``FSDPModule.set_requires_gradient_sync``."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(
                f"requires_gradient_sync must be a bool, got {requires_gradient_sync!r}"
            )
        self.hooks.requires_gradient_sync = requires_gradient_sync

    def wait_all_reduces(self) -> None:
        """Block (CPU) or order the current stream (CUDA) until every owned gradient is final;
        also waits for pending publishes, whose source the optimizer is about to overwrite."""
        with record_function("dmuon::wait_reduces"):
            self.reduce_queue.wait_all()
            self.wait_all_replicate_broadcasts()

    def after_step(self, async_: bool = True) -> None:
        """The owners' weights changed: drop weights kept on peers (Z2) and, in HSDP, publish
        the owners' packs to their replicate peers (``async_``: waited at the next forward)."""
        with record_function("dmuon::after_step"):
            for group in self.groups:
                group.reshard()
            if self.layout.is_hsdp:
                with record_function("dmuon::publish"):
                    for group in self.groups:
                        group.publish()
                if not async_:
                    self.wait_all_replicate_broadcasts()
            if self.config.debug_fence:
                self.drain()
                self.comm_ctx.barrier()

    def drain(self) -> None:
        """Wait for every collective dmuon has in flight."""
        with record_function("dmuon::drain"):
            for group in self.groups:
                group.wait_for_unshard()
            self.wait_all_reduces()

    def wait_all_replicate_broadcasts(self) -> None:
        for group in self.groups:
            group.wait_for_publish()

    def remove(self) -> None:
        """Remove every hook (the parameters keep their current storage)."""
        self.hooks.remove()


def get_runtime(model: nn.Module) -> DedicatedRuntime:
    """The runtime :func:`dedicate_params` attached to ``model``."""
    runtime = getattr(model, RUNTIME_ATTR, None)
    if not isinstance(runtime, DedicatedRuntime):
        raise ValueError(
            f"{type(model).__name__} has no dmuon runtime: call dmuon.dedicate_params(model, "
            "mesh, predicate) first, on the same model object"
        )
    return runtime
