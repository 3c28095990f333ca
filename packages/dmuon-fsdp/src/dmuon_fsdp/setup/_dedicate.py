"""``dedicate_params``: select the Muon-target parameters, plan owners, build the runtime.

[Note: what dedicate_params does, in order]

1. validate the arguments and the call order (before ``fully_shard``);
2. resolve the mesh into a shard × replicate grid (:mod:`._mesh`, collective);
3. select trainable parameters with ``predicate(fqn, param)``, route them with
   ``param_policy`` (``"sharded_adamw"`` ones stay with FSDP2), and find each one's hook
   boundary;
4. plan owners with dmuon-ownership (pure, identical on every rank) and prove it by comparing
   ``plan.fingerprint()`` across ranks once; check what else can refuse the call (each
   parameter's type, each boundary's casts, a dedicated parameter on a childless root: see
   [Note: a dedicated parameter on a childless root]): every refusal comes before step 5 changes
   anything, so a refused call leaves the model as it was;
5. build the comm context (isolated groups are created here, collectively), one holder per
   planned parameter and one group per boundary, and make torch's paths that cannot reach a
   dedicated weight raise (``_refuse_torch_paths``);
6. build the runtime: it registers the hooks and packs each boundary's parameters per owner,
   frees the peers' storage and publishes the owners' weights to their shard column (HSDP)
   (a meta-device model is packed later, see [Note: meta-device models] in ``_runtime``);
7. install the ``fully_shard`` patch (unless ``patch_fully_shard=False``), attach the runtime
   to the model, wrap its ``zero_grad`` (see [Note: Module.zero_grad]) and its conversions
   (see [Note: conversions after packing] in ``_runtime``).

[Note: what this runtime does not do]

The model cannot be converted (``.to(dtype)``, ``.half()``, another device) after its
parameters are packed (at ``dedicate_params``, or for a meta-device model at the first forward,
``Muon(...)`` or a checkpoint call): they are views into packed buffers, and such a call is
refused before anything changes (see [Note: conversions after packing] in ``_runtime``);
``to_empty`` on a meta-device model before that point is the supported way to materialise it
(see [Note: meta-device models] in ``_runtime``). A selected parameter that is already a
DTensor on the data-parallel mesh (FSDP2 got there first) is refused; a tensor-parallel one
must be an equal ``Shard`` split on one 1-D TP mesh (``check_call_order``);
``DistributedDataParallel`` over a dedicated model raises
(``dedicate_params_ddp`` + ``replicate`` is the replicated path), and so does torch's FSDP1
(``FullyShardedDataParallel``): around the model before ``dedicate_params`` (``_refuse_fsdp1``),
or after it, where its flattening reads a weight a peer does not hold. On NCCL the broadcasts
of one boundary's packs are issued one after another on the broadcast stream (not in one
coalesced group call).
"""

from __future__ import annotations

import hashlib
import logging
import re
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields, replace
from typing import Any, NamedTuple, TypedDict, Unpack, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel

import dmuon_ownership
from dmuon_ownership import (
    MatrixSplit,
    Owner,
    ParamPolicy,
    Plan,
    ResolvedPolicy,
    WorkItem,
    plan_owners,
    validate_param_policy,
)

from .._matrix import MatrixView, describe_pieces, pieces_of
from .._torch_internals import ddp_modules
from .._warnings import warn
from ..holder import (
    DedicatedParam,
    ExpertStack,
    Found,
    ParamHolder,
    Role,
    check_guardable,
    is_dedicated,
    kind_of,
    refuse_accelerate_clip,
    refuse_ddp,
    refuse_foreign_optimizers,
    refuse_module_load,
    refuse_module_state_dict,
    refuse_torch_clip,
    refuse_torch_state_dict,
)
from ..runtime import (
    RUNTIME_ATTR,
    BoundaryPredicate,
    DedicateConfig,
    DedicatedGroup,
    DedicatedRuntime,
    check_conversions,
)
from ..topology import (
    DedicatedCommContext,
    MeshLayout,
    ProcessGroupPolicy,
    all_gather_numbers,
    resolve_layout,
)
from ._fsdp_integration import check_call_order, install_patch
from ._replicate import broadcast_from_first_rank

__all__ = ["dedicate_params", "dedicate_params_ddp", "dedicate_params_ddp_tp"]

logger = logging.getLogger(__name__)

# ``predicate(fqn, param)``: truthy selects the parameter; a MatrixSplit result also declares
# its split (see [Note: declared splits] in dmuon_ownership).
Predicate = Callable[[str, nn.Parameter], bool | MatrixSplit]

_LAYER_NAME = re.compile(r"(?:^|\.)(?:layers|blocks)\.\d+$")


def dedicate_params(
    model: nn.Module,
    mesh: DeviceMesh,
    predicate: Predicate,
    *,
    reshard_after_forward: bool = True,
    replicate_mesh: DeviceMesh | None = None,
    pipeline_mesh: DeviceMesh | None = None,
    hook_boundary_predicate: BoundaryPredicate | None = None,
    hook_boundary_strict: bool = True,
    param_policy: Mapping[str, Any] | ParamPolicy | None = None,
    process_group_policy: str = "isolated",
    small_param_threshold: int = 5_000_000,
    patch_fully_shard: bool = True,
    debug_fence: bool = False,
    config: DedicateConfig | None = None,
) -> DedicatedRuntime:
    """Give each selected matrix parameter of ``model`` one owner rank.

    Call it after building the model (and after tensor parallelism and any module swap, such
    as torchao's ``convert_to_float8_training``), before ``fully_shard``.
    ``mesh`` is the 1-D data-parallel (shard) mesh, or a 2-D mesh named
    ``('replicate', 'shard')``; for HSDP pass ``hsdp['shard']`` and
    ``replicate_mesh=hsdp['replicate']``. ``predicate(fqn, param)`` selects parameters;
    ``param_policy`` routes them (``"muon"``, ``"adamw"``, or ``"sharded_adamw"``, which
    leaves the parameter to FSDP2). Every later ``fully_shard`` leaves the dedicated parameters
    alone: ``patch_fully_shard=True`` (the default) installs a wrapper that makes a plain
    ``fully_shard(layer, mesh=mesh)`` skip them (:func:`uninstall_patch` removes it); with
    ``patch_fully_shard=False`` pass ``ignored_params=dmuon.dedicated_params_of(model)`` to each
    ``fully_shard`` call (layers and root), FSDP2's public way (see [Note: FSDP2 integration] in
    ``_fsdp_integration``). A dedicated parameter that ``fully_shard`` took anyway raises, on
    every rank, at that ``fully_shard`` or at ``Muon(model)``. ``model.load_state_dict`` with
    a value for a dedicated parameter raises (load with :func:`set_model_state_dict` or
    :func:`load_checkpoint`); with more than one rank per shard group, where a peer holds a
    dedicated weight only inside its layer's forward and backward, ``model.state_dict()``
    raises :class:`NotHeldError` on every rank (save with :func:`save_checkpoint` or
    :class:`AppState`, gather with :func:`get_model_state_dict`).

    With pipeline parallelism call it on each stage module with the stage's data-parallel mesh
    and ``pipeline_mesh``, then ``fully_shard`` the stage module (its layers, then the stage
    module itself) and build one ``Muon`` per stage module (see the pipeline guide).

    The options that shape the runtime (every keyword but ``replicate_mesh``,
    ``pipeline_mesh`` and ``param_policy``: the fields of :class:`DedicateConfig`) may
    instead come whole as
    ``config=DedicateConfig(...)``; then leave those keywords at their defaults (one that
    differs raises a ``ValueError``).
    Returns the runtime it attached to ``model``, whose ``.plan`` is the owner plan (its
    ``fingerprint()`` is the one ``dmuon.plan`` prints for the same model and mesh).
    Collective: every rank must call it with the same arguments.

    Args:
        model: the model to train, built (materialised or on the meta device) and, with
            tensor parallelism, already parallelised; not yet ``fully_shard``-ed. One call per
            model: a second one raises ``RuntimeError``.
        mesh: a 1-D ``DeviceMesh`` of the data-parallel ranks that shard the weights (the
            owners are spread over it), or a 2-D one with dimensions named
            ``('replicate', 'shard')`` for HSDP. Anything else raises ``TypeError`` or
            ``ValueError``.
        predicate: ``predicate(fqn, param) -> bool``, called for every trainable parameter
            (under each of its names when it has several); the ones it accepts are dedicated.
            A ``dmuon.MatrixSplit`` result accepts the parameter and declares its
            split: a fused 2-D weight (``[q; k; v]``, ``[gate; up]``) whose pieces Muon
            orthogonalises apart, checked against its shape here (``ValueError`` naming the
            parameter when it does not fit). Accepting none warns (no Muon step will run).
            On the Muon route a 2-D weight is one matrix, the kernel of an ``nn.Conv1d``,
            ``Conv2d`` or ``Conv3d`` one flattened ``(out, in/groups·∏k)`` matrix, any other
            3-D parameter a stack of experts on dim 0; anything else raises ``ValueError``.
        reshard_after_forward: Z3 (``True``) or Z2 (``False``); see
            :class:`DedicateConfig`. Pass ``fully_shard`` the same value.
        replicate_mesh: for HSDP with a 1-D ``mesh``, the 1-D ``DeviceMesh`` of the replicas
            (``hsdp['replicate']``); each owner's weights are then kept by one rank per
            replica. ``None``: no replicas, or they come from a 2-D ``mesh`` (giving both
            raises ``ValueError``). A replicate mesh of one rank is no replication.
        pipeline_mesh: with pipeline parallelism (``torch.distributed.pipelining``), the 1-D
            ``DeviceMesh`` of the pipeline dimension (``mesh['pp']``), whose other dimensions
            give ``mesh`` (and ``replicate_mesh``); ``model`` is then this rank's stage module.
            Owners are planned and agreed on inside each stage; the step's non-finite skip
            and the clip norm are reduced over every stage. One stage module per rank: the
            optimizers of two stages stepping in turn on one rank (an interleaved schedule)
            raise ``RuntimeError`` at the second one's step. ``None``: no pipeline
            parallelism (a pipeline mesh of one rank is none).
        hook_boundary_predicate: which module a dedicated parameter is gathered and reduced
            with; ``None``: the nearest layer-stack item. See :class:`DedicateConfig`.
        hook_boundary_strict: whether a dedicated parameter without a hook boundary raises
            (``True``) or is hooked at the root module (``False``); see
            :class:`DedicateConfig`.
        param_policy: per-parameter route and dtypes: ``{"defaults": {...}, "overrides":
            [...]}`` with the fields ``route`` (``"muon"``, ``"adamw"`` or
            ``"sharded_adamw"``), ``param_dtype``, ``grad_dtype``, ``master_dtype``,
            ``optim_dtype``, ``output_dtype``, ``cast_forward_inputs``, ``glu`` and ``split``
            (a ``MatrixSplit`` or a dict of its fields), each override selecting parameters by
            ``"name"`` (whole dotted components) or ``"contains"`` (substrings) of their FQN
            (see the routing guide). ``None``: every selected parameter takes route
            ``"muon"``, with no dtype override. A malformed policy raises ``ValueError``
            naming the key.
        process_group_policy: ``"isolated"`` (dmuon's own process groups) or ``"shared"``
            (the mesh's); see :class:`DedicateConfig`.
        small_param_threshold: an int >= 0, in elements: smaller dedicated parameters of one
            hook boundary share one owner (``0``: none do); see :class:`DedicateConfig`.
        patch_fully_shard: ``True`` makes a plain ``fully_shard`` skip the dedicated
            parameters; ``False`` leaves ``fully_shard`` alone, and each call must pass
            ``ignored_params=dmuon.dedicated_params_of(model)``.
        debug_fence: ``True`` drains dmuon's collectives and runs a barrier after every step
            (diagnosis only); see :class:`DedicateConfig`.
        config: all of the options above but ``replicate_mesh``, ``pipeline_mesh`` and
            ``param_policy`` as one
            :class:`DedicateConfig` (its ``replicated`` must be ``False``); ``None``: the
            keywords give them.
    """
    options = DedicateConfig(
        reshard_after_forward=reshard_after_forward,
        hook_boundary_predicate=hook_boundary_predicate,
        hook_boundary_strict=hook_boundary_strict,
        process_group_policy=ProcessGroupPolicy.parse(process_group_policy),
        small_param_threshold=small_param_threshold,
        patch_fully_shard=patch_fully_shard,
        debug_fence=debug_fence,
    )
    if config is None:
        config = options
    else:
        _check_config("dedicate_params", config)
        given = [f"{f}={getattr(options, f)!r}" for f in _CONFIG_FIELDS if _differs(options, f)]
        if given:
            raise ValueError(
                f"dedicate_params got config= and {', '.join(given)}: pass each option once, "
                "either as a keyword or in the DedicateConfig (dataclasses.replace(config, "
                f"{given[0]}))"
            )
        if config.replicated:
            raise ValueError(
                "dedicate_params got config=DedicateConfig(replicated=True), the replicated "
                "(DDP) path: call dmuon.dedicate_params_ddp(model, mesh, predicate, config=...) "
                "instead"
            )
    return _dedicate(model, mesh, predicate, config, replicate_mesh, param_policy, pipeline_mesh)


class SharedOptions(TypedDict, total=False):
    """The options :func:`dedicate_params_ddp` shares with :func:`dedicate_params`: the fields
    of :class:`DedicateConfig` that apply to the replicated path (same meaning, same
    defaults)."""

    hook_boundary_predicate: BoundaryPredicate | None
    hook_boundary_strict: bool
    process_group_policy: str
    small_param_threshold: int
    debug_fence: bool


def dedicate_params_ddp(
    model: nn.Module,
    mesh: DeviceMesh,
    predicate: Predicate,
    *,
    param_policy: Mapping[str, Any] | ParamPolicy | None = None,
    config: DedicateConfig | None = None,
    **options: Unpack[SharedOptions],
) -> DedicatedRuntime:
    """The replicated (DDP) path: like :func:`dedicate_params` (whose keyword options it takes,
    but for the sharding ones), but every rank keeps every weight whole for forward and
    backward, as with ``DistributedDataParallel``. Gradients of the selected parameters are
    reduced to their owner, the owner runs the optimizer, and the update is broadcast back
    after ``step()`` (see [Note: the replicated path]). Then call :func:`dmuon.replicate(model,
    mesh) <replicate>` for the other parameters, and build ``Muon(model)``; no ``fully_shard``.
    ``mesh`` is the 1-D data-parallel mesh; on a tensor-parallel model (``parallelize_module``
    first) the data-parallel dimension of the (dp, tp) mesh, as tensor-parallel matrices are
    recognised by their DTensor placements. The options but ``param_policy`` may instead come
    whole as ``config=DedicateConfig(...)`` (its ``reshard_after_forward`` does not apply).
    Collective.

    Every rank then holds every weight: ``model.state_dict()`` and ``model.load_state_dict``
    work as on a plain model, and in-place writes made on every rank between steps (right
    after ``step()`` too, and into a lower-precision compute copy, which reaches the owner's
    master) are what the next forward and step use. ``load_state_dict(..., assign=True)`` with
    a value for a parameter dmuon took raises (see [Note: loads that replace parameters]).

    Args:
        model: the model to train, built and, with tensor parallelism, already parallelised;
            not sharded. One call per model.
        mesh: the 1-D ``DeviceMesh`` of the data-parallel ranks (with tensor parallelism the
            ``dp`` dimension of the ``(dp, tp)`` mesh). A 2-D ``('replicate', 'shard')`` mesh
            with one replica stands for its shard dimension; with more than one it raises
            ``ValueError``: the replicated path has no shard x replicate grid.
        predicate: ``predicate(fqn, param) -> bool``, called for every trainable parameter;
            the ones it accepts are dedicated (owned by one rank, stepped there). A
            ``MatrixSplit`` result also declares the parameter's split, as for
            :func:`dedicate_params`.
        param_policy: per-parameter route and dtypes, as for :func:`dedicate_params`;
            ``None``: every selected parameter takes route ``"muon"``.
        config: the options as one :class:`DedicateConfig`; its ``reshard_after_forward``,
            ``patch_fully_shard`` and ``replicated`` are replaced by this path's own. ``None``:
            the keyword options give them (giving both raises ``ValueError``).
        options: keyword options, each a field of :class:`DedicateConfig` with its meaning
            and default: ``hook_boundary_predicate``, ``hook_boundary_strict``,
            ``process_group_policy``, ``small_param_threshold`` and ``debug_fence``; any
            other keyword raises ``TypeError``.
    """
    unknown = sorted(set(options) - set(SharedOptions.__annotations__))
    if unknown:
        raise TypeError(
            f"dedicate_params_ddp got unexpected option(s) {unknown}; it takes "
            f"{sorted([*SharedOptions.__annotations__, 'param_policy', 'config'])} (the "
            "replicated path neither shards nor reshards: use dedicate_params for those)"
        )
    if config is None:
        config = DedicateConfig(**options)  # type: ignore[arg-type]  # process_group_policy: parsed there
    else:
        _check_config("dedicate_params_ddp", config)
        if options:
            raise ValueError(
                f"dedicate_params_ddp got config= and {', '.join(sorted(options))}: pass each "
                "option once, either as a keyword or in the DedicateConfig"
            )
    # The replicated path calls no fully_shard: nothing to patch.
    config = replace(config, reshard_after_forward=False, replicated=True, patch_fully_shard=False)
    return _dedicate(model, mesh, predicate, config, None, param_policy)


def dedicate_params_ddp_tp(
    model: nn.Module,
    mesh: DeviceMesh,
    predicate: Predicate,
    *,
    param_policy: Mapping[str, Any] | ParamPolicy | None = None,
    config: DedicateConfig | None = None,
    **options: Unpack[SharedOptions],
) -> DedicatedRuntime:
    """Deprecated: :func:`dedicate_params_ddp` under another name (it recognises
    tensor-parallel matrices by their DTensor placements). Warns, then calls it."""
    warnings.warn(
        "dmuon.dedicate_params_ddp_tp is deprecated and will be removed: call "
        "dmuon.dedicate_params_ddp(model, mesh['dp'], predicate, ...), the same function",
        DeprecationWarning,
        stacklevel=2,
    )
    return dedicate_params_ddp(
        model, mesh, predicate, param_policy=param_policy, config=config, **options
    )


# DedicateConfig's fields that dedicate_params takes as keywords (``replicated`` is the
# entry point's own choice).
_CONFIG_FIELDS = tuple(f.name for f in fields(DedicateConfig) if f.name != "replicated")
_DEFAULTS = DedicateConfig()


def _differs(options: DedicateConfig, field: str) -> bool:
    """Whether a keyword of dedicate_params was set away from its default."""
    return bool(getattr(options, field) != getattr(_DEFAULTS, field))


def _check_config(entry: str, config: object) -> None:
    if not isinstance(config, DedicateConfig):
        raise TypeError(
            f"{entry}: config must be a dmuon.DedicateConfig (or None: the keyword options), "
            f"got {type(config).__name__}"
        )


def _dedicate(
    model: nn.Module,
    mesh: DeviceMesh,
    predicate: Predicate,
    config: DedicateConfig,
    replicate_mesh: DeviceMesh | None,
    param_policy: Mapping[str, Any] | ParamPolicy | None,
    pipeline_mesh: DeviceMesh | None = None,
) -> DedicatedRuntime:
    """What both entry points do; see [Note: what dedicate_params does, in order]."""
    _check_model_and_predicate(model, predicate)
    policy = validate_param_policy(param_policy)
    aliases = parameter_names(model)
    _warn_unmatched_overrides(policy, aliases, model)
    _refuse_inner_ddp(model)
    _refuse_fsdp1(model)
    modules = dict(model.named_modules())
    claimed = _claim(_select(model, aliases, predicate), policy, modules, aliases)
    # A kind FSDP2 holds (an expert stack) is stepped where it lies; every other selected
    # parameter is dedicated (or, routed to sharded_adamw, left to FSDP2 as it is).
    in_place = [claim for claim in claimed if claim.kind and not claim.kind.dedicated]
    _check_stack_dtypes(in_place, config)
    selected = [(f.fqn, f.param) for f, kind, _ in claimed if not kind or kind.dedicated]
    tp_mesh, tp_dims = check_call_order(model, selected, mesh, replicate_mesh)
    layout = resolve_layout(mesh, replicate_mesh, tp_mesh, pipeline_mesh)
    if config.replicated and layout.is_hsdp:
        raise ValueError(
            "dedicate_params_ddp takes the 1-D data-parallel mesh (every rank keeps every "
            "weight, so there is no shard x replicate grid); for HSDP use dedicate_params(model, "
            "hsdp['shard'], ..., replicate_mesh=hsdp['replicate']) and fully_shard"
        )

    # The plan's parameters are all of dedicated kinds.
    dedicated = [claim for claim in claimed if claim.kind and claim.kind.dedicated]
    packed = {f.fqn: (f, cast("type[DedicatedParam]", kind)) for f, kind, _ in dedicated}
    _refuse_childless_root(model, packed)
    tp = 1 if tp_mesh is None else tp_mesh.size()
    items = _work_items(dedicated, aliases, modules, config, {n: tp for n in tp_dims})
    if config.hook_boundary_predicate is None:
        _warn_nested_boundaries({item.boundary for item in items}, modules)
    plan = plan_owners(
        items,
        layout.shard_size,
        layout.replicate_size,
        small_param_threshold=config.small_param_threshold,
        experts=_planned_experts(in_place, config),
    )
    _check_fingerprint(plan, model, layout)

    checked = _checked_before_taking(plan, packed, layout)
    comm = DedicatedCommContext.build(layout, config.process_group_policy)
    if config.replicated:
        # Every copy starts from its grid's first rank.
        weights = [packed[item.name][0].param for item in items]
        broadcast_from_first_rank(weights, layout, comm.world_group)
    params, groups = _build_groups(modules, plan, packed, tp_dims, layout, comm, config, checked)
    # Before the runtime, whose state-dict pre-hooks then run after the refusals.
    _refuse_torch_paths(model, modules, params, aliases, config, layout)
    stacks = [_held_in_place(claim, plan, layout) for claim in in_place]
    tied_names = {
        alias: dp.fqn for dp in params for alias in aliases[id(dp.param)] if alias != dp.fqn
    }
    runtime = DedicatedRuntime(model, config, layout, comm, plan, params, groups, tied_names)
    runtime.local_muon = stacks
    runtime.param_policy = policy
    _attach(model, runtime, config)
    comm.counter.reset()
    if dist.get_rank() == 0:
        _log_plan(plan, stacks, params)
    return runtime


def _check_model_and_predicate(model: nn.Module, predicate: Predicate) -> None:
    """Refuse a model that is no module or has a runtime already, and a predicate that cannot
    be called."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if getattr(model, RUNTIME_ATTR, None) is not None:
        raise RuntimeError(
            f"dedicate_params was already called on this {type(model).__name__}; call it once "
            "per model"
        )
    if not callable(predicate):
        raise TypeError(
            "predicate must be a callable (fqn, param) -> bool, e.g. "
            "lambda n, p: 'proj' in n and p.ndim == 2"
        )


def _warn_unmatched_overrides(
    policy: ParamPolicy, aliases: Mapping[int, list[str]], model: nn.Module
) -> None:
    """Warn of ``param_policy`` override names that match no parameter (likely typos: an
    override that matches nothing changes nothing), against every name of each parameter (a
    tied one's second too: an override may route it by either)."""
    names = [name for aliases_of in aliases.values() for name in aliases_of]
    unmatched = policy.unmatched_tokens(names, selector="name")
    if unmatched:
        warn(
            f"param_policy: the override name(s) {list(unmatched)} match no parameter of the "
            f"{type(model).__name__}, so they change nothing; a name matches whole "
            "dot-separated components of a parameter's FQN (see the routing guide)",
            UserWarning,
        )
    # A ``contains`` token is a plain substring: the advice about components would mislead.
    unmatched = policy.unmatched_tokens(names, selector="contains")
    if unmatched:
        warn(
            f"param_policy: the override 'contains' substring(s) {list(unmatched)} occur in no "
            f"parameter name of the {type(model).__name__}, so they change nothing; a "
            "'contains' token is a plain, case-sensitive substring of a parameter's FQN "
            "(see the routing guide)",
            UserWarning,
        )


def _attach(model: nn.Module, runtime: DedicatedRuntime, config: DedicateConfig) -> None:
    """Step 7 of [Note: what dedicate_params does, in order]: the ``fully_shard`` patch, the
    runtime on the model, the model's ``zero_grad`` and conversions wrapped."""
    if config.patch_fully_shard:
        install_patch()
    setattr(model, RUNTIME_ATTR, runtime)
    _zero_grad_clears_owner_grads(model, runtime)
    check_conversions(model, runtime)


def _log_plan(plan: Plan, stacks: list[ExpertStack], params: list[DedicatedParam]) -> None:
    """Log the plan's summary and the parameters Muon orthogonalises in pieces."""
    logger.info("dedicate_params: %s", plan.summary())
    split = [f"{s.fqn} ({s.view.split})" for s in stacks if s.view.split is not None]
    split += [f"{dp.fqn} ({describe_pieces(dp.pieces)})" for dp in params if dp.pieces]
    if split:
        logger.info("dedicate_params: Muon orthogonalises apart: %s", ", ".join(split))


def _zero_grad_clears_owner_grads(model: nn.Module, runtime: DedicatedRuntime) -> None:
    """Make ``model.zero_grad()`` clear the owners' gradients too.

    [Note: Module.zero_grad]
    A dedicated parameter's ``.grad`` is dropped as soon as its pack is reduced, and the
    averaged gradient lives on its owner in ``DedicatedParam.grad``, where it accumulates over
    backward passes until something clears it, as ``.grad`` does in torch. ``Muon.zero_grad``
    clears it; but training loops that zero through the module (the Hugging Face ``Trainer``
    calls ``model.zero_grad()`` and never ``optimizer.zero_grad()``) would otherwise add every
    step's gradient to the last ones, while FSDP2's gradients start afresh: silently wrong
    training. So the model's ``zero_grad`` is wrapped, on this instance only, to clear them
    as well (FSDP2 likewise gives the module it shards new methods). A submodule's
    ``zero_grad`` or a ``torch.compile`` wrapper's does not reach it: call
    ``optimizer.zero_grad()`` there.
    """
    module_zero_grad = model.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        module_zero_grad(set_to_none)
        runtime.clear_grads(set_to_none)

    model.zero_grad = zero_grad  # type: ignore[method-assign]


def _refuse_inner_ddp(model: nn.Module) -> None:
    """A ``DistributedDataParallel`` built inside the model before this call (a block wrapped
    in place): its reducer would all-reduce the dedicated gradients on top of dmuon's reduces,
    and dmuon's hooks on it run before its forward, where no check sees it running."""
    inner = [name or type(model).__name__ for name, _ in ddp_modules(model)]
    if inner:
        raise RuntimeError(
            f"DistributedDataParallel cannot wrap a module of a model given to dmuon: {inner[:3]} "
            "wrap modules of this model, and their reducers would all-reduce the dedicated "
            "gradients on top of dmuon's reduces. Unwrap them (module.module) before "
            "dedicate_params: dmuon.dedicate_params_ddp(model, mesh, predicate) + "
            "dmuon.replicate(model, mesh) is the replicated path; to shard, dedicate_params + "
            "fully_shard"
        )


def _refuse_fsdp1(model: nn.Module) -> None:
    """A model that torch's FSDP1 (``FullyShardedDataParallel``) wrapped before this call: its
    parameters are FSDP1's flat shards (or, under ``use_orig_params=True``, views of them of
    another size on each rank), so the predicate sees no matrix, or plans that differ across
    ranks. dmuon composes with FSDP2's ``fully_shard`` only. The module tree is the same on
    every rank, so every rank raises alike, before the predicate runs."""
    wrapped = [
        repr(name) if name else "the root module"
        for name, module in model.named_modules()
        if isinstance(module, FullyShardedDataParallel)
    ]
    if wrapped:
        raise RuntimeError(
            f"FullyShardedDataParallel (FSDP1) already wraps {', '.join(wrapped[:3])} of the "
            "model given to dedicate_params: dmuon works with FSDP2's fully_shard, not FSDP1, "
            "whose flat shards hide the matrices. Build the model unwrapped, then dmuon.dedicate_params("
            "model, mesh, predicate) -> fully_shard(layer, mesh=mesh) for each layer -> "
            "fully_shard(model, mesh=mesh) -> dmuon.Muon(model)"
        )


def parameter_names(model: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter, keyed by ``id``: a parameter registered on two modules (a
    tied embedding and head, a block shared by two layers) has two names; the first is the
    one ``named_parameters()`` and ``state_dict()`` order by."""
    names: dict[int, list[str]] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(fqn)
    return names


class _Selected(NamedTuple):
    """A parameter the predicate accepted, and the split its result declared (or ``None``)."""

    fqn: str
    param: nn.Parameter
    split: MatrixSplit | None


def _verdict(predicate: Predicate, names: list[str], param: nn.Parameter) -> object:
    """The predicate's first truthy result over the parameter's names (else the last)."""
    verdict: object = False
    for name in names:
        verdict = predicate(name, param)
        if verdict:
            break
    return verdict


def _select(
    model: nn.Module, aliases: Mapping[int, list[str]], predicate: Predicate
) -> list[_Selected]:
    """The trainable parameters ``predicate`` accepts under any of their names, by first name,
    with the split a ``MatrixSplit`` result declares; warns when it accepts none and raises
    when one is dedicated already."""
    selected = [
        _Selected(fqn, param, verdict if isinstance(verdict, MatrixSplit) else None)
        for fqn, param in model.named_parameters()
        if param.requires_grad and (verdict := _verdict(predicate, aliases[id(param)], param))
    ]
    taken = [s.fqn for s in selected if is_dedicated(s.param)]
    if taken:
        raise RuntimeError(
            f"dedicate_params selected {taken[:5]}, which an earlier dedicate_params call "
            "already dedicated: on a submodule of this model (call dedicate_params once, on "
            "the whole model, with a predicate that selects every Muon matrix), or on another "
            "model that shares them (put both models under one root module, dedicate that "
            "once and step it with one Muon)"
        )
    if not selected:
        trainable = sum(1 for p in model.parameters() if p.requires_grad)
        message = (
            f"dedicate_params: the predicate selected none of the {trainable} trainable "
            f"parameters of {type(model).__name__}, so dmuon will run no Muon step; check the "
            "predicate against model.named_parameters() (e.g. lambda n, p: 'proj' in n and "
            "p.ndim == 2)"
        )
        if trainable == 0 and any(True for _ in model.parameters()):
            # Frozen whole (a distillation teacher): no predicate would select anything.
            message = (
                f"dedicate_params: {type(model).__name__} has no trainable parameter (every"
                " one is frozen, and dedicate_params selects trainable parameters only), so"
                " dmuon dedicates nothing and will run no Muon step. A model that only runs"
                " forward, such as a frozen teacher for distillation, needs no dedicate_params:"
                " shard it with fully_shard alone; to train it, make its parameters trainable"
                " before dedicate_params"
            )
        logger.warning(message)
        warn(message)
    return selected


class _Claim(NamedTuple):
    """A selected parameter, its kind (``None``: left to FSDP2, the ``sharded_adamw`` route)
    and its matrices (``None``: not on the Muon route)."""

    found: Found
    kind: type[ParamHolder] | None
    view: MatrixView | None


def _claim(
    selected: list[_Selected],
    policy: ParamPolicy,
    modules: Mapping[str, nn.Module],
    aliases: Mapping[int, list[str]],
) -> list[_Claim]:
    """Ask the registry once per selected parameter for its kind (see [Note: the kinds of
    holders] in ``holder/_kinds``), and the kind for its matrices (which checks that Muon can
    step them, and that a declared split fits them)."""
    claims = []
    for fqn, param, declared in selected:
        path, _, name = fqn.rpartition(".")
        # By every name, as _select asks the predicate: a tied head routed as 'lm_head'.
        resolved = policy.resolve(fqn, aliases.get(id(param), ()))
        split = _split_of(fqn, declared, resolved.split)
        found = Found(fqn, param, modules[path], name, resolved, split)
        kind = kind_of(found)
        module = found.module
        if (
            kind is not None
            and isinstance(module, nn.Embedding | nn.EmbeddingBag)
            and module.sparse
        ):
            raise ValueError(
                f"{fqn!r} belongs to a {type(module).__name__} built with sparse=True, whose"
                " gradient is a sparse tensor; dmuon reduces a dense gradient to each weight's"
                f" owner: build it with sparse=False, or leave {fqn!r} out of the predicate"
            )
        if kind is None and split is not None:
            raise ValueError(
                f"{fqn!r} has a declared split {split}, but its route is 'sharded_adamw' (left "
                "to FSDP2 and AdamW): a split cuts the matrices Muon orthogonalises; declare it "
                "only for Muon-route weights"
            )
        claims.append(_Claim(found, kind, None if kind is None else kind.view_of(found)))
    _warn_muon_biases(claims)
    _warn_stacks_of_one(claims)
    return claims


def _warn_muon_biases(claims: list[_Claim]) -> None:
    """Warn of biases on the Muon route: a predicate that takes every parameter of two or
    more dims (Moonlight's ``p.ndim >= 2``) takes the 2-D bias stacks of Hugging Face experts
    (GPT-OSS's ``gate_up_proj_bias (E, 2I)``, ``down_proj_bias (E, H)``), which Muon would
    orthogonalise as one matrix across the experts."""
    biases = [
        f"{found.fqn} {tuple(found.param.shape)}"
        for found, _, view in claims
        if view is not None and (found.name == "bias" or found.name.endswith("_bias"))
    ]
    if biases:
        warn(
            f"dedicate_params: the predicate put {len(biases)} bias(es) on the Muon route"
            f" (first: {biases[:3]}): Muon orthogonalises each as one matrix (an expert"
            " bias stack across its experts), where biases train with AdamW; leave them out"
            " of the predicate (and 'bias' not in name), or route them to 'adamw' with"
            " param_policy",
            UserWarning,
        )


def _warn_stacks_of_one(claims: list[_Claim]) -> None:
    """Warn of 3-D parameters of one expert on the Muon route: a predicate that takes every
    parameter of two or more dims (``p.ndim >= 2``) takes a vision transformer's class token
    ``(1, 1, D)`` and position embedding ``(1, N, D)``, held on the model with a leading dim
    of one for broadcasting, which dmuon would take as a stack of one expert and Muon would
    orthogonalise (a ``(1, D)`` row: normalise), where Muon recipes train them with AdamW. A
    stack of one expert is rare enough that a real one can bear the warning."""
    ones = [
        f"{found.fqn} {tuple(found.param.shape)}"
        for found, _, view in claims
        if view is not None and view.experts == 1
    ]
    if ones:
        warn(
            f"dedicate_params: the predicate put {len(ones)} 3-D parameter(s) with a leading"
            f" dim of 1 on the Muon route (first: {ones[:3]}): dmuon takes a 3-D parameter as a"
            " stack of experts on dim 0, so Muon orthogonalises its one (N, D) slice; a class"
            " token or position embedding (1, N, D) trains with AdamW: leave it out of the"
            " predicate (and p.ndim == 2), or route it to 'adamw' with param_policy",
            UserWarning,
        )


_STACK_DTYPE_FIELDS = ("param_dtype", "grad_dtype", "master_dtype", "optim_dtype")


def _check_stack_dtypes(in_place: list[_Claim], config: DedicateConfig) -> None:
    """Refuse (replicated path) or warn of (sharded path) ``param_policy`` dtypes that an
    expert stack cannot take.

    [Note: expert stacks keep their own dtypes]
    An expert stack is not dedicated (see [Note: expert stacks] in holder/_experts): it stays
    the parameter FSDP2 (or, on the replicated path, ``replicate``) holds, in the dtypes that
    holder gives it, so ``param_policy``'s dtype fields never reach it. Left unsaid, a policy
    that computes the blocks in bf16 (``defaults: {"param_dtype": "bfloat16"}``, the mixed
    precision guide's pattern) casts each block's inputs to bf16 while its stacks stay fp32,
    and the experts' matmul fails deep in the forward (``expected scalar type Float but found
    BFloat16``), or a ``master_dtype``/``optim_dtype`` asked for is silently not used. On the
    replicated path nothing else can give a stack another dtype, so it is refused; on the
    sharded path FSDP2's ``MixedPrecisionPolicy``, applied after ``dedicate_params``, may give
    the stack the same compute dtype, so it is a warning. A field equal to the stack's own
    dtype changes nothing and passes.
    """
    asked = []
    for found, _, _ in in_place:
        own = str(found.param.dtype).removeprefix("torch.")
        fields_ = [
            f"{name}={getattr(found.policy, name)!r}"
            for name in _STACK_DTYPE_FIELDS
            if getattr(found.policy, name) not in (None, own)
        ]
        if fields_:
            asked.append(f"{found.fqn!r} ({own}): {', '.join(fields_)}")
    if not asked:
        return
    where = (
        "keep the model in one dtype (model.to(torch.bfloat16)) or use torch.autocast"
        if config.replicated
        else "give it FSDP2's MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...) on the"
        " fully_shard that holds it"
    )
    detail = (
        f"for {len(asked)} stack(s), e.g. {'; '.join(asked[:2])}. An expert stack is stepped"
        " where it lies, not dedicated, and keeps the dtypes of the parameter that holds it:"
        f" {where}, and leave its dtypes out of param_policy (an override such as"
        " {'name': ['experts'], 'set': {'param_dtype': None, 'master_dtype': None}})"
    )
    if config.replicated:
        raise ValueError(
            f"dedicate_params_ddp: param_policy sets dtypes that an expert stack cannot take,"
            f" {detail}"
        )
    warn(
        f"dedicate_params: param_policy sets dtypes that an expert stack cannot take, {detail}",
        UserWarning,
    )


def _split_of(
    fqn: str, declared: MatrixSplit | None, policy: MatrixSplit | None
) -> MatrixSplit | None:
    """The split of a parameter: the predicate's or ``param_policy``'s (both: they must be
    the same)."""
    if declared is not None and policy is not None and declared != policy:
        raise ValueError(
            f"{fqn!r} has two different splits: {declared} from the predicate and {policy} "
            "from param_policy's split; declare it in one place"
        )
    return declared or policy


def _planned_experts(
    in_place: list[_Claim], config: DedicateConfig
) -> list[tuple[str, dmuon_ownership.ExpertStack]] | None:
    """The expert stacks FSDP2's dim-0 split will leave on the grid, for the planner to weigh
    (so that it puts dense matrices on the ranks with fewer experts) and, under HSDP, to pick
    expert sources (see [Note: expert sources] in dmuon_ownership); ``None``: nothing to weigh.
    A stack already split by expert parallelism is left out (its split is the EP mesh's); on
    the replicated path every rank steps every expert, which weighs every slot alike."""
    if config.replicated:
        return None
    planned = []
    for found, kind, view in in_place:
        assert kind is not None and view is not None
        spec = cast("type[ExpertStack]", kind).planned(found, view)
        if spec is not None:
            planned.append((found.fqn, spec))
    return planned or None


def _held_in_place(claim: _Claim, plan: Plan, layout: MeshLayout) -> ExpertStack:
    """The holder of a parameter FSDP2 keeps, once the plan is made."""
    found, kind, view = claim
    assert kind is not None and view is not None
    return cast("type[ExpertStack]", kind).build(found, view, plan, layout)


def _work_items(
    claims: Iterable[_Claim],
    aliases: Mapping[int, list[str]],
    modules: Mapping[str, nn.Module],
    config: DedicateConfig,
    tp: Mapping[str, int],
) -> list[WorkItem]:
    """What the planner sees of each dedicated parameter (``tp``: the TP degree of the
    tensor-parallel ones)."""
    items: list[WorkItem] = []
    for found, _, view in claims:
        param = found.param
        boundary = _shared_boundary(aliases[id(param)], modules, config)
        pieces = () if found.split is None else pieces_of(param.shape, found.fqn, found.split)
        # A split weight's owner runs NS on its pieces, a convolution kernel's on its one
        # flattened matrix (its kind's view): the planner weighs those.
        matrices = tuple(piece.view.stack_shape for piece in pieces)
        if view is not None and view.kernel:
            matrices = (view.stack_shape,)
        items.append(
            WorkItem(
                found.fqn,
                tuple(param.shape),
                boundary,
                found.policy.route,
                param.element_size(),
                tp.get(found.fqn, 1),
                matrices,
            )
        )
    return items


def _is_default_boundary(name: str, modules: Mapping[str, nn.Module]) -> bool:
    """A block of a layer stack: an item of an ``nn.ModuleList`` (``layers.3``, ``blocks.3``,
    ``h.3``, ``encoder.layer.3``), or any module named ``layers.N`` / ``blocks.N``."""
    if _LAYER_NAME.search(name):
        return True
    parent, _, last = name.rpartition(".")
    return last.isdigit() and isinstance(modules.get(parent), nn.ModuleList)


def _warn_nested_boundaries(boundaries: set[str], modules: Mapping[str, nn.Module]) -> None:
    """Warn when a default hook boundary lies inside another layer-stack item (experts kept
    as an ``nn.ModuleList`` inside each decoder layer): each then waits for its own broadcast
    when it runs, so a rank that skips one (an expert no token picked there) leaves the others
    waiting. Hooked at the outer layer, each rank may skip whichever it likes."""
    outer: dict[str, str] = {}  # nested boundary -> the outermost stack item above it
    for name in boundaries:
        above = [name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)]
        items = [a for a in above if _is_default_boundary(a, modules)]
        if items:
            outer[name] = items[-1]
    if outer:
        nested = sorted(outer)
        layer = type(modules[outer[nested[0]]]).__name__
        message = (
            f"dedicate_params: {len(nested)} hook boundaries lie inside another layer of the"
            f" stack ({', '.join(repr(n) for n in nested[:3])}{', ...' if len(nested) > 3 else ''}):"
            " each is gathered when it runs, so every rank must run each of them. If a rank may"
            " skip one (a loop over experts that skips those no token picked), hook at the"
            f" outer layer instead: hook_boundary_predicate=lambda m: isinstance(m, {layer})"
        )
        logger.warning(message)
        warn(message)


def _boundary_of(
    module: str,
    what: str,
    modules: Mapping[str, nn.Module],
    predicate: BoundaryPredicate | None,
    strict: bool,
) -> str:
    """The lowest hook boundary among ``module`` and its ancestors (``what`` names the
    parameter in the error raised in ``strict`` mode when there is none; otherwise the root)."""
    parts = module.split(".") if module else []
    ancestors = [".".join(parts[:i]) for i in range(len(parts), -1, -1)]
    for name in ancestors:
        if predicate is None:
            if _is_default_boundary(name, modules):
                return name
        elif predicate(modules[name]):
            return name
    if strict:
        rule = (
            "hook_boundary_predicate matches none of its ancestors"
            if predicate is not None
            else "it has no ancestor that is an item of a layer stack (an nn.ModuleList item "
            "such as 'layers.N', 'blocks.N' or 'h.N')"
        )
        raise ValueError(
            f"dedicated parameter {what} has no hook boundary: {rule} "
            f"({', '.join(repr(a) for a in ancestors)}); pass hook_boundary_predicate="
            "lambda m: ... that matches one of them, exclude the parameter in the predicate, "
            "or pass hook_boundary_strict=False to hook it at the root module"
        )
    return ""


def _shared_boundary(
    names: list[str], modules: Mapping[str, nn.Module], config: DedicateConfig
) -> str:
    """The hook boundary of a parameter registered under ``names``.

    [Note: shared parameters] A parameter registered on modules of different boundaries (a
    block shared by two layers, an embedding tied to the head) is hooked at the lowest
    boundary that contains all of them, the root module at the latest: its weight is then
    gathered for that boundary's whole forward and backward, so every use reads it. Such a
    parameter never makes ``hook_boundary_strict`` raise, since each of its uses has a place.
    """
    predicate, strict = config.hook_boundary_predicate, config.hook_boundary_strict
    paths = [name.split(".")[:-1] for name in names]
    found = {
        _boundary_of(".".join(path), repr(names[0]), modules, predicate, strict and len(names) == 1)
        for path in paths
    }
    if len(found) == 1:
        return found.pop()
    common = ".".join(_common_prefix(paths))
    return _boundary_of(common, repr(names[0]), modules, predicate, strict=False)


def _common_prefix(paths: list[list[str]]) -> list[str]:
    prefix: list[str] = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        prefix.append(parts[0])
    return prefix


def _check_fingerprint(plan: Plan, model: nn.Module, layout: MeshLayout) -> None:
    """Every rank must hold the same model and plan: the plan's fingerprint and every
    parameter's name and (global) shape, hashed together and compared across ranks. The names
    catch models that differ outside the plan too, such as pipeline stages passed as HSDP
    replicas, whose first step would otherwise hang."""
    params = "".join(f"{name}:{tuple(p.shape)};" for name, p in model.named_parameters())
    mine = hashlib.sha256(f"{plan.fingerprint()}|{params}".encode()).hexdigest()
    # The sha256 hex digest as 16 ints of 16 bits each, compared across ranks.
    digits = [int(mine[i : i + 4], 16) for i in range(0, len(mine), 4)]
    # Compared inside each pipeline stage: the stages hold different models.
    everyone = all_gather_numbers([layout.pp_index, *digits], layout.device)
    differing = sorted(
        {"".join(f"{d:04x}" for d in row[1:]) for row in everyone if row[0] == layout.pp_index}
        - {mine}
    )
    if differing:
        raise RuntimeError(
            f"dmuon's owner plan differs across ranks (this rank {mine[:12]}, others "
            f"{[d[:12] for d in differing]}): every rank must build the same model and call "
            "dedicate_params with the same predicate, policy and meshes (the stages of "
            "pipeline parallelism hold different models: pass the pipeline dimension as "
            "pipeline_mesh, never as replicate_mesh)"
        )


def _role(owner: Owner, layout: MeshLayout) -> Role:
    if owner == layout.coord:
        return Role.OWNER
    if owner.shard == layout.coord.shard and layout.is_hsdp:
        return Role.REPLICA
    return Role.PEER


class _Checked(NamedTuple):
    """What ``_checked_before_taking`` found: each planned parameter's name for errors, and
    each boundary's input and output casts."""

    where: dict[str, str]
    casts: dict[str, tuple[torch.dtype | None, torch.dtype | None]]


def _checked_before_taking(
    plan: Plan, packed: Mapping[str, tuple[Found, type[DedicatedParam]]], layout: MeshLayout
) -> _Checked:
    """Everything about the planned parameters that can refuse ``dedicate_params``, asked
    before anything changes (the replicated path's first broadcast, the holders that take the
    parameters over): a refused call leaves the model as it was, and a retry does not find
    its parameters dedicated."""
    where: dict[str, str] = {}
    # boundary -> owner -> names, both in plan order
    by_boundary: dict[str, dict[Owner, list[str]]] = defaultdict(dict)
    for unit in plan.units:
        role = _role(unit.owner, layout)
        for fqn in unit.names:
            where[fqn] = (
                f"dedicated parameter {fqn!r} (owner: rank {layout.global_rank(unit.owner)};"
                f" this rank {dist.get_rank()} is its {role.value})"
            )
            check_guardable(packed[fqn][0].param, where[fqn])
            by_boundary[unit.boundary].setdefault(unit.owner, []).append(fqn)
    casts = {
        boundary: _boundary_casts(
            boundary, [(fqn, packed[fqn][0].policy) for owned in by.values() for fqn in owned]
        )
        for boundary, by in by_boundary.items()
    }
    return _Checked(where, casts)


def _build_groups(
    modules: Mapping[str, nn.Module],
    plan: Plan,
    packed: Mapping[str, tuple[Found, type[DedicatedParam]]],
    tp_dims: Mapping[str, int],
    layout: MeshLayout,
    comm: DedicatedCommContext,
    config: DedicateConfig,
    checked: _Checked,
) -> tuple[list[DedicatedParam], list[DedicatedGroup]]:
    """One holder of its kind per planned parameter (guarded, see [Note: reads on a peer]) and
    one group per boundary; the groups pack their members later (``DedicatedRuntime.lazy_init``).
    ``checked``: what :func:`_checked_before_taking` found."""
    where, casts = checked
    params: list[DedicatedParam] = []
    members: dict[str, dict[Owner, list[DedicatedParam]]] = defaultdict(dict)
    for unit in plan.units:
        role = _role(unit.owner, layout)
        for fqn in unit.names:
            found, kind = packed[fqn]
            dp = kind(
                fqn=fqn,
                param=found.param,
                module=found.module,
                name=found.name,
                boundary=unit.boundary,
                owner=unit.owner,
                role=role,
                route=found.policy.route,
                policy=found.policy,
                tp_dim=tp_dims.get(fqn),
                split=found.split,
                where=where[fqn],
                reduced_at_step=layout.pp_size > 1,
            )
            params.append(dp)
            members[unit.boundary].setdefault(unit.owner, []).append(dp)
    groups = []
    for name in modules:
        if name in members:
            group = DedicatedGroup(name, modules[name], list(members[name].values()), comm)
            group.replicated = config.replicated
            group.input_dtype, group.output_dtype = casts[name]
            groups.append(group)
    return params, groups


def _refuse_torch_paths(
    model: nn.Module,
    modules: Mapping[str, nn.Module],
    params: list[DedicatedParam],
    aliases: Mapping[int, list[str]],
    config: DedicateConfig,
    layout: MeshLayout,
) -> None:
    """Make torch's own paths that would reach the dedicated weights only where they are held
    raise instead: ``DistributedDataParallel`` around any module above one (see [Note: reads on
    a peer] in holder/_guard), ``load_state_dict`` on the sharded path (the replicated one
    loads through it), ``state_dict()`` there where some rank does not hold them, the functions
    of ``torch.distributed.checkpoint.state_dict`` (on the replicated path those that take the
    optimizer) and torch's optimizers (see [Note: torch's paths that cannot reach a dedicated
    weight]), torch's clip functions and accelerate's among them (accelerate's once it is
    imported). Each module that registers a dedicated weight is refused, under every name of a
    tied one (``aliases``: the names of each parameter by ``id``), so that a head tied to a
    dedicated embedding refuses ``lm_head.state_dict()`` and ``lm_head.load_state_dict`` as the
    embedding does."""
    above = _ancestors_of({dp.fqn for dp in params})
    for name in above:
        refuse_ddp(modules[name], f"module {name!r}" if name else f"this {type(model).__name__}")
    refused = {id(modules[name]) for name in above}
    tied = {alias for dp in params for alias in aliases.get(id(dp.param), ()) if alias != dp.fqn}
    for name in sorted(_ancestors_of(tied)):
        # A module shared by two paths is one object, refused under its first path already.
        if id(module := model.get_submodule(name)) not in refused:
            refused.add(id(module))
            refuse_ddp(module, f"module {name!r}")
    held: dict[nn.Module, dict[str, DedicatedParam]] = defaultdict(dict)
    for dp in params:
        held[dp.module][dp.name] = dp
    for dp in params:
        for alias in aliases.get(id(dp.param), ()):
            prefix, _, attribute = alias.rpartition(".")
            held[model.get_submodule(prefix)].setdefault(attribute, dp)
    for module, dps in held.items():
        names = {attribute: dp.fqn for attribute, dp in dps.items()}
        attribute, first = next(iter(dps.items()))
        if not config.replicated:
            refuse_module_load(module, names)
            if layout.shard_size > 1:  # a peer of every dedicated weight exists
                owner = layout.global_rank(first.owner)
                refuse_module_state_dict(module, attribute, first.fqn, owner)
        refuse_torch_state_dict(module, first.fqn, replicated=config.replicated)
    refuse_foreign_optimizers()
    refuse_accelerate_clip()
    refuse_torch_clip()


def _refuse_childless_root(
    model: nn.Module, packed: Mapping[str, tuple[Found, type[DedicatedParam]]]
) -> None:
    """Refuse a dedicated parameter registered on a root module that has no submodules.

    [Note: a dedicated parameter on a childless root]
    torch.distributed.checkpoint.state_dict's functions ask a module for its
    ``_fqn_modifiers``, where dmuon refuses them (see [Note: torch's paths that cannot reach a
    dedicated weight] in holder/_guard), only while they walk a dotted parameter name or a
    module's children. A parameter of a childless root has neither: ``get_model_state_dict``
    would return the matrix on its owner and raise ``NotHeldError`` on the other ranks (its
    full state dict, the ``set_`` functions and the optimizer's would go on into their
    collectives on the owner alone). Nothing of such a root is asked before they read, so the parameter must
    live in a submodule; asked before anything changes (step 4 of [Note: what dedicate_params
    does, in order])."""
    if next(model.children(), None) is not None:
        return
    for found, _ in packed.values():
        if found.module is model:
            raise ValueError(
                f"dedicated parameter {found.fqn!r} is registered on the root"
                f" {type(model).__name__} itself, which has no submodules: the functions of"
                " torch.distributed.checkpoint.state_dict (get_model_state_dict,"
                " get_optimizer_state_dict, ...) consult nothing of such a model before they"
                " read its weights, so dmuon could not stop them on every rank alike, and the"
                " owner would go on alone into their collectives while the other ranks raised."
                " Hold the matrix in a submodule (self.proj = nn.Linear(...), or a small"
                " nn.Module that registers the nn.Parameter) or leave it to FSDP2 (the"
                " predicate returns False for it); nothing was dedicated"
            )


def _boundary_casts(
    boundary: str, params: list[tuple[str, ResolvedPolicy]]
) -> tuple[torch.dtype | None, torch.dtype | None]:
    """The input and output dtypes ``param_policy`` asks of the boundary (``None``: no cast;
    the ``MixedPrecisionPolicy`` of an enclosing ``fully_shard`` casts on its own), from the
    ``(fqn, policy)`` of its parameters. Raises when two of them ask for different ones."""
    casts: dict[str, dict[str, str]] = {"input": {}, "output": {}}
    for fqn, policy in params:
        if policy.param_dtype is not None and policy.cast_forward_inputs:
            casts["input"].setdefault(policy.param_dtype, fqn)
        if policy.output_dtype is not None:
            casts["output"].setdefault(policy.output_dtype, fqn)
    found: list[torch.dtype | None] = []
    for what, asked in casts.items():
        if len(asked) > 1:
            (d1, p1), (d2, p2) = list(asked.items())[:2]
            where = f"module {boundary!r}" if boundary else "the root module"
            raise ValueError(
                f"param_policy asks the hook boundary {where} to cast its {what}s to {d1} (for "
                f"{p1!r}) and to {d2} (for {p2!r}); one boundary casts to one dtype: give both "
                "parameters the same param_dtype/output_dtype, set cast_forward_inputs=False "
                "for one of them, or put them under different boundaries "
                "(hook_boundary_predicate)"
            )
        found.append(getattr(torch, next(iter(asked))) if asked else None)
    return found[0], found[1]


def _ancestors_of(fqns: set[str]) -> set[str]:
    """Every module name above the parameters ``fqns`` (the root ``""`` included)."""
    found = {""}
    for fqn in fqns:
        parts = fqn.split(".")[:-1]
        found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return found
