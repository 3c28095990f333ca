"""Mesh validation: turn the user's mesh arguments into a shard × replicate grid of ranks.

[Note: the grid]

dmuon sees the data-parallel ranks as a grid of ``G`` shards × ``R`` replicas. A rank's
coordinate is ``Owner(shard, replicate)``: its local rank in the shard mesh and in the
replicate mesh (``replicate = 0`` on a 1-D mesh). The global rank of every coordinate is learnt
once at setup with one ``all_gather`` over the default group, which also proves that the
two meshes are orthogonal (every coordinate appears exactly once) and that ``G · R`` covers
the world; the groups of :mod:`._comm` are then built from this table, never from guesses
about how a ``DeviceMesh`` lays ranks out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dmuon_ownership import Owner

__all__ = ["MeshLayout", "all_gather_numbers", "resolve_layout"]

_HSDP_HINT = (
    "build it with init_device_mesh(device, (replicate, shard), "
    "mesh_dim_names=('replicate', 'shard')) and call "
    "dedicate_params(model, hsdp['shard'], ..., replicate_mesh=hsdp['replicate'])"
)


@dataclass(frozen=True, eq=False)
class MeshLayout:
    """This rank's place on the grid and the global rank of every grid coordinate."""

    shard_size: int
    replicate_size: int
    coord: Owner
    rank_of: tuple[tuple[int, ...], ...]  # rank_of[replicate][shard] -> global rank
    device: torch.device
    shard_mesh: DeviceMesh
    replicate_mesh: DeviceMesh | None
    # Tensor parallelism: every TP index t has its own grid of the same shape
    # (all_rank_of[t]); this rank's is rank_of, and its TP group holds the ranks of its own
    # grid coordinate in every grid. See [Note: tensor-parallel grids].
    tp_size: int = 1
    tp_index: int = 0
    all_rank_of: tuple[tuple[tuple[int, ...], ...], ...] = ()
    tp_mesh: DeviceMesh | None = None
    # Pipeline parallelism: the world is pp_size stages, each with grids of its own
    # (stage_rank_of[p] is stage p's all_rank_of; this rank's stage is pp_index). See [Note:
    # pipeline stages].
    pp_size: int = 1
    pp_index: int = 0
    stage_rank_of: tuple[tuple[tuple[tuple[int, ...], ...], ...], ...] = ()
    pipeline_mesh: DeviceMesh | None = None

    @property
    def world_size(self) -> int:
        """Ranks of one data-parallel grid (the divisor of a gradient average)."""
        return self.shard_size * self.replicate_size

    def tp_ranks(self, owner: Owner) -> tuple[int, ...]:
        """The global ranks of grid coordinate ``owner`` in every TP index's grid."""
        return tuple(grid[owner.replicate][owner.shard] for grid in self.all_rank_of)

    @property
    def is_hsdp(self) -> bool:
        return self.replicate_mesh is not None

    def global_rank(self, owner: Owner) -> int:
        return self.rank_of[owner.replicate][owner.shard]

    def coord_of(self, rank: int) -> Owner:
        for r, row in enumerate(self.rank_of):
            for s, g in enumerate(row):
                if g == rank:
                    return Owner(s, r)
        raise ValueError(
            f"rank {rank} is not on dmuon's {self.shard_size} x {self.replicate_size} grid; "
            "pass a global rank in range(world_size) or an Owner(shard, replicate)"
        )


def all_gather_numbers(
    values: Sequence[float],
    device: torch.device,
    *,
    dtype: torch.dtype = torch.int64,
    group: dist.ProcessGroup | None = None,
) -> list[list[Any]]:
    """Every rank's ``values`` (same length everywhere), in rank order, as ``dtype`` holds them
    (int64: ints; float64: floats, and ints below 2**53 exactly); collective over ``group``
    (the default group: ``None``). A tensor collective, not ``all_gather_object``: no
    pickling, and nothing beyond torch is needed at run time."""
    mine = torch.tensor(values, dtype=dtype, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return [t.tolist() for t in everyone]


def _check_1d(mesh: object, argument: str) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"{argument} must be a torch.distributed DeviceMesh, got {type(mesh).__name__}; "
            "build one with init_device_mesh"
        )
    if mesh.ndim != 1:
        raise ValueError(
            f"{argument} must be a 1-D DeviceMesh, got a {mesh.ndim}-D mesh "
            f"(dims {mesh.mesh_dim_names}); pass one named dimension of it, e.g. mesh['shard']"
        )
    return mesh


def _split_2d(mesh: DeviceMesh, replicate_mesh: object) -> tuple[DeviceMesh, DeviceMesh]:
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            f"mesh is an unnamed 2-D DeviceMesh; dmuon cannot tell replicate from shard: {_HSDP_HINT}"
        )
    if set(names) != {"replicate", "shard"}:
        raise ValueError(
            f"mesh is a 2-D DeviceMesh with dims {names}, expected ('replicate', 'shard'): {_HSDP_HINT}"
        )
    if replicate_mesh is not None:
        raise ValueError(f"replicate_mesh was given together with a 2-D mesh: {_HSDP_HINT}")
    return mesh["shard"], mesh["replicate"]


def resolve_layout(
    mesh: object,
    replicate_mesh: object = None,
    tp_mesh: DeviceMesh | None = None,
    pipeline_mesh: object = None,
) -> MeshLayout:
    """Validate ``mesh`` (1-D shard mesh, or a 2-D mesh named ('replicate', 'shard')),
    ``replicate_mesh`` and ``pipeline_mesh``; ``tp_mesh`` is the tensor-parallel mesh of the
    selected parameters (``None``: no TP). Collective over the default group (see [Note: the
    grid]).

    [Note: pipeline stages]
    With pipeline parallelism of degree P (``pipeline_mesh``, torchtitan's 'pp' dimension) the
    world is P stages, each a model of its own over its own data-parallel ranks (and TP grids):
    every rank calls ``dedicate_params`` on its stage module with its stage's meshes, at the
    same point of the program. Each stage plans its owners and agrees on the plan among its own
    ranks; its process groups, its checkpoints and everything per model stay inside it. What
    must hold for the whole step, the non-finite skip and the clip norm, is reduced over every
    rank of every stage (``DedicatedCommContext.step_group``), so every rank skips alike and
    scales by one coefficient, as torchtitan's clip reduces its norm over the 'pp' mesh.
    Process groups are made by every rank for every stage in the same order (``new_group`` is
    collective over the default group), each rank keeping its stage's.

    [Note: tensor-parallel grids]
    With tensor parallelism of degree T the world is T data-parallel grids of G × R ranks: the
    ranks of one TP index t form one grid, and the data-parallel meshes a rank passes
    (``mesh['dp']``, or ``mesh['shard']`` and ``mesh['replicate']`` of a 3-D mesh) are its own
    grid's. Each grid runs dmuon's protocol on its ranks' local TP shards, with the same plan;
    the T ranks of one grid coordinate (one in each grid) form a TP group, which Newton–Schulz
    of a sharded matrix uses.

    [Note: degree-1 mesh dimensions]
    A mesh dimension of one rank changes nothing, so dmuon treats it as absent: a
    ``replicate_mesh`` of size 1 is a 1-D run (no replicate stage, no publish), and a TP mesh of
    size 1 (torchtitan keeps a 'tp' dimension of size 1 when TP is off; ``parallelize_module``
    on it makes DTensors whose local tensor is the whole matrix) is no tensor parallelism: such
    parameters are whole matrices, stepped in the 1-D stacks (``tp_dim`` is ``None``).
    Without this, a one-rank TP group or replicate column would run every TP or HSDP
    collective over a single rank, and the TP path would look for groups it never made.

    [Note: a mesh's rank order]
    A ``DeviceMesh`` built from a tensor of ranks keeps the order it was given for its
    coordinates, but the process group of each of its dimensions numbers the ranks in increasing
    order, and ``get_local_rank()`` (this layout's shard index) and FSDP2's shard index are
    that number. A shard group listed out of order, ``DeviceMesh("cpu", [2, 0, 1])``, would make
    the two disagree on which rank holds which shard; such a mesh is refused on every rank (each
    rank's verdict travels in the one gather), naming the fix, before anything is built."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "dedicate_params needs torch.distributed: call dist.init_process_group(...) first"
        )
    shard_mesh, rep_mesh = _data_parallel_meshes(mesh, replicate_mesh)
    pp_mesh = None if pipeline_mesh is None else _check_1d(pipeline_mesh, "pipeline_mesh")
    if pp_mesh is not None and pp_mesh.size() == 1:  # see [Note: degree-1 mesh dimensions]
        pp_mesh = None
    if tp_mesh is not None and tp_mesh.size() == 1:  # see [Note: degree-1 mesh dimensions]
        tp_mesh = None
    shard_size = shard_mesh.size()
    replicate_size = 1 if rep_mesh is None else rep_mesh.size()
    tp_size = 1 if tp_mesh is None else tp_mesh.size()
    pp_size = 1 if pp_mesh is None else pp_mesh.size()
    coord = Owner(_local_rank(shard_mesh), 0 if rep_mesh is None else _local_rank(rep_mesh))
    tp_index = 0 if tp_mesh is None else _local_rank(tp_mesh)
    pp_index = 0 if pp_mesh is None else _local_rank(pp_mesh)
    if shard_mesh.device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device(shard_mesh.device_type)
    # See [Note: a mesh's rank order].
    listed = tuple(int(g) for g in shard_mesh.mesh.tolist())
    in_order = int(list(listed) == sorted(listed))
    covered = shard_size * replicate_size * tp_size * pp_size
    gathered = all_gather_numbers(
        [coord.shard, coord.replicate, tp_index, pp_index, dist.get_rank(), in_order, covered],
        device,
    )
    _check_covers_world(shard_size, replicate_size, tp_size, pp_size, [g.pop() for g in gathered])
    _check_rank_order(listed, gathered)
    stage_rank_of = tuple(
        _grids([g for g in gathered if g[3] == p], shard_size, replicate_size, tp_size, pp_size)
        for p in range(pp_size)
    )
    all_rank_of = stage_rank_of[pp_index]
    rank_of = all_rank_of[tp_index]
    if listed != rank_of[coord.replicate]:
        raise ValueError(
            f"replicate_mesh does not match mesh: this rank's shard group is {listed} but the "
            f"grid row is {rank_of[coord.replicate]}: {_HSDP_HINT}"
        )
    return MeshLayout(
        shard_size,
        replicate_size,
        coord,
        rank_of,
        device,
        shard_mesh,
        rep_mesh,
        tp_size=tp_size,
        tp_index=tp_index,
        all_rank_of=all_rank_of,
        tp_mesh=tp_mesh,
        pp_size=pp_size,
        pp_index=pp_index,
        stage_rank_of=stage_rank_of,
        pipeline_mesh=pp_mesh,
    )


def _local_rank(mesh: DeviceMesh) -> int:
    """This rank's index in the 1-D ``mesh``, or -1 where the mesh leaves this rank out (one built
    over fewer ranks than the world, ``init_device_mesh(..., (1,))`` with a world size read
    from one process's view): torch's ``get_local_rank`` fails there with an ``IndexError`` on
    those ranks alone, while ``_check_covers_world`` refuses such meshes on every rank."""
    return -1 if mesh.get_coordinate() is None else mesh.get_local_rank()


def _data_parallel_meshes(
    mesh: object, replicate_mesh: object
) -> tuple[DeviceMesh, DeviceMesh | None]:
    """The shard mesh and the replicate mesh (``None``: no HSDP) that ``mesh`` and
    ``replicate_mesh`` give, checked; a replicate mesh of one rank is none (see [Note: degree-1
    mesh dimensions])."""
    rep_mesh: DeviceMesh | None
    if isinstance(mesh, DeviceMesh) and mesh.ndim == 2:
        shard_mesh, rep_mesh = _split_2d(mesh, replicate_mesh)
    else:
        shard_mesh = _check_1d(mesh, "mesh")
        rep_mesh = None if replicate_mesh is None else _check_1d(replicate_mesh, "replicate_mesh")
    if rep_mesh is not None and rep_mesh.device_type != shard_mesh.device_type:
        raise ValueError(
            f"replicate_mesh is on {rep_mesh.device_type!r} but mesh is on "
            f"{shard_mesh.device_type!r}; take both from one mesh: {_HSDP_HINT}"
        )
    if rep_mesh is not None and rep_mesh.size() == 1:
        rep_mesh = None
    return shard_mesh, rep_mesh


def _check_covers_world(
    shard_size: int, replicate_size: int, tp_size: int, pp_size: int, covered: list[int]
) -> None:
    """Raise, on every rank alike, unless the grids (``tp_size`` of them per pipeline stage,
    ``pp_size`` stages, ``shard_size x replicate_size`` each) hold every rank of the world on
    every rank (``covered``: every rank's product of its sizes, from the one gather; a rank
    that raised alone, a stage that forgot ``pipeline_mesh``, would leave the others waiting
    in their next collective)."""
    world = dist.get_world_size()
    if shard_size * replicate_size * tp_size * pp_size == world:
        short = sorted(rank for rank, size in enumerate(covered) if size != world)
        if short:
            raise ValueError(
                f"mesh sizes do not multiply to the world size on ranks {short} (this rank's"
                f" meshes cover the {world} ranks): every rank must call dedicate_params with"
                " meshes of the same shape; with pipeline parallelism every stage passes"
                " pipeline_mesh=mesh['pp'] with its mesh['dp']"
            )
        return
    tp = f" x tensor-parallel {tp_size}" if tp_size > 1 else ""
    tp += f" x pipeline {pp_size}" if pp_size > 1 else ""
    no_tp = (
        ""
        if tp_size > 1
        else " If the model is tensor-parallel, parallelize it first (torch's"
        " parallelize_module, then dedicate_params): dmuon reads the tensor-parallel mesh"
        " from the model's DTensor weights, and found none."
    )
    raise ValueError(
        f"mesh sizes do not multiply to the world size: shard {shard_size} x replicate "
        f"{replicate_size}{tp} != {world} ranks; dmuon's data-parallel grid must cover every "
        f"rank (pass the full data-parallel mesh, or replicate_mesh for HSDP).{no_tp} With"
        " pipeline parallelism call dedicate_params on each stage module with the stage's"
        " data-parallel mesh and the pipeline dimension as pipeline_mesh (mesh['dp'],"
        " pipeline_mesh=mesh['pp']; dedicate_params_ddp takes none), never as replicate_mesh"
        " (replicas must hold the same model)"
    )


def _check_rank_order(listed: tuple[int, ...], gathered: list[list[Any]]) -> None:
    """Raise on every rank where some rank's shard group lists its ranks out of increasing
    order (``gathered``: every rank's ``[shard, replicate, tp index, pp index, rank, in
    order]``; see [Note: a mesh's rank order])."""
    out_of_order = sorted({rank for *_, rank, ordered in gathered if not ordered})
    if out_of_order:
        raise ValueError(
            f"mesh lists the ranks of a shard group out of increasing order (this rank's: "
            f"{listed}; ranks {out_of_order} sit in such a group): torch numbers a mesh "
            "dimension's process group by increasing rank, and FSDP2 shards by that number, "
            "while the mesh's coordinates follow the listed order, so the two would disagree "
            "on which rank holds which shard. Build the mesh with init_device_mesh(device, "
            "shape, mesh_dim_names=...), or list each dimension's ranks in increasing order"
        )


def _grids(
    gathered: list[list[Any]], shard_size: int, replicate_size: int, tp_size: int, pp_size: int
) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """The global rank at every coordinate of every TP index's grid, ``[t][replicate][shard]``,
    from every rank's ``[shard, replicate, tp index, pp index, rank, in order]`` (one pipeline
    stage's, ``pp_size`` stages in all); raises where two ranks claim one coordinate (meshes
    that are not the dimensions of one mesh)."""
    grids: list[list[list[int | None]]] = [
        [[None] * shard_size for _ in range(replicate_size)] for _ in range(tp_size)
    ]
    for s, r, t, p, rank, _ in gathered:
        if grids[t][r][s] is not None and pp_size > 1:
            raise ValueError(
                f"pipeline_mesh does not match mesh: ranks {grids[t][r][s]} and {rank} both sit "
                f"at (shard={s}, replicate={r}, tp={t}) of pipeline stage {p}; take the "
                "data-parallel and the pipeline dimensions from one mesh, e.g. "
                "init_device_mesh(device, (pp, dp), mesh_dim_names=('pp', 'dp')), and pass "
                "mesh['dp'] with pipeline_mesh=mesh['pp']"
            )
        if grids[t][r][s] is not None and tp_size > 1:
            raise ValueError(
                f"the tensor-parallel mesh does not match mesh: ranks {grids[t][r][s]} and {rank} "
                f"both sit at (shard={s}, replicate={r}, tp={t}); take the data-parallel and the "
                "TP dimensions from one mesh, e.g. init_device_mesh(..., (dp, tp), "
                "mesh_dim_names=('dp', 'tp')) and pass mesh['dp'] with the plan on mesh['tp']"
            )
        if grids[t][r][s] is not None:
            raise ValueError(
                f"replicate_mesh does not match mesh: ranks {grids[t][r][s]} and {rank} both sit "
                f"at (shard={s}, replicate={r}); the two meshes must be the two dimensions of one "
                f"2-D mesh: {_HSDP_HINT}"
            )
        grids[t][r][s] = rank
    return tuple(
        tuple(tuple(int(g) for g in row if g is not None) for row in grid) for grid in grids
    )
