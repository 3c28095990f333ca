"""Save a sharded checkpoint halfway through training and resume from it in a fresh model.

    python docs/examples/checkpoint_fsdp.py                            # starts 2 CPU ranks itself
    torchrun --nproc-per-node 2 docs/examples/checkpoint_fsdp.py       # any number of ranks
    torchrun ... docs/examples/checkpoint_fsdp.py --dir /shared/ckpt   # several machines

It trains the quickstart's model (``train_fsdp.py``, beside this file) for ``--steps`` steps,
writing a checkpoint with ``dmuon.save_checkpoint`` after the first half. Then it builds the
model again from other initial weights, loads the checkpoint into it with
``dmuon.load_checkpoint`` and trains the second half once more. The script exits non-zero
unless the resumed run's losses equal the uninterrupted run's bit for bit: the checkpoint
carries the weights, the momentum, the Adam moments and the step counts. The checkpoint goes to
a temporary directory, removed at the end, unless ``--dir`` names one (it must then be on a
file system every rank can read).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from functools import partial

import torch.distributed as dist
from train_fsdp import batch, build, device_and_mesh, launch, train_step

import dmuon


def resume(steps: int, directory: str) -> tuple[list[float], list[float]]:
    """One rank's run: the second half's losses uninterrupted, and after resuming."""
    device, mesh = device_and_mesh()
    tokens = batch(dist.get_rank(), device)
    half = steps // 2

    model, optimizer = build(mesh, device, seed=0)
    for _ in range(half):
        train_step(model, optimizer, tokens)
    # Collective: every rank writes what it holds (the owner of a Muon matrix its full weight
    # and state, every rank its FSDP2 shards); nothing is gathered.
    dmuon.save_checkpoint(directory, model, optimizer)
    uninterrupted = [train_step(model, optimizer, tokens) for _ in range(steps - half)]

    # Resume: build, dedicate, shard and make the optimizer as before, then load.
    model, optimizer = build(mesh, device, seed=1)  # other weights: the load must replace them
    dmuon.load_checkpoint(directory, model, optimizer)
    resumed = [train_step(model, optimizer, tokens) for _ in range(steps - half)]
    return uninterrupted, resumed


def resume_and_check(steps: int, directory: str | None) -> None:
    if directory is None:  # under torchrun: one temporary directory for all ranks, rank 0's
        made = [tempfile.mkdtemp(prefix="dmuon-checkpoint-") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(made, src=0)
        try:
            resume_and_check(steps, str(made[0]))
        finally:
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(str(made[0]))
        return
    uninterrupted, resumed = resume(steps, directory)
    if dist.get_rank() != 0:
        return
    if resumed != uninterrupted:
        raise SystemExit(
            f"FAILED: the resumed run's losses {resumed} differ from the uninterrupted run's"
            f" {uninterrupted}"
        )
    print(f"OK: resumed from {directory}, losses {resumed} as without the checkpoint", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps (default 4)")
    parser.add_argument("--dir", help="checkpoint directory (default: a temporary one)")
    parser.add_argument(
        "--world-size", type=int, default=2, help="ranks to spawn when not under torchrun"
    )
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (steps before and after the save), got {args.steps}")
    if args.dir is not None or "RANK" in os.environ:  # torchrun: rank 0 makes the directory
        launch(partial(resume_and_check, args.steps, args.dir), args.world_size)
        return
    with tempfile.TemporaryDirectory(prefix="dmuon-checkpoint-") as directory:
        launch(partial(resume_and_check, args.steps, directory), args.world_size)


if __name__ == "__main__":
    sys.exit(main())
