"""The demo's byte column: wire bytes per rank per step for the Muon-target matrices.

dmuon's are counted: its ``CommCounter`` records the payload of every collective it issues.
FSDP2's are computed ("formula"): FSDP2's collectives carry these matrices together with the
norms of the same layer in one flat buffer and are not counted, so the demo computes what they
move for the matrices alone from FSDP2's sharding of them.

[Note: wire bytes]
A round moves a payload over a group of n ranks; what one rank sends and receives of it is
(n-1)/n of the payload, for a ring all-gather, reduce-scatter, broadcast or reduce alike (an
all-reduce is two such rounds). FSDP2 splits each matrix on dim 0 into G chunks of
ceil(rows/G) rows, padding the last, so an all-gather or a reduce-scatter of one matrix moves
(G-1) padded chunks per rank: (G-1)/G of the matrix when G divides its rows. With tensor
parallelism FSDP2 splits each rank's TP shard (``ColwiseParallel`` splits the rows by T,
``RowwiseParallel`` the columns), and with HSDP it all-reduces each gradient chunk over the R
replicas.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from dmuon._demo_model import LlamaConfig, TinyLlama, dedicated_matrix
from dmuon._demo_train import TP_PLAN, RunResult

__all__ = ["Mesh", "compare", "counted_bytes", "fsdp_bytes", "fsdp_shard_bytes"]


class Mesh(NamedTuple):
    shard: int  # G: ranks that share one copy of the model
    replicate: int  # R: copies (1 without HSDP)
    tp: int  # T: tensor-parallel degree (1 without TP)


def fsdp_shard_bytes(model: LlamaConfig, mesh: Mesh, itemsize: int) -> int:
    """One rank's FSDP2 chunks of every Muon-target matrix, in bytes, padded as FSDP2 pads
    them (see [Note: wire bytes])."""
    with torch.device("meta"):
        named = list(TinyLlama(model).named_parameters())
    total = 0
    for name, param in named:
        if not dedicated_matrix(name, param):
            continue
        rows, cols = param.shape
        if mesh.tp > 1:
            style = TP_PLAN.get(_layer_path(name))
            if isinstance(style, ColwiseParallel):
                rows //= mesh.tp
            elif isinstance(style, RowwiseParallel):
                cols //= mesh.tp
        total += -(-rows // mesh.shard) * cols * itemsize
    return total


def _layer_path(name: str) -> str:
    """``layers.3.self_attn.q_proj.weight`` -> ``self_attn.q_proj``, the key of ``TP_PLAN``."""
    parts = name.split(".")
    return ".".join(parts[2:-1]) if parts[0] == "layers" else ".".join(parts[:-1])


def fsdp_bytes(mesh: Mesh, zero: int, shard_bytes: int, p_m: int, *, plain_muon: bool) -> float:
    """FSDP2's wire bytes per rank per step for the Muon-target matrices, whose chunks on one
    rank take ``shard_bytes``: Z3 all-gathers them twice (forward, backward) and
    reduce-scatters the gradients once, Z2 all-gathers once; HSDP adds the all-reduce of each
    gradient chunk over the replicas. A plain Muon adds one all-gather of each full gradient,
    since NS needs the whole matrix (with TP, one more over the TP group: (T-1)/T·P_M, with
    ``p_m`` the matrices' full size)."""
    g, r, t = mesh
    rounds = (3 if zero == 3 else 2) + (1 if plain_muon else 0)
    moved = rounds * (g - 1) * shard_bytes + 2 * (r - 1) / r * shard_bytes
    return moved + ((t - 1) / t * p_m if plain_muon else 0.0)


def counted_bytes(results: Sequence[RunResult], mesh: Mesh, p_m: int) -> tuple[float, str]:
    """dmuon's wire bytes per rank per step, from the payloads its ``CommCounter`` recorded on
    every rank (mean over ranks and steps) times (n-1)/n for a group of n; and the payloads in
    units of ``p_m``, the matrices' full size."""
    g, r, t = mesh
    ranks_steps = sum(len(res.shard_bytes) for res in results)
    shard_payload = sum(sum(res.shard_bytes) for res in results) / ranks_steps
    repl_payload = sum(sum(res.replicate_bytes) for res in results) / ranks_steps
    tp_wire = sum(sum(res.tp_wire) for res in results) / ranks_steps
    wire = shard_payload * (g - 1) / g + repl_payload * (r - 1) / r + tp_wire
    how = f"counted: shard {shard_payload / p_m:.2f}·P_M"
    if r > 1:
        how += f", replicate {repl_payload / p_m:.2f}·P_M"
    if t > 1:
        how += f", tp NS {tp_wire / p_m:.2f}·P_M wire"
    return wire, how


def compare(moved: float, other: float) -> str:
    """How ``moved`` stands to ``other``, in words a reader can check against both figures:
    "25% fewer bytes than", "67% more bytes than", "as many bytes as"."""
    if other == 0:
        return "as many bytes as" if moved == 0 else "more bytes than"
    change = round((moved / other - 1) * 100)
    if change == 0:
        return "as many bytes as"
    return f"{abs(change)}% {'more' if change > 0 else 'fewer'} bytes than"
