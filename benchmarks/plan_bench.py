"""How long the planner before the run takes at scale, and how even its plans are.

    python3 benchmarks/plan_bench.py
    python3 benchmarks/plan_bench.py --repeats 5

With the packages installed (``dmuon.plan`` lives in the ``dmuon`` package, whose import
brings torch); the planning itself is pure Python and uses no device. For each case of
``CASES`` (configs in ``benchmarks/configs/``) at its topology, best of ``--repeats`` runs:

  items        the work items the owner plan places (the dedicated matrices)
  slots        shard x replicate grid (a TP group counts once)
  plan s       plan_owners alone, with the expert stacks (what dedicate_params calls)
  forecast s   the whole dmuon-plan forecast: shapes, plan, every per-rank figure
  sources      expert stack shards one HSDP replica steps for all (expert sources)
  max/mean     the plan's NS load, experts included
  no sources   the same plan's max/mean with every replica stepping its own experts

The last line checks the planning target: Kimi K2 on 1024 ranks plans in under 2 s of CPU with
NS load max/mean <= 1.05.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from dmuon.plan import Topology, forecast
from dmuon.plan._forecast import expert_stack
from dmuon_ownership import plan_owners

CONFIGS = Path(__file__).resolve().parent / "configs"
CASES = (
    ("Kimi K2", "kimi-k2.json", Topology(1024, shard_size=128)),
    ("DeepSeek-V3", "deepseek-v3.json", Topology(2048, shard_size=256)),
    ("Llama-3-70B", "llama-3-70b.json", Topology(512, shard_size=64)),
    ("Llama-3-70B", "llama-3-70b.json", Topology(512)),
    ("Llama-3-70B", "llama-3-70b.json", Topology(512, shard_size=8, tp=8)),
)


def _best(fn: Callable[[], Any], repeats: int) -> tuple[float, float, Any]:
    """Best wall and CPU seconds of ``repeats`` calls, and the last result."""
    walls, cpus, result = [], [], None
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        result = fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return min(walls), min(cpus), result


def _layout(topology: Topology) -> str:
    return f"{topology.replicas}x{topology.shard}" + (
        f" TP{topology.tp}" if topology.tp > 1 else ""
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, Python "
        f"{platform.python_version()}, {platform.processor() or platform.machine()}"
    )
    header = (
        "| model | ranks | replicas x shard | items | slots | plan s | forecast s (CPU) | "
        "sources | max/mean | no sources |"
    )
    print(header)
    print("|---|---|---|---|---|---|---|---|---|---|")
    target = None
    for name, file, topology in CASES:
        config = json.loads((CONFIGS / file).read_text())
        fc_wall, fc_cpu, fc = _best(partial(forecast, config, topology), args.repeats)
        shapes = fc.shapes
        experts = [(item.name, expert_stack(item)) for item in shapes.experts] or None
        plan = partial(
            plan_owners, shapes.dedicated, topology.shard, topology.replicas, experts=experts
        )
        plan_wall, _, _ = _best(plan, args.repeats)
        plain = plan_owners(
            shapes.dedicated,
            topology.shard,
            topology.replicas,
            base_loads=list(fc.plan.base_loads) or None,
        )
        print(
            f"| {name} | {topology.ranks} | {_layout(topology)} | {len(shapes.dedicated):,} | "
            f"{fc.plan.world_size:,} | {plan_wall:.3f} | {fc_wall:.3f} ({fc_cpu:.3f}) | "
            f"{len(fc.plan.expert_sources):,} | {fc.balance:.4f} | {1 + plain.imbalance:.4f} |"
        )
        if name == "Kimi K2":
            target = (fc_cpu, fc.balance)
    assert target is not None
    cpu, balance = target
    verdict = "met" if cpu < 2.0 and balance <= 1.05 else "NOT met"
    print(
        f"\nKimi K2 on 1024 ranks: forecast in {cpu:.3f} s of CPU (< 2 s), NS max/mean "
        f"{balance:.4f} (<= 1.05): target {verdict}"
    )


if __name__ == "__main__":
    main()
