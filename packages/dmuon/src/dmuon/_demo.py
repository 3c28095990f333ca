"""``dmuon-demo``: dmuon next to FSDP2 + AdamW on a small Llama-style model, on N local ranks.

    dmuon-demo                          # 4 ranks (gloo on CPU, NCCL with 4 GPUs), 40 steps
    dmuon-demo --replicate 2 --zero 2   # HSDP on a (2, 2) mesh, keep weights after forward
    dmuon-demo --tp 2                   # tensor parallelism: mesh (2, 2) ('shard', 'tp')
    dmuon-demo --plot loss.png          # both loss curves (needs matplotlib)
    dmuon-demo --qk-clip 30 --lr 0.1    # a high lr grows the logits: dmuon with and without
                                        # QK-clip at τ = 30, per-layer max logit per step
    torchrun --nproc-per-node 8 --no-python dmuon-demo --torchrun   # one process per GPU, NCCL

The command starts its own ranks with torch.multiprocessing, trains the baseline and then
dmuon in the same processes on the same data from the same initial weights, prints one line
per step from rank 0 and a comparison table at the end.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import statistics
import sys
from collections.abc import Sequence
from typing import TextIO

from dmuon._demo_bytes import Mesh, compare, counted_bytes, fsdp_bytes, fsdp_shard_bytes
from dmuon._demo_data import MarkovStream
from dmuon._demo_model import LlamaConfig, TinyLlama, muon_predicate
from dmuon._demo_train import (
    DemoOptions,
    LogEvent,
    RunKind,
    RunResult,
    StepEvent,
    train_rank,
)
from dmuon._launch import choose_backend, spawn, torchrun_world

__all__ = ["main"]

_LABELS = {
    RunKind.ADAMW: "FSDP2 + AdamW",
    RunKind.DMUON: "dmuon (Muon + AdamW)",
    RunKind.DMUON_QK: "dmuon + QK-clip",
}
_PLAIN = "FSDP2 + plain Muon"  # not run: the design dmuon replaces, its bytes computed


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dmuon-demo",
        description="Train a small Llama-style model twice on a learnable synthetic token stream:"
        " FSDP2 + AdamW, then dmuon (dedicated-owner Muon for the projection matrices).",
    )
    p.add_argument("--steps", type=int, default=40, help="training steps per run (default 40)")
    p.add_argument("--nproc", type=int, default=4, help="local ranks to start (default 4)")
    p.add_argument(
        "--replicate",
        type=int,
        default=1,
        help="HSDP replicas R: mesh (R, nproc/R) named ('replicate', 'shard') (default 1)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel degree T: Colwise q/k/v/gate/up, Rowwise o/down on a 'tp' mesh"
        " dimension, data parallelism over the other nproc/T (default 1)",
    )
    p.add_argument(
        "--zero",
        type=int,
        default=3,
        help="3: free gathered weights after forward (default); 2: keep them until backward",
    )
    p.add_argument("--plot", metavar="FILE.png", help="save both loss curves (needs matplotlib)")
    p.add_argument("--seed", type=int, default=0, help="model init and data seed (default 0)")
    p.add_argument("--only", choices=[k.value for k in RunKind], help="run one of the runs")
    p.add_argument(
        "--qk-clip",
        type=float,
        metavar="TAU",
        help="also run dmuon with QK-clip at τ = TAU (run 'dmuon-qk'); both dmuon runs record"
        " each layer's largest attention logit, reported (and with --plot drawn) per step",
    )
    p.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA if 1 GPU/rank"
    )
    p.add_argument(
        "--torchrun",
        action="store_true",
        help="join the world torchrun started instead of spawning --nproc ranks",
    )
    size = p.add_argument_group("model and data")
    size.add_argument("--hidden", type=int, default=128, help="(default 128)")
    size.add_argument("--intermediate", type=int, default=None, help="default 3 x hidden")
    size.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    size.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    size.add_argument("--vocab", type=int, default=256, help="(default 256)")
    size.add_argument("--seq-len", type=int, default=64, help="(default 64)")
    size.add_argument("--batch-size", type=int, default=16, help="global batch (default 16)")
    size.add_argument(
        "--moe",
        type=int,
        default=0,
        metavar="E",
        help="mixture-of-experts: E experts per layer (torchtitan's 3-D stacks and a router),"
        " each expert orthogonalised on its own where FSDP2 holds it (default 0: dense)",
    )
    size.add_argument("--lr", type=float, default=0.02, help="Muon lr (default 0.02)")
    size.add_argument("--adamw-lr", type=float, default=3e-3, help="AdamW lr (default 3e-3)")
    return p


def _options(args: argparse.Namespace, world_size: int) -> DemoOptions:
    """Turn parsed arguments into options, with errors that say what to change."""
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if world_size < 1:
        raise ValueError(f"--nproc must be >= 1, got {world_size}")
    if args.replicate < 1:
        raise ValueError(f"--replicate must be >= 1, got {args.replicate}")
    if world_size % args.replicate:
        raise ValueError(
            f"--replicate {args.replicate} must divide the number of ranks ({world_size}):"
            f" the HSDP mesh is (replicate, ranks / replicate); try --replicate"
            f" {_largest_divisor_below(world_size, args.replicate)} or --nproc"
            f" {args.replicate * -(-world_size // args.replicate)}"
        )
    if args.tp < 1:
        raise ValueError(f"--tp must be >= 1, got {args.tp}")
    if (world_size // args.replicate) % args.tp:
        raise ValueError(
            f"--tp {args.tp} must divide the ranks of one replica ({world_size // args.replicate}):"
            f" the mesh is (replicate, shard, tp); try --nproc"
            f" {args.replicate * args.tp * max(1, world_size // (args.replicate * args.tp))}"
        )
    if args.zero not in (2, 3):
        raise ValueError(f"--zero must be 2 or 3, got {args.zero}")
    dp_size = world_size // args.tp
    if args.batch_size % dp_size:
        raise ValueError(
            f"--batch-size {args.batch_size} must be divisible by the number of data-parallel"
            f" ranks ({dp_size}) so that every rank gets the same rows; try --batch-size"
            f" {dp_size * max(1, args.batch_size // dp_size)}"
        )
    if args.plot is not None and not args.plot.lower().endswith(".png"):
        raise ValueError(f"--plot needs a .png file name, got {args.plot!r}")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        # Checked before training rather than found missing after it.
        raise ValueError("--plot needs matplotlib, which is not installed: pip install matplotlib")
    for name in ("lr", "adamw_lr"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    model = LlamaConfig(
        vocab=args.vocab,
        hidden=args.hidden,
        intermediate=args.intermediate or 3 * args.hidden,
        layers=args.layers,
        heads=args.heads,
        seq_len=args.seq_len,
        experts=args.moe,
    )
    if args.moe and args.tp > 1:
        raise ValueError(
            "--moe with --tp: the demo's tensor-parallel plan does not split experts, and dmuon "
            "steps whole experts where FSDP2 holds them; drop --tp for the MoE run"
        )
    for what, size in (
        ("--heads", model.heads),
        ("the key/value heads", model.n_kv_heads),
        ("--intermediate", model.intermediate),
    ):
        if size % args.tp:
            raise ValueError(
                f"--tp {args.tp} must divide {what} ({size}): each tensor-parallel rank holds"
                " an equal share of every projection"
            )
    if args.qk_clip is not None and not args.qk_clip > 0:
        raise ValueError(
            f"--qk-clip must be > 0 (the largest logit a head may keep), got {args.qk_clip}"
        )
    if args.only == RunKind.DMUON_QK and args.qk_clip is None:
        raise ValueError("--only dmuon-qk needs --qk-clip TAU")
    runs: tuple[RunKind, ...] = (RunKind.ADAMW, RunKind.DMUON)
    if args.qk_clip is not None:
        runs += (RunKind.DMUON_QK,)
    if args.only:
        runs = (RunKind(args.only),)
    return DemoOptions(
        model=model,
        steps=args.steps,
        batch_size=args.batch_size,
        replicate=args.replicate,
        tp=args.tp,
        zero=args.zero,
        seed=args.seed,
        lr=args.lr,
        adamw_lr=args.adamw_lr,
        runs=runs,
        qk_clip=args.qk_clip,
    )


def _largest_divisor_below(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


class _Progress:
    """Prints rank 0's step events (and dmuon's log lines) as they arrive."""

    def __init__(self, out: TextIO) -> None:
        self.out = out

    def __call__(self, event: StepEvent | LogEvent) -> None:
        if isinstance(event, LogEvent):
            print(event.message, file=self.out, flush=True)
            return
        print(
            f"step {event.step:>{len(str(event.steps))}}/{event.steps}  {event.run.value:<5}"
            f" loss {event.loss:.4f}  {event.seconds:.2f} s/it",
            file=self.out,
            flush=True,
        )


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _table(
    per_rank: Sequence[Sequence[RunResult]],
    opts: DemoOptions,
    world_size: int,
    stream: MarkovStream,
    device_type: str = "cpu",
) -> str:
    """The final comparison; ``per_rank[rank][run]`` as the ranks returned them. Beside the
    runs it shows FSDP2 + a plain Muon, the design dmuon replaces, which the demo does not run:
    its bytes are computed, and the table says so. The line under the table compares dmuon's
    bytes with each other row's, in the figures the table shows."""
    first = per_rank[0][0]
    p_m = first.muon_numel * first.muon_itemsize
    mesh = Mesh(world_size // (opts.replicate * opts.tp), opts.replicate, opts.tp)
    shard = fsdp_shard_bytes(opts.model, mesh, first.muon_itemsize)
    plain = fsdp_bytes(mesh, opts.zero, shard, p_m, plain_muon=True)
    formula = "formula (FSDP2's sharding)"
    header = (
        "run",
        "final loss",
        "mean step",
        "Muon bytes/step/rank",
        "bytes from",
        "NS per matrix",
    )
    rows = [header]
    steps: dict[RunKind, float] = {}
    moved: dict[RunKind, float] = {}
    for i, r in enumerate(per_rank[0]):
        timed = r.seconds[1:] or r.seconds  # the first step pays for warm-up
        steps[r.run] = statistics.mean(timed)
        if r.run is not RunKind.ADAMW:
            moved[r.run], source = counted_bytes([rank[i] for rank in per_rank], mesh, p_m)
            ns = "1 (its owner)" if opts.tp == 1 else f"1 (its owner's {opts.tp} TP ranks)"
        else:
            moved[r.run] = fsdp_bytes(mesh, opts.zero, shard, p_m, plain_muon=False)
            source, ns = formula, "0 (no Muon)"
        loss, step = f"{r.losses[-1]:.4f}", f"{steps[r.run]:.3f} s"
        rows.append((_LABELS[r.run], loss, step, _fmt_bytes(moved[r.run]), source, ns))
    rows.append((_PLAIN, "not run", "-", _fmt_bytes(plain), formula, f"{world_size} (every rank)"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if RunKind.DMUON in moved:
        against = (
            [
                f"{compare(moved[RunKind.DMUON], moved[RunKind.ADAMW])} {_LABELS[RunKind.ADAMW]}"
                " (run; its bytes by formula)"
            ]
            if RunKind.ADAMW in moved
            else []
        )
        against.append(f"{compare(moved[RunKind.DMUON], plain)} {_PLAIN} (not run; formula)")
        lines.append(f"bytes: dmuon moved {' and '.join(against)}.")
    what = (
        "the 2-D Muon matrices: attention projections and routers; the expert stacks, Muon too,"
        " are stepped per expert where FSDP2 holds them and move as FSDP2 moves them, the same"
        " in every run"
        if opts.model.experts
        else "the 2-D attention and MLP projections"
    )
    lines += [
        f"P_M = {_fmt_bytes(p_m)}: the Muon-target weights ({what}). A round moves P_M over a"
        " group of n ranks at (n-1)/n·P_M per rank.",
        f"Z{opts.zero} (this run): Z3 frees the weights a rank received once forward is done"
        " and sends them again for backward; Z2 keeps them until backward.",
        f"{_PLAIN} all-gathers every full gradient and runs NS on every rank; dmuon sends each"
        " matrix's gradient to one owner (reduce), which alone runs NS and broadcasts the"
        " weight. 'bytes from': counted from the collectives dmuon issued in this run, or"
        " computed from FSDP2's sharding of the same matrices (its all-gathers and"
        " reduce-scatters move G-1 of a matrix's G padded chunks per rank), since FSDP2's"
        " collectives are not counted.",
        *(
            [
                f"TP {opts.tp}: a rank holds 1/{opts.tp} of each projection, and dmuon's rounds"
                f" move only those shards (P_M/{opts.tp} per TP index); NS of a sharded matrix"
                " gathers it to one rank of its TP group or all-reduces Gram matrices ('tp NS',"
                " StepOptions(tp_ns='auto'))."
            ]
            if opts.tp > 1
            else []
        ),
        "loads=[...] in the plan line above: the estimated NS work each rank owns"
        " (imbalance = max/mean - 1).",
        f"loss: starts near ln(vocab) = {stream.uniform_loss:.3f}; best possible on this stream"
        f" {stream.loss_floor():.3f}. Mean step excludes step 1 (warm-up).",
    ]
    slower = RunKind.DMUON in steps and steps[RunKind.DMUON] > steps.get(RunKind.ADAMW, math.inf)
    if device_type == "cpu" and slower:
        cores = os.cpu_count() or 1
        lines.append(
            "step time on CPU: dmuon's step runs Newton-Schulz on every Muon matrix (5"
            " iterations of matrix products each), compute that AdamW's elementwise update does"
            f" not have, on {world_size} ranks sharing {cores} CPU core(s); and gloo moves bytes"
            " through this machine's memory, so fewer bytes barely shorten a step here. On GPUs"
            " NS is a small part of a step and the saved bytes are interconnect time."
        )
    return "\n".join(lines)


def _plot(path: str, results: Sequence[RunResult], opts: DemoOptions) -> None:
    """Both loss curves (rank 0's records; the loss is already the global mean)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        ax.plot(range(1, len(r.losses) + 1), r.losses, label=_LABELS[r.run])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats)")
    ax.set_title(f"dmuon demo: {opts.model.layers} layers, hidden {opts.model.hidden}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _max_logit_report(results: Sequence[RunResult], opts: DemoOptions) -> str:
    """Each layer's largest attention logit at the last step and its peak over the run, for
    the runs that recorded them (--qk-clip)."""
    recorded = [r for r in results if r.max_logits]
    lines = [
        f"largest attention logit per layer (QK-clip at τ = {opts.qk_clip:g}): last step"
        " (peak over the run)"
    ]
    width = max(len(_LABELS[r.run]) for r in recorded)
    for r in recorded:
        cells = [
            f"{last:8.2f} ({max(step[i] for step in r.max_logits):.2f})"
            for i, last in enumerate(r.max_logits[-1])
        ]
        lines.append(f"  {_LABELS[r.run]:<{width}}  " + "  ".join(cells))
    lines.append(
        "  A head over τ in a step is scaled back to τ after it; the next update can raise it"
        " again by what one step adds, so the clipped logits hover at τ rather than under it."
    )
    return "\n".join(lines)


def _plot_max_logits(path: str, results: Sequence[RunResult], opts: DemoOptions) -> None:
    """Each layer's largest logit per step: dmuon without QK-clip solid, with it dashed
    (drawn only for a run with QK-clip, ``opts.qk_clip`` set)."""
    assert opts.qk_clip is not None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    styles = {RunKind.DMUON: "-", RunKind.DMUON_QK: "--"}
    for r in results:
        if not r.max_logits:
            continue
        for layer in range(len(r.max_logits[0])):
            ax.plot(
                range(1, len(r.max_logits) + 1),
                [step[layer] for step in r.max_logits],
                styles[r.run],
                color=f"C{layer}",
                label=f"layer {layer}, {_LABELS[r.run]}",
            )
    ax.axhline(opts.qk_clip, color="black", linewidth=0.8, label=f"τ = {opts.qk_clip:g}")
    ax.set_xlabel("step")
    ax.set_ylabel("largest attention logit")
    ax.set_title(f"max logit per layer, lr {opts.lr:g}")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _max_logits_path(path: str) -> str:
    """``loss.png`` -> ``loss-max-logits.png``."""
    return f"{path[: -len('.png')]}-max-logits.png"


def _header(opts: DemoOptions, world_size: int, device_type: str, backend: str) -> str:
    m = opts.model
    n_params = sum(p.numel() for p in TinyLlama(m).parameters())
    n_muon = sum(p.numel() for n, p in TinyLlama(m).named_parameters() if muon_predicate(n, p))
    shard = world_size // (opts.replicate * opts.tp)
    dims = [("replicate", opts.replicate), ("shard", shard), ("tp", opts.tp)]
    dims = [(n, k) for n, k in dims if n == "shard" or k > 1]
    sizes = ", ".join(str(k) for _, k in dims) + ("," if len(dims) == 1 else "")
    names = ", ".join(repr(n) for n, _ in dims) + ("," if len(dims) == 1 else "")
    mesh = f"({sizes}) ({names})" if len(dims) > 1 else f"({sizes}) {names[:-1]}"
    return (
        f"dmuon demo: {world_size} ranks on {device_type} ({backend}), mesh {mesh}, Z{opts.zero}\n"
        f"model: {m.layers} layers, hidden {m.hidden}, intermediate {m.intermediate},"
        f" {m.heads} heads, vocab {m.vocab}, seq {m.seq_len}; {n_params:,} params,"
        f" {n_muon:,} in Muon-target matrices\n"
        f"data: sparse Markov stream (seed {opts.seed}), global batch {opts.batch_size};"
        f" {opts.steps} steps per run"
    )


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None) -> int:
    """Entry point of ``dmuon-demo``; returns the process exit code."""
    out = out or sys.stdout
    parser = _parser()
    args = parser.parse_args(argv)
    torchrun = args.torchrun or ("TORCHELASTIC_RUN_ID" in os.environ and argv is None)
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if torchrun else args.nproc
    try:
        if torchrun and not {"RANK", "WORLD_SIZE"} <= os.environ.keys():
            raise ValueError(
                "--torchrun: RANK and WORLD_SIZE are not set; start the demo with"
                " `torchrun --nproc-per-node N --no-python dmuon-demo --torchrun`, or drop --torchrun"
                " to let it spawn --nproc ranks itself"
            )
        opts = _options(args, world_size)
        if torchrun:
            device_type, backend = choose_backend(
                args.device, int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            )
        else:
            device_type, backend = choose_backend(args.device, world_size)
    except ValueError as err:
        parser.error(str(err))  # exits with status 2 and the usage line

    stream = MarkovStream(opts.model.vocab, opts.model.seq_len, seed=opts.seed)
    progress = _Progress(out)
    per_rank: list[list[RunResult]]
    if not torchrun or int(os.environ["RANK"]) == 0:
        print(_header(opts, world_size, device_type, backend), file=out, flush=True)
    if torchrun:
        per_rank = torchrun_world(train_rank, (opts,), device=args.device, on_event=progress)
        if int(os.environ["RANK"]) != 0:
            return 0
    else:
        per_rank = spawn(
            train_rank,
            world_size,
            (opts,),
            device_type=device_type,
            backend=backend,
            on_event=progress,
        )[0]
    print(_table(per_rank, opts, world_size, stream, device_type), file=out, flush=True)
    if any(r.max_logits for r in per_rank[0]):
        print(_max_logit_report(per_rank[0], opts), file=out, flush=True)
    if args.plot:
        _plot(args.plot, per_rank[0], opts)
        print(f"loss curves saved to {args.plot}", file=out, flush=True)
        if any(r.max_logits for r in per_rank[0]):
            logits_path = _max_logits_path(args.plot)
            _plot_max_logits(logits_path, per_rank[0], opts)
            print(f"max logits per layer saved to {logits_path}", file=out, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
