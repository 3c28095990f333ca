"""``Muon``: one ``torch.optim.Optimizer`` that steps dmuon's dedicated matrices with Muon on
their owners and every other trainable parameter with AdamW on every rank.

[Note: what the optimizer's param groups hold]
``param_groups`` hold the model's own parameters, the same objects on every rank: the FSDP2
DTensor parameters and the dedicated ``nn.Parameter`` objects (which keep their full shape on
every rank, see [Note: storage of a dedicated parameter]). State is keyed by those objects, so
schedulers, ``state_dict()`` round trips and ``param_names`` work as with any optimizer. What
a step *touches* for a dedicated parameter is different: the owner's ``DedicatedParam.full``
(the authoritative weight) and ``DedicatedParam.grad`` (the averaged full gradient). Other
ranks skip dedicated parameters; their state stays empty.

[Note: step order]
``step()`` is a short list of phases, none of which knows what kind a parameter is (each
parameter's holder answers for it, see [Note: the step plan] in _step_plan):

1. the pre-step hooks (QK-clip launches its all-reduce there);
2. collect: wait for the pending gradient reductions (owned gradients are final after that)
   and read each planned parameter's tensors through its holder;
3. the non-finite decision (see [Note: non-finite gradients] in _muon_math);
4. Muon: per NS batch, momentum, one NS call and the decay and update; then the momentum of
   the matrices another replica steps;
5. AdamW over every ``adamw`` subgroup (FSDP2 shards on all ranks, owned dedicated
   AdamW-route weights on their owners);
6. the post-update hooks (see [Note: the post-update hook] in _step_plan);
7. publish: each holder that sends its update on in the step does (expert sources, the
   ``expert_publish`` phase), then the runtime's ``after_step`` drops weights kept by peers
   (Z2) and, in HSDP and on the replicated path, publishes the owners' new weights
   (asynchronously with ``replicate_async``).
"""

from __future__ import annotations

import contextlib
import re
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, NamedTuple, Never, overload

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

from dmuon_ownership import Route

from .._checks import check_bool, is_int
from .._matrix import LrScaling, NSFunction
from .._profile import PhaseTimer, no_mark, span
from .._torch_internals import (
    disable_dynamo,
    foreach_max_abs,
    fsdp_all_reduce_hook_reader,
    local_shard,
    optimizer_state_dict_hooks_taken,
    torch_optim_state_dict_running,
)
from ..holder import (
    DedicatedParam,
    MuonEntry,
    ParamHolder,
    StepContext,
    TPMode,
    fsdp_modules,
    register_dmuon_optimizer,
)
from ..runtime import DedicatedRuntime, get_runtime
from ._fused import FusedLayout, compile_in_background
from ._graphed_step import GraphedMuonPhase
from ._muon_math import MuonItem, adamw_step, fresh_state, make_newton_schulz, muon_phase
from ._ns_overlap import NSOverlap
from ._param_groups import (
    BuiltParams,
    GroupDefaults,
    build_param_groups,
    peeked_numbers,
    take_group_edits,
)
from ._state_checks import for_saving, install_dedicated_state, split_for_load
from ._step_hooks import PostUpdateHook, PreStepHook, StepHooks
from ._step_plan import AdamWEntry, StepPlan
from ._usage_checks import (
    check_cuda_graph_applies,
    check_every_param_is_synchronised,
    check_fully_shard_mesh,
    check_fully_shard_options,
    check_model,
    check_no_all_reduce_hook,
    check_no_loss_scaling,
    check_no_other_keywords,
    check_no_other_stage_pending,
    check_none_unfrozen,
    check_one_muon_per_backward,
    check_one_stage_per_rank,
    check_params_current,
    check_pipeline_stage,
    refuse_added_group,
    refuse_clip_after_no_sync,
    refuse_part_used_alone,
    refuse_step_while_lent,
    stage_steps_so_far,
    warn_frozen_dedicated,
)

__all__ = [
    "DEFAULT_NS_BATCH_BYTES",
    "Muon",
    "MuonClipGrads",
    "MuonStepStats",
    "PostUpdateHook",
    "StepOptions",
]

# Cap on one batched NS input; see [Note: one Newton–Schulz call per shape] in _muon_math.
# 256 MiB stacks 2048×8192 matrices (bf16) in eights and 4096×14336 ones (a Llama-8B MLP
# matrix, 112 MiB) in pairs. Batches of two 2048² matrices leave the last of quack's
# persistent rounds of product tiles half empty: on an H200 the 16-layer H=2048 bench stack
# stepped in 0.456 × torch.optim.Muon's time at 256 MiB against 0.48–0.51 × at 64 MiB, for
# 0.55 GiB more step memory (1.20 × torch.optim.Muon's); the H=4096 stack kept its time (0.22
# GiB more), the MoE step its time and memory. The transient memory is 3.25–4 × the stack, and
# each doubling of the cap buys less (no cap: 0.412 × for 3.0 GiB more than at 256 MiB);
# benchmarks/HISTORY.md, "Training step".
DEFAULT_NS_BATCH_BYTES = 256 * 2**20


class MuonClipGrads(NamedTuple):
    """What ``Muon.grads_for_clip()`` hands to dmuon-clip (ARCHITECTURE.md)."""

    grads: list[Tensor]  # this rank's part of the gradients (whole or shards), which it counts
    process_group: ProcessGroup | None  # every rank: a sum over it counts each element once
    device: torch.device  # where the norm accumulator lives
    # Gradients other ranks keep too (a whole matrix in every TP grid, a shard on every
    # replica): counted on one, copies (scaled, not counted) on the others; see [Note: global
    # quantities] in _comm.
    copies: tuple[Tensor, ...] = ()
    # Some gradient is split over ranks (a TP shard, an FSDP2 shard of an AdamW parameter): its
    # own norm needs a collective.
    sharded: bool = False


class MuonStepStats(NamedTuple):
    """What the last ``Muon.step()`` did, as device tensors (reading them syncs, the optimizer
    never does)."""

    skipped: Tensor  # 0-d bool: the step kept every weight and state (a non-finite gradient)
    skipped_steps: Tensor  # 0-d int64: steps skipped since the optimizer was built


@dataclass(frozen=True)
class StepOptions:
    """How :class:`Muon` steps, beyond the per-group hyperparameters; validated at
    construction.

    Args:
        lr_scaling: the factor ``s(m, n)`` the update of an ``m x n`` matrix is scaled by,
            beside ``lr``: ``"moonlight"`` ``0.2·√max(m, n)``, so that the update's RMS
            matches AdamW's and AdamW learning rates carry over; ``"original"`` (or
            ``"spectral"``) ``√max(1, m/n)``, Keller Jordan's; ``"none"`` 1. A string or
            ``LrScaling``; another value raises ``ValueError``.
        ns_batch_bytes: same-shape matrices share one Newton–Schulz call up to this many bytes
            of input (an int >= 1; a matrix larger than it runs alone); ``None``: one call per
            shape, however large. Larger batches mean fewer kernel launches and more transient
            memory (3.25 to 4 times the batch). The default is 256 MiB. It also caps the whole
            tensor-parallel matrices a TP owner holds at once when it orthogonalises them
            beside its group's others (``tp_ns`` gather: [Note: Newton–Schulz that waits for
            peers] in _muon_math).
        replicate_async: HSDP and the replicated path: ``True`` launches the publish of the
            updated weights at the end of ``step()`` without waiting (each boundary's next
            forward waits for its own part); ``False`` waits for it in ``step()``. A bool.
        skip_nonfinite: ``True`` checks every gradient a rank is about to step with, and skips
            the whole step on every rank when one is not finite (weights, states and step
            counts unchanged; see ``last_step_stats``), without a host sync. ``False`` steps
            regardless. A bool.
        tp_ns: how Newton–Schulz runs on a tensor-parallel matrix: ``"gather"`` (the TP owner
            gathers the shards, runs NS once, scatters the result; the group's owners run
            their matrices side by side), ``"gram"`` (distributed Gram NS over the TP group,
            where the shards split the matrix's long side and the NS is a Gram
            ``NewtonSchulz``; gather elsewhere), or ``"auto"`` (``"gram"`` where it applies
            and the bytes it saves outweigh the Gram iterations every TP rank repeats, as
            ``dmuon_ownership.tp_gram_pays`` decides: very wide matrices of modest width;
            else gather). A string or ``TPMode``; another value raises ``ValueError``.
        profile: ``True`` times every step's phases, read with :meth:`Muon.step_profile`
            (and records the forward's wait times). A bool.
        ns_overlap: ``True`` runs each owned NS batch during backward, as soon as the
            reduces of its gradients land (on CUDA on a side stream beside backward), and
            ``step()`` applies the updates: the same bits as ``False``, with the rank's
            updates kept from backward to the step (memory about its owned matrices in the
            momentum's dtype). A batch whose gradients or momentum change after backward
            (another backward, a checkpoint load, an in-place op; not a write through
            ``.data``, which torch does not count) is recomputed in the step; Muon-aware
            clipping (``muon_grads_for_clip``) turns the option off with a warning, since a
            clip needs every gradient first. Tensor-parallel matrices and expert stacks
            always run in the step. It runs for the ``Muon`` built last on a model: an
            earlier one runs NS in the step from its next ``step()`` on, with a warning. A
            bool.
        cuda_graph: ``True`` captures the Muon phase of ``step()`` (momentum, Newton–Schulz
            and update of every matrix the rank steps) in one CUDA graph and replays it from
            the third step on, while the tensors and the batching stay the same (learning-rate
            and other hyperparameter changes do not matter); a step where they changed runs
            eagerly and the next one recaptures. Same bits as ``False``. Costs the phase's
            transient memory kept between steps (up to about four times ``ns_batch_bytes``). Needs
            CUDA and dmuon's own Newton–Schulz (a ``dmuon_ns.NewtonSchulz``); not with
            ``ns_overlap`` or tensor-parallel matrices (``ValueError``). A bool.
    """

    lr_scaling: LrScaling = LrScaling.MOONLIGHT
    # Same-shape matrices share one NS call up to this many bytes of input (None: no cap).
    ns_batch_bytes: int | None = DEFAULT_NS_BATCH_BYTES
    # HSDP: publish updated weights without waiting (each boundary's next forward waits).
    replicate_async: bool = True
    # Skip the whole step when any gradient is not finite; see [Note: non-finite gradients].
    skip_nonfinite: bool = True
    # How NS runs on a tensor-parallel matrix; see [Note: Newton–Schulz under tensor
    # parallelism] in holder/_tp_ns.
    tp_ns: TPMode = TPMode.AUTO
    # Time every step's phases (``Muon.step_profile()``); see [Note: the step profile].
    profile: bool = False
    # Newton–Schulz during backward; see [Note: Newton–Schulz during backward] in _ns_overlap.
    ns_overlap: bool = False
    # Replay the Muon phase from a CUDA graph; see [Note: the graphed Muon phase].
    cuda_graph: bool = False

    def __post_init__(self) -> None:
        try:
            scaling = LrScaling(self.lr_scaling)
        except ValueError:
            raise ValueError(
                f"lr_scaling must be one of {[s.value for s in LrScaling]}, got"
                f" {self.lr_scaling!r} (torch.optim.Muon's adjust_lr_fn='match_rms_adamw' is"
                " 'moonlight', its default 'original' or None is 'original')"
            ) from None
        object.__setattr__(self, "lr_scaling", scaling)
        cap = self.ns_batch_bytes
        if cap is not None and (not is_int(cap) or cap < 1):
            raise ValueError(
                f"ns_batch_bytes must be a positive int (bytes of one NS batch) or None for one"
                f" NS call per shape, got {cap!r}"
            )
        try:
            object.__setattr__(self, "tp_ns", TPMode(self.tp_ns))
        except ValueError:
            raise ValueError(
                f"tp_ns must be one of {[m.value for m in TPMode]}, got {self.tp_ns!r}"
            ) from None
        for name in ("replicate_async", "skip_nonfinite", "profile", "ns_overlap", "cuda_graph"):
            check_bool(name, getattr(self, name))
        if self.ns_overlap and self.cuda_graph:
            raise ValueError(
                "ns_overlap=True and cuda_graph=True exclude each other (NS runs during backward"
                " in one, inside the step's graph in the other); choose one"
            )


# Per AdamW group: its numbers of this step (``group_numbers``), tensors, gradients, states.
_AdamWWork = tuple[dict[str, Any], list[Tensor], list[Tensor], list[Any]]


class _StepWork(NamedTuple):
    """What one step touches: the Muon items of each NS batch with the batch's NS, those
    whose momentum alone advances here, and per AdamW group its hyperparameters, tensors,
    gradients and states."""

    batches: list[tuple[int, list[MuonItem], NSFunction | None]]  # with its plan index
    momentum_only: list[list[MuonItem]]  # stepped on another replica (expert sources)
    adamw: list[_AdamWWork]


def _rows(t: Tensor, rows: tuple[int, int]) -> Tensor:
    """``t``'s rows ``rows`` (a piece of a declared split: a view)."""
    return t[rows[0] : rows[1]]


def _closure_loss(closure: Callable[[], float] | None) -> float | None:
    """``closure()`` with gradients enabled, as ``torch.optim`` optimizers run it."""
    if closure is None:
        return None
    if not callable(closure):
        raise TypeError(
            f"Muon.step: closure must be None or a callable returning the loss, got "
            f"{type(closure).__name__}"
        )
    with torch.enable_grad():
        return closure()


# [Note: the step under torch.compile]
# ``step()`` and ``zero_grad()`` wait for the gradient reduces, issue collectives and read the
# runtime's Python state. Traced by dynamo (``torch.compile(optimizer.step)``, or a compiled
# train step that calls them, a habit with torch's own optimizers) they split into some twenty
# graphs at as many graph breaks inside dmuon (measured on 2 gloo ranks, torch 2.13: 21 graphs
# for the step), and ``fullgraph=True`` refused them with an error that named a private torch
# call inside dmuon, neither the cause nor the fix, for nothing worth compiling: the step
# already runs batched Newton–Schulz and fused updates. So a compiled caller runs each of them
# eagerly, one graph break, which dynamo's log and ``fullgraph=True``'s error name with the
# reason and the fix (``_UNTRACED_REASON``); torch keeps its own ``Optimizer.zero_grad`` out of
# graphs the same way. Applying ``torch.compiler.disable`` (the public one, which takes the
# reason) imports the compiler, so the first ``Muon(model)`` makes them, not ``import dmuon``.
# Such a compiled function also leaves dynamo on during its eager ``backward()``, where dynamo
# traces every Python hook the autograd engine calls: dmuon's backward hooks and its
# end-of-backward callback are untraced callables too (they were traced into graphs of
# dmuon's bookkeeping, between breaks at each collective, measured with torch 2.13).
_UNTRACED_REASON = (
    "dmuon.Muon.{} runs eagerly under torch.compile (one graph break): it waits for the "
    "gradient reduces and issues collectives, and the step already runs batched Newton-Schulz "
    "and fused updates. Call optimizer.zero_grad() and optimizer.step() outside the compiled "
    "function (compile the model, its blocks or the loss), or compile it without "
    "fullgraph=True; see dmuon's torch.compile guide"
)
_untraced: dict[str, Callable[..., Any]] = {}


def _make_untraced() -> None:
    """``Muon.step`` and ``Muon.zero_grad`` as a compiled caller runs them (once per process);
    see [Note: the step under torch.compile]."""
    if not _untraced:
        _untraced["step"] = disable_dynamo(Muon._eager_step, reason=_UNTRACED_REASON.format("step"))
        _untraced["zero_grad"] = disable_dynamo(
            Muon._eager_zero_grad, reason=_UNTRACED_REASON.format("zero_grad")
        )


class Muon(torch.optim.Optimizer):
    """Muon for dmuon's dedicated matrices (owner only), AdamW for everything else.

    ``model`` is the model after ``dedicate_params`` and ``fully_shard``. Groups are ``muon``
    and ``adamw``, or with semantic ``param_groups`` ``<name>/muon`` and ``<name>/adamw``
    (see :mod:`._param_groups`). Muon math: ``buf = momentum * buf + grad``; NS input
    ``grad + momentum * buf`` (Nesterov) or ``buf``; update ``NS(input)`` scaled by
    ``lr * s(m, n)`` with ``s`` from ``lr_scaling`` (``"moonlight"``: ``0.2·√max(m, n)``,
    ``"original"``: ``√max(1, m/n)``, ``"none"``: 1); decoupled decay ``p *= 1 - lr * wd``
    before the update. Same-shape matrices share one NS call, up to ``ns_batch_bytes`` of input
    per call (``None``: one call per shape). AdamW matches ``torch.optim.AdamW``.

    ``ns_backend`` is ``"gram"`` or ``"direct"`` (a ``dmuon_ns.NewtonSchulz`` with
    ``ns_steps`` iterations, 5 by default), a ``NewtonSchulz`` instance, or any callable that
    orthogonalises every matrix of a ``(batch, m, n)`` tensor and returns that shape
    (microsoft/dion's ``newton_schulz_func`` contract; ``ns_steps`` must then be left out).

    The keywords are those of the first public DMuon (``lr`` to ``param_groups``); how the step
    runs beyond them (the learning-rate
    scaling, NS batching, the HSDP publish, the non-finite skip, NS under tensor parallelism,
    the step profile) is ``options=StepOptions(...)``. Features that act inside the step attach
    themselves as hooks: ``dmuon.QKClip.from_model(model, ...).attach(optimizer)`` (QK-clip),
    :meth:`register_post_update_hook`, :meth:`register_pre_step_hook`.

    Args:
        model: the model after ``dedicate_params`` and ``fully_shard`` (layers, then the root),
            or after ``dedicate_params_ddp`` and ``replicate``; the optimizer steps its
            trainable parameters. Not a parameter list (``ValueError``); a trainable parameter
            that nothing synchronises (neither dedicated, nor FSDP2's, nor replicated) raises
            ``ValueError``.
        lr: the Muon learning rate, a finite number >= 0: each update is ``NS(input)`` times
            ``lr * s(m, n)``, and decay multiplies the weight by ``1 - lr * weight_decay``.
        momentum: the Muon momentum ``β`` of ``buf = β * buf + grad``, in ``[0, 1)``.
        weight_decay: decoupled weight decay of the Muon matrices, a finite number >= 0 (``0``:
            none).
        ns_steps: Newton–Schulz iterations of the ``"gram"`` / ``"direct"`` backends, an
            int >= 1; ``None``: 5. Must be ``None`` with a ``NewtonSchulz`` or a callable
            ``ns_backend``, which carries its own.
        nesterov: ``True``: the NS input is ``grad + momentum * buf`` (Nesterov); ``False``:
            ``buf``. A bool.
        ns_backend: the orthogonalisation: ``"gram"`` (Gram Newton–Schulz, direct NS on square
            matrices), ``"direct"``, a ``NewtonSchulz``, or a callable ``(batch, m, n) tensor
            -> tensor`` of the same shape. Another string raises ``ValueError``.
        adamw_lr: the learning rate of the parameters AdamW steps (every trainable parameter
            that Muon does not), a finite number >= 0.
        adamw_betas: AdamW's ``(β1, β2)``, each in ``[0, 1)``.
        adamw_weight_decay: AdamW's decoupled weight decay (as in ``torch.optim.AdamW``), a
            finite number >= 0.
        adamw_eps: AdamW's ``ε``, added to the denominator, a finite number >= 0.
        param_groups: semantic groups: a list of dicts, each with ``"params"`` (parameters, or
            ``(name, parameter)`` pairs, of the wrapped model: build them after
            ``fully_shard``) and optionally ``"group_name"`` (unique, no ``/``), ``"lr"``,
            ``"weight_decay"`` (both optimizers), ``"muon_lr"``, ``"adamw_lr"``,
            ``"muon_weight_decay"``, ``"adamw_weight_decay"``, ``"momentum"``,
            ``"nesterov"``, ``"adamw_betas"``, ``"adamw_eps"`` and ``"dmuon_route"``
            (``"muon"`` or ``"adamw"``: every dedicated parameter of the group takes that
            optimizer). Every trainable parameter must be in exactly one group; each becomes
            the optimizer groups ``<name>/muon`` and ``<name>/adamw``; keys it leaves out take
            the keywords above. ``None``: one ``muon`` and one ``adamw`` group of every
            trainable parameter.
        options: how the step runs beyond the hyperparameters (:class:`StepOptions`);
            ``None``: ``StepOptions()``, every default.
        other_keywords: none is taken; a :class:`StepOptions` field or a keyword of
            ``torch.optim.Muon`` or ``torch.optim.AdamW`` raises ``TypeError`` naming what
            dmuon takes instead.
    """

    # It steps dedicated parameters itself (holder.STEPS_DEDICATED: torch's optimizers are
    # refused them, see [Note: torch's paths that cannot reach a dedicated weight]).
    _steps_dedicated_params = True

    # torch's GradScaler hands an optimizer that says it handles loss scaling itself its scale and
    # found_inf as attributes and calls step(): the one way to notice a GradScaler (see
    # check_no_loss_scaling).
    _step_supports_amp_scaling = True

    def __init__(
        self,
        model: nn.Module,
        lr: float = 0.02,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
        ns_steps: int | None = None,
        nesterov: bool = True,
        ns_backend: str | NSFunction = "gram",
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_weight_decay: float = 0.01,
        adamw_eps: float = 1e-8,
        param_groups: Sequence[Mapping[str, Any]] | None = None,
        *,
        options: StepOptions | None = None,
        **other_keywords: Never,
    ) -> None:
        check_no_other_keywords(other_keywords, StepOptions.__dataclass_fields__)
        check_model(model)
        group_defaults = GroupDefaults(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            adamw_lr=adamw_lr,
            adamw_betas=adamw_betas,
            adamw_eps=adamw_eps,
            adamw_weight_decay=adamw_weight_decay,
        )
        if options is None:
            options = StepOptions()
        elif not isinstance(options, StepOptions):
            raise TypeError(
                f"options must be a dmuon.StepOptions, got {type(options).__name__}: "
                "Muon(model, ..., options=dmuon.StepOptions(replicate_async=False, ...))"
            )
        self._options = options
        self._ns = make_newton_schulz(ns_backend, ns_steps)
        self._runtime: DedicatedRuntime = get_runtime(model)
        self._runtime.lazy_init()
        _make_untraced()
        self._model = model
        self._dedicated: dict[int, DedicatedParam] = {
            id(dp.param): dp for dp in self._runtime.params
        }
        self._holders: dict[int, ParamHolder] = self._runtime.holders_by_param()
        check_pipeline_stage(model, self._runtime)
        # See [Note: one stage module per rank]; None: no pipeline stage.
        self._stage_mark: int | None = None
        # The MuonParts this optimizer is a part of (see [Note: the parts of a rank] in
        # _parts); held weakly: the MuonParts holds its parts.
        self._joint: weakref.ref[Any] | None = None
        if self._runtime.layout.pp_size > 1:
            hooks = self._runtime.hooks
            self._stage_mark = stage_steps_so_far(self, lambda: hooks.backward_since_step)
        check_every_param_is_synchronised(model, self._runtime)
        check_fully_shard_options(model, self._runtime)
        check_fully_shard_mesh(model, self._runtime)
        # Which fully_shard module has an all-reduce hook, read at every step (a hook set
        # later); its FSDP2 parameter groups are found once, here.
        self._all_reduce_hooked = fsdp_all_reduce_hook_reader(fsdp_modules(model))
        check_no_all_reduce_hook(self._all_reduce_hooked)
        groups = build_param_groups(
            model.named_parameters(), self._holders, param_groups, group_defaults
        )
        device = self._runtime.layout.device
        self._skipped_steps = torch.zeros((), dtype=torch.int64, device=device)
        # Fixed for the runtime's life; asked once (the query costs host time every step).
        self._global_size = dist.get_world_size(self._runtime.step_group)
        self._timer = PhaseTimer(device) if options.profile else None
        self._last_skip = torch.zeros((), dtype=torch.bool, device=device)
        self._hooks = StepHooks(self._runtime.comm_ctx.host_group)
        # (name, module, attribute, shard) of one FSDP2 parameter per module, found at the
        # first step: see check_params_current.
        self._fsdp_probes: list[tuple[str, nn.Module, str, Tensor]] | None = None
        # The parameters frozen when it was built, which it never steps: see
        # check_none_unfrozen.
        self._frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
        # Who holds the weights while _weights_lent's block runs (see step).
        self._weights_lent_to: str | None = None
        warn_frozen_dedicated(self._runtime)
        self._constructing = True
        super().__init__(groups, {})
        self._constructing = False
        # The group dicts the step plan reads; see [Note: edits to the groups].
        self._built_groups = tuple(self.param_groups)
        self._built_params = tuple(BuiltParams.of(group) for group in self._built_groups)
        # For introspection only: every group carries its own values, so nothing is merged.
        self.defaults = {f.name: getattr(group_defaults, f.name) for f in fields(group_defaults)}
        self.defaults["ns_steps"] = getattr(self._ns, "steps", None)
        runtime = self._runtime
        context = StepContext(
            self._ns,
            options.lr_scaling,
            options.tp_ns,
            runtime.layout,
            runtime.plan,
            runtime.comm_ctx,
        )
        self._plan = StepPlan(
            self.param_groups, self._holders, context, ns_batch_bytes=options.ns_batch_bytes
        )
        self._graphed: GraphedMuonPhase | None = None
        if options.cuda_graph:
            check_cuda_graph_applies(runtime.params, self._ns, device)
            self._graphed = GraphedMuonPhase(device)
        compile_in_background(self._fused_layouts(), device)
        self._overlap: NSOverlap | None = None
        if options.ns_overlap:
            self._overlap = NSOverlap(
                self._plan.batches,
                lambda entry: entry.holder.dedicated and entry.ns is self._ns,
                self._muon_items,
                self._peeked_muon_numbers,
                device,
            )
        runtime.set_grad_listener(self._overlap)
        # Last: a construction that failed leaves the runtime as it was. The Muon built last
        # decides whether the forwards are timed, for as long as it lives.
        runtime.hooks.time_forward_waits(device if options.profile else None, self)
        # A torch optimizer over what it steps would step it twice: its step() raises.
        register_dmuon_optimizer(self, self._plan.names)

    # -- structure ----------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused, changing nothing: the groups, the step plan and the owners are fixed at
        construction. The message names what the group held and the fix (a parameter to
        train later, as in staged fine-tuning, is trainable when ``Muon(model)`` is built and
        frozen until then)."""
        if not getattr(self, "_constructing", False):
            refuse_added_group(self._model, param_group)
        super().add_param_group(param_group)

    def __reduce_ex__(self, protocol: Any) -> Never:
        """Refused, naming the fix: ``copy.deepcopy``, ``copy.copy``, ``pickle`` and
        ``torch.save(optimizer)`` would copy the model it steps through its runtime (process
        groups, the weights on their owners); its state is what to save or carry over."""
        raise TypeError(
            "dmuon.Muon cannot be copied or pickled (copy.deepcopy, copy.copy, pickle,"
            " torch.save(optimizer)): it steps the model it was built on, through that model's"
            " runtime and process groups. Save its state instead: optimizer.state_dict() (on"
            " every rank: torch.save(optimizer.state_dict(), path) with the rank in the path),"
            " dmuon.get_optimizer_state_dict(model, optimizer) or dmuon.save_checkpoint; for a"
            " second optimizer, build another dmuon.Muon(model, ...) and load_state_dict the"
            " first's state into it"
        )

    @property
    def options(self) -> StepOptions:
        """The :class:`StepOptions` it was built with, fixed for its life: several shape the
        step plan, the CUDA graph and the hooks at construction (build a new ``Muon`` to change
        them)."""
        return self._options

    @property
    def runtime(self) -> DedicatedRuntime:
        return self._runtime

    @property
    def model(self) -> nn.Module:
        return self._model

    @property
    def newton_schulz(self) -> NSFunction:
        """The NS function the Muon step calls on each ``(batch, m, n)`` stack."""
        return self._ns

    def dedicated_param(self, param: Tensor) -> DedicatedParam | None:
        """The ``DedicatedParam`` behind ``param``, or ``None`` for FSDP2 parameters."""
        return self._dedicated.get(id(param))

    def _fused_layouts(self) -> Iterable[FusedLayout]:
        """What the fused step kernels will see of each matrix this rank steps (see [Note:
        compiling off the training thread] in _fused)."""
        for entry in self._plan.muon:
            dtypes = entry.holder.fused_dtypes()
            if dtypes is not None:
                yield FusedLayout(
                    entry.matrix_shape,
                    weight=dtypes[0],
                    grad=dtypes[1],
                    state=entry.state_dtype,
                    nesterov=bool(entry.group["nesterov"]),
                    split=self.options.ns_overlap,
                    hp=self.options.cuda_graph,
                )

    def register_post_update_hook(
        self, hook: PostUpdateHook, *, prepend: bool = False
    ) -> RemovableHandle:
        """Run ``hook(optimizer, parts)`` in every ``step()`` on every rank, after the update
        and before the publish; ``parts`` maps each FQN this rank steps to its
        :class:`WeightPart`, which the hook may change in place, never its storage, shape or
        dtype (``RuntimeError`` after the hooks ran, naming the parts; see [Note: the
        post-update hook]). Register and remove a hook alike on every rank: a step with
        post-update hooks joins a small collective on every rank. Returns a handle whose
        ``remove()`` unregisters it.

        Args:
            hook: a callable ``hook(optimizer, parts) -> None``, run after the hooks registered
                before it; ``parts`` is a mapping ``{fqn: WeightPart}``. Not callable:
                ``TypeError``. If it raises, the step still publishes, then re-raises (see
                [Note: a hook that raises]).
            prepend: ``True``: run it before every hook registered so far (as torch's module
                hooks take ``prepend``), for a hook that belongs to the update itself
                (:meth:`QKClip.attach` registers its clip so, ahead of an :class:`EMA`'s
                average); ``False``: after them. A bool.
        """
        if not callable(hook):
            raise TypeError(
                f"register_post_update_hook takes a callable (optimizer, parts) -> None, got "
                f"{hook!r}"
            )
        if not isinstance(prepend, bool):
            raise TypeError(f"register_post_update_hook: prepend must be a bool, got {prepend!r}")
        return self._hooks.add_post_update(hook, prepend=prepend)

    def register_pre_step_hook(self, hook: PreStepHook) -> RemovableHandle:
        """Run ``hook(optimizer)`` at the start of every ``step()`` on every rank, before the
        step waits for the gradient reduces (to launch work a post-update hook waits for).
        Returns a handle whose ``remove()`` unregisters it. The hook must behave alike on every
        rank: one that raises on some ranks only takes them out of the step while the others
        wait for them in its collectives (see [Note: a hook that raises]).

        Args:
            hook: a callable ``hook(optimizer) -> None``, run after the hooks registered before
                it. Not callable: ``TypeError``.
        """
        if not callable(hook):
            raise TypeError(
                f"register_pre_step_hook takes a callable (optimizer) -> None, got {hook!r}"
            )
        return self._hooks.add_pre_step(hook)

    @contextlib.contextmanager
    def _weights_lent(self, to: str) -> Iterator[None]:
        """The weights hold other values for the block (``to`` names who lends them, e.g.
        ``dmuon.EMA``'s ``"ema.applied()"``) and get theirs back on exit, so a ``step()``
        inside it raises: its update would be undone while the momenta moved on."""
        outer, self._weights_lent_to = self._weights_lent_to, to
        try:
            yield
        finally:
            self._weights_lent_to = outer

    # -- the step -----------------------------------------------------------------------------

    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> float: ...
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Muon on owned matrices, AdamW on the rest; see [Note: step order].

        Refuses, before changing anything, a dedicated parameter whose ``.grad`` no backward
        sent to its owner (``p.grad = g`` written by hand; see [Note: a gradient set by
        hand]): ``RuntimeError`` naming it and the fix (``loss.backward()`` on every rank).

        Args:
            closure: ``None``, or a callable that recomputes the loss (run with gradients
                enabled before the step) and returns it; ``step`` returns what it returned.

        Under ``torch.compile`` it runs eagerly, one graph break (see [Note: the step under
        torch.compile]).
        """
        if torch.compiler.is_compiling():
            return _untraced["step"](self, closure)
        return self._eager_step(closure)

    def _eager_step(self, closure: Callable[[], float] | None) -> float | None:
        parts = self._parts()
        if parts:
            joint = self._joint() if self._joint is not None else None
            if not getattr(joint, "_stepping", False) or closure is not None:
                refuse_part_used_alone("Muon.step()")
            # Inside MuonParts.step(): each part's step() (torch's wrapper runs its step hooks
            # and counts it for an LR scheduler) calls the next part's; the last steps them all
            # (see [Note: the parts of a rank]).
            k = next(i for i, part in enumerate(parts) if part is self)
            if k + 1 < len(parts):
                parts[k + 1].step()
            else:
                step_together(parts)
            return None
        if self._weights_lent_to is not None:
            refuse_step_while_lent(self._weights_lent_to)
        loss = _closure_loss(closure)
        step_together((self,))
        return loss

    def _parts(self) -> tuple[Muon, ...]:
        """The parts of the live ``MuonParts`` this optimizer is one of (itself among them),
        ``()`` where none is."""
        joint = None if self._joint is None else self._joint()
        return () if joint is None else joint.optimizers

    # -- the phases of a step: each closes its step-profile phase with ``mark`` ----------------

    def _begin(self) -> tuple[Callable[[str], None], dict[int, dict[str, Any]]]:
        """Start the step profile, check that the process groups are alive and that the
        gradients were reduced, take the param-group edits and check the parameters (all of
        them at the first step); returns the profile's ``mark`` (see [Note: the step profile])
        and each group's hyperparameters of this step (``take_group_edits``)."""
        mark = no_mark if self._timer is None else self._timer.mark
        if self._timer is not None:
            self._timer.start()
        self._runtime.comm_ctx.check_alive()
        check_one_muon_per_backward(self, self._runtime, self._model, self._plan.names.values())
        if self._stage_mark is not None:
            self._stage_mark = check_one_stage_per_rank(self, self._stage_mark, self._parts())
        self._runtime.check_gradients_synced()
        self._runtime.check_no_grad_set_by_hand()
        check_no_all_reduce_hook(self._all_reduce_hooked)
        numbers = take_group_edits(self.param_groups, self._built_groups, self._built_params)
        self._fsdp_probes = check_params_current(
            self._fsdp_probes,
            self.param_groups,
            self._model,
            self._dedicated,
            backward_ran=self._runtime.hooks.backward_since_step,
        )
        check_no_loss_scaling(self)
        check_none_unfrozen(self._frozen)
        return mark, numbers

    def _before_step(
        self, mark: Callable[[str], None], numbers: dict[int, dict[str, Any]]
    ) -> dict[int, dict[str, Any]]:
        """Run the pre-step hooks (after :meth:`_begin`'s checks, those of every part of a
        ``MuonParts``); returns the groups' hyperparameters of this step, which a hook may
        have set."""
        self._hooks.before_step(self)
        if self._hooks.pre_step:  # a hook may set this step's values (an adaptive lr)
            numbers = take_group_edits(self.param_groups, self._built_groups, self._built_params)
        mark("pre_step")
        return numbers

    def _collect(
        self, numbers: dict[int, dict[str, Any]], mark: Callable[[str], None]
    ) -> _StepWork:
        """Wait for the gradient reduces; the Muon items and AdamW tensors this step touches
        (states made on first use), with the group's hyperparameters of this step."""
        self._runtime.wait_all_reduces()
        if self._overlap is not None and self._runtime.grad_listener is not self._overlap:
            self._stop_overlap(
                "a dmuon.Muon built after this one on the same model took its place (the"
                " model's runtime runs Newton–Schulz during backward for the optimizer built"
                " last)",
                "The results are the same. Step the optimizer built last and delete this one,"
                " or build this one again to have its Newton–Schulz run during backward",
            )
        if self._overlap is not None:
            self._overlap.begin_step()
        mark("wait_reduces")
        plan = self._plan
        batches = [
            (index, items, part[0].ns)
            for index, part in enumerate(plan.batches)
            if (items := self._muon_items(part, numbers))
        ]
        momentum = [
            items for part in plan.momentum_only if (items := self._muon_items(part, numbers))
        ]
        adamw = [
            work
            for group, entries in plan.adamw
            if (work := self._adamw_work(numbers[id(group)], entries))
        ]
        return _StepWork(batches, momentum, adamw)

    def _stop_overlap(self, why: str, advice: str) -> None:
        """Turn ``ns_overlap`` off for good: drop the early results with a warning
        (``NSOverlap.stop``) and stop listening."""
        assert self._overlap is not None
        self._overlap.stop(why, advice)
        if self._runtime.grad_listener is self._overlap:
            self._runtime.set_grad_listener(None)
        self._overlap = None

    def _nonfinite(
        self, found: Tensor | None, mark: Callable[[str], None]
    ) -> tuple[Tensor | None, Tensor | None]:
        """The non-finite decision (``found``, agreed over every rank by
        :func:`_agreed_nonfinite`, for torch's fused AdamW; ``skip`` for the Muon passes),
        counted in the step stats, or ``(None, None)`` without ``skip_nonfinite``."""
        if found is None:
            mark("nonfinite_check")
            return None, None
        skip = found > 0
        self._skipped_steps.add_(skip.to(self._skipped_steps.device))
        self._last_skip = skip
        mark("nonfinite_check")
        return found, skip

    def _muon_update(
        self, work: _StepWork, skip: Tensor | None, mark: Callable[[str], None]
    ) -> None:
        """Momentum, NS (one call per batch, with the batch's NS) and the update of every
        matrix this rank steps; the momentum alone of those another replica steps. With
        ``ns_overlap`` a batch whose NS ran during backward takes that result."""
        with span("dmuon::muon_step"):
            if self._graphed is not None:
                self._graphed.run(work.batches, work.momentum_only, skip, mark)
            else:
                overlap = self._overlap
                muon_phase(
                    work.batches,
                    work.momentum_only,
                    skip,
                    mark,
                    window_bytes=self._options.ns_batch_bytes,
                    early=None if overlap is None else overlap.take,
                )
                if overlap is not None:
                    overlap.end_step()
        mark("muon_update")

    def _post_update(self, mark: Callable[[str], None]) -> BaseException | None:
        """The post-update hooks; the exception one raised, which the step raises once it has
        published (see [Note: a hook that raises] in _step_hooks)."""
        if not self._hooks.post_update:
            return None
        with span("dmuon::post_update"):
            error = self._hooks.run_post_update(self, self._plan.weight_parts)
        mark("post_update")
        return error

    def _publish(self, mark: Callable[[str], None]) -> None:
        """The holders' own publish (expert sources), then the runtime's: replicas and peers
        get the new weights (see [Note: step order])."""
        self._plan.publish(self._runtime.comm_ctx, mark)
        if self._runtime.hooks.backward_since_step:  # see [Note: one Muon per model]
            self._runtime.stepped_by = weakref.ref(self)
        self._runtime.after_step(async_=self._options.replicate_async)
        mark("publish")

    def _adamw_update(
        self,
        work: _StepWork,
        found: Tensor | None,
        skip: Tensor | None,
        mark: Callable[[str], None],
    ) -> None:
        """AdamW over every group's tensors (torch's fused kernel skips on ``found``)."""
        with span("dmuon::adamw_step"):
            for group, params, grads, states in work.adamw:
                adamw_step(
                    params,
                    grads,
                    states,
                    lr=group["lr"],
                    betas=group["betas"],
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    found_inf=found,
                )
        mark("adamw")

    def step_profile(self) -> dict[str, float]:
        """Milliseconds per phase of the last ``step()`` (see [Note: the step profile]):
        ``pre_step`` (the param-group edits, the parameter checks and the pre-step hooks),
        ``wait_reduces``, ``nonfinite_check``, ``ns[<batch shape>]`` per NS call (the pieces
        of a weight with a declared split run in the calls of their own shapes: a fused
        ``(32, 16)`` ``[q; k; v]`` split as ``q (16, 16)``, ``k`` and ``v (8, 16)`` shows
        ``ns[...x16x16]`` and ``ns[...x8x16]``, not ``ns[1x32x16]``), ``muon_update``,
        ``adamw``, ``post_update`` (with hooks), ``expert_publish`` (with expert sources),
        ``publish``; with ``ns_overlap`` only the NS calls the step itself ran (the others ran
        during backward); with ``cuda_graph`` a replayed step has no ``ns[...]`` phases (its
        whole Muon phase is ``muon_update``). Needs ``Muon(model,
        options=StepOptions(profile=True))`` (``ValueError`` otherwise); on CUDA this waits for
        the step's recorded events, the step itself never does."""
        if self._timer is None:
            raise ValueError(
                "step_profile() needs the step profile: build the optimizer with "
                "Muon(model, ..., options=dmuon.StepOptions(profile=True))"
            )
        return self._timer.phases()

    def _muon_items(
        self, entries: Sequence[MuonEntry], numbers: Mapping[int, dict[str, Any]]
    ) -> list[MuonItem]:
        """The step's item of each entry with a gradient (momentum buffer made on first
        use), with its group's hyperparameters from ``numbers`` (``group_numbers`` by the
        group's ``id``): the tensors its holder steps (an owned matrix's full master and
        averaged gradient, or this rank's shard of an expert stack and of its gradient)."""
        # Per entry at every step, so written out: no generator, no keywords, the rows cut
        # only where a split declares them (about 1 µs an entry less; the collect of 168
        # matrices took 350 µs of host time, 177 so).
        items: list[MuonItem] = []
        append = items.append
        state = self.state
        for entry in entries:
            weight, grad = entry.holder.step_tensors()
            if grad is None:
                continue
            assert weight is not None, f"{entry.fqn}: this rank holds no weight to step"
            group = numbers[id(entry.group)]
            param_state = state[entry.param]
            if not param_state:
                param_state.update(fresh_state(Route.MUON, weight, entry.holder.optim_dtype))
            weight = local_shard(weight)
            grad = local_shard(grad)
            buf = local_shard(param_state["momentum_buffer"])
            rows = entry.rows
            if rows is not None:  # a piece of a declared split: its rows (views)
                weight, grad, buf = _rows(weight, rows), _rows(grad, rows), _rows(buf, rows)
            append(
                MuonItem(
                    weight,
                    grad,
                    buf,
                    group["momentum"],
                    group["nesterov"],
                    group["lr"],
                    group["weight_decay"],
                    entry.scale,
                    entry.cut,
                )
            )
        return items

    def _peeked_muon_numbers(self) -> dict[int, dict[str, Any]]:
        """Each Muon group's hyperparameters as they are now, unchecked (``peeked_numbers``):
        what NS during backward computes with, where nothing may raise."""
        return {
            id(group): peeked_numbers(group)
            for group in self._built_groups
            if group["optimizer"] == Route.MUON
        }

    def _adamw_work(
        self, group: dict[str, Any], entries: Sequence[AdamWEntry]
    ) -> _AdamWWork | None:
        """The tensors one AdamW group (its ``group_numbers`` of this step) steps on this
        rank (FSDP2 shards; dedicated AdamW-route weights on their owners), their gradients
        and states (made on first use)."""
        params: list[Tensor] = []
        grads: list[Tensor] = []
        states: list[Any] = []
        for p, view in entries:
            target, grad = view.step_tensors()
            if grad is None or target is None:
                continue
            state = self.state[p]
            if not state:
                state.update(fresh_state(Route.ADAMW, target, view.optim_dtype))
            params.append(target)
            grads.append(grad)
            states.append(state)
        return (group, params, grads, states) if params else None

    def _find_nonfinite(self, work: _StepWork) -> Tensor:
        """1.0 when any gradient this rank is about to step with holds a NaN or an infinity, on
        the device without a host sync (:func:`_agreed_nonfinite` agrees on it across ranks);
        see [Note: non-finite gradients] in _muon_math."""
        device = self._runtime.layout.device
        found = torch.zeros((), dtype=torch.float32, device=device)
        grads = [item.grad for _, items, _ in work.batches for item in items]
        # A stack shard another replica steps still advances its momentum here.
        grads += [item.grad for items in work.momentum_only for item in items]
        grads += [local_shard(g) for *_, gs, _ in work.adamw for g in gs]
        # An FSDP2 shard of a dimension smaller than the world (a (1, 1, d) class token on
        # two ranks) is empty on some ranks: nothing to check, and its inf-norm is an error.
        grads = [g for g in grads if g.numel()]
        if grads:
            # The largest magnitude of each gradient (one foreach launch, any float dtype): NaN
            # or infinity there iff anywhere in the gradient.
            peaks = foreach_max_abs(grads)
            # One stack in the widest of their dtypes (torch promotes), not a conversion per
            # gradient; then fp32, as each dtype's stack was converted before (the same values:
            # a widening is exact, and fp32 is the same narrowing either way).
            stacked = torch.stack(peaks).float()
            found = (~torch.isfinite(stacked).all()).float()
        return found

    @property
    def last_step_stats(self) -> MuonStepStats:
        """Device tensors, read without a host sync: whether the last ``step()`` was skipped for
        a non-finite gradient, and how many steps were skipped so far."""
        return MuonStepStats(self._last_skip, self._skipped_steps)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the grads of every parameter, dedicated ones' owner gradients included.

        Args:
            set_to_none: ``True`` sets every gradient to ``None`` (frees its memory);
                ``False`` fills it with zeros, as ``torch.optim.Optimizer.zero_grad`` does (a
                dedicated matrix's owner gradient too), so a parameter that the next backward
                gives no gradient (frozen mid-run) is stepped on zeros, as torch steps it.

        Under ``torch.compile`` it runs eagerly, one graph break (see [Note: the step under
        torch.compile]).
        """
        if torch.compiler.is_compiling():
            _untraced["zero_grad"](self, set_to_none)
            return
        self._eager_zero_grad(set_to_none)

    def _eager_zero_grad(self, set_to_none: bool) -> None:
        # First the runtime: an all-reduce still in flight would write a replicated gradient
        # after torch's zero_grad cleared it.
        self._runtime.clear_grads(set_to_none)
        super().zero_grad(set_to_none=set_to_none)
        if self._overlap is not None:
            self._overlap.end_step()

    # -- torch's state dict: see [Note: loading another rank's optimizer state dict] ----------
    #
    # [Note: the optimizer's state dict hooks]
    # torch runs ``register_state_dict_pre_hook`` / ``_post_hook`` and
    # ``register_load_state_dict_pre_hook`` / ``_post_hook`` hooks inside its own method, which
    # here is only part of the work: run there, a state_dict post-hook would see the dictionary
    # without its ``dmuon_holdings`` (a dictionary saved from it would be refused at its load),
    # a load pre-hook would run after dmuon had checked the dictionary (too late for a hook that
    # deletes a key no step reads, torch's way to convert an old dictionary) and a load
    # post-hook before the owned matrices' states are installed (it would see none of them).
    # So the hooks are taken out of torch's call and run around dmuon's whole method, as torch
    # runs them around its own: where the user's call is, once per call. dmuon's own uses of
    # the dictionary (``MuonParts.load_state_dict`` keeps each part's state to give it back
    # when another part refuses its own) go through ``_own_state_dict`` and
    # ``_load_own_state_dict``, which run none: torch runs no hook that its caller did not
    # ask for, and a hook that strips a key would have broken the state given back.

    def state_dict(self) -> dict[str, Any]:
        if torch_optim_state_dict_running():
            raise RuntimeError(
                "Muon.state_dict() was called by torch.distributed.checkpoint.state_dict's"
                " get_optimizer_state_dict (or get_state_dict), which takes it for every"
                " parameter's state on every rank, or its DTensor shard: a dedicated matrix's"
                " state is kept on its owner alone, so the result would lack the other owners'"
                " without an error. Use dmuon.get_optimizer_state_dict(model, optimizer) (the"
                " full state, collective), or dmuon.save_checkpoint / dmuon.AppState for a"
                " sharded checkpoint"
            )
        # The hooks see the whole dictionary (see [Note: the optimizer's state dict hooks]).
        with optimizer_state_dict_hooks_taken(self, load=False) as (pre_hooks, post_hooks):
            for pre_hook in pre_hooks:
                pre_hook(self)
            state_dict = self._own_state_dict()
            for post_hook in post_hooks:
                returned = post_hook(self, state_dict)
                if returned is not None:
                    state_dict = returned
        return state_dict

    def _own_state_dict(self) -> dict[str, Any]:
        """:meth:`state_dict` without its hooks (see [Note: the optimizer's state dict
        hooks])."""
        with optimizer_state_dict_hooks_taken(self, load=False):
            return for_saving(self, self._dedicated, super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict``, for this rank's ``state_dict()``; its hooks run around
        the whole load (see [Note: the optimizer's state dict hooks])."""
        with optimizer_state_dict_hooks_taken(self, load=True) as (pre_hooks, post_hooks):
            if isinstance(state_dict, dict):
                state_dict = state_dict.copy()  # as torch's: a hook may change it in place
            for pre_hook in pre_hooks:
                returned = pre_hook(self, state_dict)
                if returned is not None:
                    state_dict = returned
            self._load_own_state_dict(state_dict)
            for post_hook in post_hooks:
                post_hook(self)

    def _load_own_state_dict(self, state_dict: dict[str, Any]) -> None:
        """:meth:`load_state_dict` without its hooks (see [Note: the optimizer's state dict
        hooks])."""
        with optimizer_state_dict_hooks_taken(self, load=True):
            torch_part, owned = split_for_load(self, self._dedicated, state_dict)
            groups = self.param_groups
            super().load_state_dict(torch_part)
            # torch loads into new group dicts, but the step plan (and with it every step)
            # reads the groups it was built on: those take the loaded values and stay the
            # groups, so a loaded lr, or a scheduler's after the load, reaches the step.
            for group, loaded in zip(groups, self.param_groups, strict=True):
                group.update(loaded)
            self.param_groups = groups
            install_dedicated_state(self, owned)

    # -- the dmuon-clip protocol --------------------------------------------------------------

    def muon_grads_for_clip(self) -> MuonClipGrads:
        """The owned Muon gradients, final, for clipping: ``grads_for_clip("muon")``."""
        return self.grads_for_clip("muon")

    def grads_for_clip(self, params: str | Iterable[Tensor] = "muon") -> MuonClipGrads:
        """This rank's part of the final gradients (pending reduces waited) of the parameters
        ``params`` names, for clipping: scaling them in place changes what the next ``step()``
        reads. A Muon weight's come as the matrices Muon steps, views of its gradient: a
        convolution kernel's flattened, a declared split's one per piece. Scale ``.copies`` by
        the same factor too: they are the gradients other ranks count and this rank steps as
        well (HSDP replicas, TP grids), and left unscaled they make the replicas diverge.
        Summed over every rank ``.grads`` count each element once (see [Note: global
        quantities] in _comm). Where a Muon gradient is among them, the NS results that
        ``ns_overlap`` computed during backward are dropped (a clip may scale every gradient,
        by a kernel torch does not see) and the next steps compute NS in the step (see [Note:
        Newton–Schulz during backward]). Right after a backward under ``no_sync`` (nothing
        reduced yet) it raises ``RuntimeError``, as ``step()`` does, before anything changes.

        Args:
            params: ``"muon"`` (every Muon-route parameter: dedicated matrices on their owners,
                expert stacks), ``"adamw"`` (every AdamW-route one: FSDP2 shards, dedicated
                weights on their owners), ``"all"``, one of this optimizer's parameters, or an
                iterable of them (frozen ones are skipped; another tensor raises
                ``ValueError``).
        """
        if self._parts():
            refuse_part_used_alone("Muon.grads_for_clip() (dmuon.clip_grad_norm_)")
        return self._grads_for_clip(self._clip_selection(params))

    def _grads_for_clip(self, chosen: set[int]) -> MuonClipGrads:
        """:meth:`grads_for_clip` of the parameters ``chosen`` (ids), also for a part of a
        ``MuonParts``, whose other parts are clipped with it."""
        if self._stage_mark is not None:
            check_no_other_stage_pending(
                self, "dmuon.clip_grad_norm_ (grads_for_clip)", self._parts()
            )
        self._runtime.finish_pipeline_backward()
        if self._runtime.hooks.unsynced_backward:
            refuse_clip_after_no_sync()
        sharded = self._clip_sharded(chosen)
        self._runtime.wait_all_reduces()
        if self._overlap is not None and not chosen.isdisjoint(self._route_ids(Route.MUON)):
            self._stop_overlap(
                "the gradients were handed to a clip (grads_for_clip)",
                "Clipping needs every gradient's norm, known only once backward is done; drop"
                " ns_overlap when you clip",
            )
        layout = self._runtime.layout
        grads: list[Tensor] = []
        copies: list[Tensor] = []
        for param, view in self._plan.clip_views():
            if id(param) not in chosen:
                continue
            # A whole matrix is held in every TP grid (counted in grid 0), an expert shard or
            # an FSDP2 shard by every replica of its mesh (counted on the first). A conv kernel
            # comes as its flattened matrix, a split weight as one view per piece: the
            # matrices Muon steps, so that a per-matrix clip clips those.
            got = view.clip_grad(layout)
            if got is not None:
                (copies if got[1] else grads).extend(got[0])
        device = (grads or copies)[0].device if grads or copies else self._clip_device()
        return MuonClipGrads(grads, self._clip_group(), device, tuple(copies), sharded=sharded)

    def clip_group_and_device(
        self, params: str | Iterable[Tensor] = "muon"
    ) -> tuple[ProcessGroup | None, torch.device]:
        """The ``process_group`` and ``device`` that ``grads_for_clip(params)`` hands over,
        without taking the gradients: nothing is waited for or changed (``ns_overlap`` stays
        on), so that a clip can decline, or refuse its input, before it takes them
        (``dmuon.clip.try_clip_optimizer_grad_norm_buckets_`` does). The same group on every
        rank; the device is the parameters', where every gradient lives.

        Args:
            params: the selection :meth:`grads_for_clip` takes: ``"muon"``, ``"adamw"``,
                ``"all"``, or an iterable of this optimizer's parameters (another tensor
                raises ``ValueError``).
        """
        self._clip_selection(params)
        return self._clip_group(), self._clip_device()

    def _clip_group(self) -> ProcessGroup | None:
        """The group over which the clip's sums count every element once: every rank (of every
        pipeline stage)."""
        distributed = dist.is_available() and dist.is_initialized()
        return self._runtime.step_group if distributed else None

    def _clip_device(self) -> torch.device:
        """Where this rank's gradients to clip live: its parameters' device (CPU with none)."""
        if self._runtime.params:
            return self._runtime.params[0].param.device
        first = next((p for g in self.param_groups for p in g["params"]), None)
        return first.device if first is not None else torch.device("cpu")

    def grads_split_over_ranks(self, params: str | Iterable[Tensor] = "muon") -> bool:
        """Whether some gradient that ``grads_for_clip(params)`` hands over is split over ranks
        (its ``sharded``: a tensor-parallel shard, an FSDP2 shard of an AdamW parameter), from
        the layout alone: nothing is waited for or changed (``ns_overlap`` stays on), so that a
        clip refuses a rank-local strategy before it takes the gradients. The same answer on
        every rank.

        Args:
            params: the selection :meth:`grads_for_clip` takes: ``"muon"``, ``"adamw"``,
                ``"all"``, or an iterable of this optimizer's parameters (another tensor
                raises ``ValueError``).
        """
        return self._clip_sharded(self._clip_selection(params))

    def param_split_over_ranks(self, params: str | Iterable[Tensor] = "muon") -> str | None:
        """The FQN of the first parameter ``params`` selects (in the order of the param groups)
        whose gradient ranks hold parts of: a tensor-parallel matrix, an AdamW parameter FSDP2
        shards; ``None`` where there is none. From the layout alone, as
        :meth:`grads_split_over_ranks` (nothing is waited for or changed), and the same answer
        on every rank, so that a clip refusing a rank-local strategy names the parameter.

        Args:
            params: the selection :meth:`grads_for_clip` takes: ``"muon"``, ``"adamw"``,
                ``"all"``, or an iterable of this optimizer's parameters (another tensor
                raises ``ValueError``).
        """
        return self._split_param(self._clip_selection(params))

    def _clip_sharded(self, chosen: set[int]) -> bool:
        """``grads_split_over_ranks`` of the parameters ``chosen`` (ids). The same answer on
        every rank (the clip refuses "per_matrix" on all of them alike): under TP on every
        rank, whatever this rank's model part holds (a matrix's TP shards are split), else
        where a chosen parameter is split (:meth:`_split_param`)."""
        return self._runtime.layout.tp_size > 1 or self._split_param(chosen) is not None

    def _split_param(self, chosen: set[int]) -> str | None:
        """``param_split_over_ranks`` of the parameters ``chosen`` (ids). Every rank asks the
        same views: each parameter's holder (every rank has one of every dedicated matrix,
        whoever owns it) or the view of a tensor dmuon does not take over (every rank steps
        its part), not only those this rank steps."""
        views = {id(p): view for _, entries in self._plan.adamw for p, view in entries}
        for group in self.param_groups:
            for name, p in zip(group["param_names"], group["params"]):
                view = self._holders.get(id(p), views.get(id(p)))
                if id(p) in chosen and view is not None and view.split_over_ranks:
                    return name
        return None

    def _clip_selection(self, params: str | Iterable[Tensor]) -> set[int]:
        """The ids of the parameters ``grads_for_clip(params)`` takes (the same on every rank).
        By identity, not by name: a wrapper added after ``dedicate_params`` (activation
        checkpointing, ``torch.compile``) renames the parameters, not the tensors."""
        routes = {
            "muon": (Route.MUON,),
            "adamw": (Route.ADAMW,),
            "all": (Route.MUON, Route.ADAMW),
        }
        if isinstance(params, str):
            if params not in routes:
                raise ValueError(
                    f"params={params!r}: pass 'muon', 'adamw', 'all' or an iterable of this"
                    " optimizer's parameters"
                )
            return set().union(*(self._route_ids(route) for route in routes[params]))
        if isinstance(params, nn.Module):
            raise ValueError(
                f"params is a module ({type(params).__name__}), not its parameters; pass"
                " params=module.parameters(), or 'muon', 'adamw' or 'all'"
            )
        if isinstance(params, Tensor):
            # One parameter, as torch.nn.utils.clip_grad_norm_ takes it; iterated, a matrix
            # would be its rows (and a dedicated weight cannot be read off its owner).
            params = [params]
        names = self._plan.names
        chosen = set()
        for p in params:
            if isinstance(p, Tensor) and id(p) in names:
                chosen.add(id(p))
            elif not (isinstance(p, nn.Parameter) and not p.requires_grad):
                # A frozen parameter has no gradient, and torch's clip skips it too. Any
                # other tensor is refused: a gradient (torch.nn.utils.get_total_norm takes
                # gradients; the clip, as torch's clip_grad_norm_, parameters) would
                # otherwise select nothing, and the clip measure 0.
                raise ValueError(
                    f"params holds a {type(p).__name__} that is not a parameter of this"
                    " optimizer (a gradient, another model's parameter, or a copy); pass"
                    " the optimizer's own parameters, whose gradients are clipped (as"
                    " torch.nn.utils.clip_grad_norm_ takes them), or 'muon', 'adamw' or 'all'"
                )
        return chosen

    def _route_ids(self, route: Route) -> set[int]:
        """The ids of the parameters of every group of ``route``."""
        return {id(p) for g in self.param_groups if g["optimizer"] == route for p in g["params"]}

    def muon_param_names(self) -> list[str]:
        """FQNs of every Muon-route matrix, in group order (the same on every rank)."""
        return [
            name
            for group in self.param_groups
            if group["optimizer"] == Route.MUON
            for name in group["param_names"]
        ]


def step_together(optimizers: Sequence[Muon]) -> None:
    """One ``step()`` of each of ``optimizers`` (one ``Muon``, or the parts of a ``MuonParts``
    in their order, the same on every rank) with one non-finite decision over all of them (see
    [Note: the parts of a rank] in _parts). Every check of every optimizer runs before any
    pre-step hook, and a post-update hook's exception is raised once every optimizer has
    published."""
    for optimizer in optimizers:
        if optimizer._weights_lent_to is not None:
            refuse_step_while_lent(optimizer._weights_lent_to)
    begun = [optimizer._begin() for optimizer in optimizers]
    begun = [
        (mark, optimizer._before_step(mark, numbers))
        for optimizer, (mark, numbers) in zip(optimizers, begun, strict=True)
    ]
    errors: list[BaseException] = []
    with span("dmuon::optimizer_step"):
        works = [
            optimizer._collect(numbers, mark)
            for optimizer, (mark, numbers) in zip(optimizers, begun, strict=True)
        ]
        agreed = _agreed_nonfinite(optimizers, works)
        for optimizer, (mark, _), work in zip(optimizers, begun, works, strict=True):
            found, skip = optimizer._nonfinite(agreed, mark)
            optimizer._muon_update(work, skip, mark)
            optimizer._adamw_update(work, found, skip, mark)
            error = optimizer._post_update(mark)
            if error is not None:
                errors.append(error)
            optimizer._publish(mark)
    if errors:
        raise errors[0]


def _agreed_nonfinite(optimizers: Sequence[Muon], works: Sequence[_StepWork]) -> Tensor | None:
    """1.0 when any gradient that any of ``optimizers`` on any rank is about to step with holds
    a NaN or an infinity, agreed in one all-reduce (``None`` without ``skip_nonfinite``, which
    the parts of a ``MuonParts`` share). Every rank, TP grids, pipeline stages and model parts
    included: one decision for the step (see [Note: global quantities] in _comm, [Note:
    pipeline stages] in _mesh)."""
    first = optimizers[0]
    if not first._options.skip_nonfinite:
        return None
    found = [
        optimizer._find_nonfinite(work) for optimizer, work in zip(optimizers, works, strict=True)
    ]
    agreed = found[0] if len(found) == 1 else torch.stack(found).amax()
    if first._global_size > 1:
        try:
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=first._runtime.step_group)
        except RuntimeError as exc:
            if _peers_out_of_step(exc):
                exc.add_note(_STEP_RENDEZVOUS)
            raise
    return agreed


# [Note: a step rendezvous that failed]
# The step's agreement on non-finite gradients is the first collective of its own that every
# rank joins once per step, so it is where a rank that skipped ``step()`` (or called it once
# more, or left the loop) leaves the others: its error gets a note saying so. Only the errors
# that mean a peer did not come: torch raises a plain ``RuntimeError`` for gloo and a
# ``DistBackendError`` (a ``RuntimeError``) for NCCL, for a timeout and for any other failure
# alike, so the note goes by the backends' wording of a timeout (gloo's "Timed out waiting
# <n>ms for recv operation to complete"; NCCL's watchdog "caught collective operation
# timeout", under ``TORCH_NCCL_BLOCKING_WAIT=1``, elsewhere its watchdog ends the process) and
# of a peer that ended its process (gloo's connection "closed"/"reset by peer", NCCL's
# "remote process exited"). Any other error of that collective (a device error, a CUDA launch
# that "timed out", an invalid argument) keeps its own message, unlabelled.
_OUT_OF_STEP = re.compile(
    r"Timed out waiting \d+ ?ms for \w+ operation to complete"  # gloo
    r"|Watchdog caught collective operation timeout|timed out in blocking wait"  # NCCL
    r"|Connection (?:closed|reset) by peer"  # gloo: the peer's process ended
    r"|remote process exited or there was a network error"  # NCCL: likewise
)


def _peers_out_of_step(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a collective, says that a peer never joined it (see [Note: a
    step rendezvous that failed])."""
    return _OUT_OF_STEP.search(str(exc)) is not None


# What a failed (timed out) rendezvous of the step tells, under the collective's own message.
_STEP_RENDEZVOUS = (
    "dmuon: this collective is optimizer.step()'s agreement on non-finite gradients, which "
    "every rank joins once per step. A rank that did not reach it (it skipped "
    "optimizer.step(), called it once more than the others, or ran out of data and left the "
    "loop) leaves the others waiting here until the process group's timeout, as under FSDP2 "
    "alone (or, where it ended its process, fails it at once; if it stopped on an error, its "
    "own log names it). Run the same forward, backward and step on every rank "
    "(DistributedSampler(..., drop_last=True) and DataLoader(..., drop_last=True) for uneven "
    "data; a skip decided alike on every rank); see the FAQ, 'A step hangs in "
    "optimizer.step()'."
)
