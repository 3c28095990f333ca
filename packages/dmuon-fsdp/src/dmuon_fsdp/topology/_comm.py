"""The comm context: every stream and process group dmuon's runtime uses, in one object.

[Note: isolated and shared process groups]

dmuon keeps collectives in flight across phase boundaries (a prefetched broadcast, a reduce
still running when backward returns, an HSDP publish hidden behind the next forward). A
collective on a process group must be issued in the same order on every member; if the
trainer issues its own collective (a loss all-reduce, a metrics gather, a checkpoint barrier)
on the *same* group while dmuon's work is queued, the two orders can differ across ranks. With
``"isolated"`` (the default) dmuon clones its groups with ``dist.new_group`` over exactly the
ranks of the caller's mesh, so nothing the trainer does can interleave with them. ``"shared"``
reuses the mesh's own groups (fewer communicators, e.g. when NCCL communicator memory is
tight) and leaves the ordering to the caller.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .._torch_internals import default_group_timeout
from ._mesh import MeshLayout

__all__ = ["Axis", "CommCounter", "CommKind", "DedicatedCommContext", "ProcessGroupPolicy"]


class Axis(StrEnum):
    """The mesh axis a collective runs on."""

    SHARD = "shard"
    REPLICATE = "replicate"
    TP = "tp"  # a matrix's tensor-parallel group (NS of a sharded matrix)


class CommKind(StrEnum):
    """What a collective is for; bytes are counted per (axis, kind)."""

    BROADCAST = "broadcast"  # owner -> shard peers, before forward / backward
    REDUCE = "reduce"  # gradient sum towards the owner
    PUBLISH = "publish"  # updated weight, owner -> the ranks that keep a copy (HSDP, DDP path)
    ALL_REDUCE = "all_reduce"  # a sum on every rank (DDP path gradients; TP Gram matrices)
    GATHER = "gather"  # TP: NS input shards to the matrix's TP owner
    SCATTER = "scatter"  # TP: NS result shards from the TP owner


class CommCounter:
    """Payload bytes and call counts of every collective issued, keyed by (axis, kind).

    The payload of a broadcast or reduce is the size of the tensor it carries (see "Bytes per
    step" in ARCHITECTURE.md: every Muon element travels once per round); the wire cost per
    rank is that times (n - 1) / n for a group of n ranks, which callers derive themselves.
    """

    def __init__(self) -> None:
        self._bytes: dict[tuple[Axis, CommKind], int] = defaultdict(int)
        self._calls: dict[tuple[Axis, CommKind], int] = defaultdict(int)

    def record(self, axis: Axis, kind: CommKind, nbytes: int) -> None:
        self._bytes[(axis, kind)] += nbytes
        self._calls[(axis, kind)] += 1

    def bytes(self, axis: Axis | str, kind: CommKind | str | None = None) -> int:
        """Bytes issued on ``axis`` (of one ``kind``, or of every kind when ``None``)."""
        axis = Axis(axis)
        if kind is None:
            return sum(v for (a, _), v in self._bytes.items() if a is axis)
        return self._bytes.get((axis, CommKind(kind)), 0)

    def calls(self, axis: Axis | str, kind: CommKind | str) -> int:
        return self._calls.get((Axis(axis), CommKind(kind)), 0)

    def reset(self) -> None:
        self._bytes.clear()
        self._calls.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        """JSON-friendly ``{"shard/broadcast": {"bytes": ..., "calls": ...}, ...}``."""
        return {
            f"{axis}/{kind}": {
                "bytes": self._bytes[(axis, kind)],
                "calls": self._calls[(axis, kind)],
            }
            for (axis, kind) in sorted(self._bytes)
        }


class ProcessGroupPolicy(StrEnum):
    """Where dmuon's collectives run; see [Note: isolated and shared process groups]."""

    ISOLATED = "isolated"
    SHARED = "shared"

    @classmethod
    def parse(cls, value: object) -> ProcessGroupPolicy:
        if isinstance(value, str) and value in cls._value2member_map_:
            return cls(value)
        allowed = ", ".join(repr(p.value) for p in cls)
        raise ValueError(
            f"process_group_policy={value!r} is not one of {allowed}; use 'isolated' "
            "(dmuon's own cloned groups, the default) or 'shared' (the mesh's groups)"
        )


class _Groups(NamedTuple):
    """dmuon's process groups of every TP index's grid of one pipeline stage (see [Note:
    tensor-parallel grids] and [Note: pipeline stages])."""

    rows: list[list[ProcessGroup]]  # [t][replicate]: one shard group per replicate row
    cols: list[list[ProcessGroup]]  # [t][shard]: one replicate group per shard column (HSDP)
    grids: list[ProcessGroup]  # [t]: every rank of one grid
    tp: dict[tuple[int, int], ProcessGroup]  # (replicate, shard): the TP group of a coordinate
    all: ProcessGroup  # every rank of the stage (the world without pipeline parallelism)
    step: ProcessGroup  # every rank of every stage


# Isolated groups per layout, and the gloo group ``host_group`` makes, kept for the default
# group they were made under (see [Note: isolated groups are made once]).
_ISOLATED: dict[tuple[object, ...], tuple[_Groups, ...]] = {}
_HOST_GROUP: dict[str, ProcessGroup] = {}
_MADE_UNDER: list[ProcessGroup | None] = [None]


def _groups_of_this_world() -> None:
    """Forget the groups made under an earlier default process group: a
    ``destroy_process_group`` destroyed them with it. Compared by identity (the kept default
    group cannot be freed, so its ``id`` cannot pass to the new one), and dropped, not kept
    for good (each holds threads and sockets until freed)."""
    world = dist.group.WORLD
    if _MADE_UNDER[0] is not world:
        _ISOLATED.clear()
        _HOST_GROUP.clear()
        _MADE_UNDER[0] = world


# dmuon's groups time out as the default group does (``init_process_group(timeout=...)``):
# ``new_group`` alone would take torch's default, and a hang in dmuon's traffic would outlast
# the timeout the user set by up to half an hour.


def _new_gloo_group() -> ProcessGroup:
    group = dist.new_group(backend="gloo", timeout=default_group_timeout())
    assert group is not None
    return group


def _new_group(ranks: list[int]) -> ProcessGroup:
    group = dist.new_group(ranks, timeout=default_group_timeout())
    assert group is not None
    return group


def _isolated_groups(layout: MeshLayout) -> _Groups:
    """dmuon's own process groups for ``layout``: per TP index's grid one per replicate row,
    one per shard column (HSDP) and one over the grid; with TP one per grid coordinate across
    the grids; one over every rank of the pipeline stage and one over every rank (the same
    group without pipeline parallelism).

    [Note: isolated groups are made once] A process group holds communicators, threads and
    sockets, and torch frees them only in ``destroy_process_group``, which is not safe to call
    from a garbage-collected model (it must not race pending work). So the groups of a layout
    are made on first use and kept while the default process group lives; a model rebuilt on
    the same layout (sweeps, notebooks) reuses them, and two live models share them safely:
    each issues its collectives in program order on every rank. Creation is collective
    (``new_group`` is entered by every rank for every group, in the same order), and so is the
    lookup: all ranks ask for the same layouts in the same order, so they all find or all
    create. A new default process group (``destroy_process_group``, then
    ``init_process_group``) starts afresh on every rank alike."""
    _groups_of_this_world()
    stages = layout.stage_rank_of or (layout.all_rank_of,)
    key = (layout.is_hsdp, stages)
    found = _ISOLATED.get(key)
    if found is None:
        # Every rank makes every stage's groups, in stage order (see [Note: pipeline stages]).
        made = [_stage_groups(layout, grids) for grids in stages]
        everyone = made[0].all if len(made) == 1 else _new_group(list(range(dist.get_world_size())))
        found = _ISOLATED[key] = tuple(groups._replace(step=everyone) for groups in made)
    return found[layout.pp_index]


def _stage_groups(layout: MeshLayout, grids: tuple[tuple[tuple[int, ...], ...], ...]) -> _Groups:
    """The groups of one pipeline stage's grids (every TP index's), made collectively."""
    rows = [[_new_group(list(row)) for row in grid] for grid in grids]
    cols = [
        [_new_group([row[s] for row in grid]) for s in range(layout.shard_size)]
        if layout.is_hsdp
        else []
        for grid in grids
    ]
    whole = [_new_group(sorted(g for row in grid for g in row)) for grid in grids]
    tp = {}
    if layout.tp_size > 1:
        for r in range(layout.replicate_size):
            for s in range(layout.shard_size):
                tp[(r, s)] = _new_group([grid[r][s] for grid in grids])
    stage = (
        whole[0]
        if layout.tp_size == 1
        else _new_group(sorted(g for grid in grids for row in grid for g in row))
    )
    return _Groups(rows, cols, whole, tp, stage, stage)


@dataclass(eq=False)
class DedicatedCommContext:
    """Streams, groups and the byte counter of one dedicated runtime.

    ``shard_group`` is this rank's replicate row, ``replicate_group`` its shard column (``None``
    on a 1-D mesh), ``world_group`` spans the whole grid (this TP index's grid with tensor
    parallelism) and ``global_group`` every rank dmuon runs on (see [Note: global
    quantities]). Streams are ``None`` off CUDA.

    [Note: global quantities]
    A quantity that must be the same for the whole step on every rank (the clip norm of the
    Muon gradients, whether any gradient is not finite) is reduced over ``global_group``, never
    over ``world_group``: with tensor parallelism a grid holds only its TP index's shards, so a
    grid-wide reduction sees 1/T of every TP matrix, and the TP partners of a rank would reach
    different answers (one grid skipping a step its partner takes leaves the matrix half
    updated). Every rank of the world belongs to exactly one grid (``resolve_layout`` checks
    that the grids cover it), so ``global_group`` is the default group's ranks; it is dmuon's
    own group under ``"isolated"`` (made with the others, in the same order on every rank).

    A sum must count each element once. An owner's Muon gradients are TP shards, disjoint across
    the world, or whole matrices; a whole matrix (one that is not tensor-parallel) is kept by
    its owner coordinate in every grid, T identical copies, so the clip counts it in grid 0
    alone and hands it to the other grids' owners as a copy to scale
    (``Muon.muon_grads_for_clip``). A maximum (the non-finite check) needs no such care: every
    rank contributes its local gradients, FSDP2 and replicated ones included.

    ``dedicate_params`` builds it (collectively); read it with ``get_comm_ctx(model)``.

    Args:
        layout: the runtime's resolved mesh: the shard x replicate grid of global ranks, this
            rank's coordinate, the tensor-parallel degree and index, and the device.
        policy: ``dedicate_params``'s ``process_group_policy``: ``"isolated"`` (the groups
            below are dmuon's own, made over the mesh's ranks) or ``"shared"`` (the mesh's own
            groups; without tensor parallelism ``world_group`` and ``global_group`` are then
            the default group).
        shard_group: this rank's replicate row: the ranks of its shard group, over which
            owners broadcast their weights and gradients are reduced to their owner.
        replicate_group: this rank's shard column, its HSDP replicas, over which the owners'
            updated weights are published and gradients reduced across replicas; ``None``
            without HSDP.
        world_group: every rank of this rank's grid (with tensor parallelism, the grid of
            its TP index).
        tp_group: with tensor parallelism, the ranks at this rank's grid coordinate in every
            TP index's grid, which Newton–Schulz of a sharded matrix runs over; ``None``
            without.
        global_group: every rank of the model dmuon runs on (``world_group`` itself without
            tensor parallelism; with pipeline parallelism every rank of this stage), for
            quantities that must agree over the whole model.
        step_group: every rank of every pipeline stage, for what must agree over the whole
            step (the non-finite skip, the clip norm; see [Note: pipeline stages]); ``None``
            (the default): ``global_group``, without pipeline parallelism.
        broadcast_stream: the owners' weight broadcasts, at high priority (a forward or Z3
            backward waits for them); ``None`` off CUDA.
        reduce_stream: the shard-axis gradient reduces, at high priority (they free a
            boundary's local gradients); ``None`` off CUDA.
        replicate_reduce_stream: HSDP's replicate-axis reduces, at default priority and apart
            from ``reduce_stream`` so that one boundary's replicate stage overlaps the next
            one's shard stage; ``None`` off CUDA.
        publish_stream: the HSDP publish of updated weights, at default priority (hidden
            behind the next forward); ``None`` off CUDA.
        counter: the payload bytes and call counts of every dmuon collective, per axis and
            kind (``counter.snapshot()``, ``counter.bytes(axis)``, ``counter.reset()``);
            default: a new, empty ``CommCounter``.
        made_under: the default process group current when it was built (default: the one
            current now); ``check_alive`` raises once another has replaced it (see [Note: a
            destroyed process group]).
    """

    layout: MeshLayout
    policy: ProcessGroupPolicy
    shard_group: ProcessGroup
    replicate_group: ProcessGroup | None
    world_group: ProcessGroup
    # Tensor parallelism: the ranks of this rank's grid coordinate in every TP index's grid
    # (None without TP).
    tp_group: ProcessGroup | None
    # Every rank of the model: its pipeline stage's (the world_group itself without TP); see
    # [Note: global quantities].
    global_group: ProcessGroup
    # Every rank of every pipeline stage (None: global_group, no pipeline parallelism); see
    # [Note: pipeline stages].
    step_group: ProcessGroup | None = None
    # High priority: a forward (or Z3 backward) of the boundary waits for its broadcast.
    broadcast_stream: torch.cuda.Stream | None = None
    # High priority: the shard-axis reduce frees the local gradient memory of a boundary.
    reduce_stream: torch.cuda.Stream | None = None
    # Default priority, separate from ``reduce_stream`` so the replicate stage of one boundary
    # overlaps the shard stage of the next one (HSDP).
    replicate_reduce_stream: torch.cuda.Stream | None = None
    # Default priority: the HSDP publish is hidden behind the next forward and only gates the
    # first broadcast of its boundary.
    publish_stream: torch.cuda.Stream | None = None
    counter: CommCounter = field(default_factory=CommCounter)
    # The default process group it was built under (see [Note: a destroyed process group]).
    made_under: ProcessGroup | None = field(default_factory=lambda: dist.group.WORLD)

    @classmethod
    def build(cls, layout: MeshLayout, policy: ProcessGroupPolicy) -> DedicatedCommContext:
        """Collective over the default group when ``policy`` is isolated (``new_group`` must
        be entered by every rank for every group, in the same order)."""
        coord, t = layout.coord, layout.tp_index
        isolated = policy is ProcessGroupPolicy.ISOLATED
        # A grid and every rank: dmuon's own groups, also under "shared" with tensor or
        # pipeline parallelism (no mesh dimension spans one TP index's grid, or one stage);
        # else the default group.
        step_group = None
        if isolated or layout.tp_size > 1 or layout.pp_size > 1:
            groups = _isolated_groups(layout)
            world_group, global_group = groups.grids[t], groups.all
            if layout.pp_size > 1:
                step_group = groups.step
        else:
            world = dist.group.WORLD
            assert world is not None
            world_group = global_group = world
        tp_group: ProcessGroup | None
        if isolated:
            shard_group = groups.rows[t][coord.replicate]
            replicate_group = groups.cols[t][coord.shard] if layout.is_hsdp else None
            tp_group = groups.tp.get((coord.replicate, coord.shard))
        else:
            shard_group = layout.shard_mesh.get_group()
            replicate_group = (
                None if layout.replicate_mesh is None else layout.replicate_mesh.get_group()
            )
            tp_group = None if layout.tp_mesh is None else layout.tp_mesh.get_group()
        ctx = cls(
            layout,
            policy,
            shard_group,
            replicate_group,
            world_group,
            tp_group,
            global_group,
            step_group,
        )
        if layout.device.type == "cuda":
            high = -1  # the highest priority CUDA exposes through torch
            ctx.broadcast_stream = torch.cuda.Stream(layout.device, priority=high)
            ctx.reduce_stream = torch.cuda.Stream(layout.device, priority=high)
            ctx.replicate_reduce_stream = torch.cuda.Stream(layout.device)
            ctx.publish_stream = torch.cuda.Stream(layout.device)
        return ctx

    def check_alive(self) -> None:
        """Raise unless the default process group it was built under is still the current one.

        [Note: a destroyed process group]
        ``destroy_process_group()`` destroys every process group, dmuon's own (``"isolated"``)
        and the mesh's (``"shared"``) with the default one, and a later ``init_process_group``
        (a notebook re-running its setup cell, a sweep) makes new ones that a model built
        before cannot reach: its collectives would stop in torch with ``Process group <object
        at 0x...> is not initialized in the world group map``, which names neither the cause
        nor the fix. A 1-D FSDP2 model may even go on (its mesh finds its group by name, and
        the new default group has the old one's), so the dmuon half of a model would be the
        only one to fail. The forward, ``step()``, ``Muon(model)`` and every checkpoint and
        diagnostics call check this first, on every rank alike (each rank destroyed and made
        its default group), so they stop with one error naming the fix before a collective is
        issued. The model is then to be built again under the new group; its weights come
        from a checkpoint saved before the destroy. The check is an identity comparison (the
        kept group cannot be freed, so a new one cannot take its place).
        """
        if dist.group.WORLD is self.made_under:
            return
        raise RuntimeError(
            "this dmuon model was built under a default process group that has since been"
            " destroyed (torch.distributed.destroy_process_group()), and with it every process"
            " group the model communicates over, so it can no longer run. Build the model"
            " again under the current process group (dmuon.dedicate_params, fully_shard or"
            " dmuon.replicate, dmuon.Muon), from a checkpoint saved before the destroy to go"
            " on from its weights (dmuon.save_checkpoint, dmuon.get_model_state_dict)"
        )

    @property
    def everyone(self) -> ProcessGroup:
        """Every rank of every pipeline stage: ``step_group``, or ``global_group`` without
        pipeline parallelism."""
        return self.global_group if self.step_group is None else self.step_group

    def host_group(self) -> ProcessGroup | None:
        """A group over every rank (of every pipeline stage) that sums CPU tensors (gloo), for
        agreeing on the host without waiting for the device (``None`` on one rank):
        ``everyone`` itself when its backend serves CPU tensors, otherwise a gloo group over
        the default group's ranks, made once per process at the first call. Collective at that
        first call: every rank makes it at the same point of the run (see [Note: isolated
        groups are made once])."""
        if dist.get_world_size(self.everyone) == 1:
            return None
        if "gloo" in str(dist.get_backend(self.everyone)):
            return self.everyone
        _groups_of_this_world()
        if _HOST_GROUP.get("group") is None:
            _HOST_GROUP["group"] = _new_gloo_group()
        return _HOST_GROUP["group"]

    def barrier(self) -> None:
        """Barrier on every dmuon-owned group (the debug fence)."""
        groups = [self.shard_group, self.replicate_group, self.world_group]
        for group in groups:
            if group is not None and dist.get_world_size(group) > 1:
                dist.barrier(group=group)
