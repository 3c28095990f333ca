"""Train, checkpoint and resume dmuon under the Hugging Face ``transformers.Trainer``.

    python docs/examples/integrations/hf_trainer_train.py                # 2 CPU ranks (gloo)
    python docs/examples/integrations/hf_trainer_train.py --device cuda --nproc 8
    torchrun --nproc-per-node 2 docs/examples/integrations/hf_trainer_train.py --dir /shared/ckpt

Started plainly, the script runs itself again under ``torchrun`` on ``--nproc`` ranks of this
machine, as ``torchrun`` or ``accelerate launch`` would start a Trainer script. Each rank builds a
tiny ``LlamaForCausalLM``, applies dmuon itself (``dmuon.dedicate_params`` on a 1-D mesh over
every rank, then ``fully_shard`` on each decoder layer and the root with ``ignored_params``) and
hands the sharded model to :class:`DmuonTrainer`, which keeps accelerate from wrapping it,
builds ``dmuon.Muon``, clips with dmuon and checkpoints through ``dmuon.save_checkpoint`` /
``dmuon.load_checkpoint``.

The script trains 10 steps with a checkpoint after step 5, then builds the model again from other
initial weights and resumes from that checkpoint with
``trainer.train(resume_from_checkpoint=...)``, and exports the result with
``trainer.save_model``. It exits non-zero unless the loss fell, the resumed steps' losses and the
evaluation loss after them equal the uninterrupted run's bit for bit, and ``from_pretrained``
reads back the trained weights.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

import torch
import transformers
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Trainer,
    TrainingArguments,
)
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME

import dmuon

VOCAB, SEQ, ROWS_PER_RANK, STEPS, SAVE_AT = 64, 16, 4, 10, 5
DMUON_DIR = "dmuon"  # the DCP checkpoint inside each checkpoint-N folder


class DmuonTrainer(Trainer):
    """``transformers.Trainer`` for a model that dmuon already runs.

    ``model`` is the model after ``dmuon.dedicate_params`` and ``fully_shard``; ``muon_kwargs``
    go to ``dmuon.Muon`` (its AdamW part defaults to the ``TrainingArguments``'
    ``learning_rate``, ``weight_decay``, ``adam_beta1``/``adam_beta2`` and ``adam_epsilon``).

    [Note: the Trainer's hooks under dmuon]
    The Trainer reaches the model and the optimizer in six places where a dmuon model needs
    another call; each override below replaces exactly one of them:

    - placement: the Trainer moves the model to ``args.device`` (``model.to``), which dmuon
      refuses once the dedicated matrices live in its packed buffers unless the call changes
      nothing; on the CPU accelerate's device is ``cpu:0``, to which ``Tensor.to`` copies even a
      CPU tensor. The model is built on its device before ``dedicate_params``, so
      ``_move_model_to_device`` does nothing.
    - preparation: ``accelerator.prepare(model, optimizer)`` wraps the model in
      ``DistributedDataParallel`` (accelerate's ``MULTI_GPU`` and ``MULTI_CPU``), which refuses
      FSDP2's DTensor parameters and would all-reduce what dmuon reduces to owners. Preparing
      the model in ``__init__`` with ``accelerator.prepare_model(..., evaluation_mode=True)``
      applies what accelerate adds to a sharded model (mixed-precision autocast) and marks it
      prepared, so the Trainer's later ``prepare`` leaves it as it is; this is what the Trainer
      itself does for a model sharded when it was loaded. The optimizer is still prepared
      (``AcceleratedOptimizer``).
    - optimizer: ``create_optimizer`` builds ``dmuon.Muon(model, ...)``; its param groups all
      hold ``"lr"``, so the Trainer's scheduler (``get_scheduler``) drives both routes.
    - gradients: the Trainer zeroes with ``model.zero_grad()``, which dmuon makes clear the
      owners' Muon gradients too (``dedicate_params`` wraps the model's ``zero_grad``);
      micro-batches before the last of an accumulation run under ``dmuon.no_sync``; the
      clip (``_clip_grad_norm``, ``_get_grad_norm``) uses ``dmuon.clip_grad_norm_`` for the
      Muon gradients, which are not in ``param.grad``.
    - checkpoints: ``_save_optimizer_and_scheduler`` writes the model and the optimizer with
      ``dmuon.save_checkpoint`` (sharded DCP; the Trainer's own ``get_model_state_dict`` and
      ``model.state_dict()`` raise ``dmuon.NotHeldError`` on a dedicated matrix), and
      ``_load_optimizer_and_scheduler`` reads them back once the optimizer exists;
      ``_load_from_checkpoint``, which the Trainer calls before the optimizer exists, only
      checks that the folder holds a dmuon checkpoint.
    - export: ``save_model`` gathers the full weights (``dmuon.get_model_state_dict``) and
      writes them with ``save_pretrained``.

    The underscored methods are transformers' own (checked to exist, against the tested
    version, when the trainer is built), so that ``resume_from_checkpoint`` and
    ``max_grad_norm`` keep their meaning.
    """

    _TRAINER_METHODS = (
        "_move_model_to_device",
        "_clip_grad_norm",
        "_get_grad_norm",
        "_save_optimizer_and_scheduler",
        "_load_from_checkpoint",
        "_load_optimizer_and_scheduler",
    )

    def __init__(
        self,
        model: nn.Module,
        args: TrainingArguments,
        *,
        muon_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        missing = [name for name in self._TRAINER_METHODS if not hasattr(Trainer, name)]
        if missing:
            raise TypeError(
                f"DmuonTrainer overrides Trainer methods that transformers"
                f" {transformers.__version__} does not have: {missing}; it is written for"
                " transformers 5.24"
            )
        if not isinstance(model, FSDPModule) or not dmuon.dedicated_params_of(model):
            raise ValueError(
                f"DmuonTrainer takes the model after dmuon.dedicate_params and fully_shard;"
                f" {type(model).__name__} is not both dedicated and sharded: apply"
                " dmuon.dedicate_params(model, mesh, predicate) and fully_shard(...,"
                " ignored_params=dmuon.dedicated_params_of(model)) first"
            )
        super().__init__(model=model, args=args, **kwargs)
        _check_training_arguments(self)
        self.muon_kwargs = dict(muon_kwargs or {})
        # See [Note: the Trainer's hooks under dmuon], preparation.
        self.accelerator.prepare_model(self.model, device_placement=False, evaluation_mode=True)

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """Nothing to move: dmuon placed the model (see [Note: the Trainer's hooks under
        dmuon], placement)."""

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            kwargs = {
                "adamw_lr": self.args.learning_rate,
                "adamw_weight_decay": self.args.weight_decay,
                "adamw_betas": (self.args.adam_beta1, self.args.adam_beta2),
                "adamw_eps": self.args.adam_epsilon,
                **self.muon_kwargs,
            }
            self.optimizer = dmuon.Muon(self.model if model is None else model, **kwargs)
        return self.optimizer

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> Tensor:
        if self.accelerator.sync_gradients:
            return super().training_step(model, inputs, num_items_in_batch)
        with dmuon.no_sync(self.model):  # a micro-batch before the last of an accumulation
            return super().training_step(model, inputs, num_items_in_batch)

    def _clip_grad_norm(self, model: nn.Module) -> Tensor:
        return self._grad_norm(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Tensor | None = None) -> Tensor:
        return self._grad_norm(None) if grad_norm is None else grad_norm

    def _grad_norm(self, max_norm: float | None) -> Tensor:
        """The 2-norm of every gradient, FSDP2's and dmuon's Muon gradients together, before
        clipping. With ``max_norm`` each kind is clipped by its own norm, as the clipping guide
        does: ``torch.nn.utils`` on the FSDP2 parameters, ``dmuon.clip_grad_norm_`` on the
        Muon matrices on their owners."""
        dedicated = {id(p) for p in dmuon.dedicated_params_of(self.model)}
        fsdp = [p for p in self.model.parameters() if id(p) not in dedicated and p.grad is not None]
        fsdp_norm = torch.nn.utils.get_total_norm([p.grad for p in fsdp])
        if max_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(fsdp, max_norm, fsdp_norm)
        if isinstance(fsdp_norm, DTensor):
            fsdp_norm = fsdp_norm.full_tensor()
        muon_norm = dmuon.clip_grad_norm_(self._muon(), max_norm).total_norm
        return torch.linalg.vector_norm(torch.stack([fsdp_norm, muon_norm.to(fsdp_norm)]))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        dmuon.save_checkpoint(os.path.join(output_dir, DMUON_DIR), self.model, self._muon())
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not os.path.isfile(os.path.join(resume_from_checkpoint, DMUON_DIR, ".metadata")):
            raise ValueError(
                f"{resume_from_checkpoint} holds no dmuon checkpoint ({DMUON_DIR}/ is missing"
                " or empty): resume from a checkpoint-N folder that DmuonTrainer wrote without"
                " save_only_model=True"
            )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        dmuon.load_checkpoint(os.path.join(checkpoint, DMUON_DIR), self.model, self._muon())
        scheduler = torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True)
        self.lr_scheduler.load_state_dict(scheduler)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the full weights in Hugging Face's format (``from_pretrained`` reads them).
        A checkpoint's weights go into its DCP folder instead, unless ``save_only_model``."""
        if _internal_call and not self.args.save_only_model:
            return
        output_dir = self.args.output_dir if output_dir is None else output_dir
        state = dmuon.get_model_state_dict(self.model, rank0_only=True)  # {} off rank 0
        if not self.args.should_save:
            return
        config = self.model.config
        with torch.device("meta"):  # no second copy of the weights: they come from `state`
            export = _unsharded_class(self.model)(config)
        export.load_state_dict(state, assign=True)
        if config.tie_word_embeddings:
            export.tie_weights()
        export.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _muon(self) -> dmuon.Muon:
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper
        if not isinstance(optimizer, dmuon.Muon):
            raise TypeError(
                f"DmuonTrainer steps one dmuon.Muon, got {type(optimizer).__name__}: leave"
                " optimizers= unset (create_optimizer builds it from muon_kwargs) or pass"
                " optimizers=(dmuon.Muon(model, ...), None)"
            )
        return optimizer


def _unsharded_class(model: nn.Module) -> type[PreTrainedModel]:
    """The model's own class: ``fully_shard`` swaps it for an ``FSDP<Name>`` subclass."""
    return next(
        c
        for c in type(model).__mro__
        if issubclass(c, PreTrainedModel) and not issubclass(c, FSDPModule)
    )


def _check_training_arguments(trainer: Trainer) -> None:
    """Refuse what would bypass dmuon (see [Note: the Trainer's hooks under dmuon])."""
    args = trainer.args
    refused = {
        "fsdp / fsdp_config": trainer.is_fsdp_enabled,
        "deepspeed": trainer.is_deepspeed_enabled,
        "fp16 (its GradScaler does not see the Muon gradients; use bf16)": args.fp16,
        "fp16_full_eval / bf16_full_eval (they cast the model)": (
            args.fp16_full_eval or args.bf16_full_eval
        ),
        "torch_compile (compile the decoder layers yourself, see the compile guide)": (
            args.torch_compile
        ),
        "load_best_model_at_end (checkpoints hold no safetensors to load)": (
            args.load_best_model_at_end
        ),
        "push_to_hub (upload the folder trainer.save_model(path) writes)": args.push_to_hub,
    }
    given = [name for name, on in refused.items() if on]
    if given:
        raise ValueError(
            f"DmuonTrainer: unset {', '.join(given)} in TrainingArguments; the model comes"
            " sharded by dmuon and FSDP2 and is checkpointed by dmuon"
        )


def build_model(seed: int, device: torch.device, mesh: DeviceMesh) -> LlamaForCausalLM:
    """A tiny Llama, dedicated and sharded for dmuon, in the order dmuon requires."""
    torch.manual_seed(seed)  # the same initial weights on every rank
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ + 1,
    )
    model = LlamaForCausalLM(config).to(device)
    # The decoder layers' matrices (attention and MLP projections) go to Muon; embeddings,
    # norms and the head stay with FSDP2 and AdamW.
    dmuon.dedicate_params(model, mesh, predicate=lambda name, p: ".layers." in name and p.ndim == 2)
    dedicated = dmuon.dedicated_params_of(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=dedicated)
    fully_shard(model, mesh=mesh, ignored_params=dedicated)
    return model


def dataset() -> list[dict[str, Tensor]]:
    """Rows of a learnable sequence task, ``t[i+1] = (5 t[i] + 3) mod VOCAB`` (the
    quickstart's), enough for every step on every rank."""
    rows = []
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS * ROWS_PER_RANK * int(os.environ["WORLD_SIZE"])):
        tokens = [int(torch.randint(0, VOCAB, (), generator=g))]
        for _ in range(SEQ):
            tokens.append((5 * tokens[-1] + 3) % VOCAB)
        row = torch.tensor(tokens)
        rows.append({"input_ids": row, "labels": row})
    return rows


def training_arguments(output_dir: str, device: str) -> TrainingArguments:
    return TrainingArguments(
        output_dir=output_dir,
        use_cpu=device == "cpu",
        per_device_train_batch_size=ROWS_PER_RANK,
        max_steps=STEPS,
        learning_rate=3e-3,  # AdamW's, for the parameters FSDP2 shards
        lr_scheduler_type="cosine",
        warmup_steps=2,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="steps",
        save_steps=SAVE_AT,
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )


def train(
    output_dir: str, device: str, seed: int, resume: str | None = None
) -> tuple[DmuonTrainer, dict[int, float], float]:
    """One Trainer run: the trainer, the logged loss (the mean over ranks) of every step this
    run trained, and the evaluation loss after it."""
    args = training_arguments(output_dir, device)
    mesh = init_device_mesh(args.device.type, (args.world_size,))
    rows = dataset()
    trainer = DmuonTrainer(
        build_model(seed, args.device, mesh),
        args,
        train_dataset=rows,
        eval_dataset=rows[: 2 * ROWS_PER_RANK * args.world_size],
        muon_kwargs={"lr": 0.02},
    )
    trainer.train(resume_from_checkpoint=resume)
    start = 0 if resume is None else SAVE_AT  # a resumed log history holds the saved steps
    losses = {
        entry["step"]: entry["loss"]
        for entry in trainer.state.log_history
        if "loss" in entry and entry["step"] > start
    }
    return trainer, losses, trainer.evaluate()["eval_loss"]


def run(directory: str, device: str) -> None:
    _, uninterrupted, eval_loss = train(os.path.join(directory, "run"), device, seed=0)
    saved = os.path.join(directory, "run", f"checkpoint-{SAVE_AT}")
    # Resume: other initial weights, which the checkpoint must replace.
    trainer, resumed, resumed_eval_loss = train(
        os.path.join(directory, "resumed"), device, seed=1, resume=saved
    )
    # Export: Hugging Face's format, which a plain single-process model loads.
    exported = os.path.join(directory, "exported")
    trainer.save_model(exported)
    weights = dmuon.get_model_state_dict(trainer.model, rank0_only=True)  # {} off rank 0

    if int(os.environ["RANK"]) != 0:
        return
    losses = [uninterrupted[step] for step in sorted(uninterrupted)]
    print("losses", " ".join(f"{x:.4f}" for x in losses), flush=True)
    if len(losses) != STEPS or not all(math.isfinite(x) for x in losses) or losses[-1] >= losses[0]:
        raise SystemExit(f"FAILED: the loss did not fall over {STEPS} steps: {uninterrupted}")
    expected = {step: loss for step, loss in uninterrupted.items() if step > SAVE_AT}
    if resumed != expected or resumed_eval_loss != eval_loss:
        raise SystemExit(
            f"FAILED: the resumed run's losses {resumed} (evaluation {resumed_eval_loss}) differ"
            f" from the uninterrupted run's {expected} (evaluation {eval_loss})"
        )
    reloaded = LlamaForCausalLM.from_pretrained(exported).state_dict()
    if reloaded.keys() != weights.keys() or not all(
        torch.equal(reloaded[name], weight) for name, weight in weights.items()
    ):
        raise SystemExit(f"FAILED: from_pretrained({exported}) differs from the trained weights")
    print(
        f"OK: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {STEPS} steps; resumed from {saved},"
        f" losses {list(resumed.values())} and evaluation loss {eval_loss} as without the"
        f" checkpoint; the export loads with from_pretrained",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--nproc", type=int, default=2, help="ranks to start on this machine")
    parser.add_argument("--dir", help="checkpoint directory (default: a temporary one)")
    args = parser.parse_args(argv)
    if "LOCAL_RANK" in os.environ:  # one rank, started by torchrun
        if args.dir is None:
            raise SystemExit("under torchrun pass --dir, a directory every rank can reach")
        torch.set_num_threads(1)
        run(args.dir, args.device)
        return
    directory = args.dir or tempfile.mkdtemp(prefix="dmuon-hf-trainer-")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(args.nproc), __file__, "--device", args.device]
    try:
        done = subprocess.run([*command, "--dir", directory], check=False)
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    if done.returncode != 0:
        raise SystemExit(f"FAILED: a rank exited with {done.returncode}")


if __name__ == "__main__":
    sys.exit(main())
