"""Train, checkpoint and resume dmuon under the Hugging Face ``transformers.Trainer``.

    python docs/examples/integrations/hf_trainer_train.py                # 2 CPU ranks (gloo)
    python docs/examples/integrations/hf_trainer_train.py --device cuda --nproc 8
    torchrun --nproc-per-node 2 docs/examples/integrations/hf_trainer_train.py --dir /shared/ckpt

Started plainly, the script runs itself again under ``torchrun`` on ``--nproc`` ranks of this
machine, as ``torchrun`` or ``accelerate launch`` would start a Trainer script. Each rank builds a
tiny ``LlamaForCausalLM``, applies dmuon itself (``dmuon.dedicate_params`` on a 1-D mesh over
every rank, then plain ``fully_shard`` calls on each decoder layer and the root) and
hands the sharded model to ``dmuon.integrations.hf.DmuonTrainer``, which builds ``dmuon.Muon``,
clips with dmuon and checkpoints through ``dmuon.save_checkpoint`` / ``dmuon.load_checkpoint``.

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

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import dmuon
from dmuon.integrations.hf import DmuonTrainer, DmuonTrainingArguments

VOCAB, SEQ, ROWS_PER_RANK, STEPS, SAVE_AT = 64, 16, 4, 10, 5


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
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
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


def training_arguments(output_dir: str, device: str) -> DmuonTrainingArguments:
    return DmuonTrainingArguments(
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
        try:
            run(args.dir, args.device)
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        # The work is done. A gloo worker thread may still be letting go of a finished
        # collective when the interpreter shuts down, which aborts the process ("terminate
        # called without an active exception", PyTorch's own; docs/faq.md): leave without the
        # interpreter's shutdown. A failure above raised and never gets here.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
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
