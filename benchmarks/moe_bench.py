"""The optimizer step over mixture-of-experts layers on one GPU: dmuon's per-expert Muon on
3-D expert stacks against torch.optim.Muon over the same experts held as separate 2-D
parameters (the layout it needs).

    python benchmarks/moe_bench.py                      # Qwen3-30B-A3B expert shapes, 4 layers
    python benchmarks/moe_bench.py --layers 2 --experts 64
    python benchmarks/moe_bench.py --device cpu --experts 4 --hidden 64 --intermediate 32 --iters 2

Each MoE layer holds torchtitan's three stacks: ``w1`` and ``w3`` ``(E, I, H)`` (gate, up) and
``w2`` ``(E, H, I)`` (down); Qwen3-30B-A3B has E = 128, H = 2048, I = 768. Weights, gradients
and momentum are bf16 (random gradients, never zeros). World size 1: dmuon's stacks go through
``dedicate_params`` → ``fully_shard(..., ignored_params=...)`` → ``dmuon.Muon`` and every
expert matrix lands in the NS batch of its shape; ``torch.optim.Muon`` (lr scaled to AdamW's
update RMS, as dmuon does) steps one parameter per expert matrix. Reported: the median of
``optimizer.step()`` over ``--iters`` timed steps after ``--warmup`` ones (CUDA events), and the
peak memory of the step. dmuon's NS choices are tuned (``dmuon_ns.tune_pending()``) after the
warm-up steps, and ``Muon(model)``'s background compile of the fused step kernels is waited
for, before timing (until it ends the step runs their per-matrix torch-op fallback).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from step_bench import _add_ns_batch_mib, _step_options, _wait_for_fused_compile
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


class Experts(nn.Module):
    def __init__(self, experts: int, hidden: int, intermediate: int, dtype: torch.dtype) -> None:
        super().__init__()
        shape_in, shape_out = (experts, intermediate, hidden), (experts, hidden, intermediate)
        self.w1 = nn.Parameter(torch.randn(shape_in, dtype=dtype) / hidden**0.5)
        self.w3 = nn.Parameter(torch.randn(shape_in, dtype=dtype) / hidden**0.5)
        self.w2 = nn.Parameter(torch.randn(shape_out, dtype=dtype) / intermediate**0.5)


class Layer(nn.Module):
    """One MoE layer's experts (the benchmark times the optimizer step alone: no forward)."""

    def __init__(self, experts: int, hidden: int, intermediate: int, dtype) -> None:
        super().__init__()
        self.experts = Experts(experts, hidden, intermediate, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Stack(nn.Module):
    def __init__(self, layers: int, experts: int, hidden: int, intermediate: int, dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            Layer(experts, hidden, intermediate, dtype) for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Separate(nn.Module):
    """The same experts as one 2-D parameter per expert matrix."""

    def __init__(self, stack: Stack) -> None:
        super().__init__()
        self.matrices = nn.ParameterList(
            nn.Parameter(m.detach().clone()) for p in stack.parameters() for m in p.unbind(0)
        )


def _time(step, grads_of, iters: int, warmup: int, device: torch.device, tune=None):
    for _ in range(warmup):
        grads_of()
        step()
    if tune is not None:
        tune()
        _wait_for_fused_compile()
    times = []
    torch.cuda.reset_peak_memory_stats(device) if device.type == "cuda" else None
    for _ in range(iters):
        grads_of()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return statistics.median(times), peak


def _fill_grads(params: list[torch.Tensor], seed: int) -> None:
    """Fresh random gradients, the old ones dropped first (as ``zero_grad`` before a backward
    does, so each step's gradients reuse the same memory)."""
    for p in params:
        p.grad = None
    gen = torch.Generator(device=params[0].device).manual_seed(seed)
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        g = torch.randn(local.shape, generator=gen, device=local.device, dtype=local.dtype)
        if hasattr(p, "to_local"):
            from torch.distributed.tensor import DTensor

            p.grad = DTensor.from_local(g, p.device_mesh, p.placements, run_check=False)
        else:
            p.grad = g


def _time_torch_muon(stack: Stack, args: argparse.Namespace, device: torch.device):
    separate = list(Separate(stack).parameters())
    torch_muon = torch.optim.Muon(
        separate, lr=0.02, weight_decay=0.0, adjust_lr_fn="match_rms_adamw"
    )
    return _time(torch_muon.step, lambda: _fill_grads(separate, 1), args.iters, args.warmup, device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="also time dmuon with StepOptions(cuda_graph=True) (the Muon phase from a graph)",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="after timing, profile one more dmuon step: GPU time per kernel, busy and wall",
    )
    _add_ns_batch_mib(p)
    args = p.parse_args(argv)
    if args.cuda_graph and args.device == "cpu":
        p.error("--cuda-graph needs --device cuda (the Muon phase as a CUDA graph)")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    os.environ.setdefault("DMUON_NS_CACHE_DIR", tempfile.mkdtemp(prefix="dmuon-ns-"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.bfloat16
    shape = (args.layers, args.experts, args.hidden, args.intermediate)
    torch.manual_seed(0)
    stack = Stack(*shape, dtype=dtype).to(device)
    matrices = sum(p.shape[0] for p in stack.parameters())

    import dmuon
    import dmuon_ns

    torch_ms, torch_peak = _time_torch_muon(stack, args, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()

    mesh = init_device_mesh(device.type, (1,))
    dmuon.dedicate_params(stack, mesh, lambda n, p: p.ndim == 3)
    dedicated = dmuon.dedicated_params_of(stack)
    for layer in stack.layers:
        fully_shard(layer, mesh=mesh, ignored_params=dedicated)
    fully_shard(stack, mesh=mesh, ignored_params=dedicated)
    params = list(stack.parameters())
    rows = []
    for graphed in (False, True) if args.cuda_graph else (False,):
        options = dmuon.StepOptions(cuda_graph=graphed, **_step_options(args.ns_batch_mib))
        optimizer = dmuon.Muon(stack, lr=0.02, weight_decay=0.0, options=options)
        ms, peak = _time(
            optimizer.step,
            lambda: _fill_grads(params, 1),
            args.iters,
            args.warmup,
            device,
            tune=getattr(dmuon_ns, "tune_pending", None),
        )
        label = "dmuon.Muon (3-D stacks, per expert)"
        if graphed:
            phase = optimizer._graphed
            label = f"  with cuda_graph ({phase.replays} replays)"
        rows.append((label, ms, peak))
        if not graphed:
            dmuon_ms = ms
        if device.type == "cuda":
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"MoE optimizer step, {args.layers} layers x {args.experts} experts, gate/up "
        f"{args.intermediate}x{args.hidden}, down {args.hidden}x{args.intermediate}, bf16: "
        f"{matrices} expert matrices; {name}, torch {torch.__version__}"
    )
    print(f"NS backend: {dmuon_ns.get_ns_backend()}")
    print(f"{'optimizer':<42} {'step ms':>9} {'peak GiB':>9}")
    print(f"{'torch.optim.Muon (one 2-D param per expert)':<42} {torch_ms:9.2f} {torch_peak:9.2f}")
    for label, ms, peak in rows:
        print(f"{label:<42} {ms:9.2f} {peak:9.2f}")
    print(f"dmuon / torch.optim.Muon = {dmuon_ms / torch_ms:.3f}  (target <= 0.5)")
    if args.trace and device.type == "cuda":
        from gpu_trace import ns_tflop, print_product_rate, trace

        _fill_grads(params, 1)
        kernel_ms = trace("dmuon.Muon step", optimizer.step)
        shapes = {
            (args.intermediate, args.hidden): 2 * args.layers * args.experts,
            (args.hidden, args.intermediate): args.layers * args.experts,
        }
        print_product_rate(kernel_ms, ns_tflop(shapes, optimizer.newton_schulz))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
