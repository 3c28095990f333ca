"""Train, checkpoint and resume dmuon in a training loop of your own under Hugging Face accelerate.

    python docs/examples/integrations/accelerate_train.py                # 2 CPU ranks (gloo)
    python docs/examples/integrations/accelerate_train.py --device cuda --nproc 8
    torchrun --nproc-per-node 2 docs/examples/integrations/accelerate_train.py --dir /shared/ckpt

Started plainly, the script runs itself again under ``torchrun`` on ``--nproc`` ranks of this
machine, as ``torchrun`` or ``accelerate launch`` would start it. Each rank builds a tiny
``LlamaForCausalLM`` and applies dmuon itself (``dmuon.dedicate_params`` on a 1-D mesh over
every rank, then plain ``fully_shard`` calls on each decoder layer and the root), with no FSDP
plugin in accelerate. ``accelerator.prepare_model(model, device_placement=False,
evaluation_mode=True)`` adds accelerate's autocast without a DDP wrap; the ``dmuon.Muon``, the
schedule and the data loader go through ``accelerator.prepare``.

The loop accumulates 2 micro-batches per step (the first under ``dmuon.no_sync``: accelerate's
``accumulate`` does not stop the reduces of a model that is not DDP), clips every gradient by
one norm with ``dmuon.clip_grad_norm_(..., params="all")`` and saves with
``dmuon.save_checkpoint`` after step 5 of 10. It then builds the model again from other
initial weights, loads that checkpoint and trains steps 6 to 10 again. It exits non-zero unless
the loss fell, the resumed steps' losses equal the uninterrupted run's bit for bit, on the
first step the clip's norm is the norm of every gradient, ``accelerator.clip_grad_norm_``
(which would see the AdamW gradients alone) raises naming dmuon's clip, and
``accelerator.get_state_dict`` raises dmuon's ``NotHeldError`` naming what to use instead.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import subprocess
import sys
import tempfile

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM, get_cosine_schedule_with_warmup

import dmuon

VOCAB, SEQ, ROWS_PER_RANK, ACCUMULATION, STEPS, SAVE_AT, MAX_NORM = 64, 16, 2, 2, 10, 5, 0.5


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


def dataset(world_size: int) -> list[Tensor]:
    """Rows of a learnable sequence task, ``t[i+1] = (5 t[i] + 3) mod VOCAB`` (the
    quickstart's), one micro-batch per rank for every micro-step."""
    rows = []
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS * ACCUMULATION * ROWS_PER_RANK * world_size):
        tokens = [int(torch.randint(0, VOCAB, (), generator=g))]
        for _ in range(SEQ):
            tokens.append((5 * tokens[-1] + 3) % VOCAB)
        rows.append(torch.tensor(tokens))
    return rows


def prepare(
    accelerator: Accelerator, seed: int
) -> tuple[LlamaForCausalLM, AcceleratedOptimizer, AcceleratedScheduler, DataLoader]:
    """The model, the optimizer, the schedule and the data, prepared by accelerate."""
    mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    model = build_model(seed, accelerator.device, mesh)
    # Autocast if mixed precision is on; no DDP wrap, no move (the model is already placed).
    model = accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
    muon = dmuon.Muon(model, lr=0.02, adamw_lr=3e-3)
    # accelerate steps a prepared schedule once per rank at each optimizer step.
    schedule = get_cosine_schedule_with_warmup(
        muon, 2 * accelerator.num_processes, STEPS * accelerator.num_processes
    )
    loader = DataLoader(dataset(accelerator.num_processes), batch_size=ROWS_PER_RANK)
    optimizer, schedule, loader = accelerator.prepare(muon, schedule, loader)
    return model, optimizer, schedule, loader


def check_clip(accelerator: Accelerator, model: torch.nn.Module, muon: dmuon.Muon) -> Tensor:
    """Before the first clip, measured without scaling: the Muon and the AdamW gradients'
    norms. ``accelerator.clip_grad_norm_`` sees ``param.grad`` alone, where the Muon
    gradients are not: given a dedicated parameter it raises, naming dmuon's clip."""
    muon_norm = dmuon.clip_grad_norm_(muon, None, params="muon").total_norm
    adamw_norm = dmuon.clip_grad_norm_(muon, None, params="adamw").total_norm
    try:
        accelerator.clip_grad_norm_(model.parameters(), math.inf)
    except ValueError as error:
        if "dmuon.clip_grad_norm_" not in str(error):
            raise
    else:
        raise SystemExit("FAILED: accelerator.clip_grad_norm_ left the Muon gradients out")
    return torch.stack([muon_norm, adamw_norm])


def train(
    accelerator: Accelerator, seed: int, directory: str, resume: bool
) -> tuple[dict[int, float], list[float]]:
    """One run: the loss (the mean over ranks) of every step it trained, and on the first
    step of a run from scratch the norms ``check_clip`` took and the clip's."""
    model, optimizer, schedule, loader = prepare(accelerator, seed)
    muon = optimizer.optimizer  # the dmuon.Muon under accelerate's AcceleratedOptimizer
    saved = os.path.join(directory, f"step-{SAVE_AT}")
    step = 0
    if resume:
        dmuon.load_checkpoint(saved, model, muon)
        schedule.load_state_dict(torch.load(os.path.join(saved, "schedule.pt")))
        loader = accelerator.skip_first_batches(loader, SAVE_AT * ACCUMULATION)
        step = SAVE_AT
    losses: dict[int, float] = {}
    norms: list[float] = []
    total = torch.zeros((), device=accelerator.device)
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            # accumulate() sets sync_gradients, but stops no reduce: the model is not DDP.
            sync = accelerator.sync_gradients
            with contextlib.nullcontext() if sync else dmuon.no_sync(model):
                loss = model(input_ids=batch, labels=batch).loss
                accelerator.backward(loss)  # divides by the accumulation steps
            total += loss.detach() / ACCUMULATION
            if sync:
                if step == 0:
                    before = check_clip(accelerator, model, muon)
                stats = dmuon.clip_grad_norm_(muon, MAX_NORM, params="all")
                if step == 0:
                    after = dmuon.clip_grad_norm_(muon, None, params="all").total_norm
                    norms = [*before.tolist(), float(stats.total_norm), float(after)]
            optimizer.step()  # accelerate's wrappers act on sync micro-batches only
            schedule.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            losses[step] = accelerator.reduce(total, "mean").item()
            total.zero_()
            if step == SAVE_AT and not resume:
                dmuon.save_checkpoint(saved, model, muon)  # collective: every rank
                if accelerator.is_main_process:
                    torch.save(schedule.state_dict(), os.path.join(saved, "schedule.pt"))
                accelerator.wait_for_everyone()
    if not resume:  # accelerate's own state functions read weights a rank does not hold
        try:
            accelerator.get_state_dict(model)
        except dmuon.NotHeldError as error:
            if "accelerate read every weight" not in str(error):
                raise
        else:
            raise SystemExit("FAILED: accelerator.get_state_dict read every dedicated weight")
    return losses, norms


def run(directory: str, device: str) -> None:
    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATION, cpu=device == "cpu")
    uninterrupted, norms = train(accelerator, seed=0, directory=directory, resume=False)
    # Resume: other initial weights, which the checkpoint must replace.
    resumed, _ = train(accelerator, seed=1, directory=directory, resume=True)

    if not accelerator.is_main_process:
        return
    losses = [uninterrupted[step] for step in sorted(uninterrupted)]
    print("losses", " ".join(f"{x:.4f}" for x in losses), flush=True)
    if len(losses) != STEPS or not all(math.isfinite(x) for x in losses) or losses[-1] >= losses[0]:
        raise SystemExit(f"FAILED: the loss did not fall over {STEPS} steps: {uninterrupted}")
    muon_norm, adamw_norm, clip_norm, after = norms
    every = math.hypot(muon_norm, adamw_norm)
    print(
        f"step 1: norm of every gradient {every:.6f} (Muon {muon_norm:.6f}, AdamW"
        f" {adamw_norm:.6f}); dmuon.clip_grad_norm_(params='all') {clip_norm:.6f}, then"
        f" {after:.6f}; accelerator.clip_grad_norm_ refused the dedicated weights",
        flush=True,
    )
    if not math.isclose(clip_norm, every, rel_tol=1e-5) or clip_norm <= MAX_NORM:
        raise SystemExit(f"FAILED: the clip's norm {clip_norm} is not every gradient's {every}")
    if not math.isclose(after, MAX_NORM, rel_tol=1e-4):
        raise SystemExit(f"FAILED: after the clip the norm is {after}, not {MAX_NORM}")
    expected = {step: loss for step, loss in uninterrupted.items() if step > SAVE_AT}
    if resumed != expected:
        raise SystemExit(
            f"FAILED: the resumed run's losses {resumed} differ from the uninterrupted"
            f" run's {expected}"
        )
    print(
        f"OK: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {STEPS} steps; resumed after step"
        f" {SAVE_AT}, losses {list(resumed.values())} as without the checkpoint; the clip"
        " took every gradient's norm",
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
    directory = args.dir or tempfile.mkdtemp(prefix="dmuon-accelerate-")
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
