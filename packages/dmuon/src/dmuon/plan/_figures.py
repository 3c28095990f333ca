"""What a forecast holds (:class:`Forecast`, :class:`RankFigures`), and how it shows it: as
text (what ``dmuon-plan`` prints) and as a JSON-ready dict."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dmuon_ownership import Plan, WorkItem

from ._fit import Fit
from ._model_shapes import ModelShapes
from ._ns_times import NSTimes
from ._spread import Spread
from ._topology import Topology

__all__ = ["ADAMW", "DMUON", "MUON", "SETUPS", "Forecast", "RankFigures", "as_dict", "render"]

DMUON, ADAMW, MUON = "dmuon", "FSDP2 + AdamW", "FSDP2 + Muon"
SETUPS = (DMUON, ADAMW, MUON)


@dataclass(frozen=True)
class RankFigures:
    """What one rank of dmuon's setup holds and issues, in bytes, exactly as the runtime
    counts and allocates it (see [Note: payload and wire bytes]).

    Args:
        replicate: the rank's replica (its grid coordinate on the replicate axis).
        shard: its index in the shard group.
        tp: its tensor-parallel index.
        payload: ``"axis/kind"``, the keys of the runtime's ``CommCounter.snapshot()``, to the
            bytes of the tensors dmuon's own collectives carry on this rank in one step (only
            the kinds it issues).
        state: ``"masters"``, ``"optimizer states"`` and ``"HSDP replica copies"`` to the
            bytes the rank keeps between steps (see [Note: the forecast]).
    """

    replicate: int
    shard: int
    tp: int
    payload: Mapping[str, int]
    state: Mapping[str, int]


@dataclass(frozen=True)
class Forecast:
    """Per-rank figures of one model at one topology (see [Note: the forecast]).

    ``memory``, ``unsharded``, ``traffic``, ``work``, ``ns_ms`` and ``step_ms`` map a setup
    (``"dmuon"``, ``"FSDP2 + AdamW"``, ``"FSDP2 + Muon"``) to rows of :class:`Spread` values
    in bytes, bytes, bytes received per step, FLOP-equivalents and milliseconds. ``ns_ms`` (NS
    calls) and ``step_ms`` (the optimizer step: NS and the elementwise passes) are predicted.
    ``ranks`` holds every rank's exact :class:`RankFigures` for dmuon (:meth:`rank` finds one).
    ``fit``, for a forecast on a GPU (``forecast(..., gpu=...)``), says whether each setup fits
    in its memory and predicts its step time there (see [Note: the fit and the step time]).
    :func:`forecast` makes it; :meth:`render` gives the report ``dmuon-plan`` prints,
    :meth:`to_dict` the same as plain data.

    Args:
        shapes: the model's parameters, as :func:`model_shapes` reads them from the config.
        topology: the cluster and sharding settings forecast for.
        plan: the owner plan, made by the call ``dedicate_params`` makes.
        ns_times: the table of measured Newton–Schulz times the predictions come from.
        memory: bytes kept between steps per rank: rows ``"masters"``, ``"optimizer
            states"``, ``"HSDP replica copies"`` and ``"total"``.
        unsharded: bytes of weights unsharded for forward per rank: rows ``"dmuon peer
            buffers"`` and ``"all"``.
        traffic: bytes received per rank in one step, per mesh axis: rows ``"shard"``,
            ``"replicate"`` and ``"tp"``.
        work: optimizer work per rank, in FLOP-equivalents (the planner's cost).
        ns_ms: predicted milliseconds of Newton–Schulz calls per rank in one step.
        step_ms: predicted milliseconds of the optimizer step per rank (NS and the
            elementwise passes).
        ranks: one :class:`RankFigures` per rank of dmuon's setup, in the order replicate,
            shard, TP index; ``()``: none.
        notes: remarks on the plan in words (uneven expert shares, an NS load imbalance above
            5 %, expert sources, ...); ``()``: none.
        fit: whether each setup fits on the GPU ``forecast`` was given and its predicted step
            time there; ``None``: no GPU given.
    """

    shapes: ModelShapes
    topology: Topology
    plan: Plan
    ns_times: NSTimes
    memory: Mapping[str, Mapping[str, Spread]]
    unsharded: Mapping[str, Mapping[str, Spread]]
    traffic: Mapping[str, Mapping[str, Spread]]
    work: Mapping[str, Spread]
    ns_ms: Mapping[str, Spread]
    step_ms: Mapping[str, Spread]
    ranks: tuple[RankFigures, ...] = field(default=())
    notes: tuple[str, ...] = field(default=())
    fit: Fit | None = None

    def rank(self, replicate: int = 0, shard: int = 0, tp: int = 0) -> RankFigures:
        """The figures of the rank at grid coordinate (``replicate``, ``shard``) and TP index
        ``tp`` (the runtime's ``layout.coord`` and ``layout.tp_index``).

        Args:
            replicate: the rank's replica, an int in ``[0, replicas)``.
            shard: its index in the shard group, an int in ``[0, shard_size)``.
            tp: its tensor-parallel index, an int in ``[0, tp)``.
        """
        topo = self.topology
        for name, value, size in (
            ("replicate", replicate, topo.replicas),
            ("shard", shard, topo.shard),
            ("tp", tp, topo.tp),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < size:
                raise ValueError(
                    f"Forecast.rank: {name} must be an int in [0, {size}) for {topo.describe()}, "
                    f"got {value!r}"
                )
        return self.ranks[(replicate * topo.shard + shard) * topo.tp + tp]

    @property
    def items(self) -> tuple[WorkItem, ...]:
        """The work items the plan was made from: what ``dedicate_params`` plans."""
        return self.shapes.dedicated

    @property
    def balance(self) -> float:
        """max / mean of the plan's per-slot work, experts included."""
        return 1.0 + self.plan.imbalance

    def render(self) -> str:
        """The report ``dmuon-plan`` prints: one row per figure, dmuon's max and mean over the
        ranks and the max of each FSDP2 setup; predicted figures say so."""
        return render(self)

    def to_dict(self) -> dict[str, Any]:
        """The forecast as plain JSON types (``dmuon-plan --json``)."""
        return as_dict(self)


_GIB = 2**30
_AXES = (("shard", "shard axis"), ("replicate", "replicate axis"), ("tp", "TP axis"))
_WIDTHS = (12, 12, 13, 12)


def _billions(numel: int) -> str:
    return f"{numel / 1e9:,.2f} B"


def _model_lines(fc: Forecast) -> list[str]:
    shapes = fc.shapes
    dedicated = sum(item.numel for item in shapes.dedicated)
    experts = sum(item.numel for item in shapes.experts)
    rest = sum(item.numel for item in shapes.fsdp)
    lines = [
        f"dmuon-plan: {shapes.model_type}, {shapes.num_layers} layers, "
        f"{_billions(shapes.numel)} parameters",
        f"  dedicated (owner runs Muon): {len(shapes.dedicated):,} matrices, {_billions(dedicated)}",
    ]
    if shapes.experts:
        lines.append(
            f"  experts (FSDP2, each rank runs Muon on its own): {len(shapes.experts):,} stacks "
            f"of {shapes.num_experts}, {_billions(experts)}"
        )
    lines.append(f"  FSDP2 + AdamW (embeddings, norms, biases, head): {_billions(rest)}")
    return lines


def payload(fc: Forecast) -> dict[str, Spread]:
    """dmuon's payload per ``"axis/kind"`` over every rank (a rank that does not issue a kind
    counts 0 for it), and per axis (``"shard"``, ...): the runtime's ``CommCounter`` unit."""
    keys = sorted({key for rank in fc.ranks for key in rank.payload})
    axes = [axis for axis, _ in _AXES]
    out = {key: Spread.of(rank.payload.get(key, 0) for rank in fc.ranks) for key in keys}
    for axis in axes:
        out[axis] = Spread.of(
            sum(v for k, v in rank.payload.items() if k.split("/")[0] == axis) for rank in fc.ranks
        )
    return out


def render(fc: Forecast) -> str:
    """The report ``dmuon-plan`` prints: one row per figure, dmuon's max and mean over the
    ranks and the max of each FSDP2 setup; predicted figures say so."""
    plan = fc.plan
    lines = _model_lines(fc)
    lines.append(f"topology: {fc.topology.describe()}")
    lines.append(
        f"owner plan: {len(plan.names):,} matrices on {plan.world_size:,} slots, NS load "
        f"max/mean {fc.balance:.3f}{' (experts included)' if fc.shapes.experts else ''}, "
        f"fingerprint {plan.fingerprint()[:12]}"
    )
    lines.append("")
    header = (
        f"{'per rank':<38}{'dmuon max':>12}{'dmuon mean':>12}{'FSDP2+AdamW':>13}{'FSDP2+Muon':>12}"
    )
    lines.append(header)

    def row(label: str, table: Mapping[str, Mapping[str, Spread]], key: str, scale: float) -> str:
        dmuon = table["dmuon"][key]
        cells = [dmuon.max / scale, dmuon.mean / scale]
        cells += [table[setup][key].max / scale for setup in SETUPS[1:]]
        return f"  {label:<36}" + "".join(f"{v:>{w},.2f}" for v, w in zip(cells, _WIDTHS))

    def dmuon_row(label: str, spread: Spread, scale: float) -> str:
        cells = [f"{spread.max / scale:,.2f}", f"{spread.mean / scale:,.2f}", "-", "-"]
        return f"  {label:<36}" + "".join(f"{v:>{w}}" for v, w in zip(cells, _WIDTHS))

    lines.append("kept between steps (GiB)")
    for key in ("masters", "optimizer states", "HSDP replica copies", "total"):
        lines.append(row(key, fc.memory, key, _GIB))
    zero = "one layer + root" if fc.topology.zero == 3 else "every layer + root"
    lines.append(f"unsharded for forward (GiB, {zero})")
    lines.append(row("dmuon peer buffers", fc.unsharded, "dmuon peer buffers", _GIB))
    lines.append(row("all unsharded weights", fc.unsharded, "all", _GIB))
    lines.append("bytes per step (GiB received per rank)")
    for key, label in _AXES:
        lines.append(row(label, fc.traffic, key, _GIB))
    lines.append("dmuon's collectives per step (GiB payload per rank, as CommCounter counts)")
    sent = payload(fc)
    for key, label in _AXES:
        lines.append(dmuon_row(label, sent[key], _GIB))
    lines.append("optimizer step")
    work = {setup: {"work": fc.work[setup]} for setup in SETUPS}
    lines.append(row("work (TFLOP-eq., planner cost)", work, "work", 1e12))
    ns = {setup: {"ns": fc.ns_ms[setup]} for setup in SETUPS}
    lines.append(row("NS time (ms, PREDICTED)", ns, "ns", 1.0))
    step = {setup: {"step": fc.step_ms[setup]} for setup in SETUPS}
    lines.append(row("step time (ms, PREDICTED)", step, "step", 1.0))
    if fc.fit is not None:
        lines.append("")
        lines.extend(fc.fit.lines(SETUPS, _ns_note(fc.ns_times)))
    lines.append("")
    lines.append("FSDP2 columns: max over ranks.")
    lines.append(
        "kept between steps: masters (FSDP2 shards padded as FSDP2 allocates them), optimizer "
        "states (AdamW's float32 step included), HSDP replica copies; no gradients or buffers."
    )
    lines.append(
        "received: (n-1)/n of each collective's payload on a group of n ranks (2(n-1)/n of an "
        "all-reduce's); the dmuon column "
        "adds FSDP2's rounds over the other parameters."
    )
    lines.append(
        "payload: the bytes of the tensors dmuon's own collectives carry on a rank, the unit of "
        "its runtime's CommCounter (dmuon.runtime.get_comm_ctx(model).counter); FSDP2's are not in it."
    )
    lines.append(
        "work, NS time: dmuon's owned matrices and own experts; FSDP2 + Muon orthogonalises "
        "every matrix on every rank; AdamW's work is its elementwise pass. Step time: NS time "
        "plus the step's elementwise passes."
    )
    if fc.notes:
        lines.append("notes:")
        lines.extend(f"  - {note}" for note in fc.notes)
    table = fc.ns_times
    if table.scaled_from is None:
        lines.append(
            f"PREDICTED: NS times from Newton-Schulz calls measured on {table.card} on "
            f"{table.date} ({table.source}), interpolated to other shapes by the FLOP model "
            f"ns_flops; step times add the elementwise passes at its {table.stream_gb_s:,.0f} "
            "GB/s; every other figure is counted from the config and the plan."
        )
    else:
        lines.append(
            f"PREDICTED, SCALED FROM {table.scaled_from.split(' (')[0]}: {table.card} has no "
            f"measured NS times. NS times from calls measured on {table.scaled_from} on "
            f"{table.date} ({table.source}), interpolated to other shapes by the FLOP model "
            f"ns_flops, times {table.time_scale:.2f} (the ratio of the cards' dense bf16 "
            f"rates); step times add the elementwise passes at {table.stream_gb_s:,.0f} GB/s "
            "(the measured card's, scaled by the ratio of their memory bandwidths); every "
            "other figure is counted from the config and the plan."
        )
    return "\n".join(lines)


def _ns_note(table: NSTimes) -> str:
    measured_on = (table.scaled_from or table.card).split(" (")[0]
    if table.scaled_from is None:
        return f"NS times measured on {measured_on}"
    return (
        f"NS times SCALED FROM {measured_on} x{table.time_scale:.2f} (dense bf16 rates), not "
        "measured on this card"
    )


def _spreads(table: Mapping[str, Any]) -> dict[str, Any]:
    return {
        key: ({"max": value.max, "mean": value.mean} if hasattr(value, "mean") else _spreads(value))
        for key, value in table.items()
    }


def as_dict(fc: Forecast) -> dict[str, Any]:
    """The forecast as plain JSON types (``dmuon-plan --json``)."""
    shapes = fc.shapes
    return {
        "model": {
            "model_type": shapes.model_type,
            "layers": shapes.num_layers,
            "experts_per_layer": shapes.num_experts,
            "parameters": shapes.numel,
            "dedicated": {
                "tensors": len(shapes.dedicated),
                "parameters": sum(i.numel for i in shapes.dedicated),
            },
            "experts": {
                "tensors": len(shapes.experts),
                "parameters": sum(i.numel for i in shapes.experts),
            },
            "fsdp": {"tensors": len(shapes.fsdp), "parameters": sum(i.numel for i in shapes.fsdp)},
        },
        "topology": {
            **dataclasses.asdict(fc.topology),
            "replicas": fc.topology.replicas,
        },
        "plan": {
            "fingerprint": fc.plan.fingerprint(),
            "slots": fc.plan.world_size,
            "matrices": len(fc.plan.names),
            "ns_load_max_over_mean": fc.balance,
        },
        "memory_bytes": _spreads(fc.memory),
        "unsharded_bytes": _spreads(fc.unsharded),
        "bytes_per_step": _spreads(fc.traffic),
        "dmuon_payload_bytes_per_step": _spreads(payload(fc)),
        "work_flop_equivalents": _spreads(fc.work),
        "predicted_ns_ms": _spreads(fc.ns_ms),
        "predicted_step_ms": _spreads(fc.step_ms),
        "ns_times": {
            "card": fc.ns_times.card,
            "date": fc.ns_times.date,
            "source": fc.ns_times.source,
            "measured_on_this_card": fc.ns_times.scaled_from is None,
            "scaled_from": fc.ns_times.scaled_from,
            "time_scale": fc.ns_times.time_scale,
            "stream_gb_s": fc.ns_times.stream_gb_s,
        },
        "notes": list(fc.notes),
        **({"fit": fc.fit.as_dict()} if fc.fit is not None else {}),
    }
