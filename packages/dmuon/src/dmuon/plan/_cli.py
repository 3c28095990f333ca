"""``dmuon-plan``: what dmuon will hold per rank and move per step, before renting the cluster.

    dmuon-plan path/to/config.json --ranks 512 --shard-size 64
    dmuon-plan path/to/model_dir --ranks 2048 --replicas 8 --zero 2 --json
    dmuon-plan path/to/config.json --ranks 8 --gpu-memory h100-80g   # will it fit, how fast

Reads a Hugging Face ``config.json`` and prints :func:`forecast`'s report (or its JSON). No
weights, no model: the shapes come from the config.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence

from ._forecast import DEFAULT_NS_BATCH_BYTES, forecast
from ._gpus import GPUS, resolve_gpu
from ._model_shapes import MODEL_TYPES
from ._topology import TP_NS_MODES, Topology

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dmuon-plan",
        description=(
            "Forecast, per rank, what dmuon holds (masters, optimizer states, buffers), moves "
            "per step (per mesh axis: bytes received, and the payload of dmuon's own "
            "collectives as its CommCounter counts it) and computes (Newton-Schulz work, its "
            "predicted time and the predicted optimizer step time), next to FSDP2 + AdamW and "
            "FSDP2 + a plain Muon, from a model's config.json. "
            f"Model types: {', '.join(MODEL_TYPES)}."
        ),
    )
    parser.add_argument("config", help="a config.json, or a model directory holding one")
    parser.add_argument("--ranks", type=int, required=True, help="GPUs in all")
    layout = parser.add_mutually_exclusive_group()
    layout.add_argument(
        "--shard-size",
        type=int,
        help="ranks of one FSDP2 / dmuon shard group (HSDP); default: every data-parallel rank",
    )
    layout.add_argument(
        "--replicas", type=int, help="HSDP replicas (shard size = ranks / (tp x replicas))"
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    parser.add_argument(
        "--tp-ns",
        default="auto",
        choices=TP_NS_MODES,
        help="Newton-Schulz of a TP matrix, as StepOptions(tp_ns=) (default auto)",
    )
    parser.add_argument(
        "--zero", type=int, default=3, choices=(2, 3), help="3: reshard after forward (default)"
    )
    parser.add_argument("--param-dtype", default="bfloat16", help="compute dtype (default bf16)")
    parser.add_argument("--master-dtype", default="float32", help="weights the optimizer updates")
    parser.add_argument("--optim-dtype", default=None, help="optimizer states (default: master)")
    parser.add_argument("--reduce-dtype", default=None, help="gradient sums (default: param)")
    parser.add_argument(
        "--small-param-threshold",
        type=int,
        default=5_000_000,
        help="dedicate_params' packing threshold, in elements (default 5000000)",
    )
    parser.add_argument(
        "--ns-batch-bytes",
        type=int,
        default=DEFAULT_NS_BATCH_BYTES,
        help="Muon's cap on one Newton-Schulz batch, in bytes of momentum (default 256 MiB)",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    cards = ", ".join(f"{name} ({gpu.memory_gib:.1f} GiB)" for name, gpu in GPUS.items())
    on_gpu = parser.add_argument_group(
        "on a GPU",
        "Whether each setup fits in one GPU's memory, and its step time per GPU: the optimizer "
        "step (NS times measured on the H200, scaled to another card by its dense bf16 rate) "
        "plus each mesh axis's bytes at that axis's bandwidth. Bandwidths are per GPU and "
        "direction; by default NVLink for an axis whose groups fit in one NVLink domain, "
        "the network (InfiniBand) otherwise.",
    )
    on_gpu.add_argument(
        "--gpu-memory",
        metavar="GIB|CARD",
        help=f"GiB per GPU (a number: H200 rates and links), or a card: {cards}",
    )
    for axis in ("shard", "replicate", "tp"):
        on_gpu.add_argument(
            f"--{axis}-gb-s",
            type=float,
            metavar="GB_S",
            help=f"bandwidth of the {axis} axis in GB/s (default: the card's, as above)",
        )
    on_gpu.add_argument(
        "--nvlink-gpus",
        type=int,
        metavar="N",
        help="GPUs of one NVLink domain (default: the card's; 8 SXM GPUs, 2 for h100-94g)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        shard_size = args.shard_size
        if args.replicas is not None:
            if args.replicas < 1 or args.ranks % (args.tp * args.replicas):
                parser.error(
                    f"--replicas {args.replicas} does not divide --ranks {args.ranks} / --tp "
                    f"{args.tp}"
                )
            shard_size = args.ranks // (args.tp * args.replicas)
        topology = Topology(
            ranks=args.ranks,
            shard_size=shard_size,
            tp=args.tp,
            tp_ns=args.tp_ns,
            zero=args.zero,
            param_dtype=args.param_dtype,
            master_dtype=args.master_dtype,
            optim_dtype=args.optim_dtype,
            reduce_dtype=args.reduce_dtype,
        )
        bandwidth = {
            axis: value
            for axis, value in (
                ("shard", args.shard_gb_s),
                ("replicate", args.replicate_gb_s),
                ("tp", args.tp_gb_s),
            )
            if value is not None
        }
        gpu = None
        if args.gpu_memory is not None:
            gpu = resolve_gpu(args.gpu_memory, "--gpu-memory")
            if args.nvlink_gpus is not None:
                if args.nvlink_gpus < 1:
                    parser.error(f"--nvlink-gpus must be >= 1, got {args.nvlink_gpus}")
                gpu = dataclasses.replace(gpu, nvlink_gpus=args.nvlink_gpus)
        elif bandwidth or args.nvlink_gpus is not None:
            parser.error(
                "--shard-gb-s, --replicate-gb-s, --tp-gb-s and --nvlink-gpus describe the GPUs' "
                "links: give --gpu-memory as well"
            )
        for axis, value in bandwidth.items():
            if not value > 0:
                parser.error(f"--{axis}-gb-s must be > 0 (GB/s per GPU and direction), got {value}")
        start = time.perf_counter()
        result = forecast(
            args.config,
            topology,
            small_param_threshold=args.small_param_threshold,
            ns_batch_bytes=args.ns_batch_bytes,
            gpu=gpu,
            bandwidth=bandwidth or None,
        )
        seconds = time.perf_counter() - start
    except ValueError as error:
        # The message names the file or the option and what is wrong; no usage text, which
        # is for arguments argparse itself rejects.
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, sort_keys=True))
    else:
        print(result.render())
        print(f"(planned and counted in {seconds:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
