"""Flat, full-tensor checkpoints of a dmuon model and its ``Muon`` optimizer.

[Note: the checkpoint format]
Model: ``{fqn: full tensor}`` with the keys of ``model.state_dict()``, the format a plain
single-process model loads with ``load_state_dict``. Dedicated parameters come from their
owners; FSDP2 DTensors are all-gathered; buffers and plain tensors are copied.

Optimizer: ``{"state": {fqn: {...}}, "param_groups": {group_name: {...}}}``. A Muon matrix's
state is ``{"momentum_buffer"}``, an AdamW parameter's ``{"step", "exp_avg", "exp_avg_sq"}``,
all full tensors (the step a scalar), one entry for every parameter (see [Note: complete
optimizer state] in :mod:`._state_layout`); each group keeps its hyperparameters (scheduler
keys such as ``initial_lr`` included) and ``"params"``, the FQNs it holds. Nothing in either
dictionary depends on the topology, so a checkpoint taken at one world size loads at another.
For checkpoints of large models use the sharded DCP path (:mod:`._dcp`), which gathers
nothing.

[Note: one full tensor at a time]
The getters materialise one full tensor at a time and hand it over before the next: a
dedicated tensor travels from its owner (a broadcast on the runtime's world group, or with
``rank0_only`` a send to rank 0 alone), an FSDP2 DTensor is all-gathered (``full_tensor``).
With ``cpu_offload`` (the default) each tensor moves to the CPU at once, and with
``rank0_only`` every rank but 0 drops it and returns ``{}``. So during the call a rank holds its
own state plus at most one full tensor of device memory; rank 0 also holds the CPU dictionary
it returns. Returned tensors never alias the model's or the optimizer's own.

[Note: validate, then apply]
``set_*_state_dict`` checks the whole dictionary (keys, shapes, dtypes, fields, group names
and membership, see :mod:`._state_layout`; and that no value is a ``DTensor``, which holds only
its rank's part: torch's own ``set_model_state_dict``, refused for a dmuon model, leaves the
model's DTensors in the dictionary it was given) before it writes anything, so a bad checkpoint
raises ``ValueError`` naming the offending key and leaves model and optimizer exactly as they
were. Loading needs no collective: every rank holds the full dictionary and takes its own part
(the owner its full weight or state, FSDP2 parameters their shard). With
``broadcast_from_rank0`` only rank 0 holds it; see [Note: loading from rank 0].

Every function here is collective over the runtime's ranks (get_*: broadcasts, sends and
``full_tensor``; set_model_state_dict: the runtime's ``after_step``) and first drains the
runtime's pending collectives.

[Note: loading from rank 0]
``set_model_state_dict(..., broadcast_from_rank0=True)`` is the load of a checkpoint that only
global rank 0 reads (a Hugging Face file too large for every rank's host memory), torch's
``StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)`` for dmuon. Rank 0 checks
the dictionary exactly as the every-rank load does and broadcasts its verdict (the error's text,
or nothing) before any tensor moves, so a bad dictionary raises the same ``ValueError`` on
every rank and nothing is written anywhere. Then the entries travel in ``state_dict`` order,
the reverse of :class:`_Gather`:

- a dedicated weight goes point to point from rank 0 to its owner, straight into the owner's
  ``full`` (with tensor parallelism to the owner coordinate of every TP grid, each its TP
  shard, or the whole matrix where it is not split). A peer receives nothing and allocates
  nothing. Consecutive dedicated weights of one hook boundary travel as one batch of sends,
  waited before anything else moves, so rank 0 holds at most one boundary's outgoing copies;
- an FSDP2 ``DTensor`` is broadcast whole, one at a time, and each rank keeps its shard
  (``shard_like``), as torch does; a plain tensor (a buffer, or a parameter of the replicated
  path) is broadcast straight into itself.

So a rank other than 0 holds, beyond its own shards and owned weights, at most one full
tensor at a time. In HSDP the plan gives each weight one global owner on the whole grid (an
``Owner(shard, replicate)``; the other rows keep its copy on the owner's column replicas), and
the weight goes to that owner alone, as the every-rank load writes only the owner's ``full``
too: the closing ``after_step`` publishes each owner's packs
to its shard column, the very broadcast that follows every optimizer step, so the replicas'
copies are the owner's bytes by construction (with mixed precision the owner's compute copy,
cast from the master just loaded), identical to what any step leaves. Sending the replicas
their own copies from rank 0 would cost the same bytes again and still need the publish for
a compute copy the replica does not cast itself. The replicated (DDP) path works the same way:
the owners' masters are loaded and published to the shard group.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.profiler import record_function
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor

from .._checks import check_bool
from ..holder import DedicatedParam, tensor_view
from ..optim import Muon, step_dtype
from ..runtime import DedicatedRuntime, get_runtime
from ._integrity import CheckpointIntegrityError
from ._state_layout import (
    STATE_FIELDS,
    TensorSpec,
    check_model,
    check_optimizer,
    check_optimizer_state,
    check_param_groups,
    fresh_state,
    keys_error,
    model_entries,
    model_specs,
    optim_dtype,
    optimizer_params,
    optimizer_specs,
    state_keys,
)
from ._torch_options import from_torch_options

__all__ = [
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "group_state",
    "refuse_under_pipeline",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "shard_like",
]


Entry = tuple[str, Tensor, DedicatedParam | None]


def _getter_flags(
    function: str, options: StateDictOptions | None, cpu_offload: bool, rank0_only: bool
) -> tuple[bool, bool]:
    """A getter's ``cpu_offload`` and ``rank0_only``, checked to be bools: its own, or as
    torch's ``options`` set them, when given, where its own must be at their defaults (see
    [Note: torch's options]). Both getters read the two flags alike."""
    if options is not None:
        given = {"cpu_offload": cpu_offload, "rank0_only": rank0_only}
        defaults = {"cpu_offload": True, "rank0_only": False}
        chosen = from_torch_options(function, options, given, defaults)
        cpu_offload, rank0_only = chosen["cpu_offload"], chosen["rank0_only"]
    check_bool("rank0_only", rank0_only)
    check_bool("cpu_offload", cpu_offload)
    return cpu_offload, rank0_only


def refuse_under_pipeline(runtime: DedicatedRuntime, call: str) -> None:
    """Raise, on every rank alike, where ``runtime`` is a pipeline stage's.

    [Note: checkpoints of pipeline stages]
    Under pipeline parallelism every checkpoint function works on a stage module. The full
    state dicts (:func:`get_model_state_dict`, :func:`get_optimizer_state_dict`, the ``set_``
    functions) gather and load a stage's tensors over the stage's ranks. A DCP checkpoint
    (``save_checkpoint``, ``AppState``) is one checkpoint of every stage, written by every rank
    at once: the tensors' keys are FQNs, which the stages do not share. The param groups are
    one value under one key, ``optim.param_groups``, as without a pipeline, since DCP keeps
    one of the values written under one key: ``AppState.state_dict()`` gathers every stage's
    groups over its pipeline group (one object all-gather) and merges them into the whole
    model's, the same on every rank. A group name's groups merge in stage order, their
    parameters joined, where their hyperparameters agree or one of them holds no parameter
    (a stage without Muon matrices keeps an empty ``muon`` group); where two stages' groups of
    one name hold parameters and differ (another lr per stage), the name gets an entry per run
    of stages. A rank with several model parts (a ``MuonParts``, interleaved and looped
    schedules) is one ``AppState`` of every part: each part's tensors under their FQNs, and
    one param-groups value, for which each part's groups are gathered over the pipeline group
    in turn with the part's stage index (``MuonParts.stage_indices``: torch's "loop" order,
    part ``k`` of position ``p`` being stage ``p + k * P``, unless given, as a V schedule's
    must be), and every stage's are merged once, in stage order. A load, plain
    ``dcp.load`` or ``load_checkpoint``, reads that key on any layout: a stage (each part of a
    rank) keeps its own parameters of each group (the other stages' are theirs), and takes the
    hyperparameters of the entries that hold them, which must agree; the whole model takes
    every parameter. So a checkpoint loads on another pipeline layout (one part per rank or
    several), or without one, and one written without a pipeline (the format is unchanged
    there) loads on stages. A group of one name whose stages were saved with different hyperparameters loads on a
    layout that keeps them apart, and raises where one group would hold both. The tensors'
    checks ignore the other stages' keys (they are not unexpected), and agree over every rank
    of every stage before DCP's read, which is collective over the world (one read of every
    part of a rank); so does the param groups' check, of every part, before any rank installs
    anything.

    A checkpoint of stages written before the groups were merged holds each stage's groups
    under a key of its own (``optim.param_groups`` the first stage's, ``optim.param_groups_<p>``
    stage ``p``'s): ``load_checkpoint`` reads every such key and merges them the same way, on
    any layout; a plain ``dcp.load`` reads the first stage's only, which the other stages'
    param groups check refuses. What is refused: ``rank0_only`` and ``broadcast_from_rank0``,
    which mean global rank 0, a rank of the first stage only."""
    if runtime.layout.pp_size > 1:
        raise RuntimeError(
            f"{call} is not supported under pipeline parallelism (dedicate_params("
            "pipeline_mesh=...)): global rank 0 belongs to the first stage only. Call it without"
            " the option (every rank of the stage gets or passes the stage module's full"
            " tensors; save them from one rank of each stage), or save and load every stage at"
            " once with dmuon.save_checkpoint and dmuon.load_checkpoint; nothing was done"
        )


class _Gather:
    """Full tensors one at a time, to every rank or to rank 0 only; see [Note: one full tensor
    at a time]."""

    def __init__(self, runtime: DedicatedRuntime, *, cpu_offload: bool, rank0_only: bool) -> None:
        self.runtime = runtime
        self.cpu_offload = cpu_offload
        self.rank0_only = rank0_only
        self.rank = dist.get_rank()
        self.world = dist.get_world_size(runtime.world_group)
        self.keeps = not rank0_only or self.rank == 0

    def _out(self, t: Tensor, *, fresh: bool, cpu: bool) -> Tensor:
        """``t`` as the caller gets it: on the CPU if ``cpu``, and a copy unless ``fresh``."""
        t = t.detach()
        if cpu:
            return t.to("cpu", copy=not fresh)
        return t if fresh else t.clone()

    def from_owner(
        self, dp: DedicatedParam, local: Tensor | None, spec: TensorSpec, *, cpu: bool
    ) -> Tensor | None:
        """The owner's ``local`` (``None`` on other ranks) where this rank keeps results."""
        if dp.tp_dim is not None and spec.shape:
            return self._from_tp_owner(dp, local, spec, cpu=cpu)
        src = self.runtime.global_rank(dp.owner)
        device = dp.param.device
        if self.rank == src:
            assert local is not None, f"{dp.fqn}: the owner has no tensor to send"
            local = local.detach().to(device)
        group = self.runtime.world_group
        if self.world > 1 and self.rank0_only and src != 0:
            if self.rank == src:
                dist.send(local, dst=0, group=group)  # type: ignore[arg-type]
            elif self.rank == 0:
                received = torch.empty(spec.shape, dtype=spec.dtype, device=device)
                dist.recv(received, src=src, group=group)
                return self._out(received, fresh=True, cpu=cpu)
            return None
        if self.world > 1 and not self.rank0_only:
            if self.rank != src:
                received = torch.empty(spec.shape, dtype=spec.dtype, device=device)
                dist.broadcast(received, src=src, group=group)
                return self._out(received, fresh=True, cpu=cpu)
            dist.broadcast(local, src=src, group=group)  # type: ignore[arg-type]
        # This rank is the owner, or the owner is rank 0 and only rank 0 keeps the result.
        if self.rank != src:
            return None
        return self._out(local, fresh=False, cpu=cpu)  # type: ignore[arg-type]

    def _from_tp_owner(
        self, dp: DedicatedParam, local: Tensor | None, spec: TensorSpec, *, cpu: bool
    ) -> Tensor | None:
        """A tensor-parallel matrix's state whole: each TP index's owner broadcasts its shard
        over its grid, then every rank all-gathers the shards of its TP group (with
        ``rank0_only`` only rank 0 keeps the result)."""
        runtime = self.runtime
        tp_group = runtime.comm_ctx.tp_group
        assert dp.tp_dim is not None and tp_group is not None
        device = dp.param.device
        shard = torch.empty(dp.local_shape, dtype=spec.dtype, device=device)
        if self.rank == runtime.global_rank(dp.owner):
            assert local is not None, f"{dp.fqn}: the owner has no tensor to send"
            shard.copy_(local.detach())
        if self.world > 1:
            dist.broadcast(shard, src=runtime.global_rank(dp.owner), group=runtime.world_group)
        parts = [torch.empty_like(shard) for _ in range(runtime.layout.tp_size)]
        dist.all_gather(parts, shard, group=tp_group)
        if not self.keeps:
            return None
        return self._out(torch.cat(parts, dim=dp.tp_dim), fresh=True, cpu=cpu)

    def from_shards(self, value: Tensor) -> Tensor | None:
        """``value`` whole: an FSDP2 DTensor all-gathered (collective), a plain tensor copied."""
        full, fresh = tensor_view(value).gathered()
        if not self.keeps:
            return None
        return self._out(full, fresh=fresh, cpu=self.cpu_offload)


def shard_like(full: Tensor, like: Tensor) -> Tensor:
    """``full`` laid out as ``like``: a DTensor with ``like``'s mesh and placements (this
    rank's shard, no communication), or a plain tensor on ``like``'s device."""
    return tensor_view(like).like(full)


# -- model ------------------------------------------------------------------------------------


def get_model_state_dict(
    model: nn.Module,
    *,
    cpu_offload: bool = True,
    rank0_only: bool = False,
    options: StateDictOptions | None = None,
) -> dict[str, Tensor]:
    """``{fqn: full tensor}`` for every entry of ``model.state_dict()``; collective.

    ``cpu_offload`` moves each tensor to the CPU as soon as it is gathered; ``rank0_only``
    returns the dictionary on rank 0 and ``{}`` on every other rank (see [Note: one full
    tensor at a time]).

    Args:
        model: the model given to ``dedicate_params`` (that object; another raises
            ``ValueError``).
        cpu_offload: ``True``: every tensor is returned on the CPU, moved there as soon as it
            is gathered, so that at most one full tensor at a time lives on the device;
            ``False``: on the device it was gathered on.
        rank0_only: ``True``: only rank 0 keeps (and returns) the tensors, the other ranks
            return ``{}``; ``False``: every rank returns the whole dictionary. A bool
            (anything else raises ``TypeError``).
        options: torch's ``StateDictOptions`` in place of the two above, read as torch's
            ``get_model_state_dict`` reads them: ``full_state_dict=True`` (else
            ``ValueError``), and ``cpu_offload=True`` returns the CPU dictionary on rank 0
            alone (see [Note: torch's options]).
    """
    cpu_offload, rank0_only = _getter_flags(
        "get_model_state_dict", options, cpu_offload, rank0_only
    )
    runtime = get_runtime(model)
    if rank0_only:
        refuse_under_pipeline(runtime, "get_model_state_dict(rank0_only=True)")
    with record_function("dmuon::checkpoint_get_model"):
        runtime.drain()
        gather = _Gather(runtime, cpu_offload=cpu_offload, rank0_only=rank0_only)
        out: dict[str, Tensor] = {}
        # A tied weight is one tensor under two keys: gathered once, under its first key, and
        # copied for the others (on every rank alike: the entries do not depend on the rank).
        first_key: dict[int, str] = {}
        for key, value, dp in model_entries(model, runtime):
            first = first_key.setdefault(id(value), key)
            if first != key:
                if first in out:
                    out[key] = out[first].clone()
                continue
            if dp is not None:
                spec = TensorSpec(tuple(dp.shape), dp.dtype)
                full = gather.from_owner(dp, dp.full, spec, cpu=cpu_offload)
            else:
                full = gather.from_shards(value)
            if full is not None:
                out[key] = full
        return out


def set_model_state_dict(
    model: nn.Module,
    state_dict: Mapping[str, Tensor],
    *,
    broadcast_from_rank0: bool = False,
    options: StateDictOptions | None = None,
) -> None:
    """Load a full ``{fqn: tensor}`` dictionary (as :func:`get_model_state_dict` returns, or a
    plain model's ``state_dict()``); raises before modifying anything when a key is missing or
    unexpected or a shape or dtype differs. Collective.

    ``broadcast_from_rank0=True``: only global rank 0 needs the dictionary (every other rank's
    ``state_dict`` is ignored; pass ``{}``). Rank 0 checks it and every rank raises the same
    ``ValueError`` when it does not fit; otherwise each dedicated weight goes from rank 0 to its
    owner alone and every FSDP2 shard is cut from one broadcast tensor at a time (see [Note:
    loading from rank 0]).

    Args:
        model: the model given to ``dedicate_params`` (that object; another raises
            ``ValueError``).
        state_dict: ``{fqn: full tensor}`` with exactly the keys of ``model.state_dict()``,
            each a plain tensor (a ``DTensor`` raises ``ValueError``) of the entry's full shape
            and dtype (on any device). Ignored on every rank but 0 with
            ``broadcast_from_rank0=True``.
        broadcast_from_rank0: ``True``: read the dictionary on global rank 0 only and send
            each tensor to where it is kept; ``False``: every rank passes the whole dictionary.
            A bool (anything else raises ``TypeError``).
        options: torch's ``StateDictOptions`` in place of ``broadcast_from_rank0``, read as
            torch's ``set_model_state_dict`` reads them (``full_state_dict=True``; ``strict``
            must stay ``True``: see [Note: torch's options]).
    """
    if options is not None:
        chosen = from_torch_options(
            "set_model_state_dict",
            options,
            {"broadcast_from_rank0": broadcast_from_rank0},
            {"broadcast_from_rank0": False},
        )
        broadcast_from_rank0 = chosen["broadcast_from_rank0"]
    check_bool("broadcast_from_rank0", broadcast_from_rank0)
    runtime = get_runtime(model)
    if broadcast_from_rank0:
        refuse_under_pipeline(runtime, "set_model_state_dict(broadcast_from_rank0=True)")
    with record_function("dmuon::checkpoint_set_model"):
        runtime.drain()
        entries = model_entries(model, runtime)
        if broadcast_from_rank0:
            _Scatter(runtime).load(entries, state_dict)
        else:
            checked_on_every_rank(
                runtime, "set_model_state_dict", lambda: _check_model_dict(entries, state_dict)
            )
            with torch.no_grad():
                for key, target, dp in entries:
                    value = state_dict[key]
                    if dp is not None:
                        if dp.full is not None:
                            dp.full.copy_(dp.local_part(value))
                    else:
                        tensor_view(target).write(value)
        # Owned weights changed: drop kept copies (Z2) and publish to replicas (HSDP).
        runtime.after_step(async_=False)


def checked_on_every_rank(
    runtime: DedicatedRuntime,
    where: str,
    check: Callable[[], None],
    *,
    everyone: bool = False,
    read_in_place: bool = False,
) -> None:
    """Run ``check`` (it raises ``ValueError`` for what does not fit: a dictionary, a
    checkpoint's files) and agree across ranks before anything is changed (:func:`_agree`):
    the model's ranks, or with ``everyone`` every rank of every pipeline stage (before a
    collective over the world, as DCP's). Each rank checks its own dictionary or its own view
    of the files, and a rank that went on alone would write its part and then wait for the
    others in the next collective. ``read_in_place``: the check runs after ``dcp.load`` read
    into the live tensors (``AppState.load_state_dict``), which the other ranks' message says
    instead of "nothing was loaded"."""
    error: ValueError | None = None
    try:
        check()
    except ValueError as e:
        error = e
    group = runtime.step_group if everyone else runtime.global_group
    _agree(runtime, where, error, group, read_in_place=read_in_place)


def _agree(
    runtime: DedicatedRuntime,
    where: str,
    error: ValueError | None,
    group: ProcessGroup,
    *,
    read_in_place: bool = False,
) -> None:
    """Return on every rank when no rank has an ``error``; else raise on every rank: a failed
    rank its own error, the others the first failed rank's text (it travels as bytes, so
    nothing is pickled, its first byte saying whether to raise a
    :class:`CheckpointIntegrityError` or a ``ValueError``), naming the ranks that failed.
    Collective over ``group``."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    # The first byte says whether it was a CheckpointIntegrityError, the others raise one too.
    kind = b"I" if isinstance(error, CheckpointIntegrityError) else b"V"
    text = b"" if error is None else kind + (str(error) or repr(error)).encode()
    lengths = torch.zeros(
        dist.get_world_size(group), dtype=torch.int64, device=runtime.layout.device
    )
    lengths[dist.get_rank(group)] = len(text)
    dist.all_reduce(lengths, group=group)
    failed = [r for r, n in enumerate(lengths.tolist()) if n]
    if not failed:
        return
    first = failed[0]
    data = torch.empty(int(lengths[first]), dtype=torch.uint8, device=runtime.layout.device)
    if error is not None and dist.get_rank(group) == first:
        data.copy_(torch.frombuffer(bytearray(text), dtype=torch.uint8))
    dist.broadcast(data, group=group, group_src=first)
    if error is not None:
        raise error
    sent = bytes(data.cpu().tolist())
    shown = sent[1:].decode()
    if read_in_place:
        named = ValueError(
            f"{shown} [{where} failed on rank(s) {failed}; every rank stopped before installing"
            " the param groups, after dcp.load had read the tensors]"
        )
    else:
        named = ValueError(
            f"{shown} [{where} failed on rank(s) {failed}; nothing was loaded on any rank]"
        )
    if sent[:1] == b"I":
        raise CheckpointIntegrityError(str(named))
    raise named


def _check_model_dict(entries: list[Entry], state_dict: object) -> None:
    """Raise ``ValueError`` unless ``state_dict`` holds exactly the model's keys, shapes and
    dtypes (see [Note: validate, then apply])."""
    if not isinstance(state_dict, Mapping):
        raise ValueError(
            f"state_dict must be a mapping fqn -> tensor, got {type(state_dict).__name__}"
        )
    check_model(
        "set_model_state_dict",
        model_specs(entries),
        {k: TensorSpec.of_saved(v) for k, v in state_dict.items()},
        "the checkpoint must hold exactly the keys of model.state_dict() (same model"
        " definition; take it with dmuon.get_model_state_dict)" + _tied_hint(entries, state_dict),
    )
    for key, value in state_dict.items():
        _refuse_dtensor("set_model_state_dict", repr(key), value)


def _refuse_dtensor(where: str, key: str, value: object) -> None:
    """Raise ``ValueError`` when a full dictionary's ``value`` is a ``DTensor`` (see [Note:
    validate, then apply])."""
    if isinstance(value, DTensor):
        raise ValueError(
            f"{where}: {key} is a DTensor, whose values are spread over its mesh; the"
            " dictionary takes full plain tensors, as dmuon.get_model_state_dict and"
            " dmuon.get_optimizer_state_dict return them (each rank takes its part, and with"
            " broadcast_from_rank0=True rank 0 sends them alone). torch's set_model_state_dict"
            " puts the model's own DTensors into the dictionary it is given: read the"
            " dictionary again, or pass value.full_tensor() (collective)"
        )


def _tied_hint(entries: list[Entry], state_dict: Mapping[str, object]) -> str:
    """How to fill a key the dictionary lacks whose weight it holds under a tied key (a
    safetensors file of ``save_pretrained`` keeps one key of a tied pair)."""
    keys_of: dict[int, list[str]] = {}
    for key, target, _ in entries:
        keys_of.setdefault(id(target), []).append(key)
    for keys in keys_of.values():
        held = [k for k in keys if k in state_dict]
        lacking = [k for k in keys if k not in state_dict]
        if held and lacking:
            return (
                f". {lacking[0]!r} is tied to {held[0]!r} (one weight, two keys): add it,"
                f" sd[{lacking[0]!r}] = sd[{held[0]!r}]"
            )
    return ""


class _Scatter:
    """Rank 0's full dictionary to where each tensor is kept; see [Note: loading from rank 0]."""

    SOURCE = 0

    def __init__(self, runtime: DedicatedRuntime) -> None:
        self.runtime = runtime
        # Every rank: with tensor parallelism rank 0 feeds every TP index's grid.
        self.group = runtime.global_group
        self.rank = dist.get_rank()
        self.world = dist.get_world_size(self.group)
        self.device = runtime.layout.device
        self.is_source = self.rank == self.SOURCE
        # The point-to-point transfers of the current boundary, and where each received
        # tensor goes once they are waited (nothing when it was received in place).
        self._ops: list[dist.P2POp] = []
        self._landing: list[tuple[Tensor, Tensor]] = []
        self._boundary: str | None = None

    def load(self, entries: list[Entry], state_dict: object) -> None:
        """Check on rank 0, share the verdict, then move every entry (collective)."""
        self._share_verdict(entries, state_dict)
        specs = model_specs(entries)
        # A tied weight is one tensor under two keys: it moves once, from its last key (the
        # value a load on every rank ends with).
        last = {id(target): key for key, target, _ in entries}
        with torch.no_grad():
            for key, target, dp in entries:
                if last[id(target)] != key:
                    continue
                value = state_dict[key] if self.is_source else None  # type: ignore[index]
                if dp is not None:
                    self._to_owner(dp, value)
                else:
                    self._to_shards(target, value, specs[key])
            self._flush()

    def _share_verdict(self, entries: list[Entry], state_dict: object) -> None:
        """Check the dictionary on rank 0 and raise its ``ValueError`` on every rank, or return
        on every rank."""
        error: ValueError | None = None
        if self.is_source:
            try:
                _check_model_dict(entries, state_dict)
            except ValueError as e:
                error = e
        _agree(self.runtime, "set_model_state_dict", error, self.runtime.global_group)

    def _to_owner(self, dp: DedicatedParam, value: Tensor | None) -> None:
        """``value`` (rank 0's full weight) to the owner coordinate of every TP grid, each
        its part: the TP shard of a split matrix (in TP-index order, as the holder's ``local_part``
        cuts it), the whole matrix otherwise."""
        if dp.boundary != self._boundary:
            self._flush()
            self._boundary = dp.boundary
        for index, rank in enumerate(self.runtime.layout.tp_ranks(dp.owner)):
            if self.is_source:
                assert value is not None
                part = dp.tp_part(value, index)
                if rank == self.rank:
                    assert dp.full is not None, f"{dp.fqn}: the owner holds no weight"
                    dp.full.copy_(part)
                else:
                    send = part.detach().to(self.device, copy=False).contiguous()
                    self._ops.append(dist.P2POp(dist.isend, send, rank, self.group))
            elif rank == self.rank:
                assert dp.full is not None, f"{dp.fqn}: the owner holds no weight"
                into = dp.full
                if not into.is_contiguous():
                    into = torch.empty(dp.local_shape, dtype=dp.full.dtype, device=self.device)
                    self._landing.append((into, dp.full))
                self._ops.append(dist.P2POp(dist.irecv, into, self.SOURCE, self.group))

    def _flush(self) -> None:
        """Wait for the current boundary's transfers and copy what landed beside its target."""
        if self._ops:
            for work in dist.batch_isend_irecv(self._ops):
                work.wait()
        for landed, target in self._landing:
            target.copy_(landed)
        self._ops, self._landing = [], []

    def _to_shards(self, target: Tensor, value: Tensor | None, spec: TensorSpec) -> None:
        """``value`` broadcast whole from rank 0; an FSDP2 ``DTensor`` keeps its shard, a plain
        tensor all of it (received in place when it is contiguous)."""
        self._flush()
        self._boundary = None
        view = tensor_view(target)
        in_place = view.receives_in_place(self.device)
        if in_place:
            full = target.detach()
            if self.is_source:
                full.copy_(value)  # type: ignore[arg-type]
        elif self.is_source:
            assert value is not None
            full = value.detach().to(self.device, copy=False).contiguous()
        else:
            full = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
        if self.world > 1:
            dist.broadcast(full, src=self.SOURCE, group=self.group)
        if not in_place:
            view.write(full)


# -- optimizer --------------------------------------------------------------------------------


def group_state(optimizer: Muon) -> dict[str, dict[str, Any]]:
    """Every param group's hyperparameters and ``"params"`` (its parameters' keys, see [Note:
    optimizer state keys]), by group name."""
    return {
        group["group_name"]: {
            **{k: v for k, v in group.items() if k not in ("params", "param_names")},
            "optimizer": str(group["optimizer"]),
            "params": keys,
        }
        for group, keys in zip(optimizer.param_groups, state_keys(optimizer), strict=True)
    }


def get_optimizer_state_dict(
    model: nn.Module,
    optimizer: Muon,
    *,
    cpu_offload: bool = True,
    rank0_only: bool = False,
    options: StateDictOptions | None = None,
) -> dict[str, Any]:
    """Full, FQN-keyed optimizer state (see [Note: the checkpoint format]); collective.

    ``cpu_offload`` and ``rank0_only`` as in :func:`get_model_state_dict` (a dedicated
    matrix's step is always on the CPU, as a non-fused ``torch.optim.AdamW`` keeps it).

    Args:
        model: the model given to ``dedicate_params`` (that object; another raises
            ``ValueError``).
        optimizer: the :class:`Muon` built on ``model`` (another object raises
            ``ValueError``).
        cpu_offload: ``True``: every state tensor is returned on the CPU, moved there as soon
            as it is gathered; ``False``: on the device it was gathered on (a dedicated
            matrix's step stays on the CPU either way; an FSDP2 parameter's step is where its
            AdamW keeps it, on the device with the fused kernel).
        rank0_only: ``True``: only rank 0 returns the state, every other rank ``{}``;
            ``False``: every rank returns it. A bool (anything else raises ``TypeError``).
        options: torch's ``StateDictOptions`` in place of the two above, as in
            :func:`get_model_state_dict`.
    """
    cpu_offload, rank0_only = _getter_flags(
        "get_optimizer_state_dict", options, cpu_offload, rank0_only
    )
    optimizer = check_optimizer(model, optimizer)
    runtime = get_runtime(model)
    if rank0_only:
        refuse_under_pipeline(runtime, "get_optimizer_state_dict(rank0_only=True)")
    with record_function("dmuon::checkpoint_get_optimizer"):
        runtime.drain()
        gather = _Gather(runtime, cpu_offload=cpu_offload, rank0_only=rank0_only)
        specs = optimizer_specs(optimizer)
        state: dict[str, dict[str, Tensor]] = {}
        for name, p, group in optimizer_params(optimizer):
            route = group["optimizer"]
            dp = optimizer.dedicated_param(p)
            entry: dict[str, Tensor] = {}
            if dp is not None:
                local = None
                if dp.is_owner:
                    assert dp.full is not None
                    local = optimizer.state.get(p) or fresh_state(route, dp.full, optim_dtype(dp))
                for field, spec in specs[name].items():
                    step = field == "step"
                    if step:
                        spec = TensorSpec((), step_dtype())
                    value = None if local is None else local[field]
                    if step and value is not None:
                        value = value.to(step_dtype())
                    full = gather.from_owner(dp, value, spec, cpu=cpu_offload or step)
                    if full is not None:
                        entry[field] = full
            else:
                local = optimizer.state.get(p) or fresh_state(route, p)
                for field in specs[name]:
                    full = gather.from_shards(local[field])
                    if full is not None:
                        entry[field] = full
            if gather.keeps:
                state[name] = entry
        if not gather.keeps:
            return {}
        return {"state": state, "param_groups": group_state(optimizer)}


def _check_top(where: str, state_dict: Any) -> None:
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"{where}: expected a dict with 'state' and 'param_groups'")
    top_missing = [k for k in ("state", "param_groups") if k not in state_dict]
    top_unexpected = [k for k in state_dict if k not in ("state", "param_groups")]
    if top_missing or top_unexpected:
        raise keys_error(
            where, top_missing, top_unexpected, "take it with dmuon.get_optimizer_state_dict"
        )
    if not isinstance(state_dict["state"], Mapping):
        raise ValueError(f"{where}: 'state' must map parameter fqn -> state dict")


def _saved_specs(where: str, saved_state: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The specs of a flat dictionary's state entries (``None`` for a non-tensor)."""
    got: dict[str, dict[str, Any]] = {}
    for fqn, entry in saved_state.items():
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}: state[{fqn!r}] must be a dict of tensors")
        for field, value in entry.items():
            _refuse_dtensor(where, f"state[{fqn!r}][{field!r}]", value)
        got[fqn] = {field: TensorSpec.of_saved(v) for field, v in entry.items()}
    return got


def set_optimizer_state_dict(
    model: nn.Module,
    optimizer: Muon,
    state_dict: Mapping[str, Any],
    *,
    strict: bool = True,
    options: StateDictOptions | None = None,
) -> None:
    """Restore momentum buffers, Adam moments, steps and group hyperparameters from a full
    optimizer state dict; raises before modifying anything when it does not fit. A parameter
    without an entry raises unless ``strict=False``, which starts it from fresh state.

    Args:
        model: the model given to ``dedicate_params`` (that object; another raises
            ``ValueError``).
        optimizer: the :class:`Muon` built on ``model`` (another object raises
            ``ValueError``).
        state_dict: a full optimizer state dict, ``{"state": {fqn: {field: tensor}},
            "param_groups": ...}``, as :func:`get_optimizer_state_dict` returns it (from any
            topology; plain tensors, a ``DTensor`` raises ``ValueError``); every rank passes
            it.
        strict: ``True``: a parameter without an entry in ``state_dict["state"]`` raises
            ``ValueError``; ``False``: it starts from fresh state.
        options: torch's ``StateDictOptions`` in place of ``strict``, read as torch's
            ``set_optimizer_state_dict`` reads them (``full_state_dict=True``; see [Note:
            torch's options]).
    """
    where = "set_optimizer_state_dict"
    if options is not None:
        strict = from_torch_options(where, options, {"strict": strict}, {"strict": True})["strict"]
    check_bool(f"{where}: strict", strict)
    optimizer = check_optimizer(model, optimizer)
    runtime = get_runtime(model)
    with record_function("dmuon::checkpoint_set_optimizer"):
        runtime.drain()
        specs = optimizer_specs(optimizer)

        def check() -> None:
            _check_top(where, state_dict)
            check_param_groups(where, optimizer, state_dict["param_groups"])
            got = _saved_specs(where, state_dict["state"])
            unexpected = [fqn for fqn in got if fqn not in specs]
            check_optimizer_state(where, specs, got, unexpected, strict=strict)

        checked_on_every_rank(runtime, where, check)
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        apply_param_groups(optimizer, saved_groups)
        optimizer.state.clear()
        with torch.no_grad():
            for name, p, group in optimizer_params(optimizer):
                entry = saved_state.get(name)
                if entry is None:
                    continue
                dp = optimizer.dedicated_param(p)
                if dp is not None:
                    if not dp.is_owner:
                        continue
                    assert dp.full is not None
                    like: Tensor = dp.full
                else:
                    like = p
                optimizer.state[p] = {
                    field: as_step(entry[field])
                    if field == "step"
                    else shard_like(
                        entry[field] if dp is None else dp.local_part(entry[field]), like
                    )
                    for field in STATE_FIELDS[group["optimizer"]]
                }


def as_step(value: Tensor) -> Tensor:
    """An AdamW step as ``torch.optim.AdamW`` keeps it: a CPU scalar of its step dtype."""
    return value.detach().reshape(()).to(device="cpu", dtype=step_dtype(), copy=True)


def apply_param_groups(optimizer: Muon, saved_groups: Mapping[str, Mapping[str, Any]]) -> None:
    """Set every group's hyperparameters from a checked ``param_groups`` dictionary."""
    for group in optimizer.param_groups:
        saved = saved_groups[group["group_name"]]
        for key, value in saved.items():
            if key not in ("params", "param_names", "group_name", "optimizer"):
                group[key] = tuple(value) if key == "betas" else value
