"""Train, checkpoint and resume dmuon with torchtitan 0.3's llama3 and its components.

    python docs/examples/integrations/torchtitan_train.py             # 2 CPU ranks (gloo)
    python docs/examples/integrations/torchtitan_train.py --pp 2      # and in 2 pipeline stages
    python docs/examples/integrations/torchtitan_train.py --pp 2 --world-size 4  # 2 stages x 2
    python docs/examples/integrations/torchtitan_train.py --pp 2 --schedule ZBVZeroBubble
    torchrun --nproc-per-node 2 docs/examples/integrations/torchtitan_train.py --dir /shared/ckpt
    torchrun --nproc-per-node 1 docs/examples/integrations/torchtitan_train.py --device cuda

The recipe is the first half of this file, four pieces a torchtitan job plugs in through its
``Trainer.Config``: :func:`parallelize_llama_dmuon` (torchtitan's ``parallelize_llama`` with
``dmuon.dedicate_params`` between tensor parallelism and FSDP2, registered as the
``ModelSpec``'s ``parallelize_fn``), :func:`pipeline_llm_dmuon` (torchtitan's ``pipeline_llm``,
the ``pipelining_fn``, for schedules of one stage per rank, 1F1B and GPipe, or of several:
the interleaved, looped, zero-bubble and V ones), :class:`DmuonOptimizersContainer` (one
``dmuon.Muon`` per model part behind torchtitan's optimizer container, several tied by one
``dmuon.MuonParts``, each part's ``Muon`` wrapped by its LR scheduler) and
:class:`DmuonCheckpointManager` (torchtitan's DCP checkpointer with the model and the optimizer in one ``dmuon.AppState``, loaded by
``dmuon.load_checkpoint`` on any layout). :func:`llama3_debugmodel_dmuon` is torchtitan's own
``llama3_debugmodel`` job with the four swapped in, for
``torchrun ... -m torchtitan.train --module torchtitan_train --config llama3_debugmodel_dmuon``
on GPUs (this directory on ``PYTHONPATH``, run from a torchtitan checkout for its test
tokenizer and data).

torchtitan's ``Trainer`` cannot start on a machine without an accelerator (it picks CUDA and
NCCL when it finds none, ``torchtitan/tools/utils.py`` line 55, and calls
``torch.cuda.set_device`` at ``torchtitan/trainer.py`` line 301). So the second half runs the
same config through the same calls as ``Trainer.__init__``, ``Trainer.train`` and
``Trainer.train_step``, in a short loop of its own, on gloo (or, with ``--device cuda`` under
``torchrun``, on NCCL and the GPUs): build the debug model (two blocks, or one per pipeline
stage) on the meta device, ``parallelize_fn`` (or, with a pipeline, the ``pipelining_fn``,
which splits it into stage modules and parallelizes this rank's), ``to_empty``,
``init_weights``, the optimizer, LR-scheduler and checkpoint builders, then 10 steps with a checkpoint at step 5 (with a
pipeline, ``pp_schedule.step`` in place of the forward and backward, the loss from the last
stage, the clip's norm reduced over the ``pp`` mesh). It then builds everything again from
other initial weights, resumes from step 5 with ``checkpointer.load`` and exits non-zero
unless the loss fell and the resumed steps' losses equal the uninterrupted run's bit for bit.

``--pp P`` (P dividing the world size) runs those two checks also on P pipeline ranks under
``--schedule`` (1F1B by default; GPipe; or two stages per rank: Interleaved1F1B, LoopedBFS,
InterleavedZeroBubble, ZBVZeroBubble, DualPipeV), one transformer block per stage (the whole
job's model has P or 2P blocks), computing in fp32 (see [Note: comparing the pipeline in
fp32]). It then resumes the run without a pipeline from its step-5 checkpoint in the pipeline,
and the pipeline's without one, and exits non-zero unless each run's step 6 loss equals that
of the run it resumed and steps 7 to 10 lie within ``ACROSS_RTOL`` of it (DualPipeV, which needs
a micro-batch per stage, cuts each rank's batch into half-size micro-batches, whose losses sum
in another order: its step 6 is held to ``ACROSS_RTOL`` too). The split-backward schedules
(InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) run with torchtitan's full activation
checkpointing in place of the debug job's selective one, whose regions torch refuses to run
backward through twice ("Trying to backward an extra time"). On 2 CPU ranks (pp=2, one
data-parallel rank per stage) the default run takes about 15 s and ``--pp 2`` about 17 s
(19 s and 20 s on a busier machine, where a schedule of two stages per rank took 26 to 28 s),
``--pp 2 --world-size 4`` (2 stages x 2 data-parallel ranks) about 30 s; ``nox -s
integrations`` runs the default, ``--pp 2`` and ``--pp 2 --schedule ZBVZeroBubble``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import sys
import tempfile
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torchtitan.distributed.parallel_dims as titan_parallel_dims
from torch import Tensor, nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
    get_schedule_class,
)
from torchtitan.components.checkpoint import MODEL, OPTIMIZER, CheckpointManager
from torchtitan.components.loss import IGNORE_INDEX, CrossEntropyLoss
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.fsdp import (
    apply_fsdp_to_decoder,
    get_fsdp_reshard_after_forward_policy,
)
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.common.attention import (
    FusedQKVLinear,
    QKVLinear,
    ScaledDotProductAttention,
)
from torchtitan.models.common.linear import Linear
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

# The quickstart's data task and launcher (docs/examples/train_fsdp.py).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from train_fsdp import ROWS_PER_RANK, batch, launch

import dmuon

STEPS, SAVE_AT = 10, 5
# The losses of the run without a pipeline resumed from its step-SAVE_AT checkpoint in pipeline
# stages, against that run's own (fp32 compute): the first step's forward sees the same weights
# and rows (equal bit for bit); the later ones follow updates from the same gradients, summed in
# another order (over micro-batches, then over the stage's ranks; the clips' norms over stages).
ACROSS_RTOL = 1e-5


# ---------------------------------------------------------------------------------------------
# The recipe: what a torchtitan job needs to train with dmuon.


def muon_matrices(name: str, param: nn.Parameter) -> bool:
    """The Muon matrices: every 2-D weight of the transformer blocks (attention ``wqkv``, ``wo``
    and feed-forward ``w1``, ``w2``, ``w3``); the embedding, the output head and the norms stay
    with FSDP2 and AdamW."""
    return name.startswith("layers.") and param.ndim == 2


def separate_qkv(fused: FusedQKVLinear.Config) -> QKVLinear.Config:
    """torchtitan's separate ``wq``, ``wk``, ``wv`` projections (``QKVLinear``) in place of a
    fused ``wqkv`` (``FusedQKVLinear``, what torchtitan's llama3 configs build).

    [Note: separate q, k and v]
    Muon orthogonalises each matrix it steps, and q, k and v are three matrices: stacked in
    one ``wqkv`` they would be orthogonalised as one (and dmuon's QK-clip would need row maps).
    The fused module also saves its weight as ``wq``/``wk``/``wv`` through a state-dict hook
    that reshapes it, a read of the whole weight on every rank, which dmuon refuses where the
    weight is not held. The separate module has those keys natively, so checkpoints keep
    torchtitan's names. The initialisation is llama3's for each of the three (a truncated
    normal, std 0.02), as the fused one draws it slice by slice."""
    init = {"weight": partial(nn.init.trunc_normal_, std=0.02)}
    dim, head_dim = fused.wqkv.in_features, fused.head_dim
    return QKVLinear.Config(
        head_dim=head_dim,
        wq=Linear.Config(in_features=dim, out_features=fused.n_heads * head_dim, param_init=init),
        wkv=Linear.Config(
            in_features=dim, out_features=fused.n_kv_heads * head_dim, param_init=init
        ),
    )


def parallelize_llama_dmuon(
    model: nn.Module,
    *,
    parallel_dims: ParallelDims,
    training: Any,
    parallelism: Any,
    compile_config: Any,
    ac_config: Any,
    dump_folder: str,
) -> nn.Module:
    """torchtitan's ``parallelize_llama`` (models/llama3/parallelize.py) with dmuon: tensor
    parallelism, activation checkpointing, ``dmuon.dedicate_params``, per-block compile, then
    torchtitan's own ``apply_fsdp_to_decoder``.

    [Note: where dmuon goes in torchtitan's parallelize]
    ``dedicate_params`` must see the weights as FSDP2 will leave them: after tensor parallelism
    (a TP weight is a DTensor on the ``tp`` mesh, which dmuon shards by owner as it is) and
    after activation checkpointing (its wrapper renames the parameters, and dmuon keys its
    checkpoints by the names it saw), and before any ``fully_shard``. ``apply_fsdp_to_decoder``
    calls ``fully_shard`` without ``ignored_params`` (distributed/fsdp.py), so it relies on the
    patch ``dedicate_params`` installs by default (``patch_fully_shard=True``, spelled out
    below): every ``fully_shard`` then leaves the dedicated matrices alone, and torchtitan's
    FSDP2 setup (mixed precision, the reshard policy, its
    gradient scaling, HSDP on a ``dp_replicate`` axis) stays exactly its own. The dmuon mesh is
    torchtitan's ``fsdp`` axis, with ``dp_replicate`` as the replicate mesh under HSDP and
    ``pp`` as the pipeline mesh under pipeline parallelism (``model`` is then this rank's stage
    module, which :func:`pipeline_llm_dmuon` hands it); the dedicated matrices follow
    torchtitan's reshard policy (Z2 under a pipeline by default, as its blocks).
    """
    if parallelism.spmd_backend != "partial_dtensor":
        raise ValueError(
            f"parallelize_llama_dmuon needs parallelism.spmd_backend='partial_dtensor', got "
            f"{parallelism.spmd_backend!r}: under 'spmd_types' and 'full_dtensor' fully_shard "
            "shards over torchtitan's whole SPMD mesh, which dmuon does not take"
        )
    unsupported = [
        name
        for name, on in (
            ("context parallelism", parallel_dims.cp_enabled),
            ("expert parallelism", parallel_dims.ep_enabled),
        )
        if on
    ]
    if unsupported:
        raise ValueError(
            f"parallelize_llama_dmuon supports FSDP, HSDP, tensor and pipeline parallelism, not "
            f"{', '.join(unsupported)}: set their degrees to 1"
        )
    if parallel_dims.tp_enabled:
        model.parallelize(parallel_dims)  # type: ignore[operator]  # torchtitan's Module
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)

    dp_axes = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    # torchtitan's FSDP2 policy for the blocks, also for the dedicated matrices: Z2 (kept
    # across the micro-batches) under a pipeline by default, Z3 otherwise.
    reshard_after_forward = get_fsdp_reshard_after_forward_policy(
        parallelism.fsdp_reshard_after_forward, parallel_dims.pp_enabled
    )
    dmuon.dedicate_params(
        model,
        parallel_dims.get_mesh("fsdp"),
        muon_matrices,
        replicate_mesh=(
            parallel_dims.get_mesh("dp_replicate") if parallel_dims.dp_replicate_enabled else None
        ),
        reshard_after_forward=reshard_after_forward,
        pipeline_mesh=parallel_dims.get_optional_mesh("pp"),
        patch_fully_shard=True,
    )

    if compile_config.enable and "model" in compile_config.components:
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
    apply_fsdp_to_decoder(
        model,  # type: ignore[arg-type]  # a torchtitan Decoder
        parallel_dims.get_mesh(dp_axes),
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        pp_enabled=parallel_dims.pp_enabled,
        cpu_offload=training.enable_cpu_offload,
        reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
        enable_symm_mem=parallelism.enable_fsdp_symm_mem,
    )
    return model


# The schedules that split each backward into the inputs' gradients and the weights' (see
# [Note: the model parts of a rank]).
SPLIT_BACKWARD = (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV)
# Each model part's pipeline stage index, noted by pipeline_llm_dmuon for the optimizer
# container's MuonParts (see [Note: the model parts of a rank]).
STAGE_INDEX: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def pipeline_llm_dmuon(
    model: nn.Module, *, parallelism: Any, **kwargs: Any
) -> tuple[Any, list[nn.Module], bool, bool]:
    """torchtitan's ``pipeline_llm`` (distributed/pipeline_parallel.py), the ``ModelSpec``'s
    ``pipelining_fn``: it splits the model into stage modules, applies the ``parallelize_fn``
    (:func:`parallelize_llama_dmuon`, which passes the ``pp`` mesh to ``dedicate_params`` as
    ``pipeline_mesh``) to each of this rank's, and builds the schedule from ``parallelism``:
    one stage per rank (``1F1B``, ``GPipe``) or several (``Interleaved1F1B``, ``LoopedBFS``,
    ``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``, a CSV schedule).

    [Note: the model parts of a rank]
    An interleaved, looped or V schedule gives a rank several model parts (stages ``r`` and
    ``r + P`` of ``2P``, or ``r`` and ``2P - 1 - r`` under a V), each a stage module that
    ``pipeline_llm`` parallelizes on its own: ``dedicate_params`` and ``fully_shard`` per part,
    in the order of ``model_parts``, the same on every rank. :class:`DmuonOptimizersContainer`
    builds one ``dmuon.Muon`` per part and ties them into one ``dmuon.MuonParts``, which takes
    one non-finite decision and one clip norm over every part of every rank (a part stepped
    alone would decide over the parts at its pipeline position only, and dmuon refuses it).
    The zero-bubble and V schedules (``InterleavedZeroBubble``, ``ZBVZeroBubble``,
    ``DualPipeV``) run each weight gradient after the layer's backward is over, when a ZeRO-3
    peer has freed its copy of a dedicated matrix (dmuon raises ``NotHeldError`` at the first
    backward there): they need torchtitan's default reshard policy under a pipeline (ZeRO-2,
    ``fsdp_reshard_after_forward`` ``"default"`` or ``"never"``), and ``"always"`` is refused
    here before anything is built.

    The parts' stage indices order the stages of a checkpoint's param groups, which list the
    whole model's parameters stage by stage: torch's "loop" order (``r + k * P``) is
    ``MuonParts``' default, but a V schedule's rank holds stages ``r`` and ``2P - 1 - r``.
    So each part's ``PipelineStage.stage_index`` is noted here (``STAGE_INDEX``) and the
    optimizer container passes them as ``MuonParts(..., stage_indices=...)``: a V schedule's
    checkpoint then loads on any layout, as the others' do.

    [Note: the dedicated gradients after the schedule]
    The schedule runs each micro-batch's backward with FSDP2's gradient sync off, and dmuon
    keeps each dedicated matrix's local sum over the micro-batches in its ``.grad`` until the
    next ``Muon`` step or clip, or ``dmuon.runtime.wait_all_reduces``, reduces it to its owner
    (the pipeline guide). ``Trainer.train_step`` clips between the schedule and the step, over
    every parameter's ``.grad``: it would count (and scale) those local sums, which dmuon's
    own clip (``muon_max_norm``) then counts again after the reduce. So the schedule's
    ``step`` is wrapped to reduce them, every part's, right after the last micro-batch: the clip
    then sees FSDP2's gradients alone, as without a pipeline."""
    name = parallelism.pipeline_parallel_schedule
    if (
        not parallelism.pipeline_parallel_schedule_csv
        and get_schedule_class(name) in SPLIT_BACKWARD
        and get_fsdp_reshard_after_forward_policy(parallelism.fsdp_reshard_after_forward, True)
    ):
        raise ValueError(
            f"pipeline_llm_dmuon: the schedule {name!r} computes the weights' gradients after "
            "the layer's backward, which needs the dedicated matrices kept across the micro-"
            "batches (ZeRO-2), and parallelism.fsdp_reshard_after_forward='always' frees them "
            "after each forward: set it to 'default' (ZeRO-2 under a pipeline) or 'never'"
        )
    schedule, model_parts, first_stage, last_stage = pipeline_llm(
        model, parallelism=parallelism, **kwargs
    )
    # torch's schedules keep their PipelineStages, in the order of model_parts, in _stages (a
    # single-stage schedule its one in _stage); each stage's submod is its part.
    stages = schedule._stages if isinstance(schedule, PipelineScheduleMulti) else [schedule._stage]
    for stage, part in zip(stages, model_parts, strict=True):
        assert stage.submod is part
        STAGE_INDEX[part] = stage.stage_index
    step = schedule.step

    def step_then_reduce(*args: Any, **step_kwargs: Any) -> Any:
        outputs = step(*args, **step_kwargs)
        for part in model_parts:
            dmuon.runtime.wait_all_reduces(part)
        return outputs

    schedule.step = step_then_reduce  # type: ignore[method-assign]
    return schedule, model_parts, first_stage, last_stage


class DmuonOptimizersContainer(OptimizersContainer):
    """One ``dmuon.Muon`` per model part (Muon for the dedicated matrices, AdamW for the rest)
    behind torchtitan's ``OptimizersContainer``, several parts (an interleaved, looped or V
    pipeline schedule's) tied into one ``dmuon.MuonParts``: ``LRSchedulersContainer`` wraps
    each optimizer it iterates (each part's ``Muon``) in a ``LambdaLR``, which scales both
    groups' ``lr``.

    [Note: Muon gradients in torchtitan]
    torchtitan divides each rank's summed loss by the global token count and turns off FSDP2's
    gradient division (``disable_fsdp_gradient_division`` sets ``set_gradient_divide_factor(1.0)``
    on every ``fully_shard`` module), so an FSDP2 gradient is the sum over the data-parallel
    ranks. dmuon follows that factor: the Muon gradients are sums too. ``Trainer.train_step``
    clips FSDP2's gradients (``training.max_norm``, expert stacks included) and never sees those
    of the dedicated weights (under a pipeline neither: see [Note: the dedicated gradients after
    the schedule]), which :meth:`step` clips at ``muon_max_norm``, over every pipeline stage.

    [Note: one step of several parts]
    :meth:`step` steps the ``MuonParts`` (or the one part's ``Muon``), which takes one
    non-finite decision and clips by one norm over every part of every rank (see [Note: the
    model parts of a rank]). ``MuonParts.step`` goes through each part's own ``step``, so the
    ``LambdaLR`` of each part counts its steps and torch's step hooks of each part run, as
    torchtitan's container steps each of its optimizers. The parts' optimizers stay in
    :attr:`optimizers` for the LR scheduler only: stepped alone, a tied part raises.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        lr: float = 0.02
        """Muon learning rate (the dedicated matrices)."""

        weight_decay: float = 0.0
        """Muon decoupled weight decay."""

        adamw_lr: float = 8e-4
        """AdamW learning rate (embedding, output head, norms)."""

        adamw_betas: tuple[float, float] = (0.9, 0.95)
        adamw_weight_decay: float = 0.1
        adamw_eps: float = 1e-8

        muon_max_norm: float | None = 1.0
        """Clip the dedicated weights' gradients to this global norm (on torchtitan's gradient
        scale); ``None`` leaves them unclipped."""

        muon_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
        """Any other ``dmuon.Muon`` argument (``momentum``, ``ns_steps``,
        ``options=dmuon.StepOptions(lr_scaling=...)``...)."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        if config.param_groups:
            raise ValueError(
                "DmuonOptimizersContainer.Config.param_groups must stay empty: dmuon.Muon routes "
                "the parameters itself (dedicated matrices to Muon, the rest to AdamW); pass "
                "Muon's own param_groups through muon_kwargs"
            )
        self.model_parts = model_parts
        parts = [
            dmuon.Muon(
                model,
                lr=config.lr,
                weight_decay=config.weight_decay,
                adamw_lr=config.adamw_lr,
                adamw_betas=config.adamw_betas,
                adamw_weight_decay=config.adamw_weight_decay,
                adamw_eps=config.adamw_eps,
                **config.muon_kwargs,
            )
            for model in model_parts
        ]
        # Several parts are stepped and clipped as one: see [Note: one step of several parts].
        # Their stage indices as pipeline_llm_dmuon noted them (MuonParts' loop order for
        # parts it did not build).
        indices = [STAGE_INDEX.get(model) for model in model_parts]
        self.muon: dmuon.Muon | dmuon.MuonParts = (
            parts[0]
            if len(parts) == 1
            else dmuon.MuonParts(
                parts, stage_indices=None if None in indices else cast(list[int], indices)
            )
        )
        self.optimizers = parts
        self.muon_max_norm = config.muon_max_norm
        # torchtitan clips every param.grad; the dedicated weights' gradients are not there.
        self.held = [p for model in model_parts for p in dmuon.dedicated_params_of(model)]
        # Optimizer.__init__, as OptimizersContainer does, for the step hooks it registers.
        self._post_init([p for model in model_parts for p in model.parameters()])

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("DmuonOptimizersContainer.step takes no closure, as torchtitan's")
        if self.muon_max_norm is not None:
            dmuon.clip_grad_norm_(self.muon, self.muon_max_norm, params=self.held)
        self.muon.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        raise TypeError(NOT_ALONE)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise TypeError(NOT_ALONE)


NOT_ALONE = (
    "DmuonOptimizersContainer is checkpointed together with the model, in one dmuon.AppState, "
    "by DmuonCheckpointManager: set the job's checkpoint=DmuonCheckpointManager.Config(...)"
)


class DmuonCheckpointManager(CheckpointManager):
    """torchtitan's DCP ``CheckpointManager`` with the model and its ``dmuon.Muon`` in one
    ``dmuon.AppState`` under ``"dmuon"``, beside the LR scheduler, the dataloader and the train
    state, which it saves and loads as it always does.

    [Note: torchtitan checkpoints]
    ``CheckpointManager`` puts a ``ModelWrapper`` (``model.state_dict()``, which reads every
    weight on every rank and so raises ``dmuon.NotHeldError`` on a dedicated matrix) and the
    optimizer container into the dictionary it hands to ``dcp.save`` / ``dcp.load``. Here the
    wrapper wraps no module (its part of the dictionary is empty) and the container's place is
    taken by ``dmuon.AppState``, which gives DCP what each rank holds: its FSDP2 shards, and on
    its owner a dedicated matrix's weight and momentum. The keys are those of
    ``dmuon.save_checkpoint`` (``dmuon.model.<fqn>``, ``dmuon.optim...``), and :meth:`dcp_load`
    reads that entry with ``dmuon.load_checkpoint``, so a step folder loads on another world
    size, HSDP shape or pipeline layout (with or without ``pp``) as any dmuon checkpoint does (a
    plain ``dcp.load`` of an ``AppState`` reads the same pipeline layout only). A model-only
    save or load would find the wrapper empty: the config refuses those options.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        last_save_model_only: bool = False
        """Must stay False: the last checkpoint is a full one (dmuon has no model-only
        DCP layout)."""

        initial_load_model_only: bool = False
        """Without ``initial_load_path`` (refused below) it has no effect."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            refused = [
                name
                for name, on in (
                    ("last_save_model_only", self.last_save_model_only),
                    ("last_save_in_hf", self.last_save_in_hf),
                    ("initial_load_path", self.initial_load_path is not None),
                    ("create_seed_checkpoint", self.create_seed_checkpoint),
                )
                if on
            ]
            if refused:
                raise ValueError(
                    f"DmuonCheckpointManager saves and loads the model and the optimizer "
                    f"together, in one dmuon.AppState: unset {', '.join(refused)}. Export "
                    "weights with dmuon.get_model_state_dict(model, rank0_only=True); start "
                    "from saved weights with dmuon.set_model_state_dict or "
                    "dmuon.load_checkpoint after the job's model is built"
                )

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[nn.Module],
        optimizers: OptimizersContainer,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any,
        base_folder: str = "",
    ) -> None:
        if not isinstance(optimizers, DmuonOptimizersContainer):
            raise TypeError(
                f"DmuonCheckpointManager checkpoints a DmuonOptimizersContainer, got "
                f"{type(optimizers).__name__}: set the job's optimizer="
                "DmuonOptimizersContainer.Config(...)"
            )
        # A stage module per rank under a pipeline, or the list of this rank's model parts
        # with their MuonParts (an interleaved, looped or V schedule).
        model = model_parts[0] if len(model_parts) == 1 else list(model_parts)
        self.dmuon_parts = (model, optimizers.muon)
        super().__init__(
            config,
            dataloader=dataloader,
            model_parts=[],
            optimizers=optimizers,
            lr_schedulers=lr_schedulers,
            states=states,
            sd_adapter=sd_adapter,
            base_folder=base_folder,
        )
        if self.enable:
            assert not self.states[MODEL].state_dict()  # wraps no module: see the Note above
            del self.states[OPTIMIZER]
            self.states[dmuon.runtime.CHECKPOINT_KEY] = dmuon.AppState(*self.dmuon_parts)

    def dcp_load(
        self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool
    ) -> None:
        """``CheckpointManager.dcp_load`` with the model and the optimizer read by
        ``dmuon.load_checkpoint`` (on any layout, all or nothing), then the other states (LR
        scheduler, dataloader, train state) by torchtitan's ``dcp.load``."""
        state_dict = dict(state_dict)
        if state_dict.pop(dmuon.runtime.CHECKPOINT_KEY, None) is not None:
            dmuon.load_checkpoint(checkpoint_id, *self.dmuon_parts)
        super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)


def llama3_debugmodel_dmuon() -> Trainer.Config:
    """torchtitan's ``llama3_debugmodel`` job (models/llama3/config_registry.py) on dmuon: the
    three pieces above, separate q/k/v projections and the ``partial_dtensor`` SPMD backend
    they need."""
    config = llama3_debugmodel()
    assert config.model_spec is not None
    for layer in config.model_spec.model.layers:
        layer.attention.qkv_linear = separate_qkv(layer.attention.qkv_linear)
    config.model_spec.parallelize_fn = parallelize_llama_dmuon
    config.model_spec.pipelining_fn = pipeline_llm_dmuon
    config.parallelism.spmd_backend = "partial_dtensor"
    config.optimizer = DmuonOptimizersContainer.Config(lr=0.02, adamw_lr=8e-4)
    config.checkpoint = DmuonCheckpointManager.Config(interval=10)
    return config


# ---------------------------------------------------------------------------------------------
# The run: torchtitan's Trainer steps, on the CPU.


def stages_per_rank(schedule: str) -> int:
    """The model parts torchtitan gives each pipeline rank under ``schedule``: one under a
    single-stage schedule (``1F1B``, ``GPipe``), else two (its default, and what the V schedules
    need)."""
    return 1 if issubclass(get_schedule_class(schedule), PipelineScheduleSingle) else 2


def microbatch_rows(schedule: str) -> int:
    """The rows of a micro-batch under ``schedule``: one quickstart batch (``ROWS_PER_RANK``),
    what a rank of the run without a pipeline takes, so each data-parallel rank's batch is one
    micro-batch per pipeline rank; half of it under ``DualPipeV``, which needs a micro-batch per
    stage (two per pipeline rank)."""
    return (
        ROWS_PER_RANK // 2 if get_schedule_class(schedule) is ScheduleDualPipeV else ROWS_PER_RANK
    )


def small_config(
    directory: str,
    resume_from: int | None,
    pp: int = 1,
    param_dtype: str = "bfloat16",
    schedule: str = "1F1B",
    layers: int = 2,
) -> Trainer.Config:
    """The job above, shrunk to run on CPU ranks as well as GPUs: ``layers`` transformer
    blocks, SDPA attention (torchtitan's language-model attentions, FlexAttention and varlen,
    are compiled or CUDA kernels), 16 tokens a row, checkpoints every ``SAVE_AT`` steps into
    ``directory``; with ``pp`` > 1, ``pp`` pipeline ranks under ``schedule``, each with one
    model part or two (:func:`stages_per_rank`), ``layers`` blocks split evenly over the stages
    (the embedding goes with the first, the norm and the head with the last), each step's
    batch of ``ROWS_PER_RANK * pp`` rows on every data-parallel rank cut into one micro-batch
    per stage. ``param_dtype`` is the compute dtype (``training.mixed_precision_param``)."""
    config = llama3_debugmodel_dmuon()
    assert config.model_spec is not None
    model = config.model_spec.model
    if layers > len(model.layers):
        raise ValueError(
            f"small_config: {layers} blocks asked, the debug model has {len(model.layers)}"
        )
    model.layers = model.layers[:layers]
    for layer in model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.loss = CrossEntropyLoss.Config()
    if get_schedule_class(schedule) in SPLIT_BACKWARD:
        config.activation_checkpoint = FullAC.Config()
    config.dump_folder = directory
    config.parallelism.pipeline_parallel_degree = pp
    config.parallelism.pipeline_parallel_schedule = schedule
    # The blocks alone decide the split: the embedding and the head weigh no block.
    config.parallelism.pipeline_parallel_first_stage_less_layers = 0
    config.parallelism.pipeline_parallel_last_stage_less_layers = 0
    config.parallelism.pipeline_parallel_microbatch_size = microbatch_rows(schedule)
    config.training.seq_len = 16
    config.training.local_batch_size = ROWS_PER_RANK * pp
    config.training.steps = STEPS
    config.training.mixed_precision_param = param_dtype  # type: ignore[assignment]
    config.training.disable_cuda_graphs = True
    config.checkpoint = DmuonCheckpointManager.Config(
        enable=True,
        interval=SAVE_AT,
        load_step=-1 if resume_from is None else resume_from,
        load_only=resume_from is not None,  # the resumed run leaves the first run's folders
    )
    return config


class Batches(Stateful):
    """This data-parallel rank's batches of the quickstart's learnable task on ``device``: each
    step the world takes ``world_size`` of the quickstart's batches (``ROWS_PER_RANK`` rows
    each), split evenly over the ``dp_size`` data-parallel ranks, whatever the pipeline degree,
    so that every layout trains on the same rows. Its position is checkpointed, as torchtitan's
    dataloader's is."""

    def __init__(self, dp_rank: int, dp_size: int, world_size: int, device: torch.device) -> None:
        self.per_rank = world_size // dp_size
        self.first = dp_rank * self.per_rank
        self.world_size, self.device, self.taken = world_size, device, 0

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        while True:
            start = self.taken * self.world_size + self.first
            tokens = torch.cat([batch(i, self.device) for i in range(start, start + self.per_rank)])
            self.taken += 1
            yield tokens[:, :-1], tokens[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"taken": self.taken}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.taken = state_dict["taken"]


class TrainState(Stateful):
    """``Trainer``'s own entry in the checkpoint (``Trainer.state_dict``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]


def parallel_dims_on(config: Trainer.Config, device: torch.device) -> ParallelDims:
    """``Trainer.init_distributed``'s ``ParallelDims``, its meshes on ``device``'s type:
    torchtitan builds them on ``tools.utils.device_type``, which is ``"cuda"`` also on a
    machine without an accelerator (tools/utils.py line 55)."""
    titan_parallel_dims.device_type = device.type  # type: ignore[attr-defined]
    return ParallelDims.from_config(config.parallelism, dist.get_world_size())


def sum_gradients_on_gloo(model: nn.Module) -> None:
    """FSDP2 divides gradients by the factor torchtitan sets (1) with ``PREMUL_SUM``, which
    gloo lacks; a plain sum is the same with a factor of 1. NCCL has it: nothing to do."""
    if dist.get_backend() != "gloo":
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def run(config: Trainer.Config, seed: int, device: torch.device) -> dict[int, float]:
    """``Trainer.__init__`` and ``Trainer.train`` for ``config`` on this rank, on ``device``;
    returns the loss of every step it trained (the sum over ranks of each rank's share, as the
    Trainer logs; under a pipeline the last stage's, on every rank).

    [Note: the logged loss in float64]
    The loss is summed over the micro-batches and the ranks in float64, where the sum of a few
    fp32 losses of like size is exact, so its value does not depend on the order of the sums:
    the run without a pipeline all-reduces one loss per rank, the pipeline sums each rank's
    micro-batches and then all-reduces, and gloo adds four ranks' losses in another order than
    (2 micro-batches) + (2 micro-batches); in fp32 the same rows' losses then came out one ulp
    apart. So equal losses of the same rows give the same step loss on every layout."""
    assert config.model_spec is not None
    parallel_dims = parallel_dims_on(config, device)
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    loss_fn = config.loss.build(compile_config=config.compile)
    parallelize = {
        "parallel_dims": parallel_dims,
        "training": config.training,
        "parallelism": config.parallelism,
        "compile_config": config.compile,
        "ac_config": config.activation_checkpoint,
        "dump_folder": config.dump_folder,
    }
    pp_mesh = parallel_dims.get_optional_mesh("pp")
    if parallel_dims.pp_enabled:
        assert config.model_spec.pipelining_fn is not None
        # This rank's stage module (parallelized), the schedule, and whether it holds the
        # first (inputs) and the last (labels, loss) stage.
        pp_schedule, model_parts, first_stage, last_stage = config.model_spec.pipelining_fn(
            model,
            **parallelize,
            device=device,
            model_config=model_config,
            parallelize_fn=config.model_spec.parallelize_fn,
            loss_fn=loss_fn,
        )
        del model
    else:
        model_parts = [config.model_spec.parallelize_fn(model, **parallelize)]
        first_stage = last_stage = True
    for part in model_parts:
        sum_gradients_on_gloo(part)
        part.to_empty(device=device)
        torch.manual_seed(seed)  # the same initial weights on every rank of a stage
        with torch.no_grad():
            part.init_weights(buffer_device=None)  # type: ignore[operator]  # a Decoder
        part.train()

    optimizers = config.optimizer.build(model_parts=model_parts)
    lr_schedulers = config.lr_scheduler.build(
        optimizers=optimizers, training_steps=config.training.steps
    )
    # None on one rank: the sums below then reduce nothing, as the Trainer's do without DP.
    batch_mesh = parallel_dims.get_optional_mesh("batch")
    loss_mesh = parallel_dims.get_optional_mesh("loss")
    data = Batches(
        batch_mesh.get_local_rank() if batch_mesh is not None else 0,
        batch_mesh.size() if batch_mesh is not None else 1,
        dist.get_world_size(),
        device,
    )
    state = TrainState()
    checkpointer = config.checkpoint.build(
        dataloader=data,
        model_parts=model_parts,
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": state},
        sd_adapter=None,
        base_folder=config.dump_folder,
    )
    train_context = dist_utils.get_spmd_context(
        parallel_dims=parallel_dims, spmd_typechecking=False
    )

    checkpointer.load(step=config.checkpoint.load_step)
    batches = iter(data)
    losses = {}
    try:
        while state.step < config.training.steps:
            state.step += 1
            # Trainer.train_step, without gradient accumulation.
            optimizers.zero_grad(set_to_none=config.training.disable_cuda_graphs)
            inputs, labels = next(batches)
            global_valid_tokens = dist_utils.dist_sum_tensor(
                (labels != IGNORE_INDEX).sum(), batch_mesh
            )
            with train_context():
                if parallel_dims.pp_enabled:
                    # Trainer.pp_forward_backward_step: the schedule splits this rank's batch
                    # into its micro-batches (torch's step() takes the whole batch).
                    mb_losses: list[Tensor] = []
                    pp_schedule.step(
                        *([inputs] if first_stage else []),
                        target=labels if last_stage else None,
                        losses=mb_losses if last_stage else None,
                        loss_kwargs={"global_valid_tokens": global_valid_tokens},
                        return_outputs=False,
                    )
                    # Summed in float64: see [Note: the logged loss in float64].
                    loss = (
                        torch.stack(mb_losses).double().sum()
                        if last_stage
                        else torch.zeros((), dtype=torch.float64, device=device)
                    )
                else:
                    loss, _ = loss_fn(model_parts[0](inputs), labels, global_valid_tokens)
                    loss.backward()
            dist_utils.clip_grad_norm_(
                [p for part in model_parts for p in part.parameters()],
                config.training.max_norm,
                foreach=True,
                pp_mesh=pp_mesh,
            )
            optimizers.step()
            lr_schedulers.step()
            loss = loss.detach().double()
            if pp_mesh is not None:  # the last stage's loss, on every rank (others add 0)
                dist.all_reduce(loss, group=pp_mesh.get_group())
            losses[state.step] = dist_utils.dist_sum(loss, loss_mesh)
            checkpointer.save(state.step, last_step=state.step == config.training.steps)
    finally:
        checkpointer.close()
    return losses


def check(name: str, uninterrupted: dict[int, float], resumed: dict[int, float]) -> list[float]:
    """Raise ``SystemExit`` unless the loss fell and the resumed run's losses equal the
    uninterrupted run's bit for bit; return the uninterrupted losses (rank 0 only)."""
    first = [uninterrupted[s] for s in sorted(uninterrupted)]
    print(f"{name} losses", " ".join(f"{x:.4f}" for x in first), flush=True)
    if not all(math.isfinite(x) for x in first) or first[-1] >= first[0]:
        raise SystemExit(f"FAILED ({name}): the loss did not fall: {first}")
    want = {s: x for s, x in uninterrupted.items() if s > SAVE_AT}
    if resumed != want:
        raise SystemExit(
            f"FAILED ({name}): the resumed run's losses {resumed} differ from the uninterrupted"
            f" run's {want}"
        )
    print(
        f"OK ({name}): loss {first[0]:.4f} -> {first[-1]:.4f} in {len(first)} steps; resumed"
        f" from step {SAVE_AT}, losses {list(resumed.values())} as without the checkpoint",
        flush=True,
    )
    return first


def train_and_resume(
    directory: str | None, device_type: str = "cpu", pp: int = 1, schedule: str = "1F1B"
) -> None:
    """The checks of the module docstring, on this process group; with ``pp`` > 1 also in
    ``pp`` pipeline stages under ``schedule``.

    [Note: comparing the pipeline in fp32]
    Resumed in pipeline stages from the step-5 checkpoint of the run without one, the job
    trains on the same rows in the same micro-batches, so its losses can be held to that run's
    tightly (``ACROSS_RTOL``). In bf16 they cannot: both sum the same gradients in the fp32
    reduce dtype (dmuon's dedicated matrices as FSDP2's parameters), but in another order (over
    the micro-batches, then over the stage's ranks), and a last-bit difference of such a sum now
    and then flips a weight's bf16 rounding: with 2 data-parallel ranks per stage the runs
    drift apart by about 3e-4 within five steps (with one they stay equal bit for bit). So with
    ``pp`` every run of the job computes in fp32 (``training.mixed_precision_param``); without
    it, in torchtitan's bf16."""
    if directory is None:  # one temporary directory for all ranks, rank 0's
        made = [tempfile.mkdtemp(prefix="dmuon-torchtitan-") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(made, src=0)
        try:
            train_and_resume(str(made[0]), device_type, pp, schedule)
        finally:
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(str(made[0]))
        return
    device = torch.device(
        device_type, torch.cuda.current_device() if device_type == "cuda" else None
    )
    # With a pipeline, every run computes in fp32: see [Note: comparing the pipeline in fp32].
    dtype = "bfloat16" if pp == 1 else "float32"
    # One block per stage, at least the two of the run without a pipeline; every run of the
    # job builds the same model.
    layers = max(2, pp * stages_per_rank(schedule))
    job = partial(small_config, param_dtype=dtype, schedule=schedule, layers=layers)
    uninterrupted = run(job(directory, None), seed=0, device=device)
    # Resume: other initial weights, which the checkpoint must replace.
    resumed = run(job(directory, SAVE_AT), seed=1, device=device)
    if dist.get_rank() == 0:
        check("no pipeline", uninterrupted, resumed)
    if pp == 1:
        return
    # The pipeline: the same, in a folder of its own.
    staged = os.path.join(directory, "pp")
    pp_uninterrupted = run(job(staged, None, pp), seed=0, device=device)
    pp_resumed = run(job(staged, SAVE_AT, pp), seed=1, device=device)
    # The run without a pipeline's step-5 checkpoint, resumed in pipeline stages; and the
    # pipeline's, resumed without one.
    across = run(job(directory, SAVE_AT, pp), seed=1, device=device)
    back = run(job(staged, SAVE_AT), seed=1, device=device)
    if dist.get_rank() != 0:
        return
    check(f"pp={pp}", pp_uninterrupted, pp_resumed)
    # Step 6's loss is the same sum of the same rows' losses where a micro-batch is a rank's
    # batch of the run without a pipeline; under DualPipeV's half-size micro-batches it sums
    # them in another order, so that step too is held to ACROSS_RTOL.
    exact = microbatch_rows(schedule) == ROWS_PER_RANK
    where = f"{pp} pipeline stages ({schedule})"
    check_across(
        f"resumed in {where} from the checkpoint without a pipeline", across, uninterrupted, exact
    )
    check_across(
        f"resumed without a pipeline from the checkpoint in {where}", back, pp_uninterrupted, exact
    )


def check_across(what: str, got: dict[int, float], run: dict[int, float], exact: bool) -> None:
    """Raise ``SystemExit`` unless ``got``, a run resumed from the step-``SAVE_AT`` checkpoint
    of ``run`` on another layout, has the losses of ``run``'s later steps: the first equal
    bit for bit if ``exact``, every one within ``ACROSS_RTOL``."""
    want = {s: x for s, x in run.items() if s > SAVE_AT}
    if sorted(got) != sorted(want):
        raise SystemExit(f"FAILED: {what}, the steps {sorted(got)}")
    apart = {s: abs(got[s] - x) / abs(x) for s, x in want.items()}
    first = SAVE_AT + 1
    if (exact and got[first] != want[first]) or max(apart.values()) > ACROSS_RTOL:
        raise SystemExit(
            f"FAILED: {what} (step {SAVE_AT}), the losses {got} differ from that run's {want}"
            f" (relative: {apart}); step {first} must be"
            f" {'equal' if exact else f'within {ACROSS_RTOL:g}'}, the later ones within"
            f" {ACROSS_RTOL:g}"
        )
    print(
        f"OK: {what} (step {SAVE_AT}), losses {list(got.values())}: step {first}"
        f" {'equal' if exact else f'{apart[first]:.1e} apart'}, then relative differences"
        f" {' '.join(f'{apart[s]:.1e}' for s in sorted(apart) if s > first)}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", help="checkpoint directory (default: a temporary one)")
    parser.add_argument(
        "--world-size", type=int, default=2, help="ranks to spawn when not under torchrun"
    )
    parser.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="cuda: NCCL, under torchrun"
    )
    parser.add_argument(
        "--pp",
        type=int,
        default=1,
        help="also train in this many pipeline stages (1F1B) and resume there, and from the"
        " run without a pipeline (its degree must divide the world size)",
    )
    parser.add_argument(
        "--schedule",
        default="1F1B",
        help="torchtitan's parallelism.pipeline_parallel_schedule with --pp: 1F1B or GPipe (one"
        " stage per rank), Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble or"
        " DualPipeV (two stages per rank, one block each)",
    )
    args = parser.parse_args(argv)
    try:
        get_schedule_class(args.schedule)
    except ValueError as error:
        raise SystemExit(f"--schedule {args.schedule}: {error}") from None
    if args.pp < 1 or (args.pp > 1 and args.world_size % args.pp and "RANK" not in os.environ):
        raise SystemExit(f"--pp {args.pp} must be 1 or divide --world-size {args.world_size}")
    if args.device == "cuda" and "RANK" not in os.environ:
        raise SystemExit(
            "--device cuda runs under torchrun, one rank per GPU: torchrun --nproc-per-node N"
            f" {__file__} --device cuda"
        )
    launch(
        partial(train_and_resume, args.dir, args.device, args.pp, args.schedule), args.world_size
    )


if __name__ == "__main__":
    sys.exit(main())
