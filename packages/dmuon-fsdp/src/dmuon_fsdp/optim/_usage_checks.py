"""The checks that refuse a wrong use of :class:`Muon` (the optimizer of ``_optimizer``): at
construction (a keyword dmuon does not take, a model that is not the wrapped one, a trainable
parameter nothing synchronises or FSDP2 holds unsharded, ``fully_shard`` options dmuon does not
follow, a ``fully_shard`` mesh that does not cover dmuon's data-parallel grid, dedicated
parameters frozen since ``dedicate_params``, a ``cuda_graph`` that cannot apply), on
``add_param_group``, at each step (a second ``Muon`` stepping the gradients another ``Muon``
on the model stepped, a step inside ``ema.applied()``, parameters FSDP2 replaced
or holds unsharded, a ``GradScaler``, a parameter unfrozen since construction), and at a clip
right after a backward under ``no_sync``. Each raises (or warns) naming what is wrong and the
fix; none changes anything first.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, NoReturn

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from dmuon_ns import NewtonSchulz
from dmuon_ownership import Route

from .._matrix import NSFunction
from .._torch_internals import (
    fsdp_manages,
    fsdp_offloads_to_cpu,
    fsdp_reshards_after_forward,
)
from .._warnings import warn
from ..holder import DedicatedParam, fsdp_modules, is_dedicated
from ..runtime import DedicatedRuntime
from ._param_groups import TORCH_ADAMW_FLAGS, TORCH_MUON_EPS

# -- at construction ---------------------------------------------------------------------------


def check_no_other_keywords(keywords: Mapping[str, object], option_fields: Collection[str]) -> None:
    """Refuse keywords ``Muon()`` does not take, naming what dmuon takes instead (a
    :class:`StepOptions` field, of ``option_fields``; a keyword of torch's Muon or AdamW)."""
    if keywords:
        raise TypeError(
            f"Muon() takes no keyword {', '.join(map(repr, keywords))}: "
            + _instead_of(keywords, option_fields)
        )


def check_model(model: object) -> None:
    """Refuse anything but the wrapped model (a parameter list, say)."""
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"Muon takes the wrapped model (an nn.Module), got {type(model).__name__};"
            " build it as dmuon.Muon(model, lr=...), not from a parameter list. It steps every"
            " trainable parameter of the model, the dedicated matrices with Muon and the"
            " others with AdamW (adamw_lr=, adamw_betas=, adamw_eps=, adamw_weight_decay=), so"
            " it replaces both optimizers of a Muon + Adam recipe; groups of your own go in"
            " param_groups=[...]"
        )


def check_every_param_is_synchronised(model: nn.Module, runtime: DedicatedRuntime) -> None:
    """On more than one rank, a trainable parameter that is neither dedicated nor managed by
    FSDP2 nor replicated (``replicate``) gets no gradient synchronisation at all: each rank
    would train its own copy and the ranks would drift apart without an error. A DTensor
    counts as FSDP2's where a ``fully_shard`` manages it (:func:`check_fully_shard_mesh` checks
    its mesh) or its mesh holds every rank of dmuon's grid: a tensor-parallel shard that is
    neither dedicated nor FSDP2's has its TP mesh only, and nothing reduces it over the
    data-parallel ranks. A dedicated weight's tied name that holds a parameter of its own
    (replaced since ``dedicate_params``; ``to_empty`` keeps it tied) is refused on any number
    of ranks: it would train apart from the weight."""
    synchronised = {id(p) for p in runtime.replicated_params}
    synchronised |= {id(dp.param) for dp in runtime.params}
    grid = _grid(runtime)
    modules = dict(model.named_modules())
    loose = [
        name
        for name, p in model.named_parameters()
        if p.requires_grad
        and id(p) not in synchronised
        and not (
            isinstance(p, DTensor)
            and (_covers(p, grid) or _fsdp_manager(modules, name) is not None)
        )
    ]
    if held := [n for n in loose if _held_unsharded(model, n)]:
        raise ValueError(
            f"Muon(): FSDP2 holds {held[0]!r} unsharded while the optimizer is built: a forward"
            " ran before it (an evaluation, say) and FSDP2 kept the root module's parameters"
            " gathered, so the optimizer would take the gathered copy, not the shard. Call"
            " .reshard() on every FSDP2 module first (for m in model.modules(): if"
            " isinstance(m, FSDPModule): m.reshard()), then build Muon; nothing was built"
        )
    if untied := [(n, runtime.tied_names[n]) for n in loose if n in runtime.tied_names]:
        name, tied_to = untied[0]
        raise ValueError(
            f"{name!r} was tied to the dedicated weight {tied_to!r} at dedicate_params and is "
            "a parameter of its own now (replaced since), which nothing would synchronise. Tie "
            f"it again, as for any model: model.{name} = model.{tied_to} (or "
            "model.tie_weights()); to train the two apart, untie them before dedicate_params"
        )
    if loose and runtime.layout.world_size > 1:
        shown = ", ".join(repr(n) for n in loose[:8]) + (" ..." if len(loose) > 8 else "")
        raise ValueError(
            f"{len(loose)} trainable parameter(s) are neither dedicated nor managed by FSDP2 (or "
            f"dmuon.replicate), so "
            f"nothing would synchronise their gradients across the {runtime.layout.world_size} "
            f"ranks: {shown}. Apply fully_shard to the modules that hold them (at least "
            "fully_shard(model) on the root, after the layers), select them in dedicate_params' "
            "predicate, or freeze them (requires_grad_(False)). If Muon was built before "
            "fully_shard, build it last: dedicate_params -> fully_shard (layers, then root) -> "
            "Muon(model)"
        )


def _held_unsharded(model: nn.Module, name: str) -> bool:
    """Whether FSDP2 manages the parameter ``name`` and holds its unsharded copy now (it
    registers that copy, a plain tensor, in place of the DTensor shard while it holds it)."""
    path, _, attr = name.rpartition(".")
    module = model.get_submodule(path)
    return any(fsdp_manages(m, module, attr) for _, m in fsdp_modules(model))


def check_fully_shard_options(model: nn.Module, runtime: DedicatedRuntime) -> None:
    """What ``fully_shard`` was given that dmuon does not follow: a ``CPUOffloadPolicy``
    (refused: FSDP2 would keep its shards, their gradients and AdamW's states on the CPU, while
    the dedicated matrices and their momentum stay whole on the owners' device, and the step
    would mix the two), and ``reshard_after_forward=False`` on every ``fully_shard`` module
    inside another while dmuon reshards (Z3): dmuon's Z2 or Z3 is ``dedicate_params``' own
    ``reshard_after_forward`` (warned: the results are the same, the traffic is not). The
    outermost ``fully_shard`` module is left out: FSDP2 keeps its parameters after forward
    whatever it was given."""
    modules = fsdp_modules(model)
    names = [name for name, _ in modules]
    inner = []
    for name, module in modules:
        if fsdp_offloads_to_cpu(module):
            raise ValueError(
                f"fully_shard({name or 'model'!r}) was given offload_policy=CPUOffloadPolicy(),"
                " which dmuon does not support: FSDP2 would keep that module's shards, their"
                " gradients and AdamW's states on the CPU, while dmuon keeps each dedicated"
                " matrix and its momentum whole on its owner's device and steps them there."
                " Call fully_shard without offload_policy"
            )
        if any(other != name and (not other or name.startswith(f"{other}.")) for other in names):
            inner.append(fsdp_reshards_after_forward(module))
    reshards = [flag for flag in inner if flag is not None]
    if runtime.reshard_after_forward and reshards and not any(reshards):
        warn(
            "every fully_shard below the root was given reshard_after_forward=False (Z2), but"
            " dedicate_params was not: dmuon frees each layer's dedicated matrices after its"
            " forward and broadcasts them again for backward (Z3). For Z2 pass"
            " reshard_after_forward=False to dedicate_params too (the results are the same"
            " either way)"
        )


def check_pipeline_stage(model: nn.Module, runtime: DedicatedRuntime) -> None:
    """Refuse a pipeline stage module that is not itself a ``fully_shard`` module.

    [Note: a pipeline stage that is not an FSDP2 module]
    A schedule of ``torch.distributed.pipelining`` turns gradient sync off for its
    micro-batches and reduces once at their end only for a stage module that is an
    ``FSDPModule`` (see [Note: the pipeline schedule's reduce] in ``runtime._runtime``).
    Any other stage runs plain synced backwards: dmuon would send each micro-batch's dedicated
    gradients to their owners at once, and the schedule's division of ``.grad`` by the number
    of micro-batches, which comes after, would miss them, so the owners would step gradients
    that many times too large. Raised at ``Muon(model)`` on every rank of the pipeline alike
    (they all shard their stages the same way), before anything is built."""
    if runtime.layout.pp_size > 1 and not isinstance(model, FSDPModule):
        raise ValueError(
            f"dedicate_params(pipeline_mesh=...) was given a stage module ({type(model).__name__})"
            " that is not a fully_shard module: torch's pipeline schedules reduce gradients at"
            " the end of the micro-batches only for an FSDP2 stage module, and for any other"
            " the dedicated gradients would be reduced per micro-batch and never divided by"
            " their number. Call fully_shard(stage_module, mesh=...) after its layers, before"
            " dmuon.Muon(stage_module); nothing was built"
        )


def check_fully_shard_mesh(model: nn.Module, runtime: DedicatedRuntime) -> None:
    """Refuse a ``fully_shard`` whose mesh does not cover dmuon's data-parallel grid (the ranks
    of ``dedicate_params``' mesh and ``replicate_mesh``, or ``dedicate_params_ddp``'s mesh).

    [Note: the fully_shard mesh]
    FSDP2 averages the gradients of the parameters it manages over the mesh its
    ``fully_shard`` was given, dmuon those of the dedicated matrices over its own grid, and
    neither sees the other's mesh. Given a mesh over part of the grid (``hsdp['shard']`` where
    dmuon has ``replicate_mesh=hsdp['replicate']``, a sub-mesh of a 1-D world, the TP dimension
    of a ``('dp', 'tp')`` mesh) FSDP2 averages each group of ranks apart, so the copies of its
    parameters (norms, embedding, head) in the other groups drift apart with no error while the
    Muon matrices stay in step. The ranks are compared, not the sizes: a parameter's DTensor
    mesh (public) lists every rank that holds a shard or a copy of it, FSDP2's dimensions and
    any it was placed on before (the TP dimension, or the EP one of experts that FSDP2 shards
    over the rest), and it must hold every rank of this rank's grid. A mesh over the same ranks
    laid out otherwise (a 1-D ``fully_shard`` mesh over an HSDP grid, or a 2-D one over a 1-D
    grid) averages over the same ranks and is left alone. Every rank of the grid sees the same
    meshes, so every rank raises alike, at ``Muon(model)``, before anything is built."""
    grid = _grid(runtime)
    replicated = {id(p) for p in runtime.replicated_params}
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor) or is_dedicated(param) or id(param) in replicated:
            continue
        if _covers(param, grid):
            continue
        where = _fsdp_manager(modules, name)
        if where is None:
            continue  # not FSDP2's: check_every_param_is_synchronised refuses it
        held = sorted({int(r) for r in param.device_mesh.mesh.flatten().tolist()})
        layout = runtime.layout
        if layout.tp_size > 1:
            fix = (
                "Pass fully_shard the data-parallel mesh that dedicate_params got, not the"
                " tensor-parallel dimension: mesh['dp'] of a ('dp', 'tp') mesh, or"
                " mesh['replicate', 'shard'] of a ('replicate', 'shard', 'tp') one"
            )
        elif layout.is_hsdp:
            fix = (
                "Pass fully_shard the 2-D mesh of both dimensions dedicate_params got:"
                " fully_shard(module, mesh=hsdp) with dedicate_params(model, hsdp['shard'], ...,"
                " replicate_mesh=hsdp['replicate'])"
            )
        else:
            setup = "dedicate_params_ddp" if runtime.config.replicated else "dedicate_params"
            fix = (
                f"Pass fully_shard the mesh that {setup} got, over every rank; for replicas"
                " use HSDP: fully_shard(module, mesh=hsdp) with dedicate_params(model,"
                " hsdp['shard'], ..., replicate_mesh=hsdp['replicate'])"
            )
        raise ValueError(
            f"fully_shard({where or 'model'!r}) holds {name!r} on ranks {tuple(held)}"
            f" (the mesh it was given), which does not cover dmuon's data-parallel grid, ranks"
            f" {tuple(grid)}: FSDP2 would average its gradients over that mesh only and dmuon"
            " the dedicated matrices' over the whole grid, so the copies of its parameters on"
            f" the other ranks would drift apart without an error. {fix}; nothing was built"
        )


def _grid(runtime: DedicatedRuntime) -> list[int]:
    """The global ranks of this rank's data-parallel grid, sorted."""
    return sorted(rank for row in runtime.layout.rank_of for rank in row)


def _covers(param: DTensor, grid: list[int]) -> bool:
    """Whether ``param``'s mesh holds every rank of ``grid``."""
    return {int(r) for r in param.device_mesh.mesh.flatten().tolist()}.issuperset(grid)


def _fsdp_manager(modules: Mapping[str, nn.Module], name: str) -> str | None:
    """The name of the ``fully_shard`` module (at or above its own) that manages the
    parameter ``name``, ``None`` where none does (none above, or ``ignored_params``);
    ``modules`` is ``model.named_modules()``."""
    path, _, attr = name.rpartition(".")
    parts = path.split(".") if path else []
    for depth in range(len(parts), -1, -1):
        prefix = ".".join(parts[:depth])
        candidate = modules.get(prefix)
        if isinstance(candidate, FSDPModule) and fsdp_manages(candidate, modules[path], attr):
            return prefix
    return None


def check_no_all_reduce_hook(first_hooked: Callable[[], str | None]) -> None:
    """Refuse FSDP2's ``set_all_reduce_hook`` on any ``fully_shard`` module of the model, at
    ``Muon(model)`` and at each step (a hook set later); ``first_hooked`` is the reader of
    ``fsdp_all_reduce_hook_reader(fsdp_modules(model))``, made once at ``Muon(model)``.

    [Note: FSDP2's all-reduce hook]
    FSDP2 calls the hook on the reduced gradients of its own parameters (a user's all-reduce
    across replicas of a 1-D ``fully_shard`` mesh, or anything else done to them there).
    Dedicated matrices never pass through FSDP2's reduce: dmuon reduces each one to its owner
    over ``dedicate_params``' mesh and ``replicate_mesh``, so whatever the hook does would
    reach FSDP2's parameters and not the Muon matrices, and the two routes would train on
    different gradients without an error. dmuon cannot run the hook in its place (it sees a
    shard of FSDP2's flat gradient on every rank, dmuon's gradient lands whole on one owner).
    Every rank sets the hook in the same code, so every rank raises alike."""
    hooked = first_hooked()
    if hooked is not None:
        raise ValueError(
            f"fully_shard({hooked or 'model'!r}) has an all-reduce hook"
            " (set_all_reduce_hook), which dmuon does not support: FSDP2 calls it on its own"
            " gradients only, while dmuon reduces each dedicated matrix's gradient to its owner"
            " over dedicate_params' mesh, so whatever the hook does (an all-reduce across"
            " replicas, a scaling) would not reach the Muon matrices. Remove the hook; for"
            " replicas use HSDP: fully_shard(..., mesh=hsdp) and dedicate_params(model,"
            " hsdp['shard'], ..., replicate_mesh=hsdp['replicate'])"
        )


def warn_frozen_dedicated(runtime: DedicatedRuntime) -> None:
    """Warn of dedicated parameters frozen between ``dedicate_params`` and ``Muon(model)``:
    dmuon still carries them, and no step will train them."""
    if frozen := [dp.fqn for dp in runtime.params if not dp.param.requires_grad]:
        kept = (
            "its gradient is still reduced to its owner and its weight published"
            if runtime.config.replicated
            else "it is still kept whole on its owner and broadcast for its layer's forward"
        )
        warn(
            f"{len(frozen)} dedicated parameter(s) were frozen between dedicate_params and"
            f" Muon(model) (first: {frozen[:3]}): {kept}, and no step will ever train it"
            " (Muon takes the trainable parameters when it is built). To keep it frozen,"
            " freeze it before dedicate_params, which then leaves it alone; to train it"
            " later, freeze it after Muon(model)"
        )


def check_cuda_graph_applies(
    params: Sequence[DedicatedParam], ns: NSFunction, device: torch.device
) -> None:
    """Refuse ``StepOptions(cuda_graph=True)`` where the graphed Muon phase cannot run: a
    callable Newton–Schulz, a tensor-parallel Muon matrix (of ``params``, the runtime's
    dedicated parameters), a device other than CUDA."""
    # Decided from what every rank holds alike, so that every rank raises.
    tensor_parallel = [dp.fqn for dp in params if dp.tp_dim is not None and dp.route is Route.MUON]
    what = None
    if not isinstance(ns, NewtonSchulz):
        what = f"its Newton–Schulz is a callable ({type(ns).__name__})"
    elif tensor_parallel:
        what = f"{tensor_parallel[0]!r} is a tensor-parallel matrix (its NS gathers over TP)"
    if what is not None:
        raise ValueError(
            f"StepOptions(cuda_graph=True): {what}, which the graph cannot capture; use"
            " ns_backend='gram'/'direct' or a dmuon_ns.NewtonSchulz without tensor"
            " parallelism, or drop cuda_graph"
        )
    if device.type != "cuda":
        raise ValueError(
            f"StepOptions(cuda_graph=True) needs CUDA; this model's dedicated parameters"
            f" are on {device}: drop the option there"
        )


def refuse_added_group(model: nn.Module, param_group: Any) -> NoReturn:
    """``add_param_group``'s refusal, naming what ``param_group`` held and the fix."""
    raise ValueError(
        "Muon builds its param groups from the model at construction, so"
        f" add_param_group() cannot add {_group_contents(model, param_group)}."
        " Give Muon every parameter to train when it is built: a parameter to train"
        " later must be trainable at dedicate_params and Muon(model) (freeze it with"
        " requires_grad_(False) afterwards, until it should train); a module added to the"
        " model later must be added before dedicate_params and fully_shard;"
        " hyperparameters of its own come from Muon(model, param_groups=[...])"
    )


# [Note: torch.optim.Muon's eps]
# torch.optim.Muon divides its NS input, the running mean of the gradients, by
# max(‖X‖_F, eps): eps is a floor that only a momentum of a smaller norm reaches (a zero or
# near-zero gradient), and every other input is divided by its norm exactly. dmuon's NS
# divides by ‖X‖_F + eps (Keller Jordan's form, which dmuon_ns's kernels share), and its input
# is the plain sum, 1/(1 − momentum) times torch's mean: the same as torch's
# ‖X_mean‖_F + (1 − momentum)·eps, which scales every input down by (1 − momentum)·eps/‖X‖.
# With the default 1e-7 that is below fp32 rounding wherever the momentum's norm is above
# about 0.05 (at momentum 0.95), so the two agree whatever torch's eps was, as long as no
# momentum falls below that floor (a run with tiny gradients, reproduced in fp32, takes a
# negligible NewtonSchulz(eps=1e-30), which divides by the norm itself). A torch eps carried
# over as NewtonSchulz(eps=...) would instead move every update (measured on 2 gloo ranks,
# fp32 NS on both sides, 6 steps of a 2-layer model: eps=1e-3 put the Muon weights 1.5e-3 of
# their largest entry from torch's, eps=0.1 7.5 %, where the default gave 8e-7). So a torch
# eps maps to no keyword: Muon(eps=) names TORCH_MUON_EPS, and so does "eps" written into a
# Muon group.

# What a keyword of torch's optimizers is called here (see _instead_of).
_TORCH_KEYWORDS = {
    "adjust_lr_fn": (
        "torch.optim.Muon's adjust_lr_fn is options=dmuon.StepOptions(lr_scaling=...):"
        ' "original" for None or "original", "moonlight" (the default) for "match_rms_adamw"'
    ),
    "ns_coefficients": (
        "torch.optim.Muon's ns_coefficients=(a, b, c), one row for every step, go to"
        " ns_backend=dmuon.NewtonSchulz(backend='direct', coefficients=[(a, b, c)]), its own"
        " being dmuon.ns.QUINTIC_COEFFICIENTS"
    ),
    "eps": f"{TORCH_MUON_EPS}; torch.optim.AdamW's eps is adamw_eps",
    "betas": "torch.optim.AdamW's betas are adamw_betas",
    "params": (
        "Muon takes the model itself (its first argument), not its parameters; groups of your"
        " own (a no-decay group of the norms and biases, say) go in param_groups=[{'params':"
        " [...], 'weight_decay': 0.0}, ...]"
    ),
}


def _group_contents(model: nn.Module, param_group: Any) -> str:
    """What an ``add_param_group`` argument holds, for its refusal: the model's parameter
    names, and how many tensors are not the model's."""
    params = param_group.get("params", ()) if isinstance(param_group, Mapping) else param_group
    if isinstance(params, Tensor):
        params = [params]
    try:
        tensors = [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in params]
    except TypeError:
        return f"a {type(param_group).__name__}"
    names = {id(p): name for name, p in model.named_parameters()}
    known = [names[id(p)] for p in tensors if id(p) in names]
    others = len(tensors) - len(known)
    parts = []
    if known:
        parts.append(f"the model's parameters {known[:3]}" + (" ..." if len(known) > 3 else ""))
    if others:
        parts.append(f"{others} tensor(s) that are not parameters of the model")
    return " and ".join(parts) or "a group without parameters"


def _instead_of(keywords: Iterable[str], option_fields: Collection[str]) -> str:
    """What dmuon takes instead of ``keywords``, which ``Muon()`` does not take, where it
    knows (a StepOptions field, of ``option_fields``; a keyword of torch's Muon or AdamW)."""
    hints = []
    guide = False
    for name in keywords:
        if name in option_fields:
            hints.append(f"{name} is a StepOptions field: options=dmuon.StepOptions({name}=...)")
        elif name in _TORCH_KEYWORDS:
            hints.append(_TORCH_KEYWORDS[name])
            guide = True
        elif name in TORCH_ADAMW_FLAGS:
            hints.append(f"torch.optim.AdamW's {name} is {TORCH_ADAMW_FLAGS[name]}")
        else:
            hints.append(f"{name} is not a keyword of dmuon.Muon")
    if guide:
        hints[-1] += " (the tuning guide's 'Moving from torch.optim.Muon' maps every keyword)"
    return "; ".join(hints)


# -- at each step ------------------------------------------------------------------------------


class _StageSteps:
    """The steps of pipeline stages' optimizers in this process: how many, and whose last;
    and every live one, with whether its stage module ran a backward since its last step."""

    def __init__(self) -> None:
        self.count = 0
        self.last: weakref.ref[object] | None = None
        self.pending: weakref.WeakKeyDictionary[object, Callable[[], bool]] = (
            weakref.WeakKeyDictionary()
        )


_STAGE_STEPS = _StageSteps()

# Why two untied stage modules per rank are refused, and the fix (see [Note: one stage module
# per rank]).
_ONE_STAGE_PER_RANK = (
    "and each Muon alone decides the step's non-finite skip and clip norm over the stages at its"
    " position only, not over the whole pipeline (an interleaved or looped schedule's model"
    " parts, one Muon each). Tie this rank's optimizers, in the order of its parts, into one"
    " optimizer and step and clip that: optimizer = dmuon.MuonParts([dmuon.Muon(part, ...) for"
    " part in model_parts])"
)


def stage_steps_so_far(optimizer: object, pending: Callable[[], bool]) -> int:
    """Register a pipeline stage's ``optimizer`` (``pending()``: whether its stage module ran a
    backward since its last step; it must not hold ``optimizer``) and return the mark it
    starts from (see :func:`check_one_stage_per_rank`)."""
    _STAGE_STEPS.pending[optimizer] = pending
    return _STAGE_STEPS.count


def check_no_other_stage_pending(
    optimizer: object, call: str, together: Collection[object] = ()
) -> None:
    """Refuse ``call`` (a step or a clip of a pipeline stage's ``optimizer``) while another
    live stage optimizer of this rank, not one of ``together`` (the parts of its
    ``MuonParts``), has a backward it has not stepped: the first model part of an interleaved
    schedule without ``MuonParts``, whose step or clip would otherwise change it before the
    second part's step raises (see [Note: one stage module per rank])."""
    if any(
        pending()
        for other, pending in list(_STAGE_STEPS.pending.items())
        if other is not optimizer and all(other is not mine for mine in together)
    ):
        raise RuntimeError(
            f"{call}: another pipeline stage module on this rank ran a backward that its"
            f" optimizer has not stepped, {_ONE_STAGE_PER_RANK}. A stage module trained no"
            " more: drop it and its optimizer; nothing was changed"
        )


def check_one_stage_per_rank(
    optimizer: object, mark: int, together: Collection[object] = ()
) -> int:
    """Refuse the step of a pipeline stage's ``optimizer`` when another stage's optimizer,
    still alive and not one of ``together`` (the parts of its ``MuonParts``), stepped on this
    rank since ``mark`` (its construction or its last step); returns its next mark.

    [Note: one stage module per rank]
    The step's non-finite decision and the clip norm are reduced over every rank (see [Note:
    pipeline stages] in ``topology._mesh``), once per step. With one stage module per rank
    (GPipe, 1F1B) each ``Muon`` does that itself. With several per rank (one ``Muon`` per
    model part, as torchtitan builds for an interleaved or looped schedule) the k-th optimizer
    of every rank would reduce with the k-th of the others: a NaN in one stage would skip the
    parts that share its position and not the others, and each part would be clipped by a
    norm of its own. ``MuonParts`` ties a rank's optimizers so that they reduce once, together
    (see [Note: the parts of a rank] in ``_parts``). Two stages' untied optimizers stepping in
    turn on one rank are the wrong case (an optimizer of a stage module rebuilt or resumed,
    whose predecessor steps no more, is not), so the second of them raises at its first step,
    on every rank alike (every rank of such a pipeline holds as many stages as the others),
    before it changes anything. The first part's clip or step is refused already where another
    part of this rank ran a backward not yet stepped (:func:`check_no_other_stage_pending`): an
    interleaved schedule runs every part's backward before the first optimizer clips or steps,
    so nothing of any part changes."""
    check_no_other_stage_pending(optimizer, "Muon.step()", together)
    last = None if _STAGE_STEPS.last is None else _STAGE_STEPS.last()
    if (
        last is not None
        and last is not optimizer
        and all(last is not mine for mine in together)
        and _STAGE_STEPS.count > mark
    ):
        raise RuntimeError(
            "Muon.step(): another pipeline stage's optimizer stepped on this rank since this"
            f" one was built or last stepped, {_ONE_STAGE_PER_RANK}; nothing was stepped"
        )
    _STAGE_STEPS.count += 1
    _STAGE_STEPS.last = weakref.ref(optimizer)
    return _STAGE_STEPS.count


def refuse_part_used_alone(call: str) -> NoReturn:
    """Refuse ``call`` (a step or a clip) of one part of a ``MuonParts``: it would decide the
    non-finite skip or the clip norm over that part alone (see [Note: the parts of a rank])."""
    raise RuntimeError(
        f"{call}: this Muon is a part of a dmuon.MuonParts, which steps and clips every model"
        " part of this rank with one non-finite decision and one clip norm over all of them;"
        " this part alone would decide over the stages at its position only. Call the"
        " MuonParts' own step() and clip it (dmuon.clip_grad_norm_(parts, ...)); nothing was"
        " changed"
    )


def refuse_step_while_lent(lent_to: str) -> NoReturn:
    """Refuse a step while ``dmuon.EMA`` lends the model its average (``lent_to``:
    ``"ema.applied()"``): the exit would undo the step's update."""
    raise RuntimeError(
        f"Muon.step() was called inside {lent_to}: the model holds the"
        " EMA's average for the block and gets its own weights back on exit, so this"
        " step's update would be lost while its momentum and the average moved on."
        " Step outside the block (evaluate inside it); nothing was stepped"
    )


def refuse_clip_after_no_sync() -> NoReturn:
    """Refuse ``Muon.grads_for_clip`` right after a backward under ``no_sync``: see [Note: a
    step after no_sync] in the runtime. The accumulation is each rank's own until a synced
    backward reduces it, so the owners hold no gradient yet (a clip would measure 0) and the
    replicated path's ``.grad`` is a rank's part (a clip would scale it, and the reduce then
    sum scaled and unscaled parts)."""
    raise RuntimeError(
        "Muon.grads_for_clip() (dmuon.clip_grad_norm_, clip_grad_value_): the last"
        " backward ran inside dmuon.no_sync(model) (or with FSDP2's"
        " model.set_requires_gradient_sync(False)), and no synced backward followed,"
        " so the accumulated gradients are each rank's own part, not yet reduced: a"
        " clip would measure a part of them, or nothing, and scale that part. Clip"
        " after the last micro-batch's backward, which runs outside no_sync and"
        " reduces the whole accumulation, right before optimizer.step(); nothing was"
        " clipped"
    )


def _unsharded_at_step(name: str, backward_ran: bool) -> NoReturn:
    if not backward_ran:
        # A forward and no backward since the last step: an evaluation, then a step without
        # a backward on every rank, or on a rank whose data ran out before the others'.
        raise ValueError(
            f"Muon.step: FSDP2 holds {name!r} unsharded, so the step would update a shard the "
            "next forward does not read, and no backward ran on this rank since the last "
            "step: a forward did (an evaluation, say) and FSDP2 kept the root module's "
            "parameters (and those of a module with reshard_after_forward=False) gathered. If "
            "the other ranks ran a forward and backward for this step, this rank's data ran "
            "out before theirs (an uneven last batch of an epoch): they wait for this rank's "
            "collectives and hang whatever it does now; give every rank the same number of "
            "batches (DistributedSampler(drop_last=True), DataLoader(drop_last=True)). For a "
            "step without a backward on every rank, call .reshard() on every FSDP2 module "
            "before optimizer.step()"
        )
    raise ValueError(
        f"Muon.step: FSDP2 holds {name!r} unsharded, so the step would update a shard the next "
        "forward does not read. A forward ran after backward (an evaluation, say) and left it "
        "unsharded, as FSDP2 leaves the root module's parameters and those of a module with "
        "reshard_after_forward=False; or backward ran with set_reshard_after_backward(False): "
        "call .reshard() on every FSDP2 module before optimizer.step(), or run that forward "
        "after it. After a forward or backward that raised, recover as FSDP2 does: "
        "model.reset_iter_state() on the root module, then optimizer.zero_grad(), then the "
        "next iteration"
    )


def check_params_current(
    probes: list[tuple[str, nn.Module, str, Tensor]] | None,
    param_groups: Sequence[Mapping[str, Any]],
    model: nn.Module,
    dedicated: Mapping[int, DedicatedParam],
    *,
    backward_ran: bool,
) -> list[tuple[str, nn.Module, str, Tensor]]:
    """Catch an optimizer built before ``fully_shard`` (FSDP2 then replaced the parameters
    it holds, and stepping the old tensors would silently train nothing; checked at the
    first step), and, at every step, an FSDP2 module that holds its parameters unsharded:
    stepping its shards would not reach the next forward, which reads the gathered copy
    FSDP2 keeps (one parameter per module is looked at: FSDP2 swaps a module's parameters
    together). Takes the probes found so far (``None`` before the first step) and returns
    them; ``backward_ran`` (a backward ran on this rank since the last step) decides what
    the refusal says."""
    if probes is None:
        _check_every_param(param_groups, model, backward_ran)
        probes = _probes(param_groups, model, dedicated)
    for name, module, attr, shard in probes:
        if getattr(module, attr) is not shard:
            _unsharded_at_step(name, backward_ran)
    return probes


def _check_every_param(
    param_groups: Sequence[Mapping[str, Any]], model: nn.Module, backward_ran: bool
) -> None:
    current = dict(model.named_parameters())
    ids = {id(p) for p in current.values()}
    for group in param_groups:
        for name, p in zip(group["param_names"], group["params"]):
            if id(p) in ids:
                continue
            now = current.get(name)
            if isinstance(p, DTensor) and now is not None and not isinstance(now, DTensor):
                # FSDP2 registers a module's unsharded parameters while it holds them.
                _unsharded_at_step(name, backward_ran)
            raise ValueError(
                f"Muon holds {name!r}, which is no longer a parameter of the model (was"
                " the optimizer built before fully_shard?); build it last:"
                " dedicate_params -> fully_shard (layers, then root) -> Muon(model)"
            )


def _probes(
    param_groups: Sequence[Mapping[str, Any]],
    model: nn.Module,
    dedicated: Mapping[int, DedicatedParam],
) -> list[tuple[str, nn.Module, str, Tensor]]:
    """One FSDP2 parameter (a DTensor dmuon does not hold) of each module that has some."""
    probes: dict[int, tuple[str, nn.Module, str, Tensor]] = {}
    for group in param_groups:
        for name, p in zip(group["param_names"], group["params"]):
            if isinstance(p, DTensor) and id(p) not in dedicated:
                prefix, _, attr = name.rpartition(".")
                module = model.get_submodule(prefix)
                probes.setdefault(id(module), (name, module, attr, p))
    return list(probes.values())


def check_no_loss_scaling(optimizer: torch.optim.Optimizer) -> None:
    """Refuse a step through ``torch.amp.GradScaler`` (or FSDP2's ``ShardedGradScaler``):
    its ``unscale_`` and inf check read ``param.grad``, where the gradients dmuon holds on
    owners are not, so they would stay scaled and an overflow in them would not lower the
    scale. ``optimizer`` says it handles loss scaling (``_step_supports_amp_scaling``), so a
    scaler sets its ``grad_scale`` and ``found_inf``: the refusal drops them."""
    if "grad_scale" in optimizer.__dict__ or "found_inf" in optimizer.__dict__:
        optimizer.__dict__.pop("grad_scale", None)
        optimizer.__dict__.pop("found_inf", None)
        raise RuntimeError(
            "Muon.step() was called by a GradScaler: loss scaling does not reach the"
            " gradients dmuon holds on owners (unscale_ reads param.grad only, so they would"
            " stay scaled, and an overflow in them would not lower the scale); nothing was"
            " stepped. Train in bfloat16, which needs no loss scaling: drop the scaler and"
            " run under torch.autocast(device_type, dtype=torch.bfloat16), or give FSDP2"
            " MixedPrecisionPolicy(param_dtype=torch.bfloat16)"
        )


def check_none_unfrozen(frozen: Iterable[tuple[str, Tensor]]) -> None:
    """Refuse a step while a parameter of ``frozen`` (those frozen at construction) is
    trainable: no group holds it, so its gradient would be thrown away, where a torch optimizer
    built over ``model.parameters()`` would train it."""
    unfrozen = [name for name, p in frozen if p.requires_grad]
    if unfrozen:
        raise ValueError(
            f"{len(unfrozen)} parameter(s) require grad but were frozen when Muon(model) was"
            f" built, so no group steps them (first: {unfrozen[:3]}); nothing was stepped."
            " Muon takes the trainable parameters when it is built: make them trainable"
            " before dedicate_params and Muon(model), and freeze them with"
            " requires_grad_(False) for the steps they should not train (a parameter"
            " without a gradient is skipped and keeps its value)"
        )


def check_one_muon_per_backward(
    optimizer: object, runtime: DedicatedRuntime, model: nn.Module, names: Iterable[str]
) -> None:
    """Refuse the step of ``optimizer`` (a ``Muon`` over ``model``, stepping ``names``) when
    another ``Muon`` alive on the same model stepped the gradients of the last backward.

    [Note: one Muon per model]
    ``Muon(model)`` steps every trainable parameter of the model, the dedicated matrices with
    Muon and all the others with AdamW, with states of its own. Two of them on one model, both
    stepped after a backward (``for opt in optimizers: opt.step()``, or a second
    ``Muon(model)`` built for a group of its own as a torch recipe builds a second
    optimizer), step every parameter twice with the same gradients: the weights move twice as
    far and training goes on without a word (on the tests' tiny model, the loss of the second
    step 0.07 off a single optimizer's). A torch optimizer beside ``Muon`` is refused for the
    same reason (see [Note: torch's paths that cannot reach a dedicated weight] in
    ``holder._guard``). So the runtime records, weakly, the ``Muon`` that stepped after a
    backward (``stepped_by``, at its publish), and another one alive that steps before the next
    backward raises, on every rank alike (every rank runs the same backwards and steps), before
    it changes anything. What stays allowed: one optimizer stepping twice on the same gradients,
    as torch allows; one built later that takes over (rebuilt, or resumed from the first one's
    state) on gradients of its own, while the first still lives; a freed one, which no longer
    counts. A backward counts where it runs through a layer that holds dedicated weights (a
    hook boundary: ``backward_since_step``, frozen weights or not): one that stops before every
    such layer (only the head trains for a phase) leaves the last step's record, so a
    taking-over optimizer stepped after it is refused while the first lives, with the fix its
    message names (``del`` the first); the record cannot tell that case from a second step of
    the first optimizer's gradients by another one, which must not pass without a word. Two
    models, each with its own ``dedicate_params`` and ``Muon`` (a GAN's generator and
    discriminator, a student beside a teacher), have a runtime each and never meet here, even
    where one's backward runs through the other."""
    if runtime.hooks.backward_since_step or runtime.stepped_by is None:
        return
    other = runtime.stepped_by()
    if other is None or other is optimizer:
        return
    first = next(iter(names), None)
    among = "" if first is None else f" ({first!r} among them)"
    raise RuntimeError(
        f"Muon.step(): another dmuon.Muon on this {type(model).__name__} already stepped the"
        f" gradients of its last backward, and this one steps the same parameters{among}:"
        " each dmuon.Muon(model) steps every trainable parameter of the model (Muon for the"
        " dedicated matrices, AdamW for the others, with states of its own), so each would"
        " move twice per backward; nothing was stepped. Step one dmuon.Muon per model: delete"
        " the one you no longer step (del optimizer), give parameters values of their own"
        " with Muon(model, param_groups=[...]), and give each of several models (a generator"
        " and a discriminator) its own dedicate_params and dmuon.Muon"
    )
