"""The dedicated runtime: the one object ``dedicate_params`` attaches to a model.

The optimizer, checkpoint and diagnostics talk to the runtime only through the surface
listed in ARCHITECTURE.md ("dmuon-fsdp inside"): ``params``, ``owned``, ``coord``,
``world_group``, ``global_rank``, ``wait_all_reduces``, ``after_step`` and ``drain``. Hooks
(:mod:`._hooks`) drive the per-step collectives; this object keeps what outlives one hook:
the queue of gradient reductions and the HSDP publishes.

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
from collections import deque
from dataclasses import dataclass

from torch import nn
from torch.autograd.profiler import record_function
from torch.distributed import ProcessGroup

from dmuon_ownership import Owner, Plan

from ._collectives import CommCounter
from ._comm import DedicatedCommContext, ProcessGroupPolicy
from ._group import DedicatedGroup, GroupState, Pack, PendingReduce, finish_reduce, issue_stage2
from ._mesh import MeshLayout
from ._param import DedicatedParam

__all__ = ["DedicateConfig", "DedicatedRuntime", "get_runtime"]

logger = logging.getLogger(__name__)

RUNTIME_ATTR = "_dmuon_runtime"


@dataclass(frozen=True)
class DedicateConfig:
    """The options of :func:`dedicate_params` that shape the runtime."""

    reshard_after_forward: bool = True
    hook_boundary_strict: bool = True
    process_group_policy: ProcessGroupPolicy = ProcessGroupPolicy.ISOLATED
    small_param_threshold: int = 5_000_000
    # Drain and barrier every dmuon group at the end of ``after_step``: for diagnosing
    # ordering problems only, it removes the cross-step overlap (never for benchmarks).
    debug_fence: bool = False


class DedicatedRuntime:
    """Dedicated ownership of a model's Muon-target parameters (see [Note: the step protocol])."""

    def __init__(
        self,
        model: nn.Module,
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
        # Whether backward reduces gradients (False inside ``no_sync``).
        self.sync_grads = True
        self._reduces: deque[PendingReduce] = deque()
        self._group_of: dict[int, DedicatedGroup] = {}
        self._pack_of: dict[int, Pack] = {}
        for group in groups:
            for pack in group.packs:
                for dp in pack.params:
                    self._group_of[id(dp)] = group
                    self._pack_of[id(dp)] = pack
        self._model_ref = model
        from ._hooks import BoundaryHooks  # hooks need the runtime; avoid an import cycle

        self.hooks = BoundaryHooks(self)

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

    def group_of(self, dp: DedicatedParam) -> DedicatedGroup:
        return self._group_of[id(dp)]

    def pack_of(self, dp: DedicatedParam) -> Pack:
        return self._pack_of[id(dp)]

    def wait_all_reduces(self) -> None:
        """Block (CPU) or order the current stream (CUDA) until every owned gradient is final;
        also waits for pending publishes, whose source the optimizer is about to overwrite."""
        with record_function("dmuon::wait_reduces"):
            self._advance_stage2(block=True)
            divisor = self.layout.world_size
            while self._reduces:
                finish_reduce(self._reduces.popleft(), divisor)
            self.wait_all_replicate_broadcasts()

    def after_step(self, async_: bool = True) -> None:
        """The owners' weights changed: drop weights kept on peers (Z2) and, in HSDP, publish
        the owners' packs to their replicate peers (``async_``: waited at the next forward)."""
        with record_function("dmuon::after_step"):
            for group in self.groups:
                if group.state is GroupState.BROADCASTING:
                    group.to_ready()
                if group.state is GroupState.READY:
                    group.to_freed()
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
                if group.state is GroupState.BROADCASTING:
                    group.to_ready()
            self.wait_all_reduces()

    def wait_all_replicate_broadcasts(self) -> None:
        for group in self.groups:
            group.wait_publishes()

    # -- gradient reduction, called by the hooks ---------------------------------------------

    def launch_reduce(self, group: DedicatedGroup, pack: Pack) -> None:
        with record_function("dmuon::reduce"):
            if self.layout.world_size == 1:
                group.keep_local_grads(pack)
                return
            self._reduces.append(group.reduce_pack(pack))
            self._advance_stage2(block=False)

    def _advance_stage2(self, block: bool) -> None:
        """Issue the replicate-axis stage of queued reductions, in FIFO order.

        The issue points are deterministic (never "when the shard stage happens to be done"),
        so every member of a replicate group issues the same sequence even when that group is
        shared with FSDP2 (``process_group_policy="shared"``): without ``block`` every queued
        reduction but the newest gets its second stage (its shard stage was issued one pack
        earlier, so waiting for it rarely blocks on CPU and never blocks the host on CUDA);
        with ``block`` all of them do.
        """
        queued = [p for p in self._reduces if p.needs_stage2 and p.stage2 is None]
        if not block:
            queued = queued[:-1]
        for pending in queued:
            issue_stage2(self.comm_ctx, pending)

    def finish_backward(self) -> None:
        """End of a backward pass: on CPU, issue every replicate stage still waiting."""
        self._advance_stage2(block=True)

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
