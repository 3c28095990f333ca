"""Will it fit, and how long the step's optimizer and communication take, on one GPU.

[Note: the fit and the step time]

With a GPU (``forecast(..., gpu=...)``, ``dmuon-plan --gpu-memory``) the forecast adds, per
rank and setup, the memory it needs at its peak and the parts of its step time it can
predict, and says whether that memory fits in the GPU's.

Memory, the sum of six terms (bytes, ``c``, ``r``, ``m`` the compute, reduce and master
itemsizes):

- *masters*, *optimizer states*, *HSDP replica copies*: kept between steps, as in [Note: the
  forecast] (exactly what the runtime allocates).
- *gradients*: the reduced gradients held from backward to the step: FSDP2's sharded
  gradient of every parameter it shards (``m`` per element of its padded shard), and on an
  owner the averaged gradient of each matrix it owns (``r`` per element).
- *unsharded weights*: the weights unsharded for forward and backward, with prefetch: ZeRO-3
  holds a layer and the next one it prefetches (twice the largest layer's figure of [Note:
  the forecast]) plus the root's parameters (embedding, final norm, head); ZeRO-2 every layer.
- *unsharded gradients*: in backward, one layer's full gradients before their reduction, and
  the root's (the head's gradient comes first in backward and is reduced with the embedding's
  at its end), ``c`` per element.

Not counted: activations (they depend on the batch and the sequence length, which a config
does not give), the Newton–Schulz workspace (one batch of at most ``ns_batch_bytes``; for
FSDP2 + Muon also the all-gathered gradient of the matrix being orthogonalised), the CUDA
context, NCCL's buffers and the allocator's fragmentation. The verdict therefore says what is
left of the GPU's memory for those.

Step time, per rank, in milliseconds: the optimizer step ([Note: the forecast]: the NS time
and the elementwise passes, from the NS table of the GPU, measured or scaled: [Note:
predicted NS times]) plus, per mesh axis, the bytes the rank receives there over the axis's
bandwidth ([Note: GPUs and links]), added as if nothing overlapped. Forward and backward
compute are not in it, and FSDP2 (and dmuon's prefetch) hides much of the shard axis's
transfer behind them: the figure is what the setup adds around the model's own compute, for
comparing setups, not a measured step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ._gpus import GPU, Links
from ._spread import Spread

__all__ = ["MEMORY_TERMS", "TIME_ROWS", "Fit", "Fits", "fit_of"]

MEMORY_TERMS = (
    "masters",
    "optimizer states",
    "HSDP replica copies",
    "gradients",
    "unsharded weights",
    "unsharded gradients",
)
# A time row and the received-bytes row of its axis (None: the optimizer step's own ms).
TIME_ROWS: dict[str, str | None] = {
    "optimizer step": None,
    "shard axis": "shard",
    "replicate axis": "replicate",
    "TP axis": "tp",
}
_GIB = 2**30


class Fits(NamedTuple):
    """Whether a setup fits the GPU's memory on the rank that needs the most and on the mean
    rank; true (``if fit.fits("dmuon"):``) only when it fits on every rank."""

    max_rank: bool
    mean_rank: bool

    def __bool__(self) -> bool:
        return self.max_rank


@dataclass(frozen=True)
class Fit:
    """Memory at the peak and the predictable step time of each setup on ``gpu`` (see [Note:
    the fit and the step time]).

    Args:
        gpu: the card the setups are fitted on.
        links: the bandwidth of each mesh axis the step times use.
        memory: each setup (``"dmuon"``, ``"FSDP2 + AdamW"``, ``"FSDP2 + Muon"``) to each
            memory term at the peak and ``"total"``, as a :class:`Spread` of bytes over the
            ranks.
        largest: each setup to the name of its largest term on the rank that needs the most
            and on the mean rank.
        step_ms: each setup to each row of the step (the optimizer step, the bytes of each
            mesh axis) and ``"total"``, as a :class:`Spread` of milliseconds (the total is each
            rank's sum, so its max is the slowest rank's step).
    """

    gpu: GPU
    links: Links
    memory: Mapping[str, Mapping[str, Spread]]
    largest: Mapping[str, tuple[str, str]]
    step_ms: Mapping[str, Mapping[str, Spread]]

    def fits(self, setup: str) -> Fits:
        """Whether ``setup`` fits on the rank that needs the most, and on the mean rank (true
        only when it fits on every rank). Another ``setup`` than the report's raises
        ``ValueError`` naming them."""
        if setup not in self.memory:
            raise ValueError(f"Fit.fits: setup must be one of {list(self.memory)}, got {setup!r}")
        total = self.memory[setup]["total"]
        capacity = self.gpu.memory_bytes
        return Fits(total.max <= capacity, total.mean <= capacity)

    def lines(self, setups: Sequence[str], ns_note: str) -> list[str]:
        """The fit and step-time section of the report, in the columns of the one above it."""
        gpu, cap = self.gpu, self.gpu.memory_bytes
        widths = (12, 12, 13, 12)

        def row(
            label: str, table: Mapping[str, Mapping[str, Spread]], key: str, scale: float
        ) -> str:
            first = table[setups[0]][key]
            values = [first.max, first.mean] + [table[s][key].max for s in setups[1:]]
            cells = "".join(f"{v / scale:>{w},.2f}" for v, w in zip(values, widths))
            return f"  {label:<36}{cells}"

        lines = [f"on {gpu.label}: {gpu.memory_gib:,.2f} GiB per GPU; {ns_note}"]
        lines.append("memory at the peak (GiB per GPU)")
        for term in (*MEMORY_TERMS, "total"):
            lines.append(row(term, self.memory, term, _GIB))
        lines.append(f"fits in {gpu.memory_gib:,.2f} GiB?")
        for setup in setups:
            for index, which in enumerate(("max", "mean")):
                if index and setup != setups[0]:
                    continue  # the FSDP2 columns show their max rank
                need = getattr(self.memory[setup]["total"], which)
                fits = self.fits(setup)[index]
                term = self.largest[setup][index]
                size = getattr(self.memory[setup][term], which)
                room = f"{abs(cap - need) / _GIB:,.2f} GiB {'left' if fits else 'over'}"
                lines.append(
                    f"  {f'{setup}, {which} rank':<28}{'fits' if fits else 'does not fit':<14}"
                    f"{need / _GIB:,.2f} GiB, {room}; largest term: {term} "
                    f"({size / _GIB:,.2f} GiB)"
                )
        lines.append("step time per GPU (ms, PREDICTED)")
        for name, axis in TIME_ROWS.items():
            label = name
            if axis is not None and self.links.of(axis).used:
                label = f"{name}, {self.links.of(axis).gb_s:,.0f} GB/s"
            lines.append(row(label, self.step_ms, name, 1.0))
        lines.append(row("total", self.step_ms, "total", 1.0))
        lines.append(
            "links: "
            + "; ".join(
                f"{name}: {self.links.of(axis).via}" for name, axis in TIME_ROWS.items() if axis
            )
            + "."
        )
        lines.append(
            "memory at the peak: kept between steps, the reduced gradients, the weights and "
            "gradients unsharded in forward and backward (ZeRO-3: prefetch holds two layers); "
            "not counted: activations, the NS workspace, the CUDA context, NCCL's buffers."
        )
        lines.append(
            "step time: the optimizer step plus each axis's bytes received at its bandwidth, "
            "nothing overlapped, no forward or backward compute (FSDP2 and dmuon hide much of "
            "the shard axis behind it)."
        )
        return lines

    def as_dict(self) -> dict[str, Any]:
        gpu = self.gpu
        return {
            "gpu": {
                "name": gpu.name,
                "label": gpu.label,
                "memory_gib": gpu.memory_gib,
                "bf16_tflops": gpu.bf16_tflops,
                "hbm_gb_s": gpu.hbm_gb_s,
                "nvlink_gpus": gpu.nvlink_gpus,
            },
            "links": {
                axis: {
                    "gb_s": self.links.of(axis).gb_s,
                    "via": self.links.of(axis).via,
                    "used": self.links.of(axis).used,
                }
                for axis in ("shard", "replicate", "tp")
            },
            "memory_bytes": {
                setup: {key: {"max": v.max, "mean": v.mean} for key, v in terms.items()}
                for setup, terms in self.memory.items()
            },
            "fits": {
                setup: {"max_rank": self.fits(setup)[0], "mean_rank": self.fits(setup)[1]}
                for setup in self.memory
            },
            "largest_term": {
                setup: {"max_rank": big, "mean_rank": mean}
                for setup, (big, mean) in self.largest.items()
            },
            "predicted_step_time_ms": {
                setup: {key: {"max": v.max, "mean": v.mean} for key, v in rows.items()}
                for setup, rows in self.step_ms.items()
            },
        }


def fit_of(rows: Mapping[str, Mapping[str, Sequence[float]]], gpu: GPU, links: Links) -> Fit:
    """The :class:`Fit` of per-rank ``rows``: per setup, each memory term's bytes, each axis's
    bytes received (``"shard"``, ``"replicate"``, ``"tp"``) and the optimizer step's ms
    (``"optimizer step"``), every rank in the same order."""
    memory: dict[str, dict[str, Spread]] = {}
    largest: dict[str, tuple[str, str]] = {}
    step_ms: dict[str, dict[str, Spread]] = {}
    for setup, row in rows.items():
        ranks = len(row["masters"])
        totals = [sum(row[term][i] for term in MEMORY_TERMS) for i in range(ranks)]
        memory[setup] = {term: Spread.of(row[term]) for term in MEMORY_TERMS}
        memory[setup]["total"] = Spread.of(totals)
        fullest = max(range(ranks), key=totals.__getitem__)
        largest[setup] = (
            max(MEMORY_TERMS, key=lambda term: row[term][fullest]),
            max(MEMORY_TERMS, key=lambda term: memory[setup][term].mean),
        )
        times: dict[str, list[float]] = {}
        for name, axis in TIME_ROWS.items():
            if axis is None:
                times[name] = list(row["optimizer step"])
            else:
                link = links.of(axis)
                times[name] = [link.ms(nbytes) for nbytes in row[axis]]
        step_ms[setup] = {name: Spread.of(values) for name, values in times.items()}
        step_ms[setup]["total"] = Spread.of(
            sum(values[i] for values in times.values()) for i in range(ranks)
        )
    return Fit(gpu, links, memory, largest, step_ms)
