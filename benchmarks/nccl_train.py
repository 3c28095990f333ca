"""The demo at GPU scale, ready for a multi-GPU machine: dmuon vs FSDP2 + AdamW over NCCL.

    # one node, 8 GPUs, a 1-D mesh of 8:
    torchrun --nproc-per-node 8 benchmarks/nccl_train.py
    # HSDP on the same node: mesh (2, 4) named ('replicate', 'shard'), keep weights (Z2):
    torchrun --nproc-per-node 8 benchmarks/nccl_train.py --replicate 2 --zero 2
    # two nodes (replicate across nodes):
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        benchmarks/nccl_train.py --replicate 2
    # without torchrun: spawns one rank per visible GPU itself
    python benchmarks/nccl_train.py
    # smoke test of this script on a CPU machine (gloo, one rank):
    torchrun --nproc-per-node 1 benchmarks/nccl_train.py --device cpu --steps 2 --hidden 64 \\
        --layers 2 --heads 4 --vocab 256 --seq-len 64 --batch-size 4

Every option of ``dmuon-demo`` works here (``--plot``, ``--only``, ``--seed``, ...); only the
defaults differ: a larger model (hidden 1024, 8 layers, 16 heads, vocab 4096, seq 512), 100
steps and a global batch of 8 sequences per rank. Needs ``packages/*/src`` on PYTHONPATH
(or the workspace installed).
"""

from __future__ import annotations

import os
import sys

import torch

from dmuon._demo import main

GPU_DEFAULTS = {
    "--device": "cuda",
    "--steps": "100",
    "--hidden": "1024",
    "--layers": "8",
    "--heads": "16",
    "--vocab": "4096",
    "--seq-len": "512",
}


def _argv(user: list[str], world_size: int) -> list[str]:
    given = {a.split("=", 1)[0] for a in user if a.startswith("--")}
    argv = [x for k, v in GPU_DEFAULTS.items() if k not in given for x in (k, v)]
    if "--batch-size" not in given:
        argv += ["--batch-size", str(8 * world_size)]
    return argv + user


if __name__ == "__main__":
    user = sys.argv[1:]
    if "RANK" in os.environ:  # started by torchrun
        world = int(os.environ["WORLD_SIZE"])
        raise SystemExit(main([*_argv(user, world), "--torchrun"]))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nproc = gpus if gpus and "--nproc" not in user else 1
    argv = _argv(user, nproc)
    if "--nproc" not in user:
        argv += ["--nproc", str(nproc)]
    raise SystemExit(main(argv))
