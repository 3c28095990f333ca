"""What each demo rank runs: the FSDP2 + AdamW baseline, then dmuon, on the same data.

Both runs start from the same weights (every rank seeds the same generator before building
the model) and see the same global batches (``MarkovStream`` is a function of the step), so
their curves differ only by the optimizer and its distribution.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dmuon
from dmuon._demo_data import MarkovStream
from dmuon._demo_model import (
    LlamaConfig,
    TinyLlama,
    causal_attention,
    dedicated_matrix,
    muon_predicate,
    next_token_loss,
)
from dmuon._launch import RankContext

if TYPE_CHECKING:
    from dmuon_fsdp import CommCounter

__all__ = ["DemoOptions", "LogEvent", "RunKind", "RunResult", "StepEvent", "train_rank"]


class RunKind(StrEnum):
    ADAMW = "adamw"  # FSDP2 + torch.optim.AdamW on every parameter
    DMUON = "dmuon"  # dedicate_params → fully_shard → dmuon.Muon
    DMUON_QK = "dmuon-qk"  # the same with QK-clip (--qk-clip)


@dataclass(frozen=True)
class DemoOptions:
    """Everything a rank needs; validated by the CLI before any process starts."""

    model: LlamaConfig
    steps: int = 40
    batch_size: int = 16  # global, split evenly over the data-parallel ranks
    replicate: int = 1
    tp: int = 1  # tensor-parallel degree (1: none)
    zero: int = 3
    seed: int = 0
    lr: float = 0.02
    adamw_lr: float = 3e-3
    runs: tuple[RunKind, ...] = (RunKind.ADAMW, RunKind.DMUON)
    # τ of the dmuon-qk run; with it set, both dmuon runs record each layer's largest logit.
    qk_clip: float | None = None


@dataclass(frozen=True)
class StepEvent:
    """Rank 0's live report of one finished step."""

    run: RunKind
    step: int  # 1-based
    steps: int
    loss: float
    seconds: float


@dataclass(frozen=True)
class LogEvent:
    """A log record of dmuon's own (its one-line owner-plan summary), forwarded from rank 0."""

    message: str


class _ForwardLogs(logging.Handler):
    def __init__(self, ctx: RankContext) -> None:
        super().__init__(logging.INFO)
        self.ctx = ctx

    def emit(self, record: logging.LogRecord) -> None:
        self.ctx.emit(LogEvent(record.getMessage()))


@dataclass(frozen=True)
class RunResult:
    """One rank's record of one run. ``shard_bytes`` / ``replicate_bytes`` are the payload
    bytes of the dmuon collectives this rank took part in, per step, as dmuon's own
    ``CommCounter`` counted them (empty for the baseline, whose FSDP2 traffic is not counted);
    ``tp_wire`` is this rank's wire bytes per step of tensor-parallel Newton–Schulz."""

    run: RunKind
    muon_numel: int
    muon_itemsize: int
    losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    shard_bytes: list[int] = field(default_factory=list)
    replicate_bytes: list[int] = field(default_factory=list)
    tp_wire: list[float] = field(default_factory=list)
    # Per step, per layer: the largest logit over heads and the global batch (--qk-clip).
    max_logits: list[list[float]] = field(default_factory=list)


# torchtitan's Llama plan: q/k/v and gate/up split their output features, o/down their input
# features, so each layer's attention and MLP need one all-reduce each.
TP_PLAN = {
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(),
}


def build_mesh(device_type: str, world_size: int, replicate: int, tp: int = 1) -> DeviceMesh:
    """The whole mesh: ``('shard',)``, ``('replicate', 'shard')``, and ``'tp'`` last with
    tensor parallelism (so ranks ``rank // tp`` share one data-parallel index)."""
    shape: tuple[int, ...] = (world_size // (replicate * tp),)
    names: tuple[str, ...] = ("shard",)
    if replicate > 1:
        shape, names = (replicate, *shape), ("replicate", *names)
    if tp > 1:
        shape, names = (*shape, tp), (*names, "tp")
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def _data_parallel(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: every dimension but ``'tp'``."""
    names = mesh.mesh_dim_names or ()
    if "tp" not in names:
        return mesh
    dp = tuple(n for n in names if n != "tp")
    return mesh[dp[0]] if len(dp) == 1 else mesh[dp]


def _observed(clip: dmuon.QKClip, name: str):
    """An ``Attention.attend`` that records each head's largest logit (exact) for ``clip``."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        clip.observe(name, dmuon.max_logits(q, k, is_causal=True))
        return causal_attention(q, k, v)

    return attend


def _qk_clip(opts: DemoOptions, kind: RunKind, model: nn.Module) -> dmuon.QKClip | None:
    """With --qk-clip, a clip for the dmuon runs: at τ for dmuon-qk, recording only (τ = ∞)
    for dmuon; every attention observes into it."""
    if opts.qk_clip is None or kind is RunKind.ADAMW:
        return None
    clip = dmuon.QKClip(tau=opts.qk_clip if kind is RunKind.DMUON_QK else math.inf)
    cfg = opts.model
    for i, layer in enumerate(model.layers):  # type: ignore[arg-type]
        q = f"layers.{i}.self_attn.q_proj.weight"
        clip.add(q, f"layers.{i}.self_attn.k_proj.weight", cfg.heads, cfg.n_kv_heads)
        layer.self_attn.attend = _observed(clip, q)
    return clip


def _build(
    opts: DemoOptions, kind: RunKind, mesh: DeviceMesh, device: torch.device
) -> tuple[nn.Module, torch.optim.Optimizer, tuple[int, int], dmuon.QKClip | None]:
    """The model wrapped for ``kind`` and its optimizer, in the order dmuon requires
    (``dedicate_params`` → ``fully_shard`` layers, then root → ``Muon``), plus (elements,
    bytes per element) of its Muon-target matrices and the run's QK-clip (if any)."""
    torch.manual_seed(opts.seed)
    model = TinyLlama(opts.model).to(device)
    muon = [p for n, p in model.named_parameters() if dedicated_matrix(n, p)]
    muon_bytes = (sum(p.numel() for p in muon), muon[0].element_size())
    reshard = opts.zero == 3
    if opts.tp > 1:  # order: parallelize_module -> dedicate_params -> fully_shard
        tp_mesh = mesh["tp"]  # one object: each slice is a new mesh, which compile guards on
        for layer in model.layers:
            parallelize_module(layer, tp_mesh, TP_PLAN)
    if kind is not RunKind.ADAMW:
        dmuon.dedicate_params(
            model,
            mesh["shard"],
            muon_predicate,
            reshard_after_forward=reshard,
            replicate_mesh=mesh["replicate"] if opts.replicate > 1 else None,
        )
    dp_mesh = _data_parallel(mesh)
    # FSDP2 leaves the dedicated parameters (none in the AdamW run) to dmuon.
    dedicated = dmuon.dedicated_params_of(model)
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=dedicated)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=dedicated)
    optimizer: torch.optim.Optimizer
    clip = _qk_clip(opts, kind, model)
    if kind is not RunKind.ADAMW:
        optimizer = dmuon.Muon(model, lr=opts.lr, adamw_lr=opts.adamw_lr)
        if clip is not None:
            clip.attach(optimizer)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=opts.adamw_lr, weight_decay=0.01)
    return model, optimizer, muon_bytes, clip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_run(
    ctx: RankContext, opts: DemoOptions, kind: RunKind, mesh: DeviceMesh, stream: MarkovStream
) -> RunResult:
    model, optimizer, (numel, itemsize), clip = _build(opts, kind, mesh, ctx.device)
    result = RunResult(kind, muon_numel=numel, muon_itemsize=itemsize)
    counter = None
    if kind is not RunKind.ADAMW:
        counter = dmuon.runtime.get_comm_ctx(model).counter
    # The ranks of one tensor-parallel group read the same rows (see build_mesh).
    dp_rank, dp_size = ctx.rank // opts.tp, ctx.world_size // opts.tp
    for step in range(opts.steps):
        if counter is not None:
            counter.reset()
        tokens = stream.shard(step, opts.batch_size, dp_rank, dp_size).to(ctx.device)
        _sync(ctx.device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = next_token_loss(model, tokens)
        loss.backward()
        optimizer.step()
        # Every rank holds the same number of rows (a TP group the same rows), so the mean of
        # the rank means is the loss of the global batch. (gloo has no AVG, hence SUM.)
        total = loss.detach().clone()
        dist.all_reduce(total)
        mean = total.item() / ctx.world_size
        seconds = time.perf_counter() - start
        result.losses.append(mean)
        result.seconds.append(seconds)
        if clip is not None:  # the same on every rank (reduced over the world)
            result.max_logits.append(clip.last_max_logits().amax(dim=1).tolist())
        if counter is not None:
            result.shard_bytes.append(counter.bytes("shard"))
            result.replicate_bytes.append(counter.bytes("replicate"))
            result.tp_wire.append(_tp_wire(counter, opts.tp))
        ctx.emit(StepEvent(kind, step + 1, opts.steps, mean, seconds))
    return result


def _tp_wire(counter: CommCounter, tp: int) -> float:
    """Wire bytes of this rank's tensor-parallel NS collectives: a gather or scatter of a
    payload over T ranks moves (T-1)/T of it, an all-reduce twice that (ring)."""
    if tp == 1:
        return 0.0
    moved = counter.bytes("tp", "gather") + counter.bytes("tp", "scatter")
    return (moved + 2 * counter.bytes("tp", "all_reduce")) * (tp - 1) / tp


def train_rank(ctx: RankContext, opts: DemoOptions) -> list[list[RunResult]]:
    """One rank of the demo: every requested run, one after the other, on one mesh. Returns
    every rank's results (``[rank][run]``), gathered, so that rank 0 can report byte counts
    of the whole world even when it is one of many torchrun processes."""
    mesh = build_mesh(ctx.device.type, ctx.world_size, opts.replicate, opts.tp)
    stream = MarkovStream(opts.model.vocab, opts.model.seq_len, seed=opts.seed)
    # dedicate_params logs its plan summary (rank 0 only) at INFO: show it with the progress.
    library = logging.getLogger("dmuon_fsdp")
    handler = _ForwardLogs(ctx)
    library.addHandler(handler)
    level = library.level
    library.setLevel(logging.INFO)
    try:
        mine = [train_run(ctx, opts, kind, mesh, stream) for kind in opts.runs]
    finally:
        library.removeHandler(handler)
        library.setLevel(level)
    return _gather(ctx, mine)


def _gather(ctx: RankContext, mine: list[RunResult]) -> list[list[RunResult]]:
    """Every rank's results, ``[rank][run]``, through one tensor all-gather. Every rank ran the
    same runs for the same number of steps, so each packs into the same (runs, 5, steps) shape;
    byte counts are integers far below 2**53, exact in float64. (An object collective would
    pickle through numpy, which the demo does not need otherwise.)"""
    rows = []
    for r in mine:
        zeros = [0] * len(r.losses)  # the baseline counts no bytes
        rows.append(
            [
                r.losses,
                r.seconds,
                r.shard_bytes or zeros,
                r.replicate_bytes or zeros,
                r.tp_wire or zeros,
            ]
        )
    packed = torch.tensor(rows, dtype=torch.float64, device=ctx.device)
    parts = [torch.empty_like(packed) for _ in range(ctx.world_size)]
    dist.all_gather(parts, packed)
    everyone = []
    for part in parts:
        unpacked = part.cpu().tolist()
        everyone.append(
            [
                RunResult(
                    r.run,
                    r.muon_numel,
                    r.muon_itemsize,
                    losses=losses,
                    seconds=seconds,
                    shard_bytes=[round(b) for b in shard] if r.shard_bytes else [],
                    replicate_bytes=[round(b) for b in replicate] if r.replicate_bytes else [],
                    tp_wire=tp_wire if r.tp_wire else [],
                    max_logits=r.max_logits,
                )
                for r, (losses, seconds, shard, replicate, tp_wire) in zip(mine, unpacked)
            ]
        )
    return everyone
