"""The dedicated runtime: the one object ``dedicate_params`` attaches to a model.

The optimizer, checkpoint and diagnostics talk to the runtime through the surface listed in
ARCHITECTURE.md ("dmuon-fsdp inside"). It owns the groups (:mod:`._group`), the queue of pending gradient reductions
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
   invalidates any weights still kept elsewhere and publishes the owner's packs: in HSDP to
   its shard column, on the replicated path to every rank (waited at that boundary's next
   forward when ``async_``).
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Never

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from dmuon_ownership import Owner, ParamPolicy, Plan

from .._checks import check_bool
from .._profile import span
from .._torch_internals import (
    after_fsdp_root_post_backward,
    fsdp_gradient_divide_factor,
    fsdp_gradient_sync_reader,
    fsdp_manages,
    fsdp_unreduced_grads_dropper,
    in_backward,
)
from ..holder import (
    DEEPCOPY_FIX,
    FULLY_SHARD_FIX,
    DedicatedParam,
    ExpertStack,
    NotHeldError,
    ParamHolder,
    Role,
    fsdp_modules,
    fsdp_modules_above,
    is_dedicated,
    mp_policy_above,
    resolve_precision,
)
from ..topology import CommCounter, DedicatedCommContext, MeshLayout
from ._collectives import AllReduceQueue, GradListener, ReduceQueue
from ._config import DedicateConfig
from ._group import DedicatedGroup
from ._hooks import BoundaryHooks
from ._pack import Pack, without_storage

__all__ = ["DedicatedRuntime", "get_runtime"]

# Reads the factor FSDP2's set_gradient_divide_factor gave a module (None: not set).
Reader = Callable[[], float | None]

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
        tied_names: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config
        self.layout = layout
        self.comm_ctx = comm
        # The contract surface (ARCHITECTURE.md), kept as plain attributes.
        self.coord: Owner = layout.coord
        self.world_group: ProcessGroup = comm.world_group
        # Every rank of the model, TP grids included: where quantities of the model are
        # reduced (see [Note: global quantities] in _comm).
        self.global_group: ProcessGroup = comm.global_group
        # Every rank of every pipeline stage (global_group without pipeline parallelism): the
        # step's non-finite decision and clip norm (see [Note: pipeline stages] in _mesh).
        self.step_group: ProcessGroup = comm.everyone
        self.counter: CommCounter = comm.counter
        self.reshard_after_forward = config.reshard_after_forward
        self.plan = plan
        self.params = params
        self.groups = groups
        self.owned = [dp for dp in params if dp.is_owner]
        self.reduce_queue = ReduceQueue(comm, self._grad_divisors)
        # The replicated path's other parameters (``replicate``), summed over every rank.
        self.all_reduce_queue = AllReduceQueue(comm)
        self.replicated_params: list[nn.Parameter] = []
        # Muon expert stacks stepped where FSDP2 puts them, and the param_policy that routed
        # every selected parameter (both set by dedicate_params).
        self.local_muon: list[ExpertStack] = []
        # The other names of each tied dedicated weight (alias -> its name): to_empty keeps
        # them tied (see _adopt_materialised), and Muon(model) refuses one replaced since.
        self.tied_names: dict[str, str] = dict(tied_names or {})
        self.param_policy: ParamPolicy | None = None
        # The dmuon.Muon that stepped the gradients of the last backward (held weakly), None
        # before the first such step (see [Note: one Muon per model] in optim._usage_checks).
        self.stepped_by: weakref.ref[Any] | None = None
        self._model = weakref.ref(model)
        # Reads FSDP2's gradient sync flags; made at the first backward (see _fsdp_sync_off).
        self._fsdp_sync_reader: Callable[[], bool] | None = None
        # Drops FSDP2's held unsharded gradients; made at the first clear_grads (see there).
        self._fsdp_grad_dropper: Callable[[], None] | None = None
        # Where each pack's gradient divisors come from, set at its first reduce (see
        # _grad_divisors): the readers of its parameters' factors (None: the world size), one
        # per module, and each parameter's reader in that list.
        self._divisor_sources: dict[Pack, tuple[list[Reader | None], list[int]]] = {}
        self._final = False  # packed with the precision fully_shard asks for
        # The zero gradients zero_grad(set_to_none=False) gave each owner, by id(dp): zeroed in
        # place at the next such call while still its gradient (see clear_grads).
        self._zeroed_grads: dict[int, torch.Tensor] = {}
        # The root's reset_iter_state follows FSDP2's with dmuon's (see _follow_fsdp_reset).
        self._follows_fsdp_reset = False
        self._follows_pipeline = False
        # The modules that register a tied dedicated weight under another name, by its name.
        tied_modules: dict[str, list[nn.Module]] = {}
        # The same, with the attribute each registers it under (see _check_no_new_names).
        self._tied_places: dict[str, list[tuple[nn.Module, str]]] = {}
        for alias, fqn in self.tied_names.items():
            prefix, _, attribute = alias.rpartition(".")
            tied_modules.setdefault(fqn, []).append(model.get_submodule(prefix))
            self._tied_places.setdefault(fqn, []).append((model.get_submodule(prefix), attribute))
        self.hooks = BoundaryHooks(
            groups,
            params,
            self.reduce_queue,
            reshard_after_forward=config.reshard_after_forward,
            on_first_forward=self._finish_init,
            check_alive=comm.check_alive,
            fsdp_sync_off=self._fsdp_sync_off,
            tied_modules=tied_modules,
        )
        if not any(dp.param.is_meta for dp in params):
            self._pack(dict(model.named_modules()), final=False)

    def lazy_init(self) -> None:
        """Adopt what ``to_empty`` materialised, check that every dedicated parameter is still
        the one registered on its module (see [Note: a fully_shard that takes a dedicated
        parameter]), then finish packing (once): resolve each dedicated parameter's precision
        with the ``MixedPrecisionPolicy`` of the ``fully_shard`` that now encloses it and
        repack the groups whose precision changed; a model built on the meta device is packed
        here for the first time. Runs at ``Muon(...)`` and every checkpoint or diagnostics
        call, and at the first forward without the adoption (:meth:`_finish_init`); the
        packing happens at whichever comes first (see [Note: mixed precision] and [Note:
        meta-device models]). Collective in HSDP: every rank reaches it at the same point.
        First it checks that the process groups are still alive (see [Note: a destroyed
        process group] in ``topology._comm``)."""
        self.comm_ctx.check_alive()
        self._adopt_materialised()
        self._finish_init()

    def _finish_init(self) -> None:
        """:meth:`lazy_init` after the adoption; all of it at the first forward, where nothing
        is adopted: ``fully_shard`` has put its unsharded parameters on the modules running
        now, and a meta parameter replaced by one of those must raise, not be taken for a
        materialised one (``to_empty``'s replacements were adopted when it ran)."""
        self._check_registered()
        self._finish_packing()
        self._follow_fsdp_reset()
        self._follow_pipeline_schedule()

    def _follow_fsdp_reset(self) -> None:
        """Once the model is a ``fully_shard`` root, make its ``reset_iter_state`` reset
        dmuon's iteration too, after FSDP2's own (on this instance only, as ``zero_grad``, see
        [Note: Module.zero_grad]): see [Note: a forward that raised] in :mod:`._hooks`."""
        model = self._model()
        if self._follows_fsdp_reset or not isinstance(model, FSDPModule):
            return
        fsdp_reset = getattr(model, "reset_iter_state", None)  # torch 2.13 on
        if fsdp_reset is None:
            return
        hooks = weakref.ref(self.hooks)

        def reset_iter_state() -> None:
            fsdp_reset()
            live = hooks()
            if live is not None:
                live.reset_iteration()

        functools.update_wrapper(reset_iter_state, fsdp_reset)
        model.reset_iter_state = reset_iter_state  # type: ignore[method-assign]
        self._follows_fsdp_reset = True

    def _follow_pipeline_schedule(self) -> None:
        """With pipeline parallelism, once the stage module is a ``fully_shard`` root, learn
        when a pipeline schedule ends its backward (see [Note: the pipeline schedule's
        reduce])."""
        model = self._model()
        if self._follows_pipeline or self.layout.pp_size == 1 or not isinstance(model, FSDPModule):
            return
        runtime = weakref.ref(self)

        def after() -> None:
            live = runtime()
            if live is not None:
                live._pipeline_backward_ended()

        after_fsdp_root_post_backward(model, after)
        self._follows_pipeline = True

    def _pipeline_backward_ended(self) -> None:
        """FSDP2's root post-backward ran: outside a backward, with gradient sync on (FSDP2's
        and dmuon's own: a schedule run inside ``dmuon.no_sync`` is not reduced) and gradients
        accumulated under ``no_sync``, it is a pipeline schedule's end of backward, and the
        next step (or clip) reduces them (see [Note: the pipeline schedule's reduce])."""
        hooks = self.hooks
        if (
            not in_backward()
            and hooks.unsynced_backward
            and hooks.requires_gradient_sync
            and not self._fsdp_sync_off()
        ):
            hooks.reduce_due = True

    def finish_pipeline_backward(self) -> None:
        """Reduce what the backwards of a pipeline schedule accumulated, if its end of backward
        ran since (collective over the stage's ranks, which all reach it at their step or
        clip).

        [Note: the pipeline schedule's reduce]
        A schedule of ``torch.distributed.pipelining`` runs each micro-batch's backward on an
        FSDP2 stage module with gradient sync off (``set_requires_gradient_sync(False)``), so
        dmuon, which follows that flag (see [Note: FSDP2's gradient sync] in ``_no_sync``),
        accumulates each dedicated gradient on its rank as under ``no_sync``. After the last
        micro-batch the schedule turns sync back on and runs FSDP2's post-backward and root
        callback by hand, outside any backward (``perform_reduce_grad``), then divides every
        ``.grad`` of the stage by the number of micro-batches (``scale_grads``). dmuon sees the
        hand-run callback (:func:`after_fsdp_root_post_backward`), but it reduces nothing
        there: its gradients would leave ``.grad`` before that division, and the owners would
        step a gradient the number of micro-batches times too large. It marks the reduce as
        due instead, and the next ``step()``, clip or ``wait_all_reduces`` issues it first: the
        reduces a synced backward would have issued, of the divided local sums, on every rank
        of the stage in the boundaries' order. (Under mixed precision those sums are kept in
        ``.grad`` in the reduce dtype, so the division reaches them there: see [Note:
        accumulating in the reduce dtype] in holder/_precision.) A backward under ``no_sync`` that no such
        callback followed (the user's own loop) is still refused at the step (see [Note: a
        step after no_sync]); ``zero_grad`` drops a due reduce with the gradients."""
        if self.hooks.reduce_due:
            self.hooks.reduce_unsynced()

    def _live_model(self) -> nn.Module:
        """The model this runtime belongs to (held weakly: the model holds the runtime)."""
        model = self._model()
        assert model is not None, "the model this runtime belongs to was deleted"
        return model

    def _fsdp_sync_off(self) -> bool:
        """Whether FSDP2's gradient sync is off on every ``fully_shard`` module of the model
        (see [Note: FSDP2's gradient sync] in :mod:`._no_sync`). The modules are found at the
        first backward, after the first forward, by which ``fully_shard`` has run, and with
        them their FSDP2 parameter groups, whose flags each backward reads."""
        if self._fsdp_sync_reader is None:
            model = self._live_model()
            modules = [module for _, module in fsdp_modules(model)]
            self._fsdp_sync_reader = fsdp_gradient_sync_reader(modules)
        return self._fsdp_sync_reader()

    def _grad_divisors(self, pack: Pack) -> float | list[float]:
        """What the owner divides ``pack``'s summed gradients by (see [Note: gradient
        reduction] in ``_collectives``): for each parameter the factor that
        ``set_gradient_divide_factor`` gave the nearest ``fully_shard`` module at or above its
        module that holds FSDP2 parameters (FSDP2 keeps the factor there: set on a module
        without any, it has no effect, with or without dmuon), read at each reduce as FSDP2
        reads it; the world size where none was given. One number when they agree. The
        modules are found at the pack's first reduce; later reduces read one factor per
        module, not per parameter."""
        sources = self._divisor_sources.get(pack)
        if sources is None:
            sources = self._divisor_sources[pack] = self._find_divisor_sources(pack)
        readers, index = sources
        world_size = self.layout.world_size
        factors = [world_size if r is None or (f := r()) is None else f for r in readers]
        if len(set(factors)) == 1:
            return factors[0]
        return [factors[i] for i in index]

    def _find_divisor_sources(self, pack: Pack) -> tuple[list[Reader | None], list[int]]:
        """The readers of the factors of ``pack``'s parameters, one per module (``None`` where
        no ``fully_shard`` module with parameters is above: the world size), and each
        parameter's index among them (see :meth:`_grad_divisors`)."""
        model = self._live_model()
        modules = dict(model.named_modules())
        readers: list[Reader | None] = []
        found: dict[int, int] = {}  # id of the module (0: none) -> its index in readers
        index = []
        for dp in pack.params:
            above = fsdp_modules_above(modules.get, dp.fqn.rpartition(".")[0])
            source = next(
                ((m, r) for m in above if (r := fsdp_gradient_divide_factor(m)) is not None),
                None,
            )
            key = 0 if source is None else id(source[0])
            if key not in found:
                found[key] = len(readers)
                readers.append(None if source is None else source[1])
            index.append(found[key])
        return readers, index

    def _finish_packing(self) -> None:
        if self._final:
            return
        model = self._live_model()
        self._pack(dict(model.named_modules()), final=True)

    def _pack(self, modules: dict[str, nn.Module], final: bool) -> None:
        """Pack every group whose members' precision is new. ``final=False`` (at
        ``dedicate_params``) resolves without FSDP2's policy, which is not known yet: the
        parameters are packed in the dtypes ``param_policy`` asks for, and peers free their
        memory at once."""
        changed = False
        for group in self.groups:
            members = [dp for dps in group.members for dp in dps]
            precisions = []
            for dp in members:
                _check_materialised(dp)
                param_dtype = dp.dtype if dp.precision is not None else dp.param.dtype
                # The policy of the nearest fully_shard module that holds the parameter: its
                # boundary's, or that of a fully_shard module inside the boundary, which casts
                # the inputs of the module that reads the weight.
                path = dp.fqn.rpartition(".")[0]
                mp = mp_policy_above(modules, path) if final else None
                precisions.append(resolve_precision(param_dtype, dp.policy, mp))
            if group.packs and precisions == [dp.precision for dp in members]:
                continue
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

    def _adopt_materialised(self) -> None:
        """``model.to_empty(device=...)`` replaces each meta parameter with a new
        ``nn.Parameter`` (torch cannot change a tensor's device in place), or, for a
        tensor-parallel ``DTensor``, swaps the new one's contents into the old object
        (``torch.utils.swap_tensors``, which takes its class and attributes, the guard's
        among them): take the new objects over as the dedicated parameters and guard them. A
        weight registered under two names (tied) stays tied, as FSDP2 keeps its own tied
        parameters: :class:`_CheckedApply` converts it under its own name only, and the new
        object goes under its other names here. Runs after every conversion of a module above
        a dedicated parameter or one of its other names (:class:`_CheckedApply`) and in
        :meth:`lazy_init`; leaves anything else that replaced a parameter to
        :meth:`_check_registered`."""
        model = self._model()
        for index, dp in enumerate(self.params):
            current = dp.module._parameters.get(dp.name)
            if current is None or is_dedicated(current):
                continue
            swapped = current is dp.param
            materialised = dp.param.is_meta and not isinstance(current, DTensor)
            if not (swapped or materialised):
                continue
            if materialised and model is not None:
                self._retie(model, dp.param, current)
            dp.attach(current)
            self.hooks.rebind(index)
            if self._holds_nothing(dp):
                dp.drop_storage()

    def _retie(self, model: nn.Module, old: nn.Parameter, new: nn.Parameter) -> None:
        """Register ``new`` under every other name of the tied weight ``old`` was (those
        :class:`_CheckedApply` left unconverted still hold ``old``)."""
        for alias in self.tied_names:
            prefix, _, name = alias.rpartition(".")
            module = model.get_submodule(prefix)
            if module._parameters.get(name) is old:
                module._parameters[name] = new

    def _holds_nothing(self, dp: DedicatedParam) -> bool:
        """Whether this rank keeps no storage for ``dp`` until it is packed: a peer's weight
        before packing (see [Note: meta-device models])."""
        return dp.precision is None and dp.role is Role.PEER and not self.config.replicated

    def _check_registered(self) -> None:
        """[Note: a fully_shard that takes a dedicated parameter] ``fully_shard`` manages every parameter it is not
        told to ignore: it replaces each on its module with a sharded ``DTensor`` (and, during
        the module's forward, with an unsharded copy). A dedicated parameter it took would be
        updated twice (by dmuon on its owner, and as an FSDP2 shard by whoever steps those), so
        every entry point that can see it refuses to go on: ``Muon(model)``, the first forward,
        and every checkpoint and diagnostics call check that each dedicated parameter is still
        the object registered on its module. A parameter replaced under a ``fully_shard``
        module was taken by it (a ``fully_shard`` given ``ignored_params`` never touches
        them), whatever it was replaced with: a sharded ``DTensor``, or inside the module's
        forward its unsharded copy (FSDP2's parameter group says which parameters it manages);
        a parameter replaced by anything else (an assignment) is named as such. The check reads
        only the modules' parameters and changes nothing, so a failed call leaves the model as
        it was.

        Such a ``fully_shard`` (one called with ``patch_fully_shard=False`` and without
        ``ignored_params``) already fails on most ranks: sharding reads the weight, which a
        peer does not hold, and the guard raises (see [Note: reads on a peer]). Both places
        raise the same error with the same fixes (``FULLY_SHARD_FIX``), so every rank stops, at ``fully_shard`` or at ``Muon(model)`` at the latest,
        before any of dmuon's collectives could wait for a rank that stopped."""
        model = self._live_model()
        self._check_modules_present(model)
        self._check_no_new_names(model)
        for dp in self.params:
            current = dp.module._parameters.get(dp.name)
            if current is dp.param:
                continue
            if self._taken_by_fully_shard(dp):
                kind = "a DTensor shard" if isinstance(current, DTensor) else "its unsharded copy"
                fix = _REPLICATED_FIX if self.config.replicated else FULLY_SHARD_FIX
                raise RuntimeError(
                    f"{dp.where} was taken by fully_shard (FSDP2 replaced it on its module with "
                    f"{kind}). {fix}"
                )
            raise RuntimeError(
                f"dedicated parameter {dp.fqn!r} is no longer registered on its module: "
                "something replaced it after dedicate_params (an assignment to the attribute, "
                "such as a tie made after it, or a fully_shard that took it through another "
                f"module sharing it). {FULLY_SHARD_FIX}; do not reassign dedicated parameters "
                "(tie weights before dedicate_params)"
            )

    def _check_modules_present(self, model: nn.Module) -> None:
        """Raise where the module that holds a dedicated parameter is no longer in ``model``.

        [Note: a module swapped after dedicate_params]
        A swap of the module that holds a dedicated parameter (torchao's
        ``convert_to_float8_training`` replaces each ``nn.Linear`` with a ``Float8Linear``
        that takes the same weight object) leaves the holder's module out of the model while
        the parameter lives on in the new one: the old module keeps dmuon's refusals of
        ``load_state_dict``, of torch's state dict functions and of DDP (the new one would
        load into the owner's weight alone), and the check that the parameter is still
        registered (:meth:`_check_registered`) would read the old module and pass. A swap that
        wraps the weight too (float8 all-gather) registers a new parameter that dmuon never
        sees, which FSDP2 then takes and AdamW steps. So a holder's module must still be one
        of the model's modules (a wrapper around it, as activation checkpointing adds, keeps
        it there); the check reads the module tree only, alike on every rank."""
        present = {id(m) for m in model.modules()}
        for dp in self.params:
            if id(dp.module) not in present:
                path = dp.fqn.rpartition(".")[0]
                now = dict(model.named_modules()).get(path)
                instead = f" (now a {type(now).__name__})" if now is not None else ""
                raise RuntimeError(
                    f"the {type(dp.module).__name__} that holds dedicated parameter "
                    f"{dp.fqn!r} was replaced after dedicate_params{instead}: dmuon's hooks and "
                    "its refusals of load_state_dict, torch's state dict functions and DDP "
                    "stay on the old module. Swap modules before dedicate_params: call "
                    "torchao's convert_to_float8_training (or any other module swap) first, "
                    "then dedicate_params and fully_shard"
                )

    def _check_no_new_names(self, model: nn.Module) -> None:
        """[Note: a tie made after dedicate_params]
        ``dedicate_params`` plans, hooks and refuses torch's paths for each dedicated weight
        under the names it has then (a tied one under all of them, see [Note: shared
        parameters] in ``setup/_dedicate``). A weight registered under one more name since
        (``model.lm_head.weight = model.embed_tokens.weight``, or ``tie_weights()``, after
        ``dedicate_params``) would train the same values when the tie comes before
        ``fully_shard`` (its boundary holds it for the new use too), but the new name's module
        has none of the refusals: its ``state_dict()`` would return the weight on the owner
        alone and raise on the peers, its ``load_state_dict`` write the owner's weight alone.
        Made after ``fully_shard``, the tie fails inside FSDP2's forward (an
        ``AttributeError`` about ``_local_tensor``). So a dedicated weight found under a name
        it did not have at ``dedicate_params`` raises, naming both; the walk reads the module
        tree only, alike on every rank."""
        # By module object and attribute, not by name: a wrapper added since (activation
        # checkpointing, torch.compile) changes the names, not the modules.
        known = {(id(dp), id(dp.module), dp.name) for dp in self.params} | {
            (id(dp), id(module), attribute)
            for dp in self.params
            for module, attribute in self._tied_places.get(dp.fqn, ())
        }
        by_id = {id(dp.param): dp for dp in self.params}
        for path, module in model.named_modules():
            for attribute, param in module._parameters.items():
                dp = by_id.get(id(param))
                if dp is None or (id(dp), id(module), attribute) in known:
                    continue
                name = f"{path}.{attribute}" if path else attribute
                module_name = path or type(model).__name__
                raise RuntimeError(
                    f"dedicated parameter {dp.fqn!r} is registered as {name!r} too (on module "
                    f"{module_name!r}), a name it did not have at dedicate_params: a weight tied "
                    f"after dedicate_params (model.{name} = model.{dp.fqn}, or tie_weights()). "
                    "dmuon hooks a tied weight and refuses torch's state dict, load and DDP "
                    "paths under every name it has at dedicate_params, and none of that "
                    "reaches the new one. Tie the weights first (build the model tied, or call "
                    "model.tie_weights()), then dedicate_params and fully_shard"
                )

    def _taken_by_fully_shard(self, dp: DedicatedParam) -> bool:
        """Whether a ``fully_shard`` module at or above ``dp``'s manages it."""
        model = self._live_model()
        above = fsdp_modules_above(model.get_submodule, dp.fqn.rpartition(".")[0])
        return any(fsdp_manages(m, dp.module, dp.name) for m in above)

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
        self.hooks.requires_gradient_sync = check_bool(
            "requires_gradient_sync", requires_gradient_sync
        )

    def set_grad_listener(self, listener: GradListener | None) -> None:
        """Tell ``listener`` during backward which owned gradients are final (``None``: stop),
        in place of the listener before it; held weakly (see [Note: gradients final during
        backward] in :mod:`._collectives`)."""
        self.reduce_queue.listener = listener

    @property
    def grad_listener(self) -> GradListener | None:
        """The listener :meth:`set_grad_listener` set last, ``None`` if none or freed."""
        return self.reduce_queue.listener

    def wait_all_reduces(self) -> None:
        """Block (CPU) or order the current stream (CUDA) until every owned gradient is final;
        also waits for pending publishes, whose source the optimizer is about to overwrite, and
        lets the owners' masters take what was written into their resident compute copies.

        [Note: writes into a resident compute copy]
        On the replicated path with a compute dtype below the master (see [Note: compute copies
        on the replicated path] in ``setup/_replicate``) the parameter every rank reads and
        writes is the bf16 compute copy, and the owner steps its fp32 master apart. An in-place
        write between steps (``p.mul_(0.5)``, ``p.copy_(ema)``, ``reset_parameters()``, on every
        rank) changes the copies only: left there, the next forward would compute with it, then
        the step would update the unwritten master and publish it over the write, without a
        word (halving every weight would leave them 0.50 away from the halved weights after the
        next step). The owner
        cannot see the write when it happens (a plain parameter costs nothing per operation),
        but it bumps the parameter's version counter, which nothing of dmuon's does (its casts
        and publishes write the pack buffer, a tensor of its own). So here, before every step
        and every read of the masters (checkpoints, ``init_dedicated_``, the EMA), each owned
        copy whose version moved since it last matched its master is copied into the master:
        the step then updates the weight every rank computed with, in the values the parameter
        shows (the bf16 ones; ``model.load_state_dict`` writes the fp32 master itself). A look
        at one counter per owned matrix, only where the copies are resident and the dtypes
        differ."""
        self.finish_pipeline_backward()
        with span("dmuon::wait_reduces"):
            self.reduce_queue.wait_all()
            self.all_reduce_queue.wait_all()
            self.wait_all_replicate_broadcasts()
            if self.config.replicated:
                for group in self.groups:
                    group.adopt_writes()

    def after_step(self, async_: bool = True) -> None:
        """The owners' weights changed: drop weights kept on peers (Z2) and, in HSDP and on
        the replicated path, publish the owners' packs to the ranks that keep a copy
        (``async_``: waited at the next forward)."""
        with span("dmuon::after_step"):
            self.hooks.backward_since_step = False
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

    def holders_by_param(self) -> dict[int, ParamHolder]:
        """Every parameter dmuon took over, by the ``id`` of the parameter it holds now: the
        dedicated ones, then the expert stacks (which stay FSDP2 parameters, so their keys
        are the objects their modules hold at this call)."""
        return {
            **{id(dp.param): dp for dp in self.params},
            **{id(stack.param): stack for stack in self.local_muon},
        }

    def clear_grads(self, set_to_none: bool = True) -> None:
        """Clear every owner's averaged gradient (``DedicatedParam.grad``): the next backward
        starts a new accumulation. ``set_to_none=False`` makes a gradient that is set zeros
        instead of ``None``, as torch's ``zero_grad`` does to ``.grad``: a step then steps it
        even if no backward gives it a gradient (a matrix frozen mid-run), as torch's
        optimizers step on a zero gradient. The zeros are a tensor of their own, since the
        gradient may be a view of a reduce buffer, made once and zeroed in place while it is
        still the gradient (the backward adds into it), so its storage stays the same from
        step to step, as torch's ``.grad`` does (a captured step can replay). Reduces still in
        flight (a backward thrown away before the step) land first, so that none of them adds
        to the next gradients; every rank calls this at the same point (``zero_grad``), so
        their collectives stay in step. (The publishes of the last step stay in flight: each
        boundary's forward waits for its own.) After a forward or backward that raised, the
        weights it left gathered are freed here (see [Note: a forward that raised] in
        :mod:`._hooks`)."""
        self.hooks.release_aborted()
        if len(self.reduce_queue):
            self.reduce_queue.wait_all()
        # The replicated path's all-reduces of a backward thrown away: waited, not written
        # (``zero_grad`` clears the replicated gradients after this).
        self.all_reduce_queue.discard()
        for dp in self.params:
            kept = self._zeroed_grads.pop(id(dp), None)
            if set_to_none or dp.grad is None:
                dp.grad = None
                continue
            if dp.grad is kept:
                dp.grad.zero_()
            else:
                dp.grad = torch.zeros_like(dp.grad)
            self._zeroed_grads[id(dp)] = dp.grad
        self.hooks.forget_unsynced()
        self._drop_fsdp_unreduced_grads()

    def _drop_fsdp_unreduced_grads(self) -> None:
        """Drop the gradients FSDP2 holds on its unsharded parameters, unreduced.

        [Note: FSDP2's held gradients]
        A backward under ``no_sync`` (FSDP2's ``set_requires_gradient_sync(False)``) leaves each
        FSDP2 parameter's local gradient on its unsharded parameter for the next synced
        backward to add to and reduce-scatter; so does a backward that raised before a module's
        reduce-scatter. ``optimizer.zero_grad()`` clears the sharded ``.grad`` only, so an
        accumulation abandoned there (an exception after a micro-batch, then ``zero_grad`` and a
        new accumulation) would carry its first micro-batches into the next step's FSDP2
        gradients while dmuon's own, cleared above, start afresh: the two kinds of parameter
        would train on different batches. ``zero_grad`` means every gradient, so dmuon drops
        FSDP2's held ones here too (no collective: they were never reduced). At a
        ``zero_grad`` after a step they are already ``None``. The FSDP2 modules are found at
        the first call on more than one rank (the ``Muon`` was built after ``fully_shard``),
        on one rank once one is found (``fully_shard`` may come after the ``Muon`` there)."""
        if self._fsdp_grad_dropper is None:
            modules = [module for _, module in fsdp_modules(self._live_model())]
            if not modules and self.layout.world_size == 1:
                return
            self._fsdp_grad_dropper = fsdp_unreduced_grads_dropper(modules)
        self._fsdp_grad_dropper()

    def check_gradients_synced(self) -> None:
        """Refuse a step whose gradients were accumulated under ``no_sync`` and never reduced.

        [Note: a step after no_sync]
        Inside ``no_sync`` every rank keeps its local gradient on the parameter, and only the
        next synced backward reduces the sum to the owners. A step taken right after a
        backward under ``no_sync`` (the whole accumulation wrapped in the context, or a
        pipeline schedule's step inside it) would find no owner gradient and leave every
        dedicated matrix as it was, while FSDP2's parameters, whose reduce-scatter was skipped
        too, got none either. The flag that decides it is set at the end of every backward,
        which every rank runs, so all ranks raise together; ``zero_grad`` (which discards the
        accumulation) clears it."""
        self.finish_pipeline_backward()
        if self.hooks.unsynced_backward:
            raise RuntimeError(
                "Muon.step(): the last backward ran inside dmuon.no_sync(model) (or with "
                "FSDP2's model.set_requires_gradient_sync(False)), and no synced backward "
                "followed, so its gradients were accumulated on each rank but never reduced "
                "and the step would leave the weights as they are. Run the last micro-batch's "
                "backward outside no_sync, with gradient sync on (it reduces the whole "
                "accumulation), or call optimizer.zero_grad() to discard it"
            )

    def check_no_grad_set_by_hand(self) -> None:
        """Refuse a step while a dedicated parameter's ``.grad`` holds a gradient no backward
        sent to its owner.

        [Note: a gradient set by hand]
        A dedicated gradient reaches its owner only through the backward's gradient
        accumulation: the hook that sends it takes ``.grad`` (and drops it), and the step reads
        the owner's reduced gradient alone. A ``.grad`` written otherwise, the pattern
        ``grads = torch.autograd.grad(loss, params)`` then ``p.grad = g`` (``autograd.grad``
        accumulates nothing), is never sent: the step would leave the weight as it is, without
        a word, where every rank holds its weights (one rank; the owner under Z2, whose peers
        refuse the write). A ``.grad`` still there at the step is such a gradient (one left
        under ``no_sync`` is refused before, by :meth:`check_gradients_synced`); every rank
        that wrote one raises here. The parameters are looked at only where no backward
        accumulated a dedicated gradient since the last step (``autograd.grad`` accumulates
        none): a ``.grad`` read costs about 60 ns, which every step would pay per matrix.

        Under a pipeline none is left: the schedule's reduce at the step takes every
        ``.grad`` of the stage's weights, however it was written (see [Note: weight gradients
        a schedule writes] in :mod:`._hooks`)."""
        if self.hooks.accumulated:
            self.hooks.accumulated = False
            return
        for dp in self.params:
            if dp.param.grad is not None:
                raise RuntimeError(
                    f"Muon.step(): dedicated parameter {dp.fqn!r} has a .grad that no backward "
                    "sent to its owner, so the step would leave it as it is: a .grad written "
                    "outside backward (torch.autograd.grad(loss, params) and then p.grad = g by "
                    "hand) never reaches the owner, whose reduced gradient is the only one the "
                    "step reads. Compute the gradients with loss.backward() on every rank "
                    "(torch.autograd.grad with respect to activations, as for a gradient "
                    "penalty, is fine), or drop it with optimizer.zero_grad()"
                )

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

    def __deepcopy__(self, memo: dict[int, Any]) -> DedicatedRuntime:
        """Refuse, naming the fix: the runtime alone, copied (the model's copy is refused
        before it reaches it: see [Note: copying a model after dedicate_params])."""
        _refuse_deepcopy(memo)


class _CheckedApply:
    """[Note: conversions after packing] Once a dedicated weight lives in a pack (a view into
    a packed buffer on its owner, nothing on a peer), ``model.to(dtype)``, ``.half()``,
    ``.to(other device)`` or ``.to_empty()`` cannot convert it: on a peer it is not even there,
    so such a call would convert the rest of the model, stop at the first weight the rank
    does not hold (a different one on each rank) and leave the ranks with different dtypes,
    which the next collective turns into a crash. So every module above a dedicated parameter
    checks first, in its ``_apply`` (what ``nn.Module``'s conversions all go through), whether
    the conversion would change any dedicated parameter under it, and refuses it before
    anything is converted, on every rank alike. Conversions that change nothing (``.to()`` the
    device and dtype the model has: see [Note: reads on a peer] in ``holder/_guard``) go through,
    converting the rest of the module and leaving the dedicated parameters alone, and before
    packing (a meta-device model's ``to_empty``) everything goes through."""

    def __init__(
        self,
        module: nn.Module,
        params: list[DedicatedParam],
        on_applied: Callable[[], None],
        holds_nothing: Callable[[DedicatedParam], bool],
    ) -> None:
        self._module = weakref.ref(module)
        self._params = params
        self._on_applied = on_applied
        self._holds_nothing = holds_nothing

    def __call__(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Any:
        module = self._module()
        assert module is not None, "_apply of a deleted module"
        self._refuse_conversion(module, fn)
        held = self._held_apart(module)
        materialised = self._materialised_apart(module, fn, held)
        hidden = {**held, **{name: module._parameters[name] for name in materialised}}
        module._parameters.update(dict.fromkeys(hidden))
        try:
            applied = type(module)._apply(module, fn, recurse)
        finally:
            module._parameters.update(hidden)
        module._parameters.update(materialised)
        self._on_applied()  # a meta model's to_empty: adopt the new parameters now
        return applied

    def _refuse_conversion(self, module: nn.Module, fn: Callable[[Tensor], Tensor]) -> None:
        """Raise, before anything is converted, if ``fn`` would change a packed dedicated
        parameter under ``module``."""
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

    def _held_apart(self, module: nn.Module) -> dict[str, nn.Parameter]:
        """The parameters of ``module`` that ``nn.Module._apply`` must not see (they are put
        back after it), by attribute: every packed dedicated parameter stays as it is
        (``_apply`` would re-set or swap each, which a tensor-parallel peer's cannot be), and a
        tied weight's other names are never converted on their own: they follow its own name
        (see ``DedicatedRuntime._adopt_materialised``)."""
        packed = [dp.param for dp in self._params if dp.precision is not None]
        held = {
            name: p
            for name, p in module._parameters.items()
            if p is not None and any(p is q for q in packed)
        }
        held |= {
            name: p
            for name, p in module._parameters.items()
            if p is not None
            and any(d.param is p and (d.module, d.name) != (module, name) for d in self._params)
        }
        return held

    def _materialised_apart(
        self, module: nn.Module, fn: Callable[[Tensor], Tensor], held: Mapping[str, nn.Parameter]
    ) -> dict[str, nn.Parameter]:
        """What ``fn`` makes of each meta weight of ``module`` this rank keeps none of, made
        without storage, by attribute: a peer's meta weight comes out of ``to_empty`` without
        storage, so that no rank but the ones keeping it ever holds it (see [Note: meta-device
        models])."""
        materialised: dict[str, nn.Parameter] = {}
        for name, p in module._parameters.items():
            found = next((d for d in self._params if p is not None and d.param is p), None)
            if found is None or name in held or not self._holds_nothing(found):
                continue
            empty = _materialised_without_storage(fn, found)
            if empty is not None:
                materialised[name] = empty
        return materialised


def _refuse_deepcopy(memo: dict[int, Any]) -> Never:
    """[Note: copying a model after dedicate_params]
    ``copy.deepcopy(model)`` (and ``torch.optim.swa_utils.AveragedModel(model)``, which copies
    its model) cannot copy a model after ``dedicate_params``: each dedicated weight lives on
    its owner alone (on the FSDP2 path), and the runtime holds dmuon's process groups. Left to
    itself the copy would fail in three ways: between ``dedicate_params`` and ``fully_shard`` it
    would stop at the first weight a rank does not hold (a different one on each rank); after
    ``fully_shard`` FSDP2's own refusal would come first ("FSDP does not support deepcopy.
    Please use state dict for serialization.", an ``AssertionError`` that points away from what
    an average of the weights needs); on the replicated path it would reach the runtime last. So
    the model given to ``dedicate_params`` carries a ``__deepcopy__`` of its own (an instance
    attribute, which ``copy.deepcopy`` looks up before the class's, FSDP2's included) that
    refuses at once, on every rank alike, before anything is copied, naming ``dmuon.EMA`` and
    the other fixes. Its submodules are left as they were: a copy of a block on the replicated
    path, where every rank holds every weight, goes on working."""
    raise TypeError(
        "copy.deepcopy cannot copy a model after dedicate_params (torch.optim.swa_utils."
        "AveragedModel copies its model so): its dedicated weights live on their owners, and "
        f"its runtime holds dmuon's process groups; nothing was copied. {DEEPCOPY_FIX}"
    )


def _materialised_without_storage(
    fn: Callable[[Tensor], Tensor], dp: DedicatedParam
) -> nn.Parameter | None:
    """The parameter ``fn`` (a conversion of ``nn.Module._apply``) would make of ``dp``'s
    meta parameter, without storage; ``None`` when the parameter is not on the meta device,
    ``to_empty`` swaps its contents in place (a tensor-parallel ``DTensor``: it is freed once
    adopted), or ``fn`` leaves it on the meta device (allocating nothing) or refuses it (then
    ``nn.Module._apply`` raises its own error). ``fn`` sees an empty stand-in, so the weight is
    never allocated."""
    param = dp.param
    if not param.is_meta or dp.swapped_by_to_empty:
        return None
    with torch.no_grad():
        try:
            probe = fn(torch.empty(0, dtype=param.dtype, device="meta"))
        except (RuntimeError, NotImplementedError):
            return None
    if probe.is_meta:
        return None
    empty = without_storage(param.shape, probe.dtype, probe.device)
    return nn.Parameter(empty, requires_grad=param.requires_grad)


def check_conversions(model: nn.Module, runtime: DedicatedRuntime) -> None:
    """Install :class:`_CheckedApply` on every module above a dedicated parameter of
    ``runtime`` or one of its other names (tied); after a conversion it adopts what
    ``to_empty`` materialised. ``model`` refuses ``copy.deepcopy`` too (see [Note: copying a
    model after dedicate_params])."""
    params = runtime.params
    weak = weakref.WeakMethod(runtime._adopt_materialised)
    weak_holds_nothing = weakref.WeakMethod(runtime._holds_nothing)

    def adopt() -> None:
        method = weak()
        if method is not None:
            method()

    def holds_nothing(dp: DedicatedParam) -> bool:
        method = weak_holds_nothing()
        return method is not None and method(dp)

    names: dict[str, list[str]] = {dp.fqn: [dp.fqn] for dp in params}
    for alias, fqn in runtime.tied_names.items():
        names[fqn].append(alias)
    under: dict[str, list[DedicatedParam]] = {}
    for dp in params:
        for fqn in names[dp.fqn]:  # a tied weight's other names too
            parts = fqn.split(".")[:-1]
            for depth in range(len(parts) + 1):
                found = under.setdefault(".".join(parts[:depth]), [])
                if not any(d is dp for d in found):
                    found.append(dp)
    for path, dps in under.items():
        module = model.get_submodule(path)
        # An instance attribute: nn.Module's conversions call self._apply.
        object.__setattr__(module, "_apply", _CheckedApply(module, dps, adopt, holds_nothing))
    object.__setattr__(model, "__deepcopy__", _refuse_deepcopy)


def _check_materialised(dp: DedicatedParam) -> None:
    """[Note: meta-device models] ``dedicate_params`` only plans: a model built under
    ``torch.device("meta")`` can be dedicated, sharded and materialised with
    ``model.to_empty(device=...)`` as torchtitan does, and no rank ever holds a dedicated
    weight it does not keep. A model too large for one device (Llama-3-70B's fp32 matrices are
    ~270 GB) could otherwise not even start: ``to_empty`` would give every rank every weight.

    - ``to_empty`` gives a dedicated weight storage only where it is kept: on its owner, in
      HSDP its shard column's replicas, on the replicated path every rank. On a peer,
      :class:`_CheckedApply` hides the meta parameter from ``nn.Module._apply``, asks the
      conversion what it makes of an empty stand-in (the device and dtype) and registers a
      parameter of the full shape whose storage holds zero bytes; a tensor-parallel
      ``DTensor`` (which ``nn.Module._apply`` swaps in place) is freed as soon as it is
      adopted, one module's shards at a time. Either way it is guarded at once (see [Note:
      reads on a peer] in ``holder/_guard``), and reads raise.
    - Initialising: ``dmuon.init_dedicated_(model, fn)`` runs ``fn`` on the ranks that keep
      each weight, with a generator seeded from its name, so the values do not depend on the
      world size. A model's own ``init_weights()`` run on every rank with the same generator
      state also still gives each weight the values it gives a normally built model: on a
      peer each in-place write into a plain weight not packed yet runs on a scratch tensor of
      its shape, which the write returns and the peer drops with it
      (``holder/_guard._write_to_scratch``), so the generators advance exactly as on the owner (an
      initialisation that reads back what it drew reads the scratch), at the cost of one
      weight at a time on the peer. That holds up to the first random draw into an FSDP2
      shard: a ``DTensor``'s random ops do not advance the generator as a plain tensor of the
      full shape does (on the CPU each rank draws its own shard only), and weights drawn after
      it differ from a normally built model's.
    - Packing then copies a kept weight into its pack and gives a peer's pack a buffer
      without storage (:func:`~._pack.without_storage`), so a peer allocates a dedicated
      weight only when a broadcast fills it for its layer's forward and backward. An owner
      briefly holds its own weights twice while they move into their packs.
    - Loading reads only kept weights: ``dmuon.load_checkpoint`` asks DCP for the owned keys
      and the FSDP2 shards (DCP's scratch holds those only), ``dmuon.set_model_state_dict``
      copies on each owner its part of the full dictionary every rank holds.

    Until packing, a kept weight is the plain tensor ``to_empty`` made; packing keeps its
    values."""
    if dp.param.is_meta:
        raise RuntimeError(
            f"dedicated parameter {dp.fqn!r} is still on the meta device: materialise the model "
            "first (model.to_empty(device=...) after fully_shard, then init_weights() or "
            "dmuon.set_model_state_dict(model, state_dict)) before the first forward, "
            "Muon(...) or a checkpoint call"
        )


# The fix for a fully_shard on the replicated path, which FULLY_SHARD_FIX's (the sharded
# path's) is not: there the other parameters go to dmuon.replicate, no fully_shard at all.
_REPLICATED_FIX = (
    "The model was given to dmuon.dedicate_params_ddp, the replicated path, which shards "
    "nothing: call dmuon.replicate(model, mesh) for the other parameters instead of "
    "fully_shard, or build the model again and use dmuon.dedicate_params + fully_shard to shard"
)


def get_runtime(model: nn.Module) -> DedicatedRuntime:
    """The runtime :func:`dedicate_params` attached to ``model``."""
    if not isinstance(model, nn.Module):
        hint = " (pass optimizer.model, not the optimizer)" if hasattr(model, "model") else ""
        raise TypeError(
            f"model must be the nn.Module given to dmuon.dedicate_params, got "
            f"{type(model).__name__}{hint}"
        )
    runtime: DedicatedRuntime | None = getattr(model, RUNTIME_ATTR, None)
    if runtime is None:
        if any(is_dedicated(p) for p in model.parameters()):
            raise ValueError(
                f"{type(model).__name__} is a part of the model given to dmuon.dedicate_params"
                " (it holds dedicated parameters) but not that model: pass the model itself,"
                " the root module dedicate_params took"
            )
        raise ValueError(
            f"{type(model).__name__} has no dmuon runtime: call dmuon.dedicate_params(model, "
            "mesh, predicate) first, on the same model object"
        )
    return runtime
