"""The dedicated runtime: the one object ``dedicate_params`` attaches to a model.

The optimizer, checkpoint and diagnostics talk to the runtime only through the surface
listed in ARCHITECTURE.md ("dmuon-fsdp inside"): ``params``, ``owned``, ``coord``,
``world_group``, ``global_group``, ``global_rank``, ``wait_all_reduces``, ``after_step`` and
``drain``. It owns the groups (:mod:`._group`), the queue of pending gradient reductions
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
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from dmuon_ownership import Owner, Plan

from .._profile import span
from ..topology._comm import CommCounter, DedicatedCommContext
from ..topology._mesh import MeshLayout
from ._collectives import AllReduceQueue, ReduceQueue
from ._config import DedicateConfig
from ._group import DedicatedGroup
from ._guard import NotHeldError, guard_parameter, is_dedicated
from ._hooks import BoundaryHooks
from ._param import DedicatedParam
from ._precision import fsdp_mp_policy, resolve_precision

__all__ = ["DedicatedRuntime", "get_runtime"]

logger = logging.getLogger(__name__)

RUNTIME_ATTR = "_dmuon_runtime"


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
        # The contract surface (ARCHITECTURE.md), kept as plain attributes.
        self.coord: Owner = layout.coord
        self.world_group: ProcessGroup = comm.world_group
        # Every rank, TP grids included: where global quantities are reduced (see [Note:
        # global quantities] in _comm).
        self.global_group: ProcessGroup = comm.global_group
        self.counter: CommCounter = comm.counter
        self.reshard_after_forward = config.reshard_after_forward
        self.plan = plan
        self.params = params
        self.groups = groups
        self.owned = [dp for dp in params if dp.is_owner]
        self.reduce_queue = ReduceQueue(comm)
        # The replicated path's other parameters (``replicate``), summed over every rank.
        self.all_reduce_queue = AllReduceQueue(comm)
        self.replicated_params: list[nn.Parameter] = []
        self._model = weakref.ref(model)
        self._final = False  # packed with the precision fully_shard asks for
        self.hooks = BoundaryHooks(
            groups,
            params,
            self.reduce_queue,
            reshard_after_forward=config.reshard_after_forward,
            on_first_forward=self.lazy_init,
        )
        if not any(dp.param.is_meta for dp in params):
            self._pack(dict(model.named_modules()), final=False)

    def lazy_init(self) -> None:
        """Finish packing (once): resolve each dedicated parameter's precision with the
        ``MixedPrecisionPolicy`` of the ``fully_shard`` that now encloses it and repack the
        groups whose precision changed; a model built on the meta device is packed here for
        the first time. Runs at the first forward, ``Muon(...)``, or the first checkpoint or
        diagnostics call, whichever comes first (see [Note: mixed precision] and [Note:
        meta-device models]). Collective in HSDP: every rank reaches it at the same point."""
        if self._final:
            return
        model = self._model()
        assert model is not None, "the model this runtime belongs to was deleted"
        self._pack(dict(model.named_modules()), final=True)

    def _pack(self, modules: dict[str, nn.Module], final: bool) -> None:
        """Pack every group whose members' precision is new. ``final=False`` (at
        ``dedicate_params``) resolves without FSDP2's policy, which is not known yet: the
        parameters are packed in the dtypes ``param_policy`` asks for, and peers free their
        memory at once."""
        self._adopt_replaced()
        changed = False
        for group in self.groups:
            mp = fsdp_mp_policy(modules, group.fqn) if final else None
            members = [dp for dps in group.members for dp in dps]
            precisions = []
            for dp in members:
                _check_materialised(dp)
                param_dtype = dp.dtype if dp.precision is not None else dp.param.dtype
                precisions.append(resolve_precision(param_dtype, dp.policy, mp))
            if group.packs and precisions == [dp.precision for dp in members]:
                continue
            if self.config.replicated and any(p.mixed for p in precisions):
                raise ValueError(
                    f"dedicate_params_ddp: param_policy asks a separate compute dtype for a "
                    f"parameter of {group.fqn!r}; the replicated path keeps and steps each "
                    "weight in one dtype: drop param_dtype/master_dtype from the policy (or "
                    "cast the model), or use dedicate_params + fully_shard"
                )
            for dp, precision in zip(members, precisions):
                dp.precision = precision
            group.pack()
            changed = True
        self._final = final
        if changed and (self.layout.is_hsdp or self.config.replicated):
            # Copies start from the owner's weight, whatever their own init was.
            self.after_step(async_=False)

    def replicate(self, params: list[nn.Parameter]) -> None:
        """The replicated path: average ``params``' gradients over every rank after backward
        (see [Note: the replicated path] in ``_replicate``)."""
        self.replicated_params = list(params)
        self.hooks.hook_replicated(self.replicated_params, self.all_reduce_queue)

    def _adopt_replaced(self) -> None:
        """``model.to_empty(device=...)`` replaces each meta parameter with a new
        ``nn.Parameter`` (torch cannot change a tensor's device in place), or, for a
        tensor-parallel ``DTensor``, swaps the new one's contents into the old object
        (``torch.utils.swap_tensors``, which takes its class and attributes, the guard's
        among them): take the new objects over as the dedicated parameters and guard them. A
        weight registered under two names (tied) comes back as two unrelated parameters;
        re-tie them after ``to_empty``, as for any model."""
        for index, dp in enumerate(self.params):
            current = dp.module._parameters.get(dp.name)
            if not isinstance(current, nn.Parameter) or is_dedicated(current):
                continue
            if current is not dp.param and not dp.param.is_meta:
                continue
            guard_parameter(current, dp.where)
            dp.param = current
            self.hooks.rebind(index)

    # -- the contract surface ------------------------------------------------------------------

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
        with span("dmuon::wait_reduces"):
            self.reduce_queue.wait_all()
            self.all_reduce_queue.wait_all()
            self.wait_all_replicate_broadcasts()

    def after_step(self, async_: bool = True) -> None:
        """The owners' weights changed: drop weights kept on peers (Z2) and, in HSDP, publish
        the owners' packs to their replicate peers (``async_``: waited at the next forward)."""
        with span("dmuon::after_step"):
            for group in self.groups:
                group.reshard()
            if self.layout.is_hsdp or self.config.replicated:
                with span("dmuon::publish"):
                    for group in self.groups:
                        group.publish()
                if not async_:
                    self.wait_all_replicate_broadcasts()
            if self.config.debug_fence:
                self.drain()
                self.comm_ctx.barrier()

    def drain(self) -> None:
        """Wait for every collective dmuon has in flight (packing first, if not yet done)."""
        self.lazy_init()
        with span("dmuon::drain"):
            for group in self.groups:
                group.wait_for_unshard()
            self.wait_all_reduces()

    def wait_all_replicate_broadcasts(self) -> None:
        for group in self.groups:
            group.wait_for_publish()

    def remove(self) -> None:
        """Remove every hook (the parameters keep their current storage)."""
        self.hooks.remove()


class _CheckedApply:
    """[Note: conversions after packing] Once a dedicated weight lives in a pack (a view into
    a packed buffer on its owner, nothing on a peer), ``model.to(dtype)``, ``.half()``,
    ``.to(other device)`` or ``.to_empty()`` cannot convert it: on a peer it is not even there,
    so such a call used to convert the rest of the model, stop at the first weight the rank
    does not hold (a different one on each rank) and leave the ranks with different dtypes,
    which the next collective turned into a crash. So every module above a dedicated parameter
    checks first, in its ``_apply`` (what ``nn.Module``'s conversions all go through), whether
    the conversion would change any dedicated parameter under it, and refuses it before
    anything is converted, on every rank alike. Conversions that change nothing (``.to()`` the
    device and dtype the model has: see [Note: reads on a peer] in ``_guard``) go through,
    converting the rest of the module and leaving the dedicated parameters alone, and before
    packing (a meta-device model's ``to_empty``) everything goes through."""

    def __init__(self, module: nn.Module, params: list[DedicatedParam]) -> None:
        self._module = weakref.ref(module)
        self._params = params

    def __call__(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Any:
        module = self._module()
        assert module is not None, "_apply of a deleted module"
        for dp in self._params:
            if dp.precision is None:  # not packed yet
                continue
            with torch.no_grad():
                try:
                    unchanged = fn(dp.param) is dp.param
                except NotHeldError:
                    unchanged = False
            if not unchanged:
                raise ValueError(
                    f"{type(module).__name__}.to()/.half()/.to_empty() would convert dedicated "
                    f"parameter {dp.fqn!r}, which lives in dmuon's packed buffers (only on its "
                    "owner): nothing was converted. Build the model in the dtype and on the "
                    "device it trains in before dmuon.dedicate_params (a meta-device model "
                    "may be materialised with to_empty until its first forward); for a lower "
                    "compute dtype use FSDP2's MixedPrecisionPolicy or param_policy"
                )
        # Every packed dedicated parameter stays as it is: keep nn.Module._apply away from
        # those this module holds (it would re-set or swap each, which a tensor-parallel
        # peer's cannot be), and put them back in their places.
        packed = [dp.param for dp in self._params if dp.precision is not None]
        held = {
            name: p
            for name, p in module._parameters.items()
            if p is not None and any(p is q for q in packed)
        }
        module._parameters.update(dict.fromkeys(held))
        try:
            return type(module)._apply(module, fn, recurse)
        finally:
            module._parameters.update(held)


def check_conversions(model: nn.Module, params: list[DedicatedParam]) -> None:
    """Install :class:`_CheckedApply` on every module above a dedicated parameter."""
    under: dict[str, list[DedicatedParam]] = {}
    for dp in params:
        parts = dp.fqn.split(".")[:-1]
        for depth in range(len(parts) + 1):
            under.setdefault(".".join(parts[:depth]), []).append(dp)
    for path, dps in under.items():
        module = model.get_submodule(path)
        # An instance attribute: nn.Module's conversions call self._apply.
        object.__setattr__(module, "_apply", _CheckedApply(module, dps))


def _check_materialised(dp: DedicatedParam) -> None:
    """[Note: meta-device models] ``dedicate_params`` only plans: a model built under
    ``torch.device("meta")`` can be dedicated, sharded and materialised with
    ``model.to_empty(device=...)`` as torchtitan does. Until the runtime packs its parameters
    every rank holds each dedicated weight whole, so initialising there (``init_weights()``)
    runs on every rank with the same generator state, like on a model built normally, and
    packing then keeps each weight on its owner; ``dmuon.set_model_state_dict`` loads a full
    state dict instead."""
    if dp.param.is_meta:
        raise RuntimeError(
            f"dedicated parameter {dp.fqn!r} is still on the meta device: materialise the model "
            "first (model.to_empty(device=...) after fully_shard, then init_weights() or "
            "dmuon.set_model_state_dict(model, state_dict)) before the first forward, "
            "Muon(...) or a checkpoint call"
        )


def get_runtime(model: nn.Module) -> DedicatedRuntime:
    """The runtime :func:`dedicate_params` attached to ``model``."""
    runtime = getattr(model, RUNTIME_ATTR, None)
    if not isinstance(runtime, DedicatedRuntime):
        raise ValueError(
            f"{type(model).__name__} has no dmuon runtime: call dmuon.dedicate_params(model, "
            "mesh, predicate) first, on the same model object"
        )
    return runtime
