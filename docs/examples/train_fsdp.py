"""Train a small transformer with dmuon on FSDP2: the quickstart's example, end to end.

    torchrun --nproc-per-node 2 docs/examples/train_fsdp.py           # any number of ranks
    python docs/examples/train_fsdp.py                                 # starts 2 CPU ranks itself
    python docs/examples/train_fsdp.py --steps 20 --world-size 4

Launched by ``torchrun`` it runs as one rank of that job (NCCL when every rank has a GPU, gloo
on the CPU otherwise). Started plainly, it spawns ``--world-size`` gloo ranks on this machine
with ``torch.multiprocessing``. Either way rank 0 prints the loss of every step, and the script
exits non-zero unless the loss is finite and lower after the last step than before the first.
It uses the public ``dmuon`` API only, in the order dmuon requires: build the model,
``dmuon.dedicate_params``, ``fully_shard`` each layer and then the root (plain calls: the
patch ``dedicate_params`` installs makes them leave the dedicated matrices alone; without it,
pass ``ignored_params=dmuon.dedicated_params_of(model)``), ``dmuon.Muon``.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
from collections.abc import Callable
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon

VOCAB, DIM, HIDDEN, LAYERS, SEQ, ROWS_PER_RANK = 64, 32, 64, 2, 16, 4


class Block(nn.Module):
    """Pre-norm MLP block. Its ``*_proj`` matrices are the Muon targets."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.up_proj = nn.Linear(DIM, HIDDEN, bias=False)
        self.down_proj = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down_proj(F.gelu(self.up_proj(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, blocks under ``layers.N`` (dmuon's default hook boundary), norm, head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def batch(rank: int, device: torch.device) -> Tensor:
    """This rank's rows of a learnable sequence task: ``t[i+1] = (5 t[i] + 3) mod VOCAB``."""
    g = torch.Generator().manual_seed(rank)
    tokens = [torch.randint(0, VOCAB, (ROWS_PER_RANK, 1), generator=g)]
    for _ in range(SEQ):
        tokens.append((5 * tokens[-1] + 3) % VOCAB)
    return torch.cat(tokens, dim=1).to(device)


def build(mesh: DeviceMesh, device: torch.device, seed: int = 0) -> tuple[TinyLM, dmuon.Muon]:
    """The model, sharded for dmuon, and its one optimizer, in the order dmuon requires."""
    torch.manual_seed(seed)  # the same initial weights on every rank
    model = TinyLM().to(device)

    # 1. Choose the Muon matrices and give each one an owner rank (before fully_shard).
    dmuon.dedicate_params(model, mesh, predicate=lambda name, p: "proj" in name and p.ndim == 2)
    # 2. Shard everything else with FSDP2, each layer and then the root; fully_shard leaves the
    #    dedicated matrices to dmuon.
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # 3. One optimizer: Muon for the dedicated matrices, AdamW for the rest.
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=3e-3)
    return model, optimizer


def train_step(model: nn.Module, optimizer: dmuon.Muon, tokens: Tensor) -> float:
    """One optimizer step on ``tokens``; returns the loss averaged over the ranks."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    optimizer.zero_grad()
    logits = model(inputs)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    loss.backward()
    optimizer.step()
    # The mean over ranks, for printing only: the gradients are already averaged.
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


def device_and_mesh() -> tuple[torch.device, DeviceMesh]:
    """This rank's device (a GPU under NCCL, else the CPU) and a 1-D mesh over every rank."""
    use_cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    return device, init_device_mesh(device.type, (dist.get_world_size(),))


def train(steps: int) -> list[float]:
    """One rank's training loop; the process group is already initialised."""
    device, mesh = device_and_mesh()
    model, optimizer = build(mesh, device)
    tokens = batch(dist.get_rank(), device)
    losses = []
    for step in range(steps):
        losses.append(train_step(model, optimizer, tokens))
        if dist.get_rank() == 0:
            print(f"step {step}  loss {losses[-1]:.4f}", flush=True)
    return losses


def check(losses: list[float]) -> None:
    if not all(math.isfinite(x) for x in losses):
        raise SystemExit(f"FAILED: a loss is not finite: {losses}")
    if losses[-1] >= losses[0]:
        raise SystemExit(f"FAILED: the loss did not fall: {losses}")
    print(f"OK: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps", flush=True)


def train_and_check(steps: int) -> None:
    losses = train(steps)
    if dist.get_rank() == 0:
        check(losses)


def launch(job: Callable[[], None], world_size: int) -> None:
    """Run ``job`` on every rank of a process group: as this rank when started by ``torchrun``
    (NCCL when every rank has a GPU, gloo otherwise), else on ``world_size`` gloo ranks spawned
    on this machine (``job`` must then pickle: a module-level function or a ``partial`` of one)."""
    if "RANK" in os.environ:  # started by torchrun: this process is one rank
        use_cuda = torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if use_cuda else "gloo")
        _run(job)
        return
    mp.spawn(_spawned_rank, args=(world_size, _free_port(), job), nprocs=world_size, join=True)


def _run(job: Callable[[], None]) -> None:
    try:
        job()
    finally:
        dist.barrier()  # no rank leaves while another still talks to it
        dist.destroy_process_group()
    # A gloo worker thread may still be letting go of a finished collective when the
    # interpreter shuts down, which aborts the process ("terminate called without an active
    # exception", PyTorch's own; see the FAQ): leave without the interpreter's shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawned_rank(rank: int, world_size: int, port: int, job: Callable[[], None]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    _run(job)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (default 3)")
    parser.add_argument(
        "--world-size", type=int, default=2, help="ranks to spawn when not under torchrun"
    )
    args = parser.parse_args(argv)
    launch(partial(train_and_check, args.steps), args.world_size)


if __name__ == "__main__":
    sys.exit(main())
