"""One training iteration of a Llama-style stack on one GPU: AdamW, torch.optim.Muon, dmuon.

    python benchmarks/step_bench.py                         # both configs (2048x8192x16, 4096x14336x8)
    python benchmarks/step_bench.py --config 4096x14336x8   # one of them
    python benchmarks/step_bench.py --device cpu --config tiny --iters 2   # smoke test, no GPU

World size 1, a single process in a 1-rank process group (NCCL on CUDA, gloo on CPU). The stack
is Llama-3 shaped (grouped-query attention with 8 KV heads, SwiGLU MLP, RMSNorm; no embedding
or head), bf16 weights, random bf16 inputs. For every variant it reports the median over
``--iters`` timed iterations after ``--warmup`` ones, from CUDA events, of

  fwd+bwd ms   forward + backward of ``out.float().square().mean()``
  step ms      ``optimizer.step()``
  iter ms      the whole iteration (zero_grad, fwd, bwd, step) on the host clock, synchronised
               at both ends, so work dmuon issues on its own streams is included
  peak GiB     ``torch.cuda.max_memory_allocated`` over the timed iterations (states included)
  step GiB     the same, during ``optimizer.step()`` alone (weights, grads, optimizer states and
               the step's temporaries; activations are gone by then), which is what the
               optimizer itself costs

Variants: ``plain``: the model with no optimizer (fwd+bwd only); ``fsdp2``: the model under
``fully_shard`` (fwd+bwd only); ``adamw``: fused AdamW on every parameter; ``torch-muon``:
``torch.optim.Muon`` on the 2-D projection matrices (lr scaled to AdamW's RMS, as dmuon does) +
fused AdamW on the rest; ``dmuon``: ``dedicate_params`` → ``fully_shard`` → ``dmuon.Muon``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dmuon._demo_model import LlamaConfig, LlamaStack, muon_predicate

CONFIGS = {
    # Llama-3.2-1B-like and Llama-3-8B-like layer shapes (the two rows of GPU.md).
    "2048x8192x16": LlamaConfig(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8),
    "4096x14336x8": LlamaConfig(hidden=4096, intermediate=14336, layers=8, heads=32, kv_heads=8),
    "tiny": LlamaConfig(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2),
}
VARIANTS = ("plain", "fsdp2", "adamw", "torch-muon", "dmuon")


@dataclass
class Measured:
    fwd_bwd_ms: float
    step_ms: float | None
    iter_ms: float
    peak_gib: float
    step_peak_gib: float


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


def _build(
    variant: str, cfg: LlamaConfig, device: torch.device, mesh: Any
) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    with device:
        model = LlamaStack(cfg).to(torch.bfloat16)
    if variant in ("fsdp2", "dmuon"):
        if variant == "dmuon":
            import dmuon

            dmuon.dedicate_params(model, mesh, muon_predicate)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    fused = device.type == "cuda"
    optimizers: list[torch.optim.Optimizer] = []
    if variant == "adamw":
        optimizers.append(torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused))
    elif variant == "torch-muon":
        matrices = [p for n, p in model.named_parameters() if muon_predicate(n, p)]
        rest = [p for n, p in model.named_parameters() if not muon_predicate(n, p)]
        optimizers.append(
            torch.optim.Muon(matrices, lr=0.02, weight_decay=0.0, adjust_lr_fn="match_rms_adamw")
        )
        optimizers.append(torch.optim.AdamW(rest, lr=1e-4, fused=fused))
    elif variant == "dmuon":
        import dmuon

        optimizers.append(dmuon.Muon(model, lr=0.02, adamw_lr=1e-4))
    return model, optimizers


def measure(
    variant: str,
    cfg: LlamaConfig,
    device: torch.device,
    mesh: Any,
    tokens: int,
    warmup: int,
    iters: int,
) -> Measured:
    model, optimizers = _build(variant, cfg, device, mesh)
    batch = max(1, tokens // cfg.seq_len)
    gen = torch.Generator(device=device).manual_seed(1)
    inputs = [
        torch.randn(batch, cfg.seq_len, cfg.hidden, device=device, generator=gen).to(torch.bfloat16)
        for _ in range(2)
    ]
    timer = _Timer(device)
    fwd_bwd: list[float] = []
    step: list[float] = []
    whole: list[float] = []
    cuda = device.type == "cuda"
    peak = step_peak = 0
    for i in range(warmup + iters):
        if i == 1 and variant == "dmuon":
            # dmuon-ns's autotuner measures its candidates over the steps after the first, a
            # bounded share of the time at a time; the timed steps are meant to run the
            # settled kernels, so every choice the first step opened is finished here.
            import dmuon_ns

            tune = getattr(dmuon_ns, "tune_pending", None)  # absent before the spread tuner
            if tune is not None:
                tune()
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
        model(inputs[i % 2]).float().square().mean().backward()
        t1 = timer.mark()
        if cuda and i >= warmup:
            # The allocator's statistics are host-side: no synchronisation needed here.
            peak = max(peak, torch.cuda.max_memory_allocated(device))
            torch.cuda.reset_peak_memory_stats(device)
        for opt in optimizers:
            opt.step()
        t2 = timer.mark()
        _sync(device)
        if i >= warmup:
            if cuda:
                step_peak = max(step_peak, torch.cuda.max_memory_allocated(device))
            whole.append((time.perf_counter() - host) * 1e3)
            fwd_bwd.append(timer.ms(t0, t1))
            step.append(timer.ms(t1, t2))
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
    )


def _n_params(cfg: LlamaConfig) -> tuple[int, int]:
    with torch.device("meta"):
        model = LlamaStack(cfg)
    total = sum(p.numel() for p in model.parameters())
    muon = sum(p.numel() for n, p in model.named_parameters() if muon_predicate(n, p))
    return total, muon


def _report(name: str, cfg: LlamaConfig, results: dict[str, Measured], tokens: int) -> str:
    total, muon = _n_params(cfg)
    lines = [
        f"config {name}: H={cfg.hidden} I={cfg.intermediate} layers={cfg.layers}"
        f" heads={cfg.heads}/{cfg.n_kv_heads}kv; {total / 1e9:.3f} B params"
        f" ({muon / 1e9:.3f} B Muon-target), bf16, {tokens} tokens per iteration",
        f"{'variant':<11} {'fwd+bwd ms':>10} {'step ms':>9} {'iter ms':>9} {'peak GiB':>9}"
        f" {'step GiB':>9}",
    ]
    for variant, m in results.items():
        step = f"{m.step_ms:9.2f}" if m.step_ms is not None else f"{'-':>9}"
        lines.append(
            f"{variant:<11} {m.fwd_bwd_ms:10.2f} {step} {m.iter_ms:9.2f} {m.peak_gib:9.2f}"
            f" {m.step_peak_gib:9.2f}"
        )
    checks: list[tuple[str, Callable[[], tuple[float, float]]]] = [
        ("dmuon fwd+bwd / plain fwd+bwd", lambda: (results["dmuon"].fwd_bwd_ms, results["plain"].fwd_bwd_ms)),
        ("dmuon fwd+bwd / fsdp2 fwd+bwd", lambda: (results["dmuon"].fwd_bwd_ms, results["fsdp2"].fwd_bwd_ms)),
        ("dmuon peak / torch-muon peak", lambda: (results["dmuon"].peak_gib, results["torch-muon"].peak_gib)),
        ("dmuon step GiB / torch-muon step GiB", lambda: (results["dmuon"].step_peak_gib, results["torch-muon"].step_peak_gib)),
        ("dmuon step / torch-muon step", lambda: (results["dmuon"].step_ms or 0.0, results["torch-muon"].step_ms or 0.0)),
    ]  # fmt: skip
    for label, pair in checks:
        try:
            a, b = pair()
        except KeyError:
            continue
        if b > 0:
            lines.append(f"  {label}: {a / b:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--config",
        action="append",
        choices=sorted(CONFIGS),
        help="repeatable; default: the two GPU.md configs",
    )
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per iteration (default 4096)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = p.parse_args(argv)
    wanted = {v for v in args.variants.split(",") if v}
    unknown = sorted(wanted - set(VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    # Always in VARIANTS order, dmuon last: whatever a variant leaves behind in the process
    # then cannot inflate the peak memory of a variant measured after it.
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
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"file://{os.path.join(tmp, 'rdv')}",
            rank=0,
            world_size=1,
        )
        try:
            mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("shard",))
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
                        variant, cfg, device, mesh, args.tokens, args.warmup, args.iters
                    )
                    print(f"  measured {name} {variant}", file=sys.stderr, flush=True)
                print(_report(name, cfg, results, args.tokens), flush=True)
        finally:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
