"""Host time of one training iteration on many small matrices: dmuon against FSDP2 + AdamW and
FSDP2 + torch.optim.Muon on the same model, on the CPU (gloo).

    python benchmarks/host_overhead_bench.py                   # world size 1 and 2
    python benchmarks/host_overhead_bench.py --world-sizes 2 --iters 200 --layers 48
    python benchmarks/host_overhead_bench.py --variants dmuon  # one of them
    python benchmarks/host_overhead_bench.py --process-group-policy shared  # dmuon on FSDP2's

On a GPU the step of a model with small matrices is bound by the host: what the device does per
matrix takes less time than launching it, so every microsecond of Python per layer hook and per
matrix shows in the iteration. This bench makes that Python the whole cost: the demo's
Llama-style decoder (``dmuon._demo_model``) at a tiny width (hidden 32, SwiGLU 64, 2 heads,
vocab 256, 16 tokens, 2 rows per rank) and many layers (24 by default: 168 matrices of 32×32 or
64×32), with one intra-op thread per rank, so that the compute is a small part of the time.
Every rank runs in a process of its own (spawned here, gloo, a 1-D mesh of all ranks).

Variants, on the same weights and the same batch:

  dmuon        ``dedicate_params`` (the proj matrices) -> ``fully_shard`` (layers, then root,
               leaving the dedicated ones) -> ``dmuon.Muon``
  adamw        ``fully_shard`` (layers, then root) -> ``torch.optim.AdamW`` on every parameter
  torch-muon   ``fully_shard`` (layers, then root) -> ``torch.optim.Muon`` on the proj matrices
               (their FSDP2 shards: on more than one rank, NS runs on each shard, not on the
               matrix, which is not Muon; timed all the same) + ``torch.optim.AdamW`` on the rest

For each, the median over ``--iters`` iterations after ``--warmup`` of: ``iter ms``, the whole
iteration (``zero_grad``, forward, backward, ``step``); ``fwd+bwd ms``; ``step ms``, the
optimizer's step alone. On more than one rank each figure is the largest of the ranks' medians.
The ranks share the machine's cores: on a machine with other work, compare rows of one run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ns_cpu_bench import cpu_name
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon._demo_model import LlamaConfig, TinyLlama, muon_predicate, next_token_loss

VARIANTS = ("dmuon", "adamw", "torch-muon")


class _Both:
    """``torch.optim.Muon`` on the proj matrices and ``torch.optim.AdamW`` on the rest, stepped
    as one."""

    def __init__(self, model: torch.nn.Module) -> None:
        named = list(model.named_parameters())
        matrices = [p for n, p in named if muon_predicate(n, p)]
        others = [p for n, p in named if not muon_predicate(n, p)]
        self.parts = [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(others, lr=1e-3)]

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()


def _build(variant: str, cfg: LlamaConfig, mesh: Any, args: Any) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(0)
    model = TinyLlama(cfg)
    if variant == "dmuon":
        dmuon.dedicate_params(
            model,
            mesh,
            predicate=muon_predicate,
            process_group_policy=args.process_group_policy,
        )
        dedicated = dmuon.dedicated_params_of(model)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, ignored_params=dedicated)
        fully_shard(model, mesh=mesh, ignored_params=dedicated)
        return model, dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if variant == "adamw":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, _Both(model)


def _time(model: torch.nn.Module, optimizer: Any, tokens: torch.Tensor, args: Any) -> list[float]:
    """Median ms of the iteration, forward + backward and the step."""
    clock = time.perf_counter
    iters: list[float] = []
    fwd_bwd: list[float] = []
    steps: list[float] = []
    for i in range(args.warmup + args.iters):
        start = clock()
        optimizer.zero_grad()
        next_token_loss(model, tokens).backward()
        backward_done = clock()
        optimizer.step()
        end = clock()
        if i >= args.warmup:
            iters.append(end - start)
            fwd_bwd.append(backward_done - start)
            steps.append(end - backward_done)
    return [1e3 * statistics.median(x) for x in (iters, fwd_bwd, steps)]


def _rank(rank: int, world_size: int, init: str, args: Any, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    cfg = LlamaConfig(
        vocab=256,
        hidden=args.hidden,
        intermediate=2 * args.hidden,
        layers=args.layers,
        heads=2,
        seq_len=16,
    )
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab, (2 * world_size, cfg.seq_len + 1), generator=g)
    tokens = tokens.chunk(world_size)[rank]
    results = {}
    for variant in args.variants:
        model, optimizer = _build(variant, cfg, mesh, args)
        results[variant] = _time(model, optimizer, tokens, args)
        del model, optimizer
    out.put((rank, results))
    dist.destroy_process_group()


def _run(world_size: int, args: Any) -> dict[str, list[float]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="dmuon-host-bench-") as tmp:
        init = os.path.join(tmp, "init")
        procs = [
            ctx.Process(target=_rank, args=(rank, world_size, init, args, out))
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        per_rank = [out.get() for _ in procs]
        for proc in procs:
            proc.join()
    return {
        variant: [max(results[variant][i] for _, results in per_rank) for i in range(3)]
        for variant in args.variants
    }


def _row(world_size: int, variant: str, figures: list[float], base: list[float] | None) -> str:
    ratio = f"{figures[0] / base[0]:.2f}" if base else "–"
    cells = " | ".join(f"{x:.2f}" for x in figures)
    return f"| {world_size} | {variant} | {cells} | {ratio} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", nargs="*", type=int, default=[1, 2])
    parser.add_argument("--variants", nargs="*", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument(
        "--process-group-policy",
        choices=("isolated", "shared"),
        default="isolated",
        help="dedicate_params' process_group_policy (dmuon's own groups, or the mesh's)",
    )
    args = parser.parse_args()
    print(
        f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC | {cpu_name()},"
        f" {os.cpu_count()} cores | torch {torch.__version__} | {args.layers} layers, hidden"
        f" {args.hidden}, median of {args.iters} iterations after {args.warmup}, dmuon's"
        f" process groups {args.process_group_policy}"
    )
    print(
        "| ranks | variant | iter ms | fwd+bwd ms | step ms | iter / dmuon's |\n"
        "|---|---|---|---|---|---|"
    )
    for world_size in args.world_sizes:
        figures = _run(world_size, args)
        base = figures.get("dmuon")
        for variant in args.variants:
            print(_row(world_size, variant, figures[variant], None if variant == "dmuon" else base))


if __name__ == "__main__":
    main()
