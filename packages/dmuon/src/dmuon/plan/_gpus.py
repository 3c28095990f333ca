"""The GPUs a forecast knows by name, and the bandwidth each mesh axis gets on them.

[Note: GPUs and links]

A :class:`GPU` holds what the fit check and the step-time estimate need of a card: its
memory (as ``nvidia-smi`` reports it), its dense bf16 tensor-core rate and its memory
bandwidth (the vendor's datasheet figures, which scale the NS times measured on the H200 to
another card: [Note: predicted NS times]), and the links of a server built around it: NVLink
between the GPUs of one NVLink domain (the 8 SXM GPUs of one baseboard; an H100 NVL pair on
its bridge) and the network between domains (one InfiniBand NIC per GPU).

Each mesh axis gets one bandwidth (:class:`Links`), per GPU and direction. The mesh is
``(replicate, shard, tp)`` with the TP index fastest, so the ranks of a TP group, and then of
a shard group, are neighbours: an axis whose group fits in one NVLink domain runs on NVLink;
one whose group spans domains runs on the network, since a ring through several domains goes
at the speed of its slowest hop. A collective then takes the bytes a rank receives on that
axis over that bandwidth. These are the links' datasheet rates, which NCCL does not reach, so
the times they give are a lower bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

__all__ = ["GPU", "GPUS", "TABLE_GPU", "Link", "Links", "resolve_gpu"]


@dataclass(frozen=True)
class GPU:
    """One card and the server around it (see [Note: GPUs and links]); rates are per GPU,
    bandwidths per direction, in GB/s (10^9 bytes).

    Args:
        name: the short name ``dmuon-plan --gpu-memory`` takes (``"h200"``).
        label: the card's full name, for the report.
        memory_gib: the memory a process can use, in GiB (> 0).
        bf16_tflops: the dense bf16 tensor-core peak, in TFLOP/s; NS times measured on another
            card are scaled by the ratio of these.
        hbm_gb_s: the memory bandwidth, in GB/s.
        nvlink_gb_s: the NVLink bandwidth per GPU and direction, in GB/s.
        nvlink_gpus: how many GPUs one NVLink domain connects (an axis whose groups span more
            runs on the network).
        network_gb_s: the network bandwidth per GPU and direction, in GB/s.
        network: what the network is, in words, for the report.
    """

    name: str
    label: str
    memory_gib: float
    bf16_tflops: float  # dense bf16 tensor-core peak
    hbm_gb_s: float
    nvlink_gb_s: float
    nvlink_gpus: int  # GPUs one NVLink domain connects
    network_gb_s: float
    network: str  # what the network is, for the report

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30


_NDR = "InfiniBand NDR, 400 Gb/s per GPU"
_HDR = "InfiniBand HDR, 200 Gb/s per GPU"
# Datasheet rates: dense bf16 (half the sparse figure), HBM; NVLink 900 GB/s (H100/H200 SXM)
# and 600 GB/s (A100 SXM, the H100 NVL bridge) both directions together. Memory: nvidia-smi's
# total (H200: 143,771 MiB; H100 80GB: 81,559; H100 NVL: 95,830; A100: 81,920 and 40,960).
GPUS: dict[str, GPU] = {
    gpu.name: gpu
    for gpu in (
        GPU("h200", "NVIDIA H200 SXM 141GB", 143_771 / 1024, 989.4, 4800, 450, 8, 50, _NDR),
        GPU("h100-80g", "NVIDIA H100 SXM 80GB", 81_559 / 1024, 989.4, 3350, 450, 8, 50, _NDR),
        GPU("h100-94g", "NVIDIA H100 NVL 94GB", 95_830 / 1024, 835.5, 3900, 300, 2, 50, _NDR),
        GPU("a100-80g", "NVIDIA A100 SXM 80GB", 81_920 / 1024, 312.0, 2039, 300, 8, 25, _HDR),
        GPU("a100-40g", "NVIDIA A100 SXM 40GB", 40_960 / 1024, 312.0, 1555, 300, 8, 25, _HDR),
    )
}
# The card the shipped NS tables were measured on.
TABLE_GPU = GPUS["h200"]


def resolve_gpu(spec: GPU | str | float, where: str = "gpu") -> GPU:
    """``spec`` as a :class:`GPU`: a GPU, a name of :data:`GPUS` (``"h100-80g"``), or a size in
    GiB (a number, or its text), which is a GPU of that memory with the rates and links of
    the card the NS tables were measured on (the H200). ``where`` starts the error."""
    if isinstance(spec, GPU):
        return spec
    if isinstance(spec, str) and spec.strip().lower() in GPUS:
        return GPUS[spec.strip().lower()]
    size: float | None = None
    if isinstance(spec, int | float) and not isinstance(spec, bool):
        size = float(spec)
    elif isinstance(spec, str):
        try:
            size = float(spec)
        except ValueError:
            size = None
    if size is None or not (math.isfinite(size) and size > 0):
        raise ValueError(
            f"{where}: {spec!r} is neither a memory size in GiB (a number > 0) nor a GPU this "
            f"planner knows ({', '.join(GPUS)})"
        )
    return replace(
        TABLE_GPU,
        name=f"{size:g} GiB",
        label=f"{size:g} GiB GPUs with the rates and links of the {TABLE_GPU.label}",
        memory_gib=size,
    )


@dataclass(frozen=True)
class Link:
    """One mesh axis's bandwidth per GPU and direction (GB/s), and what it is.

    Args:
        gb_s: the bandwidth, in GB/s (> 0).
        via: what carries it, in words (``"NVLink (within one 8-GPU domain)"``, ``"as
            given"``).
        used: False on an axis of one rank per group, which moves nothing.
    """

    gb_s: float
    via: str
    used: bool = True

    def ms(self, nbytes: float) -> float:
        """Milliseconds to receive ``nbytes`` at this bandwidth."""
        return nbytes / (self.gb_s * 1e6)


AXES = ("shard", "replicate", "tp")


@dataclass(frozen=True)
class Links:
    """The bandwidth of each mesh axis (see [Note: GPUs and links]).

    Args:
        shard: the shard axis's link.
        replicate: the replicate (HSDP) axis's link.
        tp: the tensor-parallel axis's link.
    """

    shard: Link
    replicate: Link
    tp: Link

    @classmethod
    def on(
        cls,
        gpu: GPU,
        ranks: int,
        shard_size: int,
        tp: int,
        given: dict[str, float] | None = None,
    ) -> Links:
        """The links of ``gpu``'s servers for a mesh of ``ranks`` = replicas x ``shard_size``
        x ``tp``; ``given`` sets an axis's GB/s (``{"replicate": 25.0}``) over the default."""
        given = dict(given or {})
        unknown = sorted(set(given) - set(AXES))
        if unknown:
            raise ValueError(
                f"bandwidth: unknown mesh axes {unknown}; give GB/s for 'shard', 'replicate' "
                "or 'tp'"
            )
        nvlink = Link(gpu.nvlink_gb_s, f"NVLink (within one {gpu.nvlink_gpus}-GPU domain)")
        network = Link(gpu.network_gb_s, f"{gpu.network} (across NVLink domains)")
        spans = {"tp": tp, "shard": tp * shard_size, "replicate": ranks}
        sizes = {"tp": tp, "shard": shard_size, "replicate": ranks // (tp * shard_size)}
        links = {axis: nvlink if spans[axis] <= gpu.nvlink_gpus else network for axis in AXES}
        for axis in AXES:
            if sizes[axis] == 1:
                links[axis] = replace(links[axis], via="not used: one rank per group", used=False)
        for axis, gb_s in given.items():
            number = isinstance(gb_s, int | float) and not isinstance(gb_s, bool)
            if not (number and math.isfinite(gb_s) and gb_s > 0):
                raise ValueError(f"bandwidth: {axis} must be GB/s > 0, got {gb_s!r}")
            links[axis] = Link(float(gb_s), "as given", used=sizes[axis] > 1)
        return cls(**links)

    def of(self, axis: str) -> Link:
        link: Link = getattr(self, axis)
        return link
