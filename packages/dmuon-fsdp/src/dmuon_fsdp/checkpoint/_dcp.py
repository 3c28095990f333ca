"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP): every rank writes what it
holds, nothing is gathered, and a checkpoint loads on any topology.

[Note: the DCP layout]
:class:`AppState` is a DCP ``Stateful``; its ``state_dict()`` is a nested dictionary that DCP
flattens with dots (``dmuon.model.<fqn>`` under :func:`save_checkpoint`'s key ``"dmuon"``):

- ``model.<fqn>``: every key of ``model.state_dict()``. An FSDP2 parameter is its DTensor: each
  rank writes its own shard (HSDP replicas write the same chunk, which DCP keeps once). A
  dedicated parameter is the owner's full weight as a plain tensor, present in the owner's
  dictionary only, so exactly one rank writes it. Under tensor parallelism the owner coordinate
  holds the matrix as TP shards, one per grid: its T ranks each write theirs, as a DTensor on
  their TP mesh (``Shard(tp_dim)``), so the key still holds the full matrix. A buffer is a
  plain tensor on every rank, which DCP keeps once.
- ``optim.state.<fqn>.<field>``: ``momentum_buffer`` (Muon) or ``step``, ``exp_avg``,
  ``exp_avg_sq`` (AdamW) of every parameter, laid out as the parameter (DTensor shards, or the
  owner's full tensors); an AdamW ``step`` is a scalar that every holder writes and DCP keeps
  once. A parameter not stepped yet is written with its fresh state (see [Note: complete
  optimizer state] in :mod:`._state_layout`).
- ``optim.param_groups``: one value, ``((group name, {hyperparameters..., "params": [fqn,
  ...]}), ...)``; a tuple, so that DCP stores it whole instead of one entry per hyperparameter.
  It holds the whole model's groups: under pipeline parallelism every stage's (every model
  part's of a ``MuonParts``), gathered and merged, the same value on every rank (see [Note:
  checkpoints of pipeline stages]).

With a ``MuonParts`` the AppState is one of every model part of the rank: one dictionary of
these keys, which the parts' FQNs keep apart.

No key names a rank, a shard, a mesh or an owner, so the layout does not depend on the
topology. On load each rank asks for exactly the tensors it holds now: its FSDP2 shards (DCP
reads the overlapping parts of the saved chunks) and, for the dedicated parameters it owns
under the current owner plan, their full weights and states (their TP shards under tensor
parallelism), whatever the TP degree they were saved at. DCP reads into the tensors
``state_dict()`` returned, which are the live ones (a parameter without state gets fresh
tensors), so a plain ``dcp.load`` of an :class:`AppState` needs no second copy of the model;
:func:`load_checkpoint` reads the live ones into scratch copies instead (see [Note: a failed
load changes nothing]).

[Note: a failed load changes nothing]
:func:`load_checkpoint` checks everything it can before DCP reads: the checksum record, the
``.metadata`` and the data files (see [Note: checkpoint integrity] in :mod:`._integrity`),
then every key, full shape and dtype against the model and optimizer (the checks of
:mod:`._state_layout`, the same on every rank). Each rank reads the files itself, so the ranks
agree on these checks before DCP's first collective (:func:`checked_on_every_rank`): where one
rank sees the files otherwise (a shared file system's stale view), it raises its error and
the others one that names it, instead of waiting for it inside DCP. DCP then reads, each chunk checked against its
checksum as it is read: every tensor the model or the optimizer holds into a CPU scratch
tensor, and the state of a parameter the optimizer has not stepped yet into the new tensors
that will hold it, which nothing else sees until the install. Only after the whole read
succeeded on every rank and the param groups passed their check are the scratch tensors copied
into the model and the optimizer and the new states installed. So a checkpoint that does not
fit, a damaged file or an exception inside DCP leaves both bit for bit as they were.

A user's own ``dcp.load`` of an :class:`AppState` reads into the live tensors, and nothing
checks the bytes. DCP's planner checks keys and shapes before reading (it converts dtypes; a
key missing on any rank, such as a parameter's state under another route, raises on every
rank before anything is read). The param groups are a non-tensor value, which DCP reads in
the same pass as the tensors, file by file, into the dictionary ``state_dict()`` returned; a
``Stateful`` never sees the checkpoint's ``.metadata``, and ``state_dict()``, which cannot
tell a save from a load, returns the live tensors so that a save copies nothing. So they are
checked as DCP writes them into that dictionary (:class:`_GroupsCheckedOnRead`), which ends
the read with a ``CheckpointException`` on every rank; and they are the first of the
AppState's entries. DCP's ``FileSystemReader`` reads a rank's entries file by file, each file
whole, in the order in which the rank's plan first names it, and the plan follows the
dictionary handed to ``dcp.load`` in sorted key order. So where the AppState's entries come
first (``dcp.load({"dmuon": app_state})``), a rank whose groups do not fit (other
``param_groups``, stages saved with different hyperparameters under one group name, see
[Note: checkpoints of pipeline stages]) raises before it reads any tensor. That is as far as
DCP lets it go: an entry whose key sorts before (``{"data": loader, "dmuon": ...}``) has its
file read first, with this rank's tensors in that file; ranks whose groups fit (the other
pipeline stages) read their tensors before DCP gathers the failure; another storage reader may
read in another order. :meth:`AppState.load_state_dict` checks the groups again on every rank
of every stage alike before any rank installs them (a ``dcp.load`` with a planner that does
not write into the dictionary), and its message says that the tensors were read.
:func:`load_checkpoint` refuses all of these with everything unchanged on every rank.

[Note: what a load holds]
During :func:`load_checkpoint` a rank holds, besides what it keeps afterwards:

- a CPU copy of each live tensor it reads (its owned weights, FSDP2 shards and buffers, and the
  optimizer state it already has), the price of all or nothing: a weight's old bytes must stay
  until every rank has read everything, so its new bytes wait beside them;
- one chunk in flight, its bytes and the tensor ``torch.load`` makes of them (see [Note: one
  chunk in flight] in :mod:`._integrity`).

The optimizer state of a parameter not stepped yet (the state of a fresh ``Muon``, as on the
meta-device route: ``to_empty``, ``Muon``, ``load_checkpoint``) is read into the tensors the
optimizer keeps, without a copy, and each gets its storage only when DCP reaches it. So on
that route a rank owning ``w`` bytes of dedicated weights peaks at ``3 w`` (the weights, their
copy, the momentum) plus its share of the FSDP2 state and one chunk; on a 1-D mesh of ``N``
ranks ``w`` is about ``1/N`` of the dedicated weights (``test_materialize``, 4 ranks: 0.78x,
where a copy of the momentum too and DCP's reader, which keeps a chunk while it reads the next,
made 1.04x). HSDP replicas also keep their copies, which no read touches (the closing
``after_step`` publishes them). On CUDA the copies and the chunk are host memory; the device
holds what it keeps.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence, Set
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.autograd.profiler import record_function
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor, Shard

from .._checks import check_bool
from .._torch_internals import local_shard
from ..holder import DedicatedParam, is_dedicated
from ..optim import Muon, MuonParts
from ..runtime import RUNTIME_ATTR, DedicatedRuntime, get_runtime
from . import _integrity as integrity
from . import _state_layout as layout
from ._checkpoint import (
    apply_param_groups,
    as_step,
    checked_on_every_rank,
    group_state,
)

__all__ = ["CHECKPOINT_KEY", "AppState", "load_checkpoint", "save_checkpoint"]

logger = logging.getLogger(__name__)

# The key of the AppState in the dictionary save_checkpoint hands to DCP.
CHECKPOINT_KEY = "dmuon"


def _as_saved(runtime: DedicatedRuntime, dp: DedicatedParam | None, t: Tensor) -> Tensor:
    """An owner's tensor laid out as a dedicated parameter, as DCP should see it: itself, or
    under tensor parallelism this rank's shard of the full matrix, a DTensor on the TP mesh
    (see [Note: the DCP layout]). Anything else (an FSDP2 parameter's state, an AdamW
    ``step``) is returned as it is."""
    if dp is None or dp.tp_dim is None or t.shape != dp.local_shape:
        return t
    mesh = runtime.layout.tp_mesh
    assert mesh is not None
    stride = torch.empty(dp.shape, device="meta").stride()
    return DTensor.from_local(
        t, mesh, [Shard(dp.tp_dim)], run_check=False, shape=dp.shape, stride=stride
    )


def _same_tensor(a: Tensor, b: Tensor) -> bool:
    a, b = local_shard(a), local_shard(b)
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape


def _model_tensors(model: nn.Module, runtime: DedicatedRuntime) -> dict[str, Tensor]:
    """The model's part of :meth:`AppState.state_dict`: the live tensors this rank holds."""
    out: dict[str, Tensor] = {}
    for key, value, dp in layout.model_entries(model, runtime):
        if dp is None:
            out[key] = value.detach()
        elif dp.is_owner:
            assert dp.full is not None
            out[key] = _as_saved(runtime, dp, dp.full)
    return out


def _install_model(
    model: nn.Module, runtime: DedicatedRuntime, loaded: Mapping[str, Tensor]
) -> None:
    """Copy what DCP read (``loaded``, keyed as :func:`_model_tensors`) into the live tensors."""
    with torch.no_grad():
        for key, value, dp in layout.model_entries(model, runtime):
            target = value if dp is None else dp.full
            if target is None:
                continue
            source = loaded[key]
            if not _same_tensor(source, target):
                local_shard(target).copy_(local_shard(source))


class _GroupsCheckedOnRead(dict[str, Any]):
    """The optimizer's part of :meth:`AppState.state_dict`, which checks the param groups
    when ``dcp.load`` writes them into it (DCP's ``set_element``), as it reads them: the
    first of the AppState's entries, so before this rank's tensors (see [Note: a failed load
    changes nothing]). Saving never writes into it."""

    def __init__(self, items: Any = (), *, check: Callable[[Any], None] | None = None) -> None:
        super().__init__(items)
        self._check = check

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "param_groups" and self._check is not None:
            self._check(value)
        super().__setitem__(key, value)


def _read_check(parts: Sequence[tuple[Muon, DedicatedRuntime]]) -> Callable[[Any], None]:
    """The check of the param groups a ``dcp.load`` reads, for :class:`_GroupsCheckedOnRead`,
    for every model part (a closure, not a bound method: a deep copy of the dictionary copies
    no model)."""
    several = len(parts) > 1

    def check(value: Any) -> None:
        where = "dcp.load of dmuon.AppState"
        try:
            for optimizer, runtime in parts:
                groups = _loaded_groups(where, [value], optimizer, runtime, several=several)
                layout.check_param_groups(where, optimizer, groups)
        except ValueError as error:
            raise ValueError(
                f"{error}. dcp.load stopped reading at the param groups, the first of the"
                " AppState's entries; the tensors it read before are loaded (none on this rank"
                " where the AppState's key sorts first in the dictionary given to dcp.load; a"
                " pipeline stage whose groups fit reads its own). Load a checkpoint that fits,"
                " or load with dmuon.load_checkpoint, which checks everything before any rank"
                " changes anything"
            ) from error

    return check


class AppState(Stateful):
    """A dmuon model and its :class:`Muon` optimizer as one DCP ``Stateful``.

    Put it in the dictionary you hand to ``dcp.save``, ``dcp.async_save`` or ``dcp.load``,
    next to your own state (a dataloader, a scheduler)::

        dcp.save({"dmuon": dmuon.AppState(model, optimizer), "data": loader}, checkpoint_id=path)

    It takes the place of ``model.state_dict()`` there, which raises :class:`NotHeldError` on
    every rank of a sharded run with more than one rank per shard group.
    See [Note: the DCP layout] for what it writes; each rank writes only what it holds.
    ``state_dict()`` and ``load_state_dict()`` are collective (they first finish dmuon's
    collectives in flight; a load ends by publishing the loaded weights to the ranks that keep
    copies, as a step does).

    Args:
        model: the model given to ``dedicate_params`` (that object; another raises
            ``ValueError``); with a :class:`MuonParts`, the list of its parts' modules, in its
            order.
        optimizer: the :class:`Muon` built on ``model`` (another object raises
            ``ValueError``), or the :class:`MuonParts` of this rank's model parts.
    """

    def __init__(self, model: nn.Module | Sequence[nn.Module], optimizer: Muon | MuonParts) -> None:
        # With a MuonParts, an AppState per model part: one Stateful, whose dictionary holds
        # every part's tensors (their FQNs are the stages') and the one param-groups value.
        self.parts: tuple[AppState, ...] = ()
        # Each part's pipeline stage index, which orders the saved param groups.
        self.stage_indices: tuple[int, ...] = ()
        if isinstance(optimizer, MuonParts):
            pairs = _pair_parts(model, optimizer)
            self.parts = tuple(AppState(m, o) for m, o in pairs)
            self.stage_indices = optimizer.stage_indices
            model, optimizer = pairs[0]
        assert isinstance(model, nn.Module)
        self.optimizer: Muon = layout.check_optimizer(model, optimizer)
        self.model: nn.Module = model
        self.runtime: DedicatedRuntime = get_runtime(model)

    def _each(self) -> tuple[AppState, ...]:
        """The AppState of every model part: this one's parts, or itself."""
        return self.parts or (self,)

    def state_dict(self) -> dict[str, Any]:
        """The live tensors this rank holds, keyed topology-independently; the param groups
        first, checked as a ``dcp.load`` reads them (see [Note: a failed load changes
        nothing])."""
        with record_function("dmuon::dcp_state_dict"):
            model: dict[str, Tensor] = {}
            state: dict[str, Any] = {}
            for part in self._each():
                part.runtime.drain()
                model |= part._model_tensors()
                state |= part._optimizer_state()
            checked = _GroupsCheckedOnRead(
                (("param_groups", self._saved_groups()), ("state", state)),
                check=_read_check([(part.optimizer, part.runtime) for part in self._each()]),
            )
            return {"optim": checked, "model": model}

    def _model_tensors(self) -> dict[str, Tensor]:
        return _model_tensors(self.model, self.runtime)

    def _load_target(self, absent: set[str]) -> tuple[dict[str, Any], list[str]]:
        """What :func:`load_checkpoint` reads into: :meth:`state_dict` of every part without
        the param groups and the optimizer entries of ``absent``, each entry an optimizer does
        not hold yet without storage until DCP reads into it; and the flattened keys of those
        entries (see [Note: what a load holds])."""
        fresh: list[str] = []
        model: dict[str, Tensor] = {}
        state: dict[str, Any] = {}
        for part in self._each():
            part.runtime.drain()
            model |= part._model_tensors()
            state |= part._optimizer_state(absent, fresh)
        direct = [
            f"{CHECKPOINT_KEY}.optim.state.{name}.{field}"
            for name in fresh
            for field in state[name]
        ]
        return {"model": model, "optim": {"state": state}}, direct

    def _optimizer_state(
        self, absent: Set[str] = frozenset(), fresh: list[str] | None = None
    ) -> dict[str, dict[str, Tensor]]:
        """The optimizer's state by parameter name, a parameter not stepped yet with its fresh
        state; with ``fresh`` (a load's target) that state holds no storage and its names are
        appended to ``fresh``. Parameters in ``absent`` are left out."""
        optimizer = self.optimizer
        state: dict[str, dict[str, Tensor]] = {}
        for name, p, group in layout.optimizer_params(optimizer):
            dp = optimizer.dedicated_param(p)
            if (dp is not None and not dp.is_owner) or name in absent:
                continue
            like = p if dp is None else dp.full
            assert like is not None
            route = group["optimizer"]
            live = optimizer.state.get(p)
            if not live:
                live = layout.fresh_state(route, like, layout.optim_dtype(dp))
                if fresh is not None:
                    for value in live.values():
                        local_shard(value).untyped_storage().resize_(0)
                    fresh.append(name)
            state[name] = {
                field: _as_saved(self.runtime, dp, live[field])
                for field in layout.STATE_FIELDS[route]
            }
        return state

    def _saved_groups(self) -> tuple[tuple[str, dict[str, Any]], ...]:
        """The value of ``optim.param_groups``: this optimizer's groups, or under a pipeline
        every stage's, each part's gathered over this rank's pipeline group and all merged in
        stage order (see [Note: checkpoints of pipeline stages]); the same on every rank. A
        tensor hyperparameter (an ``lr`` tensor) travels as a CPU copy: unpickled, a device
        tensor would land on the sender's device index."""
        layout_ = self.runtime.layout
        if layout_.pp_size == 1 and not self.parts:
            return tuple(group_state(self.optimizer).items())
        # Each part's groups with its stage index (a MuonParts' stage_indices; one stage per
        # rank: the position), gathered over the pipeline group, merged in stage order.
        stages: list[Any] = []
        for k, part in enumerate(self._each()):
            index = self.stage_indices[k] if self.parts else layout_.pp_index
            sent = (
                index,
                tuple(
                    (name, {key: _on_cpu(value) for key, value in group.items()})
                    for name, group in group_state(part.optimizer).items()
                ),
            )
            gathered: list[Any] = [sent]
            if layout_.pipeline_mesh is not None:
                gathered = [None] * layout_.pp_size
                dist.all_gather_object(gathered, sent, group=layout_.pipeline_mesh.get_group())
            stages += gathered
        return _merge_stage_groups([groups for _, groups in sorted(stages, key=lambda s: s[0])])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Install what DCP read into the tensors of :meth:`state_dict` (an optimizer state
        entry left out, as ``load_checkpoint(strict=False)`` does for one the checkpoint lacks,
        starts from fresh state). The param groups are checked first, on every rank of every
        pipeline stage alike; but ``dcp.load`` has read the tensors into the live ones before
        it calls this (see [Note: a failed load changes nothing]).

        Args:
            state_dict: the dictionary :meth:`state_dict` returned, with the values DCP read
                into it (keys ``"model"`` and ``"optim"``; anything else raises
                ``ValueError``).
        """
        where = "AppState.load_state_dict"
        with record_function("dmuon::dcp_load_state_dict"):
            if not isinstance(state_dict, Mapping) or set(state_dict) != {"model", "optim"}:
                raise ValueError(
                    f"{where}: expected the dictionary AppState.state_dict() returned, with"
                    " 'model' and 'optim'; load it with dcp.load({'dmuon': app_state})"
                )
            value = state_dict["optim"]["param_groups"]
            parts = self._each()
            found: list[dict[str, Any]] = []

            def check() -> None:
                try:
                    for part in parts:
                        groups = _loaded_groups(
                            where, [value], part.optimizer, part.runtime, several=len(parts) > 1
                        )
                        layout.check_param_groups(where, part.optimizer, groups)
                        found.append(groups)
                except ValueError as error:
                    raise ValueError(
                        f"{error}. dcp.load read the checkpoint's tensors into the model and the"
                        " optimizer before this check (it reads in place): load it with"
                        " dmuon.load_checkpoint, which checks everything before it changes"
                        " anything, or load a checkpoint that fits"
                    ) from error

            # Every rank raises alike, every part checked before any installs: a stage whose
            # groups do not fit must not leave the others installing and publishing alone.
            checked_on_every_rank(self.runtime, where, check, everyone=True, read_in_place=True)
            for part, groups in zip(parts, found, strict=True):
                part._install(state_dict, groups)

    def _install(self, state_dict: Mapping[str, Any], groups: Mapping[str, Any]) -> None:
        """Install checked values: this model's and its optimizer's of ``state_dict`` (which
        may hold other parts' too) and ``groups``."""
        self._install_model(state_dict["model"])
        self._install_optimizer(state_dict["optim"]["state"], groups)
        # Owned weights changed: drop kept copies (Z2) and publish to replicas (HSDP).
        self.runtime.after_step(async_=False)

    def _install_model(self, loaded: Mapping[str, Tensor]) -> None:
        _install_model(self.model, self.runtime, loaded)

    def _install_optimizer(
        self, loaded: Mapping[str, Mapping[str, Tensor]], groups: Mapping[str, Any]
    ) -> None:
        optimizer = self.optimizer
        apply_param_groups(optimizer, groups)
        for name, p, _ in layout.optimizer_params(optimizer):
            dp = optimizer.dedicated_param(p)
            if dp is not None and not dp.is_owner:
                continue
            entry = loaded.get(name)
            if entry is None:
                optimizer.state.pop(p, None)
                continue
            # A dedicated parameter's state is the owner's plain tensors (DCP read into their
            # TP-shard DTensor views under tensor parallelism).
            optimizer.state[p] = {
                field: as_step(value)
                if field == "step"
                else value
                if dp is None
                else local_shard(value)
                for field, value in entry.items()
            }


def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module | Sequence[nn.Module],
    optimizer: Muon | MuonParts,
) -> None:
    """Write a sharded checkpoint of ``model`` and ``optimizer`` to the directory ``path``
    with ``dcp.save`` (see [Note: the DCP layout]), and next to it ``dmuon_checksums.json``,
    the CRC32 of every chunk written, which :func:`load_checkpoint` verifies (see [Note:
    checkpoint integrity]); collective. For an asynchronous save call
    ``dcp.async_save({dmuon.runtime.CHECKPOINT_KEY: dmuon.AppState(model, optimizer)}, ...)``, which
    records no checksums.

    A write that fails on some rank (a full disk, a directory a node cannot write) raises
    ``RuntimeError`` on every rank, naming each rank's error (see [Note: a save that failed]);
    the model and the optimizer are unchanged and training can go on.

    Args:
        path: the checkpoint directory, the same on every rank (DCP's ``FileSystemWriter``
            writes there); a checksum record of an earlier save into it is removed first.
        model: the model given to ``dedicate_params`` (that object; another raises
            ``ValueError``); with a :class:`MuonParts`, the list of its parts' modules, in
            its order.
        optimizer: the :class:`Muon` built on ``model`` (another object raises
            ``ValueError``), or the :class:`MuonParts` of this rank's model parts.
    """
    _check_path_type("save_checkpoint", path)
    _check_not_a_file("save_checkpoint", path)
    with record_function("dmuon::save_checkpoint"):
        writer = integrity.ChecksumWriter(path)
        integrity.clear_checksums(path)
        try:
            dcp.save({CHECKPOINT_KEY: AppState(model, optimizer)}, storage_writer=writer)
        except CheckpointException as exc:
            raise _save_failed(path, exc) from exc
        integrity.record_checksums(writer, "save_checkpoint")


def _save_failed(path: str | os.PathLike[str], exc: CheckpointException) -> RuntimeError:
    """The error of a ``dcp.save`` that failed on some rank.

    [Note: a save that failed]
    DCP gathers each rank's exception of a step of its save (the plan, the write, ``.metadata``)
    and raises them together on every rank as a ``CheckpointException``, which derives from
    ``BaseException``: a training loop's ``except Exception`` around the save, written to log a
    failed save and train on, does not catch it, and its message is each rank's traceback,
    with the error itself last. ``save_checkpoint`` raises a ``RuntimeError`` instead, on every
    rank alike, that names each rank's error first and says what state is left; DCP's exception
    is its cause. A save reads the model and the optimizer and changes neither; the directory
    holds no finished checkpoint: the record of an earlier save into it was removed before the
    write, and ``.metadata`` is written only after every rank's files, so ``load_checkpoint``
    refuses it (``no finished DCP checkpoint at``, or ``and that file is missing`` where an
    earlier save's ``.metadata`` is left)."""
    failures = "; ".join(
        f"rank {rank}: {type(error).__name__}: {error}"
        for rank, (error, _) in sorted(exc.failures.items())
    )
    return RuntimeError(
        f"save_checkpoint: saving the checkpoint {os.fspath(path)!r} failed ({failures}). The"
        " model and the optimizer are unchanged, and the directory holds no finished checkpoint"
        " (load_checkpoint refuses it): fix the cause (free disk space, a directory every rank"
        " can write) and save again, or train on and save later"
    )


def _pair_parts(model: object, optimizer: MuonParts) -> list[tuple[nn.Module, Muon]]:
    """Each model part of ``model`` (a list of the parts' modules) with its optimizer of
    ``optimizer``, in order; raises ``ValueError`` where they do not match."""
    parts = optimizer.optimizers
    if isinstance(model, nn.Module) or not isinstance(model, Sequence):
        raise ValueError(
            f"with a MuonParts of {len(parts)} part(s) pass the model parts' modules as a list"
            f" in the order of its optimizers, got {type(model).__name__}: e.g."
            " dmuon.save_checkpoint(path, model_parts, parts)"
        )
    modules = list(model)
    if len(modules) != len(parts) or any(
        m is not o.model for m, o in zip(modules, parts, strict=False)
    ):
        raise ValueError(
            f"the {len(modules)} model part(s) given are not the {len(parts)} modules the"
            " MuonParts' optimizers were built on, in their order; pass [o.model for o in"
            " parts.optimizers]"
        )
    # One dictionary holds every part's entries, keyed by FQN: a key two parts share would
    # keep one part's tensor for both.
    seen: dict[str, int] = {}
    for k, m in enumerate(modules):
        for key in m.state_dict(keep_vars=True):
            if seen.setdefault(key, k) != k:
                raise ValueError(
                    f"model parts {seen[key]} and {k} both hold {key!r}, and a checkpoint keeps"
                    " one value per key: the parts' state-dict keys must be apart, the whole"
                    " model's FQNs as a pipeline split keeps them (delete the other stages'"
                    " layers from the whole model instead of building each part anew)"
                )
    return list(zip(modules, parts, strict=True))


def _check_path_type(where: str, path: object) -> None:
    """Refuse a ``path`` that is no path (the model, given first as some libraries take it),
    before anything reads the other arguments; the same on every rank."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(
            f"{where}: path must be the checkpoint directory (a str or os.PathLike), got"
            f" {type(path).__name__}; the directory comes first: {where}(path, model,"
            " optimizer)"
        )


def _check_not_a_file(where: str, path: str | os.PathLike[str]) -> None:
    if os.path.isfile(path):
        raise ValueError(
            f"{where}: {os.fspath(path)!r} is a file; a checkpoint is a directory (DCP writes "
            "one file per rank into it): pass a directory path"
        )


def _prefixed(prefix: str, metadata: Metadata) -> dict[str, layout.TensorSpec | None]:
    """The checkpoint's keys under ``prefix`` (stripped), with their full specs (``None`` for
    a value that is not a tensor)."""
    found: dict[str, layout.TensorSpec | None] = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(prefix):
            spec = None
            if isinstance(md, TensorStorageMetadata):
                spec = layout.TensorSpec(tuple(md.size), md.properties.dtype)
            found[key[len(prefix) :]] = spec
    return found


def _check_model_metadata(
    model: nn.Module,
    runtime: DedicatedRuntime,
    metadata: Metadata,
    where: str,
    *,
    several: bool = False,
) -> None:
    """Check the checkpoint's model tensors against the model (see [Note: a failed load
    changes nothing]); ``several``: it is one of this rank's model parts."""
    root = f"{CHECKPOINT_KEY}."
    specs = layout.model_specs(layout.model_entries(model, runtime))
    if not any(key.startswith(root) for key in metadata.state_dict_metadata):
        tops = sorted({key.split(".")[0] for key in metadata.state_dict_metadata})
        raise ValueError(
            f"{where}: the checkpoint holds no {CHECKPOINT_KEY!r} entries (its keys start with"
            f" {tops}), so it was not written by dmuon.save_checkpoint or"
            f" dcp.save({{{CHECKPOINT_KEY!r}: dmuon.AppState(...)}}), which write"
            f" '{CHECKPOINT_KEY}.model.<fqn>' and the optimizer's state"
            + _plain_checkpoint_hint(list(specs), metadata)
        )
    saved = _prefixed(f"{root}model.", metadata)
    if runtime.layout.pp_size > 1 or several:  # the other stages' keys are theirs
        saved = {key: spec for key, spec in saved.items() if key in specs}
    layout.check_model(
        where,
        specs,
        saved,
        "the checkpoint must hold exactly the keys of model.state_dict() (same model definition)",
    )


def _plain_prefix(fqns: Sequence[str], metadata: Metadata) -> str | None:
    """The prefix under which a checkpoint holds a tensor for every one of ``fqns`` (the
    model's state-dict keys): ``"model."`` for a plain FSDP2 run's ``dcp.save({"model":
    get_model_state_dict(model), ...})``, ``""`` for torchtitan's top-level keys; the shortest
    where several fit, ``None`` where none does."""
    keys = metadata.state_dict_metadata
    if not fqns:
        return None
    first = fqns[0]
    candidates = [
        key[: len(key) - len(first)] for key in keys if key == first or key.endswith(f".{first}")
    ]
    fitting = [c for c in candidates if all(f"{c}{fqn}" in keys for fqn in fqns)]
    return min(fitting, key=len) if fitting else None


def _plain_checkpoint_hint(fqns: Sequence[str], metadata: Metadata) -> str:
    """The end of the error for a checkpoint without dmuon's entries: where it holds this
    model's weights under a prefix of its own (a plain FSDP2 or torchtitan run's checkpoint),
    how to start from them."""
    prefix = _plain_prefix(fqns, metadata)
    if prefix is None:
        return "; save it through dmuon"
    return (
        f". It holds this model's weights under '{prefix}<fqn>' (e.g. '{prefix}{fqns[0]}'), as"
        " a run without dmuon saves them (plain FSDP2, torchtitan): to start from them, read"
        " them into full tensors on rank 0, full = {k: torch.empty(v.shape, dtype=v.dtype) for"
        " k, v in model.state_dict(keep_vars=True).items()} and"
        f" dcp.load({_nested(prefix, 'full')}, checkpoint_id=path, no_dist=True) (other ranks:"
        " full = {}), then dmuon.set_model_state_dict(model, full, broadcast_from_rank0=True) on"
        " every rank, and train with a fresh optimizer (see the Checkpoints guide, 'Plain FSDP2"
        " checkpoints')"
    )


def _nested(prefix: str, name: str) -> str:
    """The dictionary whose flattened keys are ``prefix`` + the keys of ``name``, as code."""
    out = name
    for part in reversed(prefix.split(".")[:-1]):
        out = f"{{{part!r}: {out}}}"
    return out


def _check_metadata(app: AppState, metadata: Metadata, where: str, *, strict: bool) -> list[str]:
    """Check every tensor of the checkpoint against the model and optimizer, of every part
    (see [Note: a failed load changes nothing]); returns the parameters without optimizer
    state."""
    root = f"{CHECKPOINT_KEY}."
    several = len(app._each()) > 1
    for part in app._each():
        _check_model_metadata(part.model, part.runtime, metadata, where, several=several)
    if f"{root}optim.param_groups" not in metadata.state_dict_metadata:
        raise ValueError(
            f"{where}: the checkpoint has no {root}optim.param_groups entry; it was not written"
            " by dmuon.save_checkpoint / AppState, or it is damaged"
        )
    absent: list[str] = []
    for part in app._each():
        specs = layout.optimizer_specs(part.optimizer)
        saved = _prefixed(f"{root}optim.state.", metadata)
        got: dict[str, dict[str, layout.TensorSpec | None]] = {}
        for fqn, fields in specs.items():
            entry = {
                field: saved.pop(f"{fqn}.{field}") for field in fields if f"{fqn}.{field}" in saved
            }
            if entry:
                got[fqn] = entry
        if part.runtime.layout.pp_size > 1 or several:  # the other stages' are theirs
            saved = {key: v for key, v in saved.items() if key.rpartition(".")[0] in specs}
        absent += layout.check_optimizer_state(where, specs, got, sorted(saved), strict=strict)
    return absent


def _groups_keys(metadata: Metadata) -> list[str]:
    """The optimizer dictionary's param-groups keys the checkpoint holds, in stage order:
    ``param_groups``, and in a checkpoint of stages written before the groups were merged,
    ``param_groups_<p>`` of stage ``p`` (see [Note: checkpoints of pipeline stages])."""
    prefix = f"{CHECKPOINT_KEY}.optim."
    found = {
        key[len(prefix) :]
        for key in metadata.state_dict_metadata
        if re.fullmatch(rf"{re.escape(prefix)}param_groups(_[1-9][0-9]*)?", key)
    }
    return sorted(found, key=lambda k: int(k.rpartition("_")[2]) if k[-1].isdigit() else 0)


_Pairs = tuple[tuple[str, dict[str, Any]], ...]


def _on_cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, Tensor) else value


def _hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}


def _same_value(a: Any, b: Any) -> bool:
    """Whether two saved hyperparameters are equal (tensors by dtype, shape and value)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (
            isinstance(a, Tensor)
            and isinstance(b, Tensor)
            and (a.dtype, a.shape) == (b.dtype, b.shape)
            and torch.equal(a.detach().cpu(), b.detach().cpu())
        )
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    try:
        return bool(a == b)
    except Exception:  # a value whose == is not a bool
        return False


def _difference(a: Mapping[str, Any], b: Mapping[str, Any]) -> str | None:
    """The first hyperparameter in which ``a`` and ``b`` differ, as a message names it."""
    for key in [*a, *(k for k in b if k not in a)]:
        if key not in a or key not in b or not _same_value(a[key], b[key]):
            absent = "<absent>"
            return f"{key}: {a.get(key, absent)!r} and {b.get(key, absent)!r}"
    return None


def _merge_stage_groups(stages: list[Any]) -> _Pairs:
    """The pipeline stages' param groups (each ``((name, group), ...)``, in stage order) as
    one value of the same form, the same on every rank (see [Note: checkpoints of pipeline
    stages]). A group name's groups merge in stage order, their ``params`` joined, where they
    hold the same hyperparameters or one of them holds no parameter (an empty group adds no
    parameter; its hyperparameters give way to those of a group with parameters). Where two
    groups of one name hold parameters and differ, the name gets a second entry."""
    entries: list[tuple[str, dict[str, Any]]] = []
    last: dict[str, dict[str, Any]] = {}
    for stage in stages:
        for name, group in stage:
            params = list(group["params"])
            held = last.get(name)
            if held is None or (
                params
                and held["params"]
                and _difference(_hyperparameters(held), _hyperparameters(group))
            ):
                entry = {**group, "params": params}
                entries.append((name, entry))
                last[name] = entry
            elif params and not held["params"]:
                held.clear()
                held.update(group, params=params)
            elif params:
                held["params"] += params
    return tuple(entries)


def _pairs(where: str, value: Any) -> _Pairs:
    if not isinstance(value, tuple) or not all(
        isinstance(pair, tuple) and len(pair) == 2 for pair in value
    ):
        raise ValueError(f"{where}: 'optim.param_groups' is not dmuon's ((name, group), ...)")
    for name, group in value:
        if not isinstance(group, Mapping):
            raise ValueError(f"{where}: param_groups[{name!r}] must be a dict")
    return value


def _loaded_groups(
    where: str,
    values: list[Any],
    optimizer: Muon,
    runtime: DedicatedRuntime,
    *,
    several: bool = False,
) -> dict[str, Any]:
    """This optimizer's ``{group name: group}`` from the checkpoint's param-groups values
    (one, or one per stage of a checkpoint written before the stages' groups were merged):
    a group name's entries joined in order, their parameters kept where this optimizer holds
    them under a pipeline or as one of ``several`` model parts of a rank (the other stages'
    are theirs); the hyperparameters of the entries that hold this optimizer's parameters,
    which must agree (see [Note: checkpoints of pipeline stages]).
    :func:`~._state_layout.check_param_groups` checks the result."""
    entries: dict[str, list[dict[str, Any]]] = {}
    for value in values:
        for name, group in _pairs(where, value):
            entries.setdefault(name, []).append(dict(group))
    stage = runtime.layout.pp_size > 1 or several
    mine = {name for name, _, _ in layout.optimizer_params(optimizer)}
    names = {group["group_name"] for group in optimizer.param_groups}
    out: dict[str, Any] = {}
    for name, groups in entries.items():
        if len(groups) == 1 and not stage:
            out[name] = groups[0]  # the whole model's group, checked as it is
            continue
        kept = [
            [fqn for fqn in group.get("params", []) if not stage or fqn in mine] for group in groups
        ]
        holding = [i for i, params in enumerate(kept) if params]
        if not holding and stage and name not in names:
            continue  # another stage's group
        source = groups[holding[0]] if holding else groups[0]
        for i in holding[1:]:
            differ = _difference(_hyperparameters(source), _hyperparameters(groups[i]))
            if differ is not None:
                raise ValueError(
                    f"{where}: param_groups[{name!r}] holds parameters saved with different"
                    f" hyperparameters ({differ}, for {kept[holding[0]][0]!r} and"
                    f" {kept[i][0]!r}): pipeline stages whose groups of one name differ, and"
                    " this optimizer's group holds parameters of both. Give each stage's group"
                    " a name of its own (Muon(model, param_groups=[{'group_name': ...}])), or"
                    " load it on the pipeline layout it was saved with"
                )
        out[name] = {**_hyperparameters(source), "params": [f for params in kept for f in params]}
    return out


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module | Sequence[nn.Module],
    optimizer: Muon | MuonParts | None,
    *,
    strict: bool = True,
) -> None:
    """Load a checkpoint written by :func:`save_checkpoint` (or a ``dcp.save`` /
    ``dcp.async_save`` of ``{"dmuon": AppState(...)}``) on any topology: another world size,
    HSDP shape or owner plan. All or nothing (see [Note: a failed load changes nothing]): it
    reads and checks everything, every chunk's checksum included, before it changes the model or
    the optimizer. A checkpoint that does not fit raises ``ValueError`` naming the key; a
    damaged one :class:`CheckpointIntegrityError` naming the file and what is wrong. A parameter
    without optimizer state in the checkpoint raises unless ``strict=False``, which starts it
    from fresh state. With ``optimizer=None`` only the model's weights and buffers are read: to
    start a new optimizer from a checkpoint's weights (fine-tuning, or routes changed since the
    save); it has no default, so that a resume cannot leave the optimizer out by mistake.
    Collective.

    Args:
        path: the checkpoint directory (every rank passes the same one). Without
            ``dmuon_checksums.json`` (a checkpoint of your own ``dcp.save``) it loads with the
            file checks but not the chunk checksums, and logs a warning (rank 0); one that
            :func:`save_checkpoint` wrote raises :class:`CheckpointIntegrityError` without it.
        model: the model given to ``dedicate_params`` (that object; another raises
            ``ValueError``); with a :class:`MuonParts`, the list of its parts' modules, in
            its order (every part is read and checked before any changes).
        optimizer: the :class:`Muon` built on ``model`` (another object raises
            ``ValueError``), or the :class:`MuonParts` of this rank's model parts; ``None``:
            the model alone is loaded (logged on rank 0), the checkpoint's optimizer state is
            not read, and a ``Muon`` built before keeps its state.
        strict: ``True``: a parameter without optimizer state in the checkpoint raises
            ``ValueError``; ``False``: such parameters start from fresh state, as before
            their first step; everything else loads. ``False`` with ``optimizer=None`` raises
            ``ValueError`` (there is no optimizer state to be strict about).
    """
    where = "load_checkpoint"
    _check_path_type(where, path)
    check_bool(f"{where}: strict", strict)
    _check_not_plain(where, model)
    if optimizer is None:
        if not strict:
            raise ValueError(
                f"{where}: strict=False applies to the optimizer state, and optimizer=None loads"
                " the model alone; pass the optimizer, or leave strict at True"
            )
        _load_model(where, path, [model] if isinstance(model, nn.Module) else list(model))
        return
    app = AppState(model, optimizer)
    parts = app._each()
    with record_function("dmuon::load_checkpoint"):
        absent: set[str] = set()
        checksums, metadata = _read_checked(
            where,
            path,
            app.runtime,
            lambda metadata: absent.update(_check_metadata(app, metadata, where, strict=strict)),
        )
        target, direct = app._load_target(absent)
        # The param groups (and a checkpoint's of stages written before they were merged,
        # every stage's key), read beside the tensors and checked before anything changes.
        optim = target["optim"]
        keys = _groups_keys(metadata)
        optim.update(dict.fromkeys(keys, ()))
        state = {CHECKPOINT_KEY: target}
        scratch = integrity.load_verified(where, path, state, metadata, checksums, direct)
        values = [optim.pop(key) for key in keys]
        found: list[dict[str, Any]] = []

        def check() -> None:
            for part in parts:
                groups = _loaded_groups(
                    where, values, part.optimizer, part.runtime, several=len(parts) > 1
                )
                layout.check_param_groups(where, part.optimizer, groups)
                found.append(groups)

        # On every rank of every stage alike, every part, before any rank installs anything.
        checked_on_every_rank(app.runtime, where, check, everyone=True)
        scratch.install()
        for part, groups in zip(parts, found, strict=True):
            part._install(target, groups)


def _check_not_plain(where: str, model: object) -> None:
    """Refuse a model that :func:`dedicate_params` never saw (a plain model for evaluation, in
    one process without a process group), naming both ways: build it as for training, or read
    the checkpoint's weights with DCP alone."""
    models = [model] if isinstance(model, nn.Module) else model
    if not isinstance(models, Sequence):
        return
    for m in models:
        if (
            isinstance(m, nn.Module)
            and getattr(m, RUNTIME_ATTR, None) is None
            and not any(is_dedicated(p) for p in m.parameters())
        ):
            raise ValueError(
                f"{where}: {type(m).__name__} has no dmuon runtime (dmuon.dedicate_params was"
                " not called on it). To resume training, build the model as for the save"
                " (dedicate_params, fully_shard, Muon, on any number of ranks) and load into it;"
                " to read the weights into a plain model, without dmuon or a process group"
                " (evaluation, inference): weights = model.state_dict();"
                f" dcp.load({{{CHECKPOINT_KEY!r}: {{'model': weights}}}}, checkpoint_id=path,"
                " no_dist=True); model.load_state_dict(weights) (see the Checkpoints guide)"
            )


def _read_checked(
    where: str,
    path: str | os.PathLike[str],
    runtime: DedicatedRuntime,
    check_tensors: Callable[[Metadata], None],
) -> tuple[integrity.Checksums | None, Metadata]:
    """The checkpoint's record and ``.metadata``, its files checked and its tensors by
    ``check_tensors``, agreed across ranks in one collective: every rank reads the files
    itself, and one that sees them otherwise (a shared file system's stale view of a file just
    written) raises on every rank instead of leaving the others waiting in DCP's first
    collective."""
    read: list[Any] = []

    def check() -> None:
        _check_not_a_file(where, path)
        try:
            checksums = integrity.read_checksums(where, path)
            metadata = integrity.read_metadata(where, path, checksums)
            integrity.check_files(where, path, metadata, checksums)
        except OSError as error:  # permissions, a stale NFS handle: raised on every rank
            raise integrity.CheckpointIntegrityError(
                f"{where}: reading checkpoint {os.fspath(path)!r} failed:"
                f" {type(error).__name__}: {error}; nothing was loaded"
            ) from error
        check_tensors(metadata)
        read.extend((checksums, metadata))

    # Over every rank of every pipeline stage: DCP's read is collective over the world.
    checked_on_every_rank(runtime, where, check, everyone=True)
    return read[0], read[1]


def _load_model(where: str, path: str | os.PathLike[str], models: list[nn.Module]) -> None:
    """:func:`load_checkpoint` without an optimizer: the tensors of the model (or of a rank's
    model parts) alone, checked and read as there, then published as a step's weights are."""
    runtimes = [get_runtime(model) for model in models]
    several = len(models) > 1

    def check(metadata: Metadata) -> None:
        for model, runtime in zip(models, runtimes, strict=True):
            _check_model_metadata(model, runtime, metadata, where, several=several)

    with record_function("dmuon::load_checkpoint"):
        checksums, metadata = _read_checked(where, path, runtimes[0], check)
        target: dict[str, Any] = {"model": {}}
        for model, runtime in zip(models, runtimes, strict=True):
            runtime.drain()
            target["model"] |= _model_tensors(model, runtime)
        scratch = integrity.load_verified(
            where, path, {CHECKPOINT_KEY: target}, metadata, checksums
        )
        scratch.install()
        for model, runtime in zip(models, runtimes, strict=True):
            _install_model(model, runtime, target["model"])
            # Owned weights changed: drop kept copies (Z2) and publish to replicas (HSDP).
            runtime.after_step(async_=False)
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info(
            "%s: loaded the model's weights and buffers from %r; optimizer=None, so no"
            " optimizer state was read",
            where,
            os.fspath(path),
        )
