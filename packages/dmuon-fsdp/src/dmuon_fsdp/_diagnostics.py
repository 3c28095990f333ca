"""Rank-local, JSON-friendly views of the optimizer groups, the ownership plan and the forward
unshard traffic. No collectives: each rank describes what it holds, and a caller that wants a
world view gathers the dictionaries itself (e.g. ``all_gather_object``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dmuon_ownership import Route

from .optim._optimizer import Muon
from .runtime._group import DedicatedGroup
from .runtime._runtime import get_runtime

__all__ = ["collect_forward_unshard_profile", "summarize_comm_plan", "summarize_param_groups"]

_HYPER_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "betas", "eps", "initial_lr")


def _plain(value: Any) -> Any:
    """A JSON-friendly copy: tensors become floats/lists, tuples lists."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    return str(value)


def summarize_param_groups(
    model: nn.Module, optimizer: Muon, *, max_rows: int = 64
) -> list[dict[str, Any]]:
    """One dict per optimizer group: name, optimizer, hyperparameters, the parameters it
    holds (all ranks) and steps (this rank), with element counts, and up to ``max_rows`` rows
    per group describing each parameter (route, dtypes, owner, shape; ``rows_omitted`` counts
    the rest)."""
    if not isinstance(optimizer, Muon):
        raise ValueError(f"optimizer must be a dmuon.Muon, got {type(optimizer).__name__}")
    if optimizer.model is not model:
        raise ValueError("optimizer was built on a different model object than the one given")
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 0:
        raise ValueError(f"max_rows must be an int >= 0, got {max_rows!r}")
    runtime = get_runtime(model)
    out = []
    for group in optimizer.param_groups:
        names: list[str] = list(group["param_names"])
        rows = [
            _param_row(name, p, optimizer.dedicated_param(p), runtime)
            for name, p in zip(names[:max_rows], group["params"])
        ]
        stepped: list[str] = []
        numel = stepped_numel = local_numel = 0
        for name, p in zip(names, group["params"]):
            dp = optimizer.dedicated_param(p)
            full = dp.numel if dp is not None else p.numel()
            numel += full
            if dp is None:
                stepped.append(name)
                stepped_numel += full
                local_numel += p.to_local().numel() if isinstance(p, DTensor) else full
            elif dp.is_owner:
                stepped.append(name)
                stepped_numel += full
                local_numel += full
        out.append(
            {
                "name": group["group_name"],
                "optimizer": str(group["optimizer"]),
                "hyperparameters": {k: _plain(group[k]) for k in _HYPER_KEYS if k in group},
                "params": names,
                "numel": numel,
                "stepped_here": stepped,
                "stepped_numel_here": stepped_numel,
                "local_numel_here": local_numel,
                "lr_scaling": optimizer.options.lr_scaling.value
                if group["optimizer"] == Route.MUON
                else None,
                "rows": rows,
                "rows_omitted": max(0, len(names) - max_rows),
            }
        )
    return out


def _param_row(name: str, p: torch.Tensor, dp: Any, runtime: Any) -> dict[str, Any]:
    if dp is None:
        return {
            "name": name,
            "route": "fsdp2" if isinstance(p, DTensor) else "replicated",
            "shape": list(p.shape),
            "dtype": str(p.dtype).removeprefix("torch."),
            "owner_rank": None,
        }
    precision = dp.precision
    return {
        "name": name,
        "route": dp.route.value,
        "shape": list(dp.shape),
        "dtype": str(dp.dtype).removeprefix("torch."),
        "compute_dtype": None if precision is None else str(precision.compute)[6:],
        "reduce_dtype": None if precision is None else str(precision.reduce)[6:],
        "owner_rank": runtime.global_rank(dp.owner),
        "role": dp.role.value,
    }


def _pack_info(group: DedicatedGroup) -> list[dict[str, Any]]:
    return [
        {
            "owner": list(pack.owner),
            "owner_rank": pack.owner_rank,
            "sender": pack.sender,
            "role": pack.role.value,
            "params": [dp.fqn for dp in pack.params],
            "numel": pack.numel,
            "bytes": pack.nbytes,
            "dtype": str(pack.buffer.dtype).removeprefix("torch."),
        }
        for pack in group.packs
    ]


def summarize_comm_plan(model: nn.Module) -> dict[str, Any]:
    """The ownership plan as this rank sees it: grid, per-slot loads and imbalance, each hook
    boundary's packs (owner, sender in this rank's row, role, bytes), and the bytes one
    training step moves on each axis: every Muon element travels once per broadcast round
    (two in Z3, one in Z2) and once per reduce round; HSDP adds one replicate-axis reduce and
    one publish round."""
    runtime = get_runtime(model)
    runtime.lazy_init()
    layout = runtime.layout
    loads = [float(x) for x in runtime.plan.loads]
    mean = sum(loads) / len(loads) if loads else 0.0
    muon_bytes = sum(dp.numel * dp.param.element_size() for dp in runtime.params)
    z3 = runtime.reshard_after_forward
    rounds = {"broadcast": 2 if z3 else 1, "reduce": 1}
    per_step: dict[str, int] = {f"shard/{k}": v * muon_bytes for k, v in rounds.items()}
    if layout.is_hsdp:
        per_step["replicate/reduce"] = muon_bytes
        per_step["replicate/publish"] = muon_bytes
    return {
        "coord": list(runtime.coord),
        "shard_size": layout.shard_size,
        "replicate_size": layout.replicate_size,
        "world_size": layout.world_size,
        "reshard_after_forward": z3,
        "fingerprint": runtime.plan.fingerprint(),
        "num_params": len(runtime.params),
        "owned_here": [dp.fqn for dp in runtime.owned],
        "owned_numel_here": sum(dp.numel for dp in runtime.owned),
        "loads": loads,
        "imbalance_pct": 100.0 * (max(loads) / mean - 1.0) if mean > 0 else 0.0,
        # Payloads summed over the whole world, before the (n - 1) / n wire factor.
        "payload_bytes_per_step": per_step,
        "boundaries": [{"name": group.fqn, "packs": _pack_info(group)} for group in runtime.groups],
    }


def collect_forward_unshard_profile(model: nn.Module, synchronize: bool = False) -> dict[str, Any]:
    """What forward unsharding costs on this rank: per boundary, the bytes it receives
    (packs it neither owns nor replicates) and sends, whether its weights are resident now,
    and the collectives counted since the runtime's counter was last reset.

    The runtime records payloads and call counts, not per-collective wait times; measuring
    those needs a profiler trace (the ``dmuon::pre_forward`` and ``dmuon::prefetch`` ranges).
    ``synchronize=True`` waits for the device first so that the snapshot is settled.
    """
    runtime = get_runtime(model)
    runtime.lazy_init()
    if synchronize and torch.cuda.is_available() and runtime.layout.device.type == "cuda":
        torch.cuda.synchronize(runtime.layout.device)
    waits = runtime.hooks.wait_timers
    boundaries = []
    for group in runtime.groups:
        recv = sum(p.nbytes for p in group.packs if not p.is_sender)
        sent = sum(p.nbytes for p in group.packs if p.is_sender)
        boundaries.append(
            {
                "name": group.fqn,
                "state": group.status,
                "packs": len(group.packs),
                "recv_bytes_per_broadcast": recv,
                "send_bytes_per_broadcast": sent,
                "resident": all(p.has_storage() for p in group.packs),
                # The last forward's wait for this boundary's broadcasts (ms), with
                # Muon(profile=True); None otherwise.
                "forward_wait_ms": (
                    waits[group.fqn].phases().get("wait") if waits is not None else None
                ),
            }
        )
    return {
        "coord": list(runtime.coord),
        "reshard_after_forward": runtime.reshard_after_forward,
        "broadcast_rounds_per_step": 2 if runtime.reshard_after_forward else 1,
        "boundaries": boundaries,
        "collectives": runtime.counter.snapshot(),
    }
