"""``MuonParts``: the :class:`Muon` optimizers of a rank's pipeline model parts, stepped and
clipped as one.

[Note: the parts of a rank]
Interleaved and looped schedules (``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``,
``ScheduleInterleavedZeroBubble``, the V schedules) give every rank several model parts, stages
``p`` and ``p + P`` of ``2P`` say, each a stage module of its own: ``dedicate_params`` (with
the same ``pipeline_mesh``) and ``fully_shard`` per part, and one ``Muon`` per part, as
torchtitan builds one optimizer per part behind its ``OptimizersContainer``. Each part plans
and agrees on its owners over its stage's data-parallel ranks, which hold the part at the same
place in their lists (the k-th ``dedicate_params`` of every rank is the k-th part of its
position), and its collectives run in the process groups of that position, in the schedule's
order, which is the same on every rank of the position.

What must hold for the whole step is reduced once over every part of every rank:
``MuonParts.step()`` checks every part, runs their pre-step hooks, collects their gradients,
takes each part's local non-finite verdict and agrees on their maximum in one all-reduce over
every rank, then steps every part with that one decision. Its clip protocol
(``grads_for_clip``) hands every part's gradients to one norm over the same ranks, so one
coefficient scales every part (torchtitan's clip reduces one norm over the ``pp`` mesh). A part
stepped or clipped alone raises: it would decide over the parts at its position only (see
[Note: one stage module per rank] in ``_usage_checks``). ``MuonParts.step()`` still goes
through every part's own ``step()``, each calling the next part's and the last stepping them
all (``step_together``): so torch's wrapper of each part's ``step`` runs that part's step
hooks (every pre-hook before the step, every post-hook after it) and counts the step for the
part's LR scheduler, which would otherwise warn that ``lr_scheduler.step()`` came before
``optimizer.step()``. Every rank ties as many parts, in the
order of its stages; ``MuonParts()`` checks both, collectively, and raises on every rank alike.

The parts' stage indices (``stage_indices``) order the stages of a checkpoint's param groups,
which list the whole model's parameters stage by stage (see [Note: checkpoints of pipeline
stages]): by default torch's "loop" order, part ``k`` of position ``p`` being stage
``p + k * P`` (the interleaved and looped schedules); a V schedule (``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV``) gives position ``p`` stages ``p`` and ``2P - 1 - p``, which must be
passed. With the loop order there, the groups would list stage ``2P - 1`` before stage ``P``,
and the checkpoint would load only on the same V layout (the whole model, or one stage per
rank, refuses groups that list its parameters in another order). ``MuonParts()`` checks,
collectively, that the ranks of one position pass the same indices and that the positions'
indices are each stage once.

[Note: V schedules over gloo]
A V schedule's last position holds two neighbouring stages, ``P - 1`` and ``P``. torch 2.11's
``PipelineScheduleMulti`` warms every stage up, at its first ``step()``, with one
``batch_isend_irecv`` of a send to and a receive from each neighbour's rank: for that pair the
rank's own, and gloo has no connection from a rank to itself ("Pair is not connected"), so
those ranks fail while the others wait in the same warm-up until their timeout. The same V
schedule on plain modules, without dmuon, fails alike, and torch 2.13's warm-up
(``PipelineStage._warmup_forward_vote``) passes a neighbour on the same rank without a send.
``MuonParts()`` sees every position's stages once it has checked them, so it raises on every
rank alike, before the first ``step()``, where the position's stages are neighbours, the
pipeline mesh is gloo's and the torch is older than 2.13 without that warm-up.
"""

from __future__ import annotations

import weakref
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, overload

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from .._torch_internals import pipeline_warmup_sends_to_self
from ..topology import MeshLayout, all_gather_numbers
from ._optimizer import Muon, MuonClipGrads, MuonStepStats

__all__ = ["MuonParts"]


class MuonParts:
    """The :class:`Muon` optimizers of this rank's model parts (an interleaved, looped or V
    pipeline schedule's stage modules), stepped and clipped as one: one non-finite skip
    decision and one clip norm over every part of every rank (see [Note: the parts of a rank]).

    ``step()`` steps every part; ``dmuon.clip_grad_norm_(parts, ...)`` clips every part's
    gradients by one norm; ``dmuon.save_checkpoint(path, model_parts, parts)`` and
    ``load_checkpoint`` take the parts' modules as a list; ``state_dict()`` is this rank's
    alone (a ``torch.save`` per rank, loaded on the same layout). A part's own ``step()`` or
    ``grads_for_clip()`` raises ``RuntimeError`` while it belongs to a live ``MuonParts``.

    Args:
        optimizers: one :class:`Muon` per model part of this rank, in the order of the parts
            (their stage indices, as torchtitan lists ``model_parts``), each built on a stage
            module given to ``dedicate_params`` with the same ``pipeline_mesh``; every rank
            passes as many. Collective over every rank (a check that the ranks agree on the
            parts). Empty, not ``Muon`` objects, two of one model, a part of another live
            ``MuonParts``, other pipeline meshes, or ``skip_nonfinite`` differing between parts
            raise ``ValueError`` before anything changes.
        stage_indices: each part's pipeline stage index (its ``PipelineStage``'s
            ``stage_index``), in the order of ``optimizers``; ``None`` (the default) for
            torch's "loop" order of the interleaved and looped schedules, where part ``k`` of
            pipeline position ``p`` is stage ``p + k * P``. Pass them for a V schedule
            (``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``: stages ``p`` and
            ``2P - 1 - p``), or a checkpoint's param groups list the stages out of order (see
            [Note: the parts of a rank]). Another length than ``optimizers``, indices that are
            not ints, that differ between the ranks of a position or are not each stage once
            over the positions raise ``ValueError``; a position's neighbouring stages (a V
            schedule's) over gloo on torch 2.11 raise ``RuntimeError`` on every rank (see
            [Note: V schedules over gloo]).
    """

    def __init__(
        self, optimizers: Sequence[Muon], *, stage_indices: Sequence[int] | None = None
    ) -> None:
        if (
            isinstance(optimizers, Muon)
            or not isinstance(optimizers, Sequence)
            or not optimizers
            or not all(isinstance(o, Muon) for o in optimizers)
        ):
            got = type(optimizers).__name__
            if isinstance(optimizers, Sequence) and not isinstance(optimizers, str):
                got = f"{got} of {[type(o).__name__ for o in optimizers]}"
            raise ValueError(
                "MuonParts takes a non-empty list of dmuon.Muon, one per model part of this"
                " rank in the order of the parts, got"
                f" {got}: dmuon.MuonParts([dmuon.Muon(part, ...) for part in model_parts])"
            )
        parts = tuple(optimizers)
        for j, later in enumerate(parts):
            for i, earlier in enumerate(parts[:j]):
                if earlier.model is later.model:
                    raise ValueError(
                        f"MuonParts: optimizers {i} and {j} step the same model part"
                        f" ({type(later.model).__name__}); pass one Muon per model part"
                    )
        for k, optimizer in enumerate(parts):
            if optimizer._parts():
                raise ValueError(
                    f"MuonParts: optimizer {k} is a part of another live MuonParts already;"
                    " tie each rank's optimizers once, and drop the old MuonParts first"
                )
        places = {(o.runtime.layout.pp_size, o.runtime.layout.pp_index) for o in parts}
        if len(places) > 1:
            raise ValueError(
                "MuonParts: the parts were given other pipeline meshes (pipeline size, index):"
                f" {sorted(places)}; pass every part's dedicate_params the same"
                " pipeline_mesh=mesh['pp']"
            )
        if len({o.options.skip_nonfinite for o in parts}) > 1:
            raise ValueError(
                "MuonParts: the parts differ in StepOptions(skip_nonfinite=...), but the step"
                " takes one non-finite decision for all of them; build every part's Muon with"
                " the same skip_nonfinite"
            )
        layout = parts[0].runtime.layout
        if stage_indices is None:
            indices = tuple(layout.pp_index + k * layout.pp_size for k in range(len(parts)))
        elif (
            isinstance(stage_indices, (str, bytes))
            or not isinstance(stage_indices, Sequence)
            or len(stage_indices) != len(parts)
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in stage_indices)
        ):
            raise ValueError(
                f"MuonParts: stage_indices must list one int per part ({len(parts)}), each"
                f" part's PipelineStage stage_index, got {stage_indices!r}"
            )
        else:
            indices = tuple(stage_indices)
        stages = _check_ranks_agree(parts, indices)
        _check_neighbours_apart(stages, layout)
        self._optimizers = parts
        self._stage_indices = indices
        self._stepping = False
        for optimizer in parts:
            optimizer._joint = weakref.ref(self)

    @property
    def optimizers(self) -> tuple[Muon, ...]:
        """The parts' optimizers, in the order given (one LR scheduler each, say)."""
        return self._optimizers

    @property
    def stage_indices(self) -> tuple[int, ...]:
        """Each part's pipeline stage index, in the order of the parts: as given, or torch's
        "loop" order (part ``k`` of position ``p`` is stage ``p + k * P``)."""
        return self._stage_indices

    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> float: ...
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Step every part, with one non-finite decision over every part of every rank (see
        [Note: the parts of a rank]); collective.

        Args:
            closure: ``None``, or a callable that recomputes the loss (run once, with
                gradients enabled, before the step) and returns it; ``step`` returns what it
                returned.
        """
        loss = None
        if closure is not None:
            if not callable(closure):
                raise TypeError(
                    "MuonParts.step: closure must be None or a callable returning the loss, got"
                    f" {type(closure).__name__}"
                )
            with torch.enable_grad():
                loss = closure()
        self._stepping = True
        try:
            self._optimizers[0].step()
        finally:
            self._stepping = False
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``zero_grad`` of every part.

        Args:
            set_to_none: as :meth:`Muon.zero_grad`: ``True`` frees the gradients, ``False``
                fills them with zeros.
        """
        for optimizer in self._optimizers:
            optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: each part's :meth:`Muon.state_dict` in the order of the parts,
        with their stage indices, for ``torch.save`` per rank and :meth:`load_state_dict` on
        the same layout. A checkpoint that loads on another layout is
        ``dmuon.save_checkpoint(path, model_parts, parts)``."""
        return {
            "stage_indices": list(self._stage_indices),
            "parts": [optimizer.state_dict() for optimizer in self._optimizers],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load this rank's :meth:`state_dict` into every part: all of them or, when a part
        refuses its state, none (the parts already loaded get their own state back).

        Args:
            state_dict: what :meth:`state_dict` returned on this rank's place (the same stage
                indices); another structure or other stage indices raise ``ValueError``
                before any part changes.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                "MuonParts.load_state_dict: state_dict must be the dict MuonParts.state_dict()"
                f" returns, got {type(state_dict).__name__}"
            )
        states, indices = state_dict.get("parts"), state_dict.get("stage_indices")
        if not isinstance(states, Sequence) or len(states) != len(self._optimizers):
            got = len(states) if isinstance(states, Sequence) else type(states).__name__
            raise ValueError(
                f"MuonParts.load_state_dict: the state dict holds {got} parts under 'parts',"
                f" this MuonParts {len(self._optimizers)}; load what MuonParts.state_dict()"
                " returned on this rank (a single Muon's state dict loads into that part's"
                " Muon, a checkpoint of another layout with dmuon.load_checkpoint)"
            )
        if list(indices or ()) != list(self._stage_indices):
            raise ValueError(
                f"MuonParts.load_state_dict: the state dict is of stages {indices}, these parts"
                f" are stages {list(self._stage_indices)}; load the state dict this rank's place"
                " saved, or a checkpoint of another layout with dmuon.load_checkpoint"
            )
        # Kept and given back without the parts' state dict hooks, which run once, around
        # each part's load (see [Note: the optimizer's state dict hooks]).
        before = [optimizer._own_state_dict() for optimizer in self._optimizers]
        loaded: list[Muon] = []
        try:
            for optimizer, state in zip(self._optimizers, states, strict=True):
                optimizer.load_state_dict(state)
                loaded.append(optimizer)
        except BaseException:
            # Loading replaces the state's tensors, it writes none of them: the parts loaded
            # take back the tensors they held.
            for optimizer, own in zip(loaded, before, strict=False):
                optimizer._load_own_state_dict(own)
            raise

    @property
    def last_step_stats(self) -> MuonStepStats:
        """:attr:`Muon.last_step_stats` of the last ``step()``: every part took the same
        decision, so the first part's."""
        return self._optimizers[0].last_step_stats

    # -- the dmuon-clip protocol: one norm over every part -------------------------------------

    def muon_grads_for_clip(self) -> MuonClipGrads:
        """``grads_for_clip("muon")``."""
        return self.grads_for_clip("muon")

    def grads_for_clip(self, params: str | Iterable[Tensor] = "muon") -> MuonClipGrads:
        """:meth:`Muon.grads_for_clip` of every part, as one: their gradients and copies in the
        order of the parts, summed over the group of every rank (every element of every part
        counted once).

        Args:
            params: ``"muon"``, ``"adamw"``, ``"all"``, a parameter of one of the parts, or an
                iterable of them (frozen ones are skipped; another tensor raises
                ``ValueError``).
        """
        chosen = self._selections(params)
        taken = [
            optimizer._grads_for_clip(ids)
            for optimizer, ids in zip(self._optimizers, chosen, strict=True)
        ]
        grads = [g for got in taken for g in got.grads]
        copies = tuple(c for got in taken for c in got.copies)
        device = next((got.device for got in taken if got.grads or got.copies), taken[0].device)
        sharded = any(got.sharded for got in taken)
        return MuonClipGrads(grads, taken[0].process_group, device, copies, sharded=sharded)

    def clip_group_and_device(
        self, params: str | Iterable[Tensor] = "muon"
    ) -> tuple[ProcessGroup | None, torch.device]:
        """:meth:`Muon.clip_group_and_device`: the group of every rank and the first part's
        device; nothing is waited for or changed.

        Args:
            params: the selection :meth:`grads_for_clip` takes.
        """
        self._selections(params)
        return self._optimizers[0].clip_group_and_device()

    def grads_split_over_ranks(self, params: str | Iterable[Tensor] = "muon") -> bool:
        """:meth:`Muon.grads_split_over_ranks` of any part; nothing is waited for or changed.

        Args:
            params: the selection :meth:`grads_for_clip` takes.
        """
        chosen = self._selections(params)
        return any(
            optimizer._clip_sharded(ids)
            for optimizer, ids in zip(self._optimizers, chosen, strict=True)
        )

    def param_split_over_ranks(self, params: str | Iterable[Tensor] = "muon") -> str | None:
        """:meth:`Muon.param_split_over_ranks` of the first part that has one; nothing is
        waited for or changed.

        Args:
            params: the selection :meth:`grads_for_clip` takes.
        """
        chosen = self._selections(params)
        names = (
            optimizer._split_param(ids)
            for optimizer, ids in zip(self._optimizers, chosen, strict=True)
        )
        return next((name for name in names if name is not None), None)

    def _selections(self, params: str | Iterable[Tensor]) -> list[set[int]]:
        """Each part's ids of the parameters ``params`` selects (checked as
        :meth:`Muon.grads_for_clip` checks them: a tensor of no part raises)."""
        if isinstance(params, str) or isinstance(params, nn.Module):
            return [optimizer._clip_selection(params) for optimizer in self._optimizers]
        if isinstance(params, Tensor):
            params = [params]
        given = list(params)
        chosen = []
        for optimizer in self._optimizers:
            names = optimizer._plan.names
            chosen.append(optimizer._clip_selection([p for p in given if id(p) in names]))
        known = set().union(*chosen)
        # A tensor of no part: the first part's check refuses it as not its parameter.
        self._optimizers[0]._clip_selection(
            [p for p in given if id(p) not in known and not _frozen(p)]
        )
        return chosen


def _frozen(p: object) -> bool:
    return isinstance(p, nn.Parameter) and not p.requires_grad


def _check_ranks_agree(parts: tuple[Muon, ...], indices: tuple[int, ...]) -> dict[int, list[int]]:
    """Raise on every rank alike unless every rank ties as many parts, the ranks of one
    pipeline position list the same parts in the same order (the FQNs of each part's
    parameters) with the same stage ``indices``, and the positions' indices are each stage
    once; collective over every rank. Returns the stage indices by pipeline position (the
    same on every rank)."""
    runtime = parts[0].runtime
    device = runtime.layout.device
    group = runtime.step_group
    counts = [row[0] for row in all_gather_numbers([len(parts)], device, group=group)]
    if len(set(counts)) > 1:
        raise ValueError(
            f"MuonParts: the ranks tie different numbers of model parts ({counts}, by rank of"
            " the pipeline), so their steps would not meet; every rank passes one Muon per"
            " model part, as many as the others (an interleaved schedule gives each rank the"
            " same number of stages)"
        )
    count = len(parts)
    mine = (
        [runtime.layout.pp_index]
        + [
            zlib.crc32(" ".join(sorted(n for n, _ in o.model.named_parameters())).encode())
            for o in parts
        ]
        + list(indices)
    )
    rows = all_gather_numbers(mine, device, group=group)
    by_position: dict[int, list[int]] = {}
    for row in rows:  # every rank sees every row, so every rank raises alike
        listed = by_position.setdefault(row[0], row[1:])
        if listed[:count] != row[1 : count + 1]:
            k = next(k for k, (a, b) in enumerate(zip(listed, row[1:], strict=False)) if a != b)
            raise ValueError(
                f"MuonParts: part {k} holds other parameters on some rank than on another rank"
                f" of the same pipeline position ({row[0]}), so their collectives would pair"
                " other stages; list the optimizers in the order of the model parts (their"
                " stage indices) on every rank"
            )
        if listed[count:] != row[count + 1 :]:
            raise ValueError(
                f"MuonParts: the ranks of pipeline position {row[0]} pass other stage_indices"
                f" ({listed[count:]} and {row[count + 1 :]}); pass every rank its parts'"
                " PipelineStage stage_index, the same on the ranks of a position"
            )
    stages = {p: listed[count:] for p, listed in sorted(by_position.items())}
    given = sorted(i for listed in stages.values() for i in listed)
    if given != list(range(len(stages) * count)):
        raise ValueError(
            f"MuonParts: the parts' stage indices by pipeline position, {stages}, are not each"
            f" of the {len(stages) * count} stages once; pass stage_indices=(each part's"
            " PipelineStage stage_index), or leave it out for torch's loop order (part k of"
            " position p is stage p + k * P)"
        )
    return stages


def _check_neighbours_apart(stages: dict[int, list[int]], layout: MeshLayout) -> None:
    """Raise on every rank alike where a pipeline position holds two neighbouring stages (a V
    schedule's last position) over gloo on a torch whose schedules would warm them up with a
    send to itself, which gloo refuses (see [Note: V schedules over gloo])."""
    mesh = layout.pipeline_mesh
    if mesh is None or not pipeline_warmup_sends_to_self():
        return
    backend = str(dist.get_backend(mesh.get_group()))
    if backend != "gloo" and f"{layout.device.type}:gloo" not in backend:
        return
    for position, held in stages.items():
        pair = next(((i, i + 1) for i in sorted(held) if i + 1 in held), None)
        if pair is not None:
            raise RuntimeError(
                f"MuonParts: pipeline position {position} holds neighbouring stages {pair[0]}"
                f" and {pair[1]} (a V schedule: ScheduleDualPipeV, ScheduleZBVZeroBubble),"
                f" over gloo: torch {torch.__version__}'s schedules warm every stage up with a"
                " send to its neighbours, here from a rank to itself, which gloo refuses (the"
                " first step() fails with 'Pair is not connected' on that position while the"
                " others wait); torch 2.13 passes a neighbour on the same rank without a send."
                " Upgrade torch to 2.13 or newer, or use a schedule that puts neighbouring"
                " stages on other ranks (ScheduleInterleaved1F1B,"
                " ScheduleInterleavedZeroBubble)"
            )
