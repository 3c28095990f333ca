"""Train, checkpoint and resume dmuon under PyTorch Lightning's ``ModelParallelStrategy``.

    python docs/examples/integrations/lightning_train.py             # 2 CPU ranks (gloo)
    python docs/examples/integrations/lightning_train.py --accelerator gpu --devices 8
    torchrun --nproc-per-node 2 docs/examples/integrations/lightning_train.py --dir /shared/ckpt

Lightning starts the other ranks itself (it runs this script again with ``LOCAL_RANK`` set)
unless ``torchrun`` already did. The LightningModule applies dmuon in ``configure_model``
(``dmuon.dedicate_params`` on the strategy's data-parallel mesh, then plain ``fully_shard``
calls, which leave the dedicated matrices alone) and returns ``dmuon.Muon(self, ...)`` from ``configure_optimizers``.
Checkpoints go through :class:`DmuonModelParallelStrategy`, which writes and reads them with
``dmuon.save_checkpoint`` / ``dmuon.load_checkpoint`` instead of the strategy's
``get_model_state_dict``, which would read every weight on every rank and so raises on a
dmuon model. The same strategy clips Lightning's
``gradient_clip_val`` with ``dmuon.clip_grad_norm_`` (Lightning's own clip sees only
``param.grad``, where the Muon gradients are not) and runs the micro-batches of
``accumulate_grad_batches`` before the last under ``dmuon.no_sync``.

The script trains 10 steps of 2 micro-batches (two epochs of 5 steps, the same rows every
step), clipped by ``gradient_clip_val``, with a ``ModelCheckpoint`` at the end of the first
epoch; then builds the module again from other initial weights and resumes from that
checkpoint with ``trainer.fit(..., ckpt_path=...)``. It exits non-zero unless the loss fell,
after each step's clip the norm of every gradient is the smaller of ``gradient_clip_val`` and
its norm before (the first step's above it), the resumed micro-batches' losses equal the
uninterrupted run's bit for bit, and ``trainer.validate(..., ckpt_path=...)`` of the last
checkpoint in a module built from other weights scores the trained module's validation loss.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

# The quickstart's model and data task (docs/examples/train_fsdp.py).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from train_fsdp import VOCAB, TinyLM, batch

import dmuon

STEPS_PER_EPOCH, EPOCHS, ACCUMULATION, MAX_NORM = 5, 2, 2, 0.5
METADATA = "lightning.pt"  # the trainer's own state, beside dmuon's DCP files
DIR_ENV = "DMUON_LIGHTNING_EXAMPLE_DIR"  # hands rank 0's directory to the ranks it starts


class DmuonModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` with dmuon checkpoints.

    [Note: Lightning checkpoints] Lightning builds a checkpoint as a dictionary: the model's
    and each optimizer's state from the strategy (``lightning_module_state_dict``,
    ``optimizer_state``; for ``ModelParallelStrategy`` DCP's ``get_model_state_dict``, which
    reads every dedicated weight on every rank) plus the loops', callbacks' and schedulers'
    state; then ``strategy.save_checkpoint`` writes it. Here the model and optimizer entries
    stay empty and ``save_checkpoint`` writes them with ``dmuon.save_checkpoint`` (each rank
    what it holds, with checksums) and the rest with ``torch.save`` on rank 0. Loading mirrors
    it: ``load_checkpoint`` (called after ``configure_model`` and ``configure_optimizers``,
    since ``restore_checkpoint_after_setup`` is true) reads the weights and optimizer state
    with ``dmuon.load_checkpoint`` and returns the rest for Lightning to restore.

    [Note: Lightning's clipping]
    ``gradient_clip_val`` makes Lightning call its precision plugin's ``clip_gradients``
    (through ``LightningModule.configure_gradient_clipping``), which clips ``param.grad`` of
    the optimizer's parameters with ``torch.nn.utils.clip_grad_norm_``. A dedicated matrix's
    gradient is not there (it lives on its owner), so that clip would take the norm of the
    FSDP2 gradients alone and leave the Muon ones as they are, without a word. ``setup``
    points the plugin's ``clip_gradients`` at ``dmuon.clip_grad_norm_(..., params="all")``
    (``dmuon.clip.clip_grad_value_`` for ``gradient_clip_algorithm="value"``): one norm over
    every gradient, as Lightning's clip takes without dmuon.
    """

    def setup(self, trainer: L.Trainer) -> None:
        super().setup(trainer)
        # See [Note: Lightning's clipping].
        self.precision_plugin.clip_gradients = self._clip_gradients  # type: ignore[method-assign]

    def _clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Lightning's ``gradient_clip_val`` on every gradient, where dmuon keeps it."""
        if clip_val <= 0:
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            dmuon.clip.clip_grad_value_(self._muon(), clip_val, params="all")
        else:
            dmuon.clip_grad_norm_(self._muon(), clip_val, params="all")

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """The micro-batches that Lightning's ``accumulate_grad_batches`` runs before the last
        one reduce nothing (``ModelParallelStrategy``'s own context does that for DDP only)."""
        with dmuon.no_sync(self.lightning_module):
            yield

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        filepath: str | os.PathLike[str],
        storage_options: Any = None,
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options")
        path = Path(self.broadcast(str(filepath)))  # rank 0's path on every rank
        dmuon.save_checkpoint(path, self.lightning_module, self._muon())
        if self.global_rank == 0:
            rest = {
                k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")
            }
            torch.save(rest, path / METADATA)
        self.barrier()

    def load_checkpoint(
        self, checkpoint_path: str | os.PathLike[str], weights_only: bool | None = None
    ) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        # validate, test and predict with ckpt_path build no optimizer: the weights alone.
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        dmuon.load_checkpoint(path, self.lightning_module, self._muon() if fitting else None)
        return torch.load(
            path / METADATA, weights_only=False if weights_only is None else weights_only
        )

    def remove_checkpoint(self, filepath: str | os.PathLike[str]) -> None:
        if self.global_rank == 0:
            shutil.rmtree(filepath, ignore_errors=True)

    def _muon(self) -> dmuon.Muon:
        optimizers = [
            o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers
        ]
        if len(optimizers) != 1 or not isinstance(optimizers[0], dmuon.Muon):
            raise TypeError(
                f"{type(self).__name__} checkpoints one dmuon.Muon; configure_optimizers returned"
                f" {[type(o).__name__ for o in optimizers]}: return dmuon.Muon(self, ...) alone"
            )
        return optimizers[0]


class TinyLMModule(L.LightningModule):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)  # the same initial weights on every rank
        self.model = TinyLM()
        self.losses: list[float] = []  # the mean over ranks of every micro-batch's loss

    def configure_model(self) -> None:
        if dmuon.dedicated_params_of(self):  # Lightning may call it again: apply dmuon once
            return
        mesh = self.device_mesh["data_parallel"]
        dmuon.dedicate_params(self, mesh, predicate=lambda name, p: "proj" in name and p.ndim == 2)
        for layer in self.model.layers:  # fully_shard leaves the dedicated matrices to dmuon
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def configure_optimizers(self) -> dmuon.Muon:
        return dmuon.Muon(self, lr=0.02, adamw_lr=3e-3)

    def training_step(self, tokens: Tensor, batch_idx: int) -> Tensor:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        logits = self.model(inputs)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    def on_train_batch_end(self, outputs: Any, tokens: Tensor, batch_idx: int) -> None:
        # Lightning hands back the loss divided by accumulate_grad_batches, as it was backward.
        mean = outputs["loss"].detach() * self.trainer.accumulate_grad_batches
        dist.all_reduce(mean)
        self.losses.append(mean.item() / dist.get_world_size())

    def train_dataloader(self) -> DataLoader:
        # This rank's rows for each micro-batch of a step, the same every step (as in
        # train_fsdp.py, where one batch serves every step).
        world, cpu = dist.get_world_size(), torch.device("cpu")
        micro = [batch(self.global_rank + world * i, cpu) for i in range(ACCUMULATION)]
        return DataLoader(micro * STEPS_PER_EPOCH, batch_size=None)


class CheckedModule(TinyLMModule):
    """``TinyLMModule`` that measures, at each optimizer step, the norm of every gradient
    (dmuon's and FSDP2's) before and after Lightning's ``gradient_clip_val`` clip."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.norms: list[tuple[float, float]] = []

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._before = self._norm(optimizer)  # Lightning calls this hook before its clip

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.norms.append((self._before, self._norm(optimizer)))

    def validation_step(self, tokens: Tensor, batch_idx: int) -> Tensor:
        loss = self.training_step(tokens, batch_idx)
        self.log("val_loss", loss, sync_dist=True, batch_size=tokens.shape[0])
        return loss

    def val_dataloader(self) -> DataLoader:
        return DataLoader([batch(self.global_rank, torch.device("cpu"))], batch_size=None)

    @staticmethod
    def _norm(optimizer: torch.optim.Optimizer) -> float:
        muon = cast(dmuon.Muon, optimizer)
        return float(dmuon.clip_grad_norm_(muon, None, params="all").total_norm)


def trainer(args: argparse.Namespace, directory: str, checkpoint: bool) -> L.Trainer:
    callbacks = [ModelCheckpoint(dirpath=directory, save_top_k=-1)] if checkpoint else []
    return L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=DmuonModelParallelStrategy(
            data_parallel_size=args.devices, tensor_parallel_size=1
        ),
        max_epochs=EPOCHS,
        accumulate_grad_batches=ACCUMULATION,  # the strategy runs all but the last in no_sync
        gradient_clip_val=MAX_NORM,  # every gradient by one norm, through the strategy
        use_distributed_sampler=False,  # train_dataloader returns this rank's rows itself
        callbacks=callbacks,
        enable_checkpointing=checkpoint,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=directory,
    )


def run(args: argparse.Namespace, directory: str) -> None:
    first = trainer(args, directory, checkpoint=True)
    module = CheckedModule(seed=0)
    first.fit(module)
    uninterrupted = module.losses

    # Resume: other initial weights, which the checkpoint must replace.
    saved = os.path.join(directory, f"epoch=0-step={STEPS_PER_EPOCH}.ckpt")
    second = trainer(args, directory, checkpoint=False)
    resumed_module = CheckedModule(seed=1)
    second.fit(resumed_module, ckpt_path=saved)
    resumed = resumed_module.losses

    # Evaluate the last checkpoint in a module built from other weights (Lightning builds no
    # optimizer for validate): it must score what the trained module scores.
    last = os.path.join(directory, f"epoch={EPOCHS - 1}-step={EPOCHS * STEPS_PER_EPOCH}.ckpt")
    trained = first.validate(module, verbose=False)[0]["val_loss"]
    third = trainer(args, directory, checkpoint=False)
    loaded = third.validate(CheckedModule(seed=2), ckpt_path=last, verbose=False)[0]["val_loss"]

    if second.global_rank != 0:
        return
    if loaded != trained:
        raise SystemExit(
            f"FAILED: validate(ckpt_path={last}) scored {loaded}, the trained module {trained}"
        )
    print("losses", " ".join(f"{x:.4f}" for x in uninterrupted), flush=True)
    if not all(math.isfinite(x) for x in uninterrupted) or uninterrupted[-1] >= uninterrupted[0]:
        raise SystemExit(f"FAILED: the loss did not fall: {uninterrupted}")
    before, after = module.norms[0]
    print(f"step 1: norm of every gradient {before:.6f}, after the clip {after:.6f}", flush=True)
    if before <= MAX_NORM:
        raise SystemExit(f"FAILED: the first step's norm {before} needs no clip to {MAX_NORM}")
    for step, (before, after) in enumerate(module.norms, 1):
        if not math.isclose(after, min(before, MAX_NORM), rel_tol=1e-4):
            raise SystemExit(
                f"FAILED: step {step}: gradient_clip_val={MAX_NORM} left every gradient's norm"
                f" at {after} (from {before}): it did not clip them all by one norm"
            )
    later = uninterrupted[STEPS_PER_EPOCH * ACCUMULATION :]
    if resumed != later:
        raise SystemExit(
            f"FAILED: the resumed run's losses {resumed} differ from the uninterrupted run's"
            f" {later}"
        )
    print(
        f"OK: loss {uninterrupted[0]:.4f} -> {uninterrupted[-1]:.4f} in {len(uninterrupted)}"
        f" micro-batches; resumed from {saved}, losses {resumed} as without the checkpoint;"
        f" the clip took every gradient's norm; validate(ckpt_path=...) scored {loaded:.6f}"
        " as the trained module",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accelerator", default="cpu", help="Lightning accelerator (cpu, gpu)")
    parser.add_argument("--devices", type=int, default=2, help="ranks on this machine")
    parser.add_argument("--dir", help="checkpoint directory (default: a temporary one)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    directory = args.dir or os.environ.get(DIR_ENV)
    if directory is not None:
        run(args, directory)
        return
    # Made by rank 0 alone when Lightning starts the other ranks (they inherit the variable);
    # under torchrun by every rank, and the strategy uses rank 0's for every save and load.
    made = tempfile.mkdtemp(prefix="dmuon-lightning-")
    os.environ[DIR_ENV] = made
    try:
        run(args, made)
    finally:
        shutil.rmtree(made, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
