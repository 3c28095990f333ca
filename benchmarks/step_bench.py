"""One training iteration of a Llama-style stack on one GPU: AdamW, torch.optim.Muon, dmuon.

    python benchmarks/step_bench.py                         # both configs (2048x8192x16, 4096x14336x8)
    python benchmarks/step_bench.py --config 4096x14336x8   # one of them
    python benchmarks/step_bench.py --config 576x1536x30    # many small matrices (SmolLM-135M-like)
    python benchmarks/step_bench.py --precision bf16-mixed  # fp32 masters, bf16 compute
    python benchmarks/step_bench.py --device cpu --config tiny --iters 2   # smoke test, no GPU
    python benchmarks/step_bench.py --config 2048x8192x16 --variants dmuon,dmuon-qk --qk-clip 100

World size 1, a single process in a 1-rank process group (NCCL on CUDA, gloo on CPU). The stack
is Llama-3 shaped (grouped-query attention with 8 KV heads, SwiGLU MLP, RMSNorm; no embedding
or head). ``--precision`` picks the dtypes:

  bf16         (default) bf16 weights, random bf16 inputs: every variant computes and keeps its
               optimizer states in bf16
  bf16-mixed   fp32 weights (the masters the optimizers update, states fp32 too), bf16 compute,
               random fp32 inputs: the FSDP2 variants through ``MixedPrecisionPolicy(param_dtype=
               bf16, reduce_dtype=fp32)`` on every layer and the root (which casts the inputs),
               the others by running forward and the loss under ``torch.autocast`` (bf16)

For every variant it reports the median over ``--iters`` timed iterations after ``--warmup``
ones, from CUDA events, of

  fwd+bwd ms   forward + backward of ``out.float().square().mean()``
  step ms      ``optimizer.step()``
  iter ms      the whole iteration (zero_grad, fwd, bwd, step) on the host clock, synchronised
               at both ends, so work dmuon issues on its own streams is included
  peak GiB     ``torch.cuda.max_memory_allocated`` over the timed iterations (states included)
  step GiB     the same, during ``optimizer.step()`` alone (weights, grads, optimizer states and
               the step's temporaries; activations are gone by then), which is what the
               optimizer itself costs

and, below the table, the first iteration of every variant against its warm one (``iter ms``),
on the host clock, synchronised at both ends: what a new job pays before its steps settle. For
dmuon that is the cold start on an empty NS autotune cache: each measuring process points
``DMUON_NS_CACHE_DIR`` at a new temporary directory of its own before anything uses dmuon-ns
(a directory from the environment is overridden), checks that dmuon-ns has seen no problem yet,
and only after the first iteration settles the open choices with ``dmuon_ns.tune_pending()``,
so the timed iterations run the tuned kernels. ``dmuon.Muon`` also compiles its fused Triton
step kernels, in a background thread, which on a new node (an empty ``TRITON_CACHE_DIR``: point
it at a new directory to measure one) takes a few seconds of that thread's time; the first
iterations run the same arithmetic as torch ops meanwhile; the timed ones start after it has
finished. cuBLAS is started before the first
variant, so no variant is charged for it.

Variants: ``plain``: the model with no optimizer (fwd+bwd only); ``fsdp2``: the model under
``fully_shard`` (fwd+bwd only); ``adamw``: fused AdamW on every parameter (bf16-mixed: of the
model under ``fully_shard`` with the policy, FSDP2's usual mixed-precision setup); ``torch-muon``:
``torch.optim.Muon`` on the 2-D projection matrices (lr scaled to AdamW's RMS, as dmuon does) +
fused AdamW on the rest; ``dmuon``: ``dedicate_params`` → ``fully_shard(...,
ignored_params=dedicated_params_of(model))`` → ``dmuon.Muon`` (its dedicated parameters follow
the policy: bf16 broadcast and compute, fp32 reduce, fp32 masters and states on the owner);
``dmuon-overlap``: ``dmuon`` with ``StepOptions(ns_overlap=True)`` (Newton–Schulz during
backward, on a side stream; its ``step ms`` is what is left for the step, ``iter ms`` says
whether the whole iteration gained); ``dmuon-graph``: ``dmuon`` with
``StepOptions(cuda_graph=True)`` (the Muon phase replayed from a CUDA graph; the line below its
table counts its captures and replays); ``dmuon-qk`` (with ``--qk-clip TAU``): ``dmuon`` with ``dmuon.QKClip(tau=TAU)`` on every layer's
attention, whose forward feeds ``clip.observe`` (``--qk-stat``: ``lse``, the default, runs the
flash kernel that returns each row's log-sum-exp, ``torch.ops.aten._scaled_dot_product_flash_
attention`` on CUDA with the key/value heads repeated to the query heads, and observes the bound
``dmuon.qk_clip.max_logits_from_lse``; ``exact`` keeps SDPA and adds ``dmuon.max_logits``, one more
``Q Kᵀ`` in float32). Below its table: its step and fwd+bwd against ``dmuon``'s, measured in
the same process (QK-clip's step work, one MAX all-reduce of the (layers, heads) maxima (none on
one rank) and one row scale of every W_q and W_k, does not depend on how many heads are over τ).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from dmuon._demo_model import LlamaConfig, LlamaStack, causal_attention, muon_predicate

CONFIGS = {
    # Llama-3.2-1B-like and Llama-3-8B-like layer shapes.
    "2048x8192x16": LlamaConfig(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8),
    "4096x14336x8": LlamaConfig(hidden=4096, intermediate=14336, layers=8, heads=32, kv_heads=8),
    # SmolLM-135M-like: many small matrices (30 layers x 7), where launch counts show.
    "576x1536x30": LlamaConfig(hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3),
    "tiny": LlamaConfig(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2),
}
VARIANTS = (
    "plain",
    "fsdp2",
    "adamw",
    "torch-muon",
    "dmuon",
    "dmuon-overlap",
    "dmuon-graph",
    "dmuon-qk",
)


class Precision(StrEnum):
    BF16 = "bf16"  # bf16 weights, states and compute
    BF16_MIXED = "bf16-mixed"  # fp32 weights and states, bf16 compute

    @property
    def input_dtype(self) -> torch.dtype:
        # Mixed: fp32 in, as from an fp32 embedding; the policy or autocast casts it.
        return torch.bfloat16 if self is Precision.BF16 else torch.float32

    def describe(self) -> str:
        return "bf16" if self is Precision.BF16 else "fp32 masters, bf16 compute"


@dataclass
class Measured:
    fwd_bwd_ms: float
    step_ms: float | None
    iter_ms: float
    peak_gib: float
    step_peak_gib: float
    first_iter_ms: float  # the first iteration, host clock (``iter_ms`` is the warm median)


class _Timer:
    """CUDA events on the current stream (CPU: host clock)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, start: Any, end: Any) -> float:
        if self.cuda:
            return float(start.elapsed_time(end))
        return (end - start) * 1e3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _start_cublas(device: torch.device) -> None:
    """Create cuBLAS's handles and workspaces (fp32 and bf16 products), which a process pays
    for once whatever it trains: otherwise the first variant's first iteration would."""
    if device.type != "cuda":
        return
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.ones(256, 256, device=device, dtype=dtype)
        a @ a
    _sync(device)


def _fresh_ns_cache(directory: str) -> None:
    """Point dmuon-ns's autotune cache at ``directory``, which must not exist yet; done before
    anything in this process uses dmuon-ns (it reads the variable when it looks a problem up)."""
    if os.path.exists(directory):
        raise RuntimeError(f"{directory} exists; the autotune cache must start empty")
    os.environ["DMUON_NS_CACHE_DIR"] = directory


def _check_ns_cold() -> None:
    """Raise unless dmuon starts cold: no verdict on disk, no problem seen in this process."""
    import dmuon_ns

    directory = os.environ.get("DMUON_NS_CACHE_DIR", "")
    if not directory or (os.path.isdir(directory) and os.listdir(directory)):
        raise RuntimeError(f"DMUON_NS_CACHE_DIR={directory!r}: expected a new, empty directory")
    tune = getattr(dmuon_ns, "tune_pending", None)  # absent before the spread tuner
    seen = tune() if tune is not None else {}  # every problem seen so far (none: no-op)
    if seen:
        raise RuntimeError(f"dmuon-ns has already seen {sorted(seen)} in this process")


class QKStat(StrEnum):
    LSE = "lse"  # the flash kernel's log-sum-exp: an upper bound, no extra work
    EXACT = "exact"  # SDPA plus dmuon.max_logits: one more Q Kᵀ


def _observing(clip: Any, name: str, stat: QKStat) -> Any:
    """An ``Attention.attend`` that feeds ``clip.observe`` for attention ``name``."""
    import dmuon

    def exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        clip.observe(name, dmuon.max_logits(q, k, is_causal=True))
        return causal_attention(q, k, v)

    def lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.device.type == "cuda":
            group = q.shape[1] // k.shape[1]
            if group > 1:  # the kernel takes as many key heads as query heads
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            flash = torch.ops.aten._scaled_dot_product_flash_attention
            out, logsumexp, *_ = flash(q, k, v, 0.0, True)
        else:
            flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
            out, logsumexp = flash(q, k, v, 0.0, True)
        clip.observe(name, dmuon.qk_clip.max_logits_from_lse(logsumexp))
        return out

    return exact if stat is QKStat.EXACT else lse


class _Built(NamedTuple):
    model: nn.Module
    optimizers: list[torch.optim.Optimizer]
    autocast: bool  # forward and loss under torch.autocast (bf16)


def _build(
    variant: str,
    cfg: LlamaConfig,
    device: torch.device,
    mesh: Any,
    precision: Precision,
    qk: tuple[float, QKStat] | None = None,
    options: dict[str, Any] | None = None,
) -> _Built:
    torch.manual_seed(0)
    with device:
        model = LlamaStack(cfg)
    mixed = precision is Precision.BF16_MIXED
    if not mixed:
        model = model.to(torch.bfloat16)
    # Mixed AdamW is FSDP2's own mixed precision; unsharded mixed variants use autocast.
    sharded = variant.startswith(("fsdp2", "dmuon")) or (mixed and variant == "adamw")
    if sharded:
        shard_kwargs: dict[str, Any] = {}
        if mixed:
            shard_kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        if variant.startswith("dmuon"):
            import dmuon

            dmuon.dedicate_params(model, mesh, muon_predicate)
            shard_kwargs["ignored_params"] = dmuon.dedicated_params_of(model)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, **shard_kwargs)
        fully_shard(model, mesh=mesh, **shard_kwargs)
    optimizers: list[torch.optim.Optimizer] = []
    if variant == "adamw":
        optimizers.append(torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
    elif variant == "torch-muon":
        matrices = [p for n, p in model.named_parameters() if muon_predicate(n, p)]
        rest = [p for n, p in model.named_parameters() if not muon_predicate(n, p)]
        optimizers.append(
            torch.optim.Muon(matrices, lr=0.02, weight_decay=0.0, adjust_lr_fn="match_rms_adamw")
        )
        optimizers.append(torch.optim.AdamW(rest, lr=1e-4, fused=True))
    elif variant.startswith("dmuon"):
        import dmuon

        clip = None
        if variant == "dmuon-qk":
            assert qk is not None, "dmuon-qk needs --qk-clip"
            clip = dmuon.QKClip(tau=qk[0])
            for i, layer in enumerate(model.layers):
                q = f"layers.{i}.self_attn.q_proj.weight"
                clip.add(q, f"layers.{i}.self_attn.k_proj.weight", cfg.heads, cfg.n_kv_heads)
                layer.self_attn.attend = _observing(clip, q, qk[1])
        step_options = dmuon.StepOptions(
            ns_overlap=variant == "dmuon-overlap",
            cuda_graph=variant == "dmuon-graph",
            **(options or {}),
        )
        optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-4, options=step_options)
        if clip is not None:
            clip.attach(optimizer)
        optimizers.append(optimizer)
    return _Built(model, optimizers, autocast=mixed and not sharded)


def _add_ns_batch_mib(p: argparse.ArgumentParser) -> None:
    """Add ``--ns-batch-mib``, which :func:`_step_options` reads (``moe_bench`` takes it too, so
    that both benchmarks batch NS alike for one flag)."""
    p.add_argument(
        "--ns-batch-mib",
        type=int,
        metavar="MIB",
        help="dmuon's StepOptions(ns_batch_bytes=MIB MiB); 0: no cap (default: dmuon's default)",
    )


def _step_options(ns_batch_mib: int | None) -> dict[str, Any]:
    """The ``dmuon.StepOptions`` fields the command line sets (``--ns-batch-mib``; 0: no cap)."""
    if ns_batch_mib is None:
        return {}
    return {"ns_batch_bytes": ns_batch_mib * 2**20 or None}


def _wait_for_fused_compile() -> None:
    """Wait for ``Muon(model)``'s background compile of the fused step kernels: until it ends
    the step runs their torch-op fallback, and the timed steps are meant to run the kernels
    (``moe_bench`` waits with it too)."""
    try:
        from dmuon_fsdp.optim._fused import _join_background
    except ImportError:  # a version without the background compile
        return
    _join_background()


def measure(
    variant: str,
    cfg: LlamaConfig,
    device: torch.device,
    mesh: Any,
    precision: Precision,
    tokens: int,
    warmup: int,
    iters: int,
    qk: tuple[float, QKStat] | None = None,
    trace_step: bool = False,
    options: dict[str, Any] | None = None,
) -> Measured:
    if variant == "dmuon":
        _check_ns_cold()
    model, optimizers, autocast = _build(variant, cfg, device, mesh, precision, qk, options)
    batch = max(1, tokens // cfg.seq_len)
    gen = torch.Generator(device=device).manual_seed(1)
    inputs = [
        torch.randn(batch, cfg.seq_len, cfg.hidden, device=device, generator=gen).to(
            precision.input_dtype
        )
        for _ in range(2)
    ]

    def forward_context() -> contextlib.AbstractContextManager[Any]:
        # Backward runs outside: autocast records each op's dtype for it (torch's advice).
        if autocast:
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    timer = _Timer(device)
    first_ms = 0.0
    fwd_bwd: list[float] = []
    step: list[float] = []
    whole: list[float] = []
    cuda = device.type == "cuda"
    peak = step_peak = 0
    for i in range(warmup + iters):
        if i == 1 and variant.startswith("dmuon"):
            # dmuon-ns's autotuner measures its candidates over the steps after the first, a
            # bounded share of the time at a time; the timed steps are meant to run the
            # settled kernels, so every choice the first step opened is finished here.
            import dmuon_ns

            tune = getattr(dmuon_ns, "tune_pending", None)  # absent before the spread tuner
            if tune is not None:
                tune()
        if i == warmup and variant.startswith("dmuon"):
            _wait_for_fused_compile()
        if i == warmup:
            _sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        host = time.perf_counter()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        if not optimizers:
            model.zero_grad(set_to_none=True)
        t0 = timer.mark()
        with forward_context():
            loss = model(inputs[i % 2]).float().square().mean()
        loss.backward()
        del loss  # as if never named: the graph's nodes go now, not at the next iteration
        t1 = timer.mark()
        if cuda and i >= warmup:
            # The allocator's statistics are host-side: no synchronisation needed here.
            peak = max(peak, torch.cuda.max_memory_allocated(device))
            torch.cuda.reset_peak_memory_stats(device)
        for opt in optimizers:
            opt.step()
        t2 = timer.mark()
        _sync(device)
        if i == 0:
            first_ms = (time.perf_counter() - host) * 1e3
        if i >= warmup:
            if cuda:
                step_peak = max(step_peak, torch.cuda.max_memory_allocated(device))
            whole.append((time.perf_counter() - host) * 1e3)
            fwd_bwd.append(timer.ms(t0, t1))
            step.append(timer.ms(t1, t2))
    graphed = getattr(optimizers[-1], "_graphed", None) if optimizers else None
    if graphed is not None:
        print(
            f"  {variant}: {graphed.captures} captures, {graphed.replays} replays in"
            f" {warmup + iters} steps",
            file=sys.stderr,
        )
    if trace_step and cuda:
        from gpu_trace import ns_tflop, print_product_rate, trace

        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        with forward_context():
            model(inputs[0]).float().square().mean().backward()
        kernel_ms = trace(
            f"{variant} step, {cfg.hidden}x{cfg.intermediate}x{cfg.layers}",
            lambda opts=optimizers: [o.step() for o in opts],
        )
        shapes = collections.Counter(
            tuple(p.shape) for n, p in model.named_parameters() if muon_predicate(n, p)
        )
        print_product_rate(kernel_ms, ns_tflop(dict(shapes), optimizers[-1].newton_schulz))
    del model, optimizers, inputs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Measured(
        fwd_bwd_ms=statistics.median(fwd_bwd),
        step_ms=statistics.median(step) if variant not in ("plain", "fsdp2") else None,
        iter_ms=statistics.median(whole),
        peak_gib=max(peak, step_peak) / 2**30,
        step_peak_gib=step_peak / 2**30,
        first_iter_ms=first_ms,
    )


def _n_params(cfg: LlamaConfig) -> tuple[int, int]:
    with torch.device("meta"):
        model = LlamaStack(cfg)
    total = sum(p.numel() for p in model.parameters())
    muon = sum(p.numel() for n, p in model.named_parameters() if muon_predicate(n, p))
    return total, muon


_FIELD_LABELS = {
    "fwd_bwd_ms": "fwd+bwd",
    "step_ms": "step",
    "peak_gib": "peak",
    "step_peak_gib": "step GiB",
}


class _Ratio(NamedTuple):
    field: str  # of Measured, dmuon's over ``of``'s
    of: str  # the variant dmuon is compared with
    mixed_target: float | None  # the goal at --precision bf16-mixed (printed only there)
    mixed_only: bool = False


_RATIOS = (
    _Ratio("fwd_bwd_ms", "plain", None),
    _Ratio("fwd_bwd_ms", "fsdp2", 1.05),
    # Mixed AdamW is FSDP2 with the same policy plus its optimizer.
    _Ratio("fwd_bwd_ms", "adamw", 1.05, mixed_only=True),
    _Ratio("peak_gib", "torch-muon", 1.1),
    _Ratio("step_peak_gib", "torch-muon", None),
    _Ratio("step_ms", "torch-muon", 0.6),
)


# QK-clip's step, over dmuon's without it (same run).
_QK_STEP_TARGET = 1.03

# The most a first iteration on an empty autotune cache may take over a warm one.
_COLD_START_TARGET_S = 2.0


def _report(
    name: str,
    cfg: LlamaConfig,
    results: dict[str, Measured],
    tokens: int,
    precision: Precision,
) -> str:
    total, muon = _n_params(cfg)
    lines = [
        f"config {name}: H={cfg.hidden} I={cfg.intermediate} layers={cfg.layers}"
        f" heads={cfg.heads}/{cfg.n_kv_heads}kv; {total / 1e9:.3f} B params"
        f" ({muon / 1e9:.3f} B Muon-target), {precision.describe()}, {tokens} tokens per"
        " iteration",
        f"{'variant':<13} {'fwd+bwd ms':>10} {'step ms':>9} {'iter ms':>9} {'peak GiB':>9}"
        f" {'step GiB':>9}",
    ]
    for variant, m in results.items():
        step = f"{m.step_ms:9.2f}" if m.step_ms is not None else f"{'-':>9}"
        lines.append(
            f"{variant:<13} {m.fwd_bwd_ms:10.2f} {step} {m.iter_ms:9.2f} {m.peak_gib:9.2f}"
            f" {m.step_peak_gib:9.2f}"
        )
    mixed = precision is Precision.BF16_MIXED
    dmuon = results.get("dmuon")
    for ratio in _RATIOS:
        other = results.get(ratio.of)
        if dmuon is None or other is None or (ratio.mixed_only and not mixed):
            continue
        a, b = getattr(dmuon, ratio.field) or 0.0, getattr(other, ratio.field) or 0.0
        if b > 0:
            what = _FIELD_LABELS[ratio.field]
            target = f" (target ≤ {ratio.mixed_target})" if mixed and ratio.mixed_target else ""
            lines.append(f"  dmuon {what} / {ratio.of} {what}: {a / b:.3f}{target}")
    overlap = results.get("dmuon-overlap")
    if overlap is not None and dmuon is not None:
        lines.append(
            f"  dmuon-overlap iter / dmuon iter: {overlap.iter_ms / dmuon.iter_ms:.3f}"
            f" (target ≤ 1); step: {(overlap.step_ms or 0.0) / (dmuon.step_ms or 1.0):.3f}"
        )
    graph = results.get("dmuon-graph")
    if graph is not None and dmuon is not None:
        lines.append(
            f"  dmuon-graph step / dmuon step: {(graph.step_ms or 0.0) / (dmuon.step_ms or 1.0):.3f}"
        )
    clipped = results.get("dmuon-qk")
    if clipped is not None and dmuon is not None:
        lines.append(
            f"  dmuon-qk step / dmuon step: {(clipped.step_ms or 0.0) / (dmuon.step_ms or 1.0):.3f}"
            f" (target ≤ {_QK_STEP_TARGET}); fwd+bwd: {clipped.fwd_bwd_ms / dmuon.fwd_bwd_ms:.3f}"
        )
    lines.append(
        "first iteration (host clock, synchronised at both ends; dmuon's NS autotune cache empty)"
    )
    lines.append(f"{'variant':<13} {'first s':>9} {'warm s':>9} {'first-warm s':>12}")
    for variant, m in results.items():
        first, warm = m.first_iter_ms / 1e3, m.iter_ms / 1e3
        target = f"  (target ≤ {_COLD_START_TARGET_S:g})" if variant == "dmuon" else ""
        lines.append(f"{variant:<13} {first:9.3f} {warm:9.3f} {first - warm:12.3f}{target}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--config",
        action="append",
        choices=sorted(CONFIGS),
        help="repeatable; default: the two Llama-shaped configs 2048x8192x16 and 4096x14336x8",
    )
    p.add_argument(
        "--variants",
        help="comma-separated subset (default: all; dmuon-qk only with --qk-clip)",
    )
    p.add_argument("--tokens", type=int, default=4096, help="tokens per iteration (default 4096)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument(
        "--precision",
        type=Precision,
        choices=list(Precision),
        default=Precision.BF16,
        help="bf16: bf16 weights (default); bf16-mixed: fp32 masters, bf16 compute",
    )
    p.add_argument(
        "--qk-clip",
        type=float,
        metavar="TAU",
        help="measure dmuon-qk: dmuon with QK-clip at τ = TAU (the step's work does not depend"
        " on TAU)",
    )
    p.add_argument(
        "--qk-stat",
        type=QKStat,
        choices=list(QKStat),
        default=QKStat.LSE,
        help="how dmuon-qk's attention gets each head's max logit: lse (the flash kernel's"
        " log-sum-exp, an upper bound, default) or exact (dmuon.max_logits, one more Q Kᵀ)",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="after timing, profile one more step of each dmuon variant: GPU time per kernel,"
        " busy and wall",
    )
    _add_ns_batch_mib(p)
    args = p.parse_args(argv)
    if args.warmup < 1:
        p.error("--warmup must be >= 1: the first iteration runs before autotuning settles")
    if args.variants is None:
        wanted = {v for v in VARIANTS if v != "dmuon-qk" or args.qk_clip is not None}
        if args.device == "cpu":
            wanted.discard("dmuon-graph")  # a CUDA graph
    else:
        wanted = {v for v in args.variants.split(",") if v}
        if args.device == "cpu" and "dmuon-graph" in wanted:
            p.error("--variants dmuon-graph needs --device cuda (the Muon phase as a CUDA graph)")
    unknown = sorted(wanted - set(VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    if "dmuon-qk" in wanted and (args.qk_clip is None or not args.qk_clip > 0):
        p.error("--variants dmuon-qk needs --qk-clip TAU (a positive τ)")
    qk = None if args.qk_clip is None else (args.qk_clip, args.qk_stat)
    # Always in VARIANTS order, dmuon (and dmuon-qk) last: whatever a variant leaves behind in
    # the process then cannot inflate the peak memory of a variant measured after it.
    variants = [v for v in VARIANTS if v in wanted]
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible; use --device cpu for a smoke test")

    configs = args.config or ["2048x8192x16", "4096x14336x8"]
    if len(configs) > 1:
        # One process per config, so that nothing one config leaves allocated (a dmuon model
        # that outlives ``del``, CUDA graphs, allocator state) counts in another's peak.
        rest = [a for a in (argv if argv is not None else sys.argv[1:])]
        rest = [
            a for i, a in enumerate(rest) if a != "--config" and rest[i - 1 : i] != ["--config"]
        ]
        for name in configs:
            done = subprocess.run([sys.executable, __file__, *rest, "--config", name], check=False)
            if done.returncode:
                return done.returncode
        return 0
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory() as tmp:
        # This process's own, whatever the environment or a parent process set.
        _fresh_ns_cache(os.path.join(tmp, "ns-autotune"))
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"file://{os.path.join(tmp, 'rdv')}",
            rank=0,
            world_size=1,
        )
        try:
            mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("shard",))
            _start_cublas(device)
            import dmuon

            gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            print(
                f"torch {torch.__version__}, {gpu}, python {sys.version.split()[0]};"
                f" dmuon NS: {dmuon.get_ns_backend()}",
                flush=True,
            )
            for name in configs:
                cfg = CONFIGS[name]
                cfg = LlamaConfig(**{**cfg.__dict__, "seq_len": min(args.seq_len, args.tokens)})
                results: dict[str, Measured] = {}
                for variant in variants:
                    results[variant] = measure(
                        variant,
                        cfg,
                        device,
                        mesh,
                        args.precision,
                        args.tokens,
                        args.warmup,
                        args.iters,
                        qk,
                        trace_step=args.trace and variant.startswith("dmuon"),
                        options=_step_options(args.ns_batch_mib),
                    )
                    print(f"  measured {name} {variant}", file=sys.stderr, flush=True)
                print(_report(name, cfg, results, args.tokens, args.precision), flush=True)
        finally:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
