"""dmuon under the Hugging Face ``transformers.Trainer`` (transformers 5 with accelerate 1),
through the Trainer's public hooks.

    import dmuon
    from dmuon.integrations.hf import DmuonTrainer, DmuonTrainingArguments

    args = DmuonTrainingArguments(output_dir="out", max_steps=1000, save_steps=200,
                                  learning_rate=3e-4, max_grad_norm=1.0)
    mesh = init_device_mesh(args.device.type, (args.world_size,))  # args start the process group
    model = LlamaForCausalLM(config).to(args.device)
    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: ".layers." in n and p.ndim == 2)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    trainer = DmuonTrainer(model, args, train_dataset=rows, muon_kwargs={"lr": 0.02})
    trainer.train(resume_from_checkpoint=True)   # True: the last checkpoint-N of output_dir
    trainer.save_model("final")                  # full weights; from_pretrained reads them

Importing this module imports ``transformers`` (``pip install "./packages/dmuon[hf]"`` from a
checkout); ``import dmuon`` does not import it.

[Note: the Trainer's public hooks under dmuon]
A dmuon model differs from what the Trainer expects in six places. Each is met through a
public extension point; no underscored ``Trainer`` method is overridden.

- Placement. ``Trainer.__init__`` moves the model to ``args.device`` unless the arguments'
  ``place_model_on_device`` (a property that integrations override) says no. dmuon refuses a
  ``.to()`` that would convert a dedicated matrix, and on the CPU accelerate's device is
  ``cpu:0``, to which ``Tensor.to`` copies even a CPU tensor. :class:`DmuonTrainingArguments`
  says no: the model is built on its device before ``dedicate_params``.
- Preparation. ``accelerator.prepare(model, optimizer)`` wraps the model in
  ``DistributedDataParallel``, which refuses FSDP2's DTensor parameters and would all-reduce
  what dmuon reduces to owners. ``DmuonTrainer.__init__`` prepares the model once with
  accelerate's public ``prepare_model(model, device_placement=False, evaluation_mode=True)``,
  which adds what accelerate adds to a sharded model (the autocast of ``bf16``) and marks it
  prepared, so that the Trainer's ``prepare`` returns it as it is.
- Optimizer and gradients. ``create_optimizer`` builds ``dmuon.Muon`` (:func:`dmuon_optimizer`);
  every param group holds its ``"lr"``, so the Trainer's scheduler drives both routes. The
  Trainer zeroes with ``model.zero_grad()``, which ``dedicate_params`` makes clear the owners'
  Muon gradients too. ``training_step`` runs the micro-batches before the last of an
  accumulation under ``dmuon.no_sync``. The Trainer clips for ``max_grad_norm`` (and measures
  the logged ``grad_norm`` without it) with ``accelerator.clip_grad_norm_(model.parameters(),
  ...)``, which sees ``param.grad`` alone, where the dedicated weights' gradients are not (they
  live on their owners), and which dmuon makes refuse a dedicated parameter. The trainer's own
  accelerator gets, as its public ``clip_grad_norm_``, dmuon's clip of the same parameters
  (``dmuon.clip_grad_norm_(muon, max_norm, params=parameters)``): every gradient by one
  norm, as the Trainer clips a model without dmuon, and that norm is the one logged. Where the
  Trainer clips without its accelerator (its gradients on several device meshes, which it
  clips by their norm itself), ``training_step`` clips every gradient by one norm with the
  same function after the last micro-batch's backward, so that the Trainer's clip finds their
  norm within ``max_grad_norm`` and scales nothing, and ``log`` reports the norm before
  clipping. Clipping the Trainer's gradients and the dedicated weights' each by their own norm
  would scale each kind by its own coefficient and leave a norm of up to
  ``max_grad_norm * sqrt(2)``.
  Unclipped (``max_grad_norm`` 0 or ``inf``), the Trainer measures its gradients, a callback's
  ``on_pre_optimizer_step`` (before ``step()``) measures the dedicated weights', and ``log``
  reports the norm of both kinds together.
- Checkpoints. The Trainer writes a checkpoint with ``save_model(checkpoint, _internal_call=
  True)``, then rank 0's ``optimizer.state_dict()`` (``optimizer.pt``), the scheduler, the RNG
  states and the trainer state. ``save_model`` writes the model and the optimizer with
  ``dmuon.save_checkpoint`` into ``checkpoint-N/dmuon`` (every rank what it holds) and the full
  weights in Hugging Face's format (``model.safetensors``, one file). ``optimizer.pt`` holds
  rank 0's part of the optimizer only, and every rank would load it on resume
  (``Muon.load_state_dict`` refuses another rank's dictionary), so ``on_save`` deletes it.
  The full weights cost what the Trainer's checkpoints of an unsharded model cost: rank 0
  gathers them into its host memory, one tensor at a time, and writes them.
- Resume. ``train(resume_from_checkpoint=...)`` first loads the checkpoint's weights file with
  ``model.load_state_dict(weights, strict=False)``: it refuses a checkpoint without one, and
  FSDP2's DTensor parameters refuse plain tensors. The first ``DmuonTrainer`` built on a
  model registers a ``load_state_dict`` pre-hook on it (one per model, however many trainers
  follow, and holding none of them) that loads a full dictionary of plain tensors with
  ``dmuon.set_model_state_dict`` (each rank takes its part), which is why each checkpoint holds
  the full weights; during a resume the hook leaves that load out, since ``on_train_begin``
  loads the same weights from ``dmuon/`` (and a transformers 5 mixture-of-experts model's file
  names each expert apart, where the model holds them stacked). The Trainer restores its state, the data position and the RNG states as
  usual; it loads no optimizer (``optimizer.pt`` is gone). ``DmuonTrainer.train`` checks that
  the folder holds ``dmuon/`` and keeps its path, and ``on_train_begin`` (the optimizer and the
  scheduler exist by then) loads the model and the optimizer with ``dmuon.load_checkpoint``
  (all or nothing, checksums checked) and the scheduler from ``scheduler.pt``.
- Export. ``save_model(path)`` gathers the full weights to rank 0
  (``dmuon.get_model_state_dict(model, rank0_only=True)``) and hands them to the model's own
  ``save_pretrained(path, state_dict=...)`` there, which writes the config, the model's
  ``generation_config`` and the weights as for a model without dmuon (without ``state_dict``
  it reads every weight, and a rank does not hold them all). The gathered copies of tied
  weights share no storage, by which ``save_pretrained`` finds them: each tied name is given
  one tensor first, so the file holds it once, as for the model's own weights. The model's own
  ``save_pretrained`` is called, not a copy's built on the meta device, which would write a
  ``generation_config`` made from the config instead of the model's.
"""

from __future__ import annotations

import functools
import math
import os
import weakref
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import transformers
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINING_ARGS_NAME
from transformers.trainer_pt_utils import get_parameter_names
from transformers.trainer_utils import TrainOutput, get_last_checkpoint

import dmuon

__all__ = ["CHECKPOINT_DIR", "DmuonTrainer", "DmuonTrainingArguments", "dmuon_optimizer"]

CHECKPOINT_DIR = "dmuon"  # the dmuon.save_checkpoint folder inside each checkpoint-N
# One weights file per checkpoint (see [Note: the Trainer's public hooks under dmuon], resume):
# the Trainer resumes a sharded one through model.state_dict(), which a dedicated matrix refuses.
_ONE_FILE = "100TB"


@dataclass
class DmuonTrainingArguments(TrainingArguments):
    """``TrainingArguments`` for :class:`DmuonTrainer`: the same fields, and two differences.

    The Trainer leaves the model where it is (``place_model_on_device`` is ``False``): build it
    on ``args.device`` before ``dmuon.dedicate_params``. Settings that would go around dmuon are
    refused when the arguments are built, with a ``ValueError`` naming them: ``fsdp`` and
    ``deepspeed`` (the model comes sharded by dmuon and FSDP2), ``fp16`` (its ``GradScaler``
    unscales ``param.grad`` only; use ``bf16``), ``fp16_full_eval`` / ``bf16_full_eval`` (they
    cast the model with ``.to()``), ``torch_compile`` (compile the decoder layers yourself),
    ``load_best_model_at_end`` and ``push_to_hub``.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        refused = {
            "fsdp / fsdp_config (the model comes sharded by dmuon and FSDP2)": bool(self.fsdp),
            "deepspeed (the model comes sharded by dmuon and FSDP2)": bool(self.deepspeed),
            "fp16 (its GradScaler does not see the Muon gradients; use bf16)": self.fp16,
            "fp16_full_eval / bf16_full_eval (they cast the model with .to())": (
                self.fp16_full_eval or self.bf16_full_eval
            ),
            "torch_compile (compile the decoder layers yourself, see the compile guide)": (
                self.torch_compile
            ),
            "load_best_model_at_end (not supported; every checkpoint-N loads with from_pretrained)": (
                self.load_best_model_at_end
            ),
            "push_to_hub (upload the folder trainer.save_model(path) writes)": self.push_to_hub,
        }
        given = [name for name, on in refused.items() if on]
        if given:
            raise ValueError(f"DmuonTrainingArguments: unset {'; '.join(given)}")

    @property
    def place_model_on_device(self) -> bool:
        """``False``: the model comes placed (see [Note: the Trainer's public hooks under
        dmuon], placement)."""
        return False


def dmuon_optimizer(
    model: nn.Module,
    args: TrainingArguments,
    decay_parameter_names: Collection[str] | None = None,
    **muon_kwargs: Any,
) -> dmuon.Muon:
    """``dmuon.Muon(model, **muon_kwargs)`` with the Trainer's hyperparameters: the AdamW part
    (the parameters FSDP2 shards) takes ``learning_rate``, ``adam_beta1``/``adam_beta2`` and
    ``adam_epsilon`` from ``args`` unless ``muon_kwargs`` sets ``adamw_lr``, ``adamw_betas`` or
    ``adamw_eps``; Muon's own ``lr``, ``momentum`` and the rest come from ``muon_kwargs`` or
    ``dmuon.Muon``'s defaults. ``args.optim`` is not read.

    ``args.weight_decay`` is the Trainer's: it decays the parameters named in
    ``decay_parameter_names`` (``None``: the Trainer's rule, every parameter but biases and
    norms, as ``Trainer.get_decay_parameter_names``), on both routes, Muon's matrices included,
    and no other parameter; ``muon_kwargs``' ``weight_decay`` (Muon's) or ``adamw_weight_decay``
    overrides it on its route. ``muon_kwargs``' ``param_groups`` replace these two groups, and
    ``args.weight_decay`` is then the decay of every group that sets none of its own
    (``weight_decay``, ``muon_weight_decay``, ``adamw_weight_decay``), on both routes, as the
    ``weight_decay`` keyword of a torch optimizer is: give the norms and biases a group with
    ``"weight_decay": 0.0``.
    :class:`DmuonTrainer` calls it with its ``get_decay_parameter_names(model)`` and its
    ``muon_kwargs``; ``DmuonTrainer(..., optimizers=(dmuon_optimizer(model, args, ...), None))``
    passes one built beforehand.

    Args:
        model: the model after ``dmuon.dedicate_params`` and ``fully_shard``.
        args: the Trainer's arguments.
        decay_parameter_names: the names (``model.named_parameters()``) that take
            ``args.weight_decay``; ``None``: the Trainer's rule.
        muon_kwargs: ``dmuon.Muon``'s keywords.
    """
    kwargs: dict[str, Any] = {
        "adamw_lr": args.learning_rate,
        "adamw_betas": (args.adam_beta1, args.adam_beta2),
        "adamw_eps": args.adam_epsilon,
        # Every group's decay unless it sets its own: the "decay" group below, or each of the
        # user's param_groups (dmuon.Muon's defaults, 0 and 0.01, would drop the Trainer's).
        "weight_decay": args.weight_decay,
        "adamw_weight_decay": args.weight_decay,
        **muon_kwargs,
    }
    if "param_groups" not in muon_kwargs:
        kwargs["param_groups"] = _decay_groups(model, decay_parameter_names)
    return dmuon.Muon(model, **kwargs)


# transformers.Trainer.get_decay_parameter_names' rule: no decay for a LayerNorm's parameters
# or a name matching one of these (test_integrations_hf checks the two agree).
_NO_DECAY_PATTERNS = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


def _decay_groups(model: nn.Module, decay_names: Collection[str] | None) -> list[dict[str, Any]]:
    """The semantic groups ``decay`` (the optimizer's weight decays) and ``no_decay`` (none)
    of the trainable parameters, left out when empty, as the Trainer groups them for its own
    optimizers."""
    if decay_names is None:
        decay_names = get_parameter_names(model, [nn.LayerNorm], _NO_DECAY_PATTERNS)
    decay_names = set(decay_names)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = {"group_name": "decay", "params": [(n, p) for n, p in trainable if n in decay_names]}
    no_decay = {
        "group_name": "no_decay",
        "params": [(n, p) for n, p in trainable if n not in decay_names],
        "weight_decay": 0.0,
    }
    return [group for group in (decay, no_decay) if group["params"]]


class DmuonTrainer(Trainer):
    """``transformers.Trainer`` for a model that dmuon already runs.

    ``model`` is the model after ``dmuon.dedicate_params`` and ``fully_shard``, built on
    ``args.device``; ``args`` are :class:`DmuonTrainingArguments`; ``muon_kwargs`` go to
    :func:`dmuon_optimizer` unless ``optimizers=(optimizer, scheduler)`` passes a ``dmuon.Muon``.
    Every other keyword is the Trainer's (``train_dataset``, ``eval_dataset``,
    ``data_collator``, ``processing_class``, ``callbacks``, ``compute_metrics``, ...), except
    ``model_init`` and ``optimizer_cls_and_kwargs``, which are refused.

    ``max_grad_norm`` clips every gradient (the FSDP2 ones and the dedicated weights', on
    their owners) by one norm, the logged ``grad_norm``;
    ``gradient_accumulation_steps`` runs the micro-batches before the last under
    ``dmuon.no_sync``. A checkpoint (``save_strategy``) holds ``dmuon/`` (``dmuon.save_checkpoint``:
    the model and the optimizer, sharded), the full weights (``model.safetensors``, which
    ``from_pretrained`` reads) and the Trainer's scheduler, RNG and state files;
    ``train(resume_from_checkpoint=...)`` resumes from it bit for bit. ``save_model(path)``
    writes the full weights in Hugging Face's format. See [Note: the Trainer's public hooks
    under dmuon] for how each reaches the Trainer.
    """

    def __init__(
        self,
        model: nn.Module,
        args: DmuonTrainingArguments,
        *,
        muon_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(args, DmuonTrainingArguments):
            raise TypeError(
                f"DmuonTrainer: args must be DmuonTrainingArguments, got"
                f" {type(args).__name__}; build them with"
                " dmuon.integrations.hf.DmuonTrainingArguments(...), which takes every"
                " TrainingArguments field"
            )
        for name in ("model_init", "optimizer_cls_and_kwargs"):
            if kwargs.get(name) is not None:
                raise ValueError(
                    f"DmuonTrainer: {name} is not supported; pass the model after"
                    " dmuon.dedicate_params and fully_shard, and set the optimizer with"
                    " muon_kwargs= or optimizers=(dmuon_optimizer(model, args, ...), None)"
                )
        if not isinstance(model, FSDPModule) or not dmuon.dedicated_params_of(model):
            raise ValueError(
                f"DmuonTrainer: model must be dedicated and sharded, got"
                f" {type(model).__name__}: apply dmuon.dedicate_params(model, mesh, predicate)"
                " and fully_shard(...) to each decoder layer and the root first"
            )
        self.muon_kwargs = dict(muon_kwargs or {})
        self.held_grad_norm: Tensor | None = None  # the dedicated weights', before clipping
        self.clipped_every_gradient = False  # this step, through the accelerator's clip
        # This step's norm where training_step clipped every gradient before the Trainer.
        self.pre_clipped_grad_norm: Tensor | None = None
        self.resuming_from: str | None = None  # the checkpoint train() resumes from
        self.saving_to: str | None = None  # the checkpoint being written
        super().__init__(model=model, args=args, **kwargs)
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:
            raise ValueError(
                "DmuonTrainer: accelerate is configured for FSDP or DeepSpeed (accelerate"
                " config or ACCELERATE_USE_* variables); launch without them: the model comes"
                " sharded by dmuon and FSDP2"
            )
        # See [Note: the Trainer's public hooks under dmuon], preparation and resume.
        self.accelerator.prepare_model(self.model, device_placement=False, evaluation_mode=True)
        # An attribute of this trainer's accelerator only: accelerate's own refuses a dedicated
        # parameter (see [Note: the Trainer's public hooks under dmuon], optimizer and gradients).
        cast(Any, self.accelerator).clip_grad_norm_ = functools.partial(_clip_every_gradient, self)
        _FullStateLoad.of(_model(self))
        self.add_callback(_DmuonEvents(self))

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        trainer = cast(Any, self)  # the Trainer's attribute, typed or not
        if trainer.optimizer is None:
            target = _model(self) if model is None else model
            # An evaluation before train() (trainer.evaluate()) leaves the root module's
            # parameters unsharded, as FSDP2 does after a forward; Muon takes the sharded ones.
            for module in target.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
            decay = self.get_decay_parameter_names(target)
            trainer.optimizer = dmuon_optimizer(target, self.args, decay, **self.muon_kwargs)
        return cast(torch.optim.Optimizer, trainer.optimizer)

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> Tensor:
        if not self.accelerator.sync_gradients:
            with dmuon.no_sync(_model(self)):  # a micro-batch before the last of an accumulation
                return super().training_step(model, inputs, num_items_in_batch)
        loss = super().training_step(model, inputs, num_items_in_batch)
        max_norm = self.args.max_grad_norm
        self.pre_clipped_grad_norm = None
        if 0 < max_norm < math.inf and _on_several_meshes(_model(self)):
            # See [Note: the Trainer's public hooks under dmuon], optimizer and gradients.
            params = _model(self).parameters()
            self.pre_clipped_grad_norm = _clip_every_gradient(self, params, max_norm)
        return loss

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> TrainOutput:
        """The Trainer's ``train``; ``resume_from_checkpoint`` (a ``checkpoint-N`` folder, or
        ``True`` for the last one in ``output_dir``) must hold a dmuon checkpoint."""
        checkpoint = _checkpoint_to_resume(resume_from_checkpoint, str(self.args.output_dir))
        loader = _FullStateLoad.of(_model(self))
        self.resuming_from = checkpoint
        loader.resuming = checkpoint is not None
        try:
            return super().train(
                resume_from_checkpoint=checkpoint,
                trial=trial,
                ignore_keys_for_eval=ignore_keys_for_eval,
            )
        finally:
            self.resuming_from = None
            loader.resuming = False

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the full weights in Hugging Face's format (``from_pretrained`` reads them);
        collective: call it on every rank, not under ``is_world_process_zero()`` (rank 0 would
        wait for the others' weights). Within a checkpoint, also the model and the optimizer with
        ``dmuon.save_checkpoint`` (unless ``save_only_model``)."""
        output_dir = str(self.args.output_dir if output_dir is None else output_dir)
        model = _model(self)
        pretrained = _pretrained_model(model)  # on every rank, before anything is written
        if _internal_call and not self.args.save_only_model:
            self.saving_to = output_dir
            dmuon.save_checkpoint(os.path.join(output_dir, CHECKPOINT_DIR), model, self.muon)
        state = dmuon.get_model_state_dict(model, rank0_only=True)  # {} off rank 0
        if not self.args.should_save:
            return
        # See [Note: the Trainer's public hooks under dmuon], export.
        save_pretrained = pretrained.save_pretrained
        state = _tied_as_one(model, state)
        if _internal_call:
            save_pretrained(output_dir, state_dict=state, max_shard_size=_ONE_FILE)
        else:
            save_pretrained(output_dir, state_dict=state)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "grad_norm" in logs and self.pre_clipped_grad_norm is not None:
            logs["grad_norm"] = self.pre_clipped_grad_norm.item()  # the Trainer's saw them clipped
        elif "grad_norm" in logs and self.held_grad_norm is not None:
            # See [Note: the Trainer's public hooks under dmuon], optimizer and gradients.
            logs["grad_norm"] = math.hypot(logs["grad_norm"], self.held_grad_norm.item())
        super().log(logs, start_time)

    @property
    def muon(self) -> dmuon.Muon:
        """The ``dmuon.Muon`` this trainer steps (under accelerate's ``AcceleratedOptimizer``)."""
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        if not isinstance(optimizer, dmuon.Muon):
            raise TypeError(
                f"DmuonTrainer steps a dmuon.Muon, got {type(optimizer).__name__}: leave"
                " optimizers= unset (the trainer builds it from muon_kwargs) or pass"
                " optimizers=(dmuon_optimizer(model, args, ...), None)"
            )
        return optimizer


class _DmuonEvents(TrainerCallback):
    """The trainer's per-step and checkpoint events (see [Note: the Trainer's public hooks
    under dmuon])."""

    def __init__(self, trainer: DmuonTrainer) -> None:
        self.trainer = trainer
        self.held: set[nn.Parameter] | None = None  # the dedicated weights, found once

    def on_train_begin(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any):
        trainer = self.trainer
        if trainer.resuming_from is None:
            return
        folder = trainer.resuming_from
        # Read before the model changes: a failed read leaves the model and optimizer as they were.
        schedule = torch.load(os.path.join(folder, SCHEDULER_NAME), weights_only=True)
        dmuon.load_checkpoint(os.path.join(folder, CHECKPOINT_DIR), _model(trainer), trainer.muon)
        cast(Any, trainer.lr_scheduler).load_state_dict(schedule)

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any
    ):
        trainer = self.trainer
        if trainer.clipped_every_gradient:  # the accelerator's clip took them all
            trainer.clipped_every_gradient = False
            trainer.held_grad_norm = None
            return
        # The Trainer clips for max_grad_norm > 0 (inf scales nothing, in dmuon's clip too);
        # otherwise it only measures, as dmuon's clip does with None.
        max_norm = args.max_grad_norm if args.max_grad_norm > 0 else None
        # The Trainer clipped every param.grad by their norm without its accelerator (on
        # several device meshes); the dedicated weights' gradients are not there.
        if self.held is None:
            self.held = dmuon.dedicated_params_of(_model(self.trainer))
        stats = dmuon.clip_grad_norm_(self.trainer.muon, max_norm, params=self.held)
        self.trainer.held_grad_norm = stats.total_norm

    def on_save(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any):
        folder, self.trainer.saving_to = self.trainer.saving_to, None
        if folder is not None and args.should_save:
            optimizer_file = os.path.join(folder, OPTIMIZER_NAME)
            if os.path.isfile(optimizer_file):
                os.remove(optimizer_file)


def _on_several_meshes(model: nn.Module) -> bool:
    """Whether ``model``'s ``param.grad`` lie on several device meshes (plain tensors as one
    more), where the Trainer clips them by their norm itself rather than through its
    accelerator."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return len({g.device_mesh if isinstance(g, DTensor) else None for g in grads}) > 1


def _clip_every_gradient(
    trainer: DmuonTrainer, parameters: Any, max_norm: float, norm_type: float = 2.0
) -> Tensor:
    """``trainer.accelerator.clip_grad_norm_``: every gradient of ``parameters``, wherever it
    lives, by one norm (``inf``: measured only), with ``dmuon.clip_grad_norm_``; returns that
    norm, before clipping, as accelerate's does."""
    trainer.accelerator.unscale_gradients()  # as accelerate's clip does (no-op without fp16)
    stats = dmuon.clip_grad_norm_(trainer.muon, max_norm, norm_type, params=parameters)
    trainer.clipped_every_gradient = True
    return stats.total_norm


class _FullStateLoad:
    """``model.load_state_dict`` of a full dictionary of plain tensors through
    ``dmuon.set_model_state_dict`` (see [Note: the Trainer's public hooks under dmuon],
    resume): a pre-hook on the root loads it and empties torch's copy of the dictionary, and
    the post-hook drops the keys it loaded from ``missing_keys``. A dictionary of DTensors (a
    sharded state dict) goes to torch's own load unchanged. While ``train`` resumes
    (``resuming``), the Trainer's load of the checkpoint's weights file is left out:
    ``on_train_begin`` loads the same weights from its ``dmuon/`` folder, and the file holds
    what ``save_pretrained`` wrote, which for a transformers 5 mixture-of-experts model names
    each expert apart where the model holds them stacked.

    One per model (:meth:`of`), whatever the number of trainers built on it, and holding none
    of them: hooks of each trainer's own would pile up on the model, the first one would load
    the file that a later trainer's resume leaves out, and they would keep every trainer, with
    its optimizer's states, alive as long as the model."""

    def __init__(self) -> None:
        self.loaded: set[str] = set()
        self.deferred = False
        self.resuming = False  # set by DmuonTrainer.train while it resumes

    @classmethod
    def of(cls, model: nn.Module) -> _FullStateLoad:
        """``model``'s loader, its two hooks registered on the first call."""
        loader = _LOADERS.get(model)
        if loader is None:
            loader = _LOADERS[model] = cls()
            model.register_load_state_dict_pre_hook(loader.before)
            model.register_load_state_dict_post_hook(loader.after)
        return loader

    def before(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
        if prefix or not state_dict or any(isinstance(v, DTensor) for v in state_dict.values()):
            return
        if self.resuming:
            self.deferred = True
            state_dict.clear()
            return
        full = dict(state_dict)
        # save_pretrained writes one name of tied weights (lm_head.weight tied to the
        # embedding): give every name of a tensor the value saved under another of its names.
        for group in _names_of_each_tensor(module):
            given = [name for name in group if name in full]
            for name in group:
                if given and name not in full:
                    full[name] = full[given[0]]
        dmuon.set_model_state_dict(module, full)
        self.loaded = set(full)
        state_dict.clear()

    def after(self, module: nn.Module, incompatible: Any) -> None:
        if self.deferred:  # every weight comes from the dmuon checkpoint in on_train_begin
            self.deferred = False
            incompatible.missing_keys.clear()
            return
        missing = [key for key in incompatible.missing_keys if key not in self.loaded]
        incompatible.missing_keys[:] = missing
        self.loaded = set()


# Each model's loader, without keeping the model alive (the model's hooks hold the loader).
_LOADERS: weakref.WeakKeyDictionary[nn.Module, _FullStateLoad] = weakref.WeakKeyDictionary()


def _checkpoint_to_resume(resume: str | bool | None, output_dir: str) -> str | None:
    """The ``checkpoint-N`` folder ``train(resume_from_checkpoint=resume)`` resumes from."""
    if resume is None or resume is False:
        return None
    if resume is True:
        last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if last is None:
            raise ValueError(
                f"resume_from_checkpoint=True: no checkpoint-N folder in {output_dir}; pass"
                " the folder to resume from, or False to start afresh"
            )
        resume = last
    if not isinstance(resume, str | os.PathLike):
        raise TypeError(
            f"resume_from_checkpoint must be a checkpoint-N folder, True or False, got {resume!r}"
        )
    folder = os.fspath(resume)
    if not os.path.isfile(os.path.join(folder, CHECKPOINT_DIR, ".metadata")):
        raise ValueError(
            f"resume_from_checkpoint={folder!r} holds no dmuon checkpoint ({CHECKPOINT_DIR}/"
            " is missing or empty): resume from a checkpoint-N folder that DmuonTrainer wrote"
            " without save_only_model=True"
        )
    if not os.path.isfile(os.path.join(folder, SCHEDULER_NAME)):
        raise ValueError(
            f"resume_from_checkpoint={folder!r} holds no scheduler.pt (the learning-rate"
            " schedule the Trainer saves with each checkpoint): resume from a complete"
            " checkpoint-N folder; nothing was loaded"
        )
    return folder


def _model(trainer: Trainer) -> nn.Module:
    """The model the trainer runs (``DmuonTrainer`` takes no ``model_init``: never ``None``)."""
    return cast(nn.Module, trainer.model)


def _tied_as_one(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every name of a tensor the model shares (``lm_head.weight`` tied to the
    embedding) holding one tensor, the first name's: ``save_pretrained`` tells tied weights by
    their storage, and writes the gathered copies, which share none, under every name."""
    state = dict(state)
    for group in _names_of_each_tensor(model):
        given = [name for name in group if name in state]
        for name in given[1:]:
            state[name] = state[given[0]]
    return state


def _names_of_each_tensor(model: nn.Module) -> list[list[str]]:
    """Every name of each parameter and buffer of ``model``, one list per tensor (several for
    a tied one, such as ``lm_head.weight`` and ``model.embed_tokens.weight``)."""
    names: dict[int, list[str]] = {}
    for name, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        names.setdefault(id(tensor), []).append(name)
    return list(names.values())


def _pretrained_model(model: nn.Module) -> PreTrainedModel:
    """``model``, which ``save_model`` writes with its ``save_pretrained``."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"DmuonTrainer.save_model writes a transformers PreTrainedModel; {type(model).__name__}"
            f" is not one (transformers {transformers.__version__})"
        )
    return model
