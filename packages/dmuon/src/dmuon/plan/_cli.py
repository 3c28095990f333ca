"""``dmuon-plan``: what dmuon will hold per rank and move per step, before renting the cluster.

    dmuon-plan path/to/config.json --ranks 512 --shard-size 64
    dmuon-plan path/to/model_dir --ranks 2048 --replicas 8 --zero 2 --json

Reads a Hugging Face ``config.json`` and prints :func:`forecast`'s report (or its JSON). No
weights, no model: the shapes come from the config.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from ._forecast import DEFAULT_NS_BATCH_BYTES, forecast
from ._model_shapes import MODEL_TYPES
from ._topology import Topology

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
        help="Muon's cap on one Newton-Schulz batch, in bytes of momentum (default 64 MiB)",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
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
            zero=args.zero,
            param_dtype=args.param_dtype,
            master_dtype=args.master_dtype,
            optim_dtype=args.optim_dtype,
            reduce_dtype=args.reduce_dtype,
        )
        start = time.perf_counter()
        result = forecast(
            args.config,
            topology,
            small_param_threshold=args.small_param_threshold,
            ns_batch_bytes=args.ns_batch_bytes,
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
