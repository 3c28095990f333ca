"""Rank-local, JSON-friendly views of the optimizer groups, the ownership plan and the forward
unshard traffic. No collectives: each rank describes what it holds, and a caller that wants a
world view gathers the dictionaries itself (e.g. ``all_gather_object``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict, cast

import torch
from torch import nn

from dmuon_ownership import (
    POLICY_FIELDS,
    ParamPolicy,
    Route,
    experts_held,
    validate_param_policy,
)

from ._checks import is_int
from ._matrix import MatrixView, describe_pieces
from ._torch_internals import local_shard
from .checkpoint import check_optimizer
from .holder import DedicatedParam, TPMode, gram_of, tensor_view
from .optim import Muon
from .runtime import DedicatedGroup, DedicatedRuntime, get_runtime, replicated_payload
from .setup import parameter_names

__all__ = [
    "BoundaryPlan",
    "BoundaryUnshard",
    "CommPlanSummary",
    "ForwardUnshardProfile",
    "Hyperparameters",
    "Matrices",
    "MatrixPiece",
    "PackRow",
    "ParamGroupSummary",
    "ParamRow",
    "collect_forward_unshard_profile",
    "summarize_comm_plan",
    "summarize_param_groups",
]


# The shapes of what the diagnostics return: plain dicts (JSON-friendly), typed for checkers.
# A key only some dicts hold is declared in a total=False subclass, not as NotRequired: under
# ``from __future__ import annotations`` Python 3.11 does not see NotRequired at run time, and
# its ``__required_keys__`` would list the key.


class _EveryGroupHyperparameters(TypedDict):
    lr: float
    weight_decay: float


class Hyperparameters(_EveryGroupHyperparameters, total=False):
    """A group's hyperparameters as plain numbers (a tensor as its float, a pair as a list):
    every group holds ``lr`` and ``weight_decay``, Muon groups ``momentum`` and ``nesterov``,
    AdamW groups ``betas`` and ``eps``, and ``initial_lr`` is there once an LR scheduler set
    it."""

    momentum: float
    nesterov: bool
    betas: list[float]
    eps: float
    initial_lr: float


class MatrixPiece(TypedDict):
    """One piece of a declared split (``MatrixSplit``): its rows ``[start, stop)`` of the
    weight and the matrices Muon orthogonalises of it."""

    name: str
    rows: list[int]
    count: int
    shape: list[int]


class Matrices(TypedDict):
    """What Muon orthogonalises of a Muon-route parameter: ``count`` matrices of ``shape``
    (``None`` where a declared split's pieces differ), cut out of it as ``split`` says in
    words (``None``: each 2-D slice is one matrix); ``pieces``: a declared split's pieces,
    else ``None``."""

    count: int
    shape: list[int] | None
    split: str | None
    pieces: list[MatrixPiece] | None


class _EveryParamRow(TypedDict):
    name: str
    route: str
    shape: list[int]
    owner_rank: int | None
    matrices: Matrices | None
    dtype: str
    master_dtype: str
    compute_dtype: str
    reduce_dtype: str
    optim_dtype: str
    output_dtype: str | None
    policy_overrides: list[int] | None


class ParamRow(_EveryParamRow, total=False):
    """One parameter of a :class:`ParamGroupSummary` (see :func:`summarize_param_groups`):
    ``role`` only for a dedicated one, ``owner_rank`` ``None`` for an FSDP2 one, ``matrices``
    ``None`` off the Muon route; dtypes by name (``"bfloat16"``), ``output_dtype`` ``None``
    where outputs are not cast."""

    role: str  #: this rank's: ``"owner"``, ``"replica"`` (HSDP) or ``"peer"``


class ParamGroupSummary(TypedDict):
    """One optimizer group, as :func:`summarize_param_groups` describes it."""

    name: str
    optimizer: str  #: ``"muon"`` or ``"adamw"``
    hyperparameters: Hyperparameters
    params: list[str]
    numel: int
    stepped_here: list[str]
    stepped_numel_here: int
    local_numel_here: int
    lr_scaling: str | None  #: a Muon group's ``StepOptions.lr_scaling``; ``None`` for AdamW
    rows: list[ParamRow]
    rows_omitted: int


class PackRow(TypedDict):
    """One pack of a boundary in a :class:`CommPlanSummary`: ``owner`` its grid coordinate,
    ``owner_rank`` and ``sender`` (in this rank's row) global ranks, ``role`` this rank's."""

    owner: list[int]
    owner_rank: int
    sender: int
    role: str
    params: list[str]
    numel: int
    bytes: int
    dtype: str


class BoundaryPlan(TypedDict):
    """One hook boundary of a :class:`CommPlanSummary`: its listed packs and how many were
    left out."""

    name: str
    num_packs: int
    packs: list[PackRow]
    packs_omitted: int


class CommPlanSummary(TypedDict):
    """What :func:`summarize_comm_plan` returns."""

    coord: list[int]
    tp_ns: str | None
    shard_size: int
    replicate_size: int
    world_size: int
    reshard_after_forward: bool
    fingerprint: str
    num_params: int
    owned_here: list[str]
    owned_numel_here: int
    loads: list[float]
    imbalance_pct: float
    #: bytes by axis and kind, keyed like ``CommCounter``: ``"shard/broadcast"``, ...
    payload_bytes_per_step: dict[str, int]
    boundaries: list[BoundaryPlan]
    rows_omitted: int


class BoundaryUnshard(TypedDict):
    """One hook boundary of a :class:`ForwardUnshardProfile`."""

    name: str
    state: str  #: ``"resharded"``, ``"unsharding"`` or ``"unsharded"``
    packs: int
    recv_bytes_per_broadcast: int
    send_bytes_per_broadcast: int
    resident: bool
    forward_wait_ms: float | None


class ForwardUnshardProfile(TypedDict):
    """What :func:`collect_forward_unshard_profile` returns."""

    coord: list[int]
    reshard_after_forward: bool
    broadcast_rounds_per_step: int
    boundaries: list[BoundaryUnshard]
    #: ``CommCounter.snapshot()``: ``{"shard/broadcast": {"bytes": ..., "calls": ...}, ...}``
    collectives: dict[str, dict[str, int]]


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


def _check_max_rows(max_rows: object) -> int:
    if not is_int(max_rows) or max_rows < 0:
        raise ValueError(f"max_rows must be an int >= 0, got {max_rows!r}")
    return max_rows


def _check_policy(
    param_policy: Mapping[str, Any] | ParamPolicy,
    runtime: DedicatedRuntime,
    aliases: Mapping[int, list[str]],
) -> ParamPolicy:
    """``param_policy`` parsed, and checked to be the one ``dedicate_params`` was given: it
    must resolve every dedicated parameter as the runtime did."""
    policy = validate_param_policy(param_policy)
    for dp in sorted(runtime.params, key=lambda dp: dp.fqn):
        resolved = policy.resolve(dp.fqn, aliases.get(id(dp.param), ()))
        differ = [
            f"{field} {getattr(resolved, field)!r} here, {getattr(dp.policy, field)!r} there"
            for field in POLICY_FIELDS
            if getattr(resolved, field) != getattr(dp.policy, field)
        ]
        if differ:
            raise ValueError(
                f"summarize_param_groups: param_policy resolves {dp.fqn!r} otherwise than"
                f" dedicate_params did ({'; '.join(differ)}): pass the param_policy that"
                " dedicate_params was given"
            )
    return policy


def summarize_param_groups(
    model: nn.Module,
    optimizer: Muon,
    *,
    max_rows: int = 64,
    param_policy: Mapping[str, Any] | ParamPolicy | None = None,
) -> list[ParamGroupSummary]:
    """One dict (a :class:`ParamGroupSummary`) per optimizer group: name, optimizer,
    hyperparameters, the parameters it holds (all ranks) and steps (this rank), with element
    counts (``numel``: of the whole parameters; ``stepped_numel_here``: of the whole
    parameters this rank steps; ``local_numel_here``: of their parts this rank holds, FSDP2
    and TP shards), and up to ``max_rows`` rows per group describing each parameter
    (``rows_omitted`` counts the rest).

    A row (a :class:`ParamRow`) holds the parameter's route, shape, owner and its dtypes:
    ``master_dtype`` (the weight the optimizer updates; also ``dtype``), ``compute_dtype``
    (forward and backward), ``reduce_dtype`` (the gradient's reduce), ``optim_dtype`` (its
    optimizer states) and ``output_dtype`` (what its boundary's outputs are cast to; ``None``:
    no cast). For a
    dedicated parameter they are dmuon's (see [Note: mixed precision]; the output cast is
    ``param_policy``'s ``output_dtype``), for an FSDP2 one those of the
    ``MixedPrecisionPolicy`` of its nearest ``fully_shard`` module. ``policy_overrides`` lists
    the indices into ``param_policy["overrides"]`` of the overrides that match the parameter,
    in the order they apply, of the ``param_policy`` that ``dedicate_params`` was given (the
    runtime keeps it); a ``param_policy`` passed here must resolve every dedicated parameter
    as ``dedicate_params`` did, or ``ValueError`` is raised.

    Args:
        model: the model given to ``dedicate_params`` (that object; another raises
            ``ValueError``).
        optimizer: the :class:`Muon` built on ``model`` (on another model: ``ValueError``).
        max_rows: the most parameter rows listed per group, an int >= 0 (``0``: none, only
            the counts).
        param_policy: the policy whose override indices ``policy_overrides`` lists, in the
            form ``dedicate_params`` takes; ``None``: the one ``dedicate_params`` was given.
    """
    optimizer = check_optimizer(model, optimizer)
    _check_max_rows(max_rows)
    runtime = get_runtime(model)
    # Every name of each parameter: an override may match a tied parameter by either.
    aliases = parameter_names(model)
    policy = (
        runtime.param_policy
        if param_policy is None
        else _check_policy(param_policy, runtime, aliases)
    )
    modules = dict(model.named_modules())
    out: list[ParamGroupSummary] = []
    for group in optimizer.param_groups:
        names: list[str] = list(group["param_names"])
        rows = [
            _param_row(name, p, optimizer, runtime, modules, policy, aliases.get(id(p), ()))
            for name, p in zip(names[:max_rows], group["params"])
        ]
        stepped: list[str] = []
        numel = stepped_numel = local_numel = 0
        for name, p in zip(names, group["params"]):
            dp = optimizer.dedicated_param(p)
            full = p.numel()  # the whole parameter's (a DTensor's is its global shape's)
            numel += full
            if dp is not None and not dp.is_owner:
                continue  # its owner steps it
            stepped.append(name)
            stepped_numel += full
            # A dedicated one's TP shard under tensor parallelism; an FSDP2 one's shard.
            local_numel += local_shard(p).numel() if dp is None else dp.numel
        out.append(
            {
                "name": group["group_name"],
                "optimizer": str(group["optimizer"]),
                "hyperparameters": cast(
                    Hyperparameters, {k: _plain(group[k]) for k in _HYPER_KEYS if k in group}
                ),
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


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def _matrices(
    p: torch.Tensor, dp: DedicatedParam | None, runtime: DedicatedRuntime
) -> Matrices | None:
    """What Muon orthogonalises of a Muon-route parameter: how many matrices, their shape
    (``None`` where a declared split's pieces differ), how they are cut out of it and, for a
    declared split, each piece's rows, matrices and shape (``None``: not on the Muon route)."""
    stacks = {id(stack.param): stack.view for stack in runtime.local_muon}
    if id(p) in stacks:
        view = stacks[id(p)]
    elif dp is not None and dp.route is Route.MUON and dp.pieces:
        shapes = {piece.view.matrix_shape for piece in dp.pieces}
        return {
            "count": sum(piece.view.batch for piece in dp.pieces),
            "shape": list(shapes.pop()) if len(shapes) == 1 else None,
            "split": f"declared: {describe_pieces(dp.pieces)}",
            "pieces": [
                {
                    "name": piece.name,
                    "rows": [piece.start, piece.stop],
                    "count": piece.view.batch,
                    "shape": list(piece.view.matrix_shape),
                }
                for piece in dp.pieces
            ],
        }
    elif dp is not None and dp.route is Route.MUON:
        view = dp.view
    else:
        return None
    return {
        "count": view.batch,
        "shape": list(view.matrix_shape),
        "split": view.split,
        "pieces": None,
    }


def _param_row(
    name: str,
    p: torch.Tensor,
    optimizer: Muon,
    runtime: DedicatedRuntime,
    modules: Mapping[str, nn.Module],
    policy: ParamPolicy | None,
    aliases: Sequence[str] = (),
) -> ParamRow:
    dp: DedicatedParam | None = optimizer.dedicated_param(p)
    output: torch.dtype | str | None
    if dp is None:
        # FSDP2 resolves its own policy: compute is param_dtype (else the sharded parameter's
        # dtype), reduce is reduce_dtype (else compute). AdamW keeps the moments of a
        # parameter that is not dedicated in that parameter's dtype, as torch's AdamW does.
        view = tensor_view(p)
        mp = view.mp_policy(modules, name)
        route, shape, owner_rank = view.route, list(p.shape), None
        master = optim = p.dtype
        compute = getattr(mp, "param_dtype", None) or p.dtype
        reduce = getattr(mp, "reduce_dtype", None) or compute
        output = getattr(mp, "output_dtype", None)
    else:
        assert dp.precision is not None, f"{dp.fqn}: packed by Muon(...)'s lazy_init"
        route, shape, owner_rank = dp.route.value, list(dp.shape), runtime.global_rank(dp.owner)
        master, compute, reduce, optim = dp.precision
        output = dp.policy.output_dtype
    row: ParamRow = {
        "name": name,
        "route": route,
        "shape": shape,
        "owner_rank": owner_rank,
        "matrices": _matrices(p, dp, runtime),
        "dtype": _dtype_name(master),
        "master_dtype": _dtype_name(master),
        "compute_dtype": _dtype_name(compute),
        "reduce_dtype": _dtype_name(reduce),
        "optim_dtype": _dtype_name(optim),
        "output_dtype": None if output is None else _dtype_name(output),
        "policy_overrides": None if policy is None else list(policy.matching(name, aliases)),
    }
    if dp is not None:
        row["role"] = dp.role.value
    return row


def _pack_info(group: DedicatedGroup, limit: int) -> list[PackRow]:
    """Rows for the first ``limit`` packs of ``group``."""
    return [
        {
            "owner": list(pack.owner),
            "owner_rank": pack.owner_rank,
            "sender": pack.sender,
            "role": pack.role.value,
            "params": [dp.fqn for dp in pack.params],
            "numel": pack.numel,
            "bytes": pack.nbytes,
            "dtype": _dtype_name(pack.buffer.dtype),
        }
        for pack in group.packs[:limit]
    ]


def summarize_comm_plan(
    model: nn.Module, optimizer: Muon | None = None, *, max_rows: int = 64
) -> CommPlanSummary:
    """The ownership plan as this rank sees it (a :class:`CommPlanSummary`): grid, per-slot
    loads and imbalance, each hook boundary's packs (owner, sender in this rank's row, role,
    bytes), and the bytes one training step moves on each axis (``payload_bytes_per_step``,
    under the keys of the runtime's ``CommCounter``).

    A payload is the size of the tensor a collective carries (the whole matrix for a TP gather
    or scatter), each collective counted once, over those the ranks of this rank's grid take
    part in (the whole world; under tensor parallelism the ranks of its TP index, every TP group
    holding one of them), but on the shard axis over one shard group's (every one carries the
    same): the figures are the same on every rank. Every dedicated element travels once per
    broadcast round (two in Z3, one in Z2), in its pack's dtype, and once per reduce round, in
    its reduce dtype, with one more element per matrix (its presence flag); HSDP adds one
    replicate-axis reduce and one publish round, each summed over the shard columns, its publish
    also carrying the expert stack shards one replica steps for all (the plan's
    ``expert_sources``, in the stack's dtype); an axis of one rank moves nothing. The replicated
    (DDP) path broadcasts nothing before forward: its shard axis carries the reduce, the owners'
    publish after the step and the all-reduces of the other parameters' gradients (one bucket
    per boundary and dtype, a presence flag per parameter). Under tensor parallelism the counts
    are of the grid's TP shards, and with ``optimizer`` the TP axis adds, per matrix, its
    Newton–Schulz traffic (see ``StepOptions.tp_ns``): the gather and the scatter of the whole
    matrix in the optimizer dtype, or one all-reduce of its fp32 ``short x short`` Gram matrix
    plus one per restart; without ``optimizer`` that traffic is left out and ``tp_ns`` is
    ``None``. The step's few-byte flags reduced over every rank (the non-finite check) are not
    counted.

    At most ``max_rows`` pack rows are listed, boundaries in order: every boundary keeps its
    name and ``num_packs``, its ``packs_omitted`` counts the packs not listed, and the top-level
    ``rows_omitted`` their total.

    Args:
        model: the model given to ``dedicate_params`` (that object; another raises
            ``ValueError``).
        optimizer: the :class:`Muon` built on ``model`` (on another model: ``ValueError``),
            whose ``tp_ns`` and Newton–Schulz decide the TP axis's traffic; ``None``: the
            TP axis's Newton–Schulz traffic is not counted.
        max_rows: the most pack rows listed over all boundaries, an int >= 0 (``0``: none,
            only the counts).
    """
    _check_max_rows(max_rows)
    runtime = get_runtime(model)
    if optimizer is not None:
        optimizer = check_optimizer(model, optimizer)
    runtime.lazy_init()
    layout = runtime.layout
    loads = [float(x) for x in runtime.plan.loads]
    mean = sum(loads) / len(loads) if loads else 0.0
    # Weights travel in their packs' dtype (the compute dtype), gradients in the reduce dtype:
    # the same on every rank, whichever it owns.
    sent = sum(pack.nbytes for group in runtime.groups for pack in group.packs)
    reduced = 0
    for dp in runtime.params:
        assert dp.precision is not None, f"{dp.fqn}: packed by lazy_init"
        # Its gradient and its presence flag (see [Note: a parameter without a gradient]).
        reduced += (dp.numel + 1) * dp.precision.reduce.itemsize
    z3 = runtime.reshard_after_forward
    per_step: dict[str, int] = {}
    if runtime.config.replicated:
        # The replicated path: no broadcast before forward, the owners publish after the step,
        # and the other parameters' gradients are all-reduced.
        if layout.shard_size > 1:
            per_step["shard/reduce"] = reduced
            per_step["shard/publish"] = sent
            per_step["shard/all_reduce"] = replicated_payload(
                runtime.groups, runtime.replicated_params
            )
    elif layout.shard_size > 1:
        per_step["shard/broadcast"] = (2 if z3 else 1) * sent
        per_step["shard/reduce"] = reduced
    if layout.is_hsdp:
        per_step["replicate/reduce"] = reduced
        per_step["replicate/publish"] = sent + _sourced_payload(model, runtime)
    if optimizer is not None:
        tp = _tp_ns_payload(runtime, optimizer)
        per_step.update({key: nbytes for key, nbytes in tp.items() if nbytes})
    boundaries: list[BoundaryPlan] = []
    left = max_rows
    for group in runtime.groups:
        listed = _pack_info(group, left)
        left -= len(listed)
        boundaries.append(
            {
                "name": group.fqn,
                "num_packs": len(group.packs),
                "packs": listed,
                "packs_omitted": len(group.packs) - len(listed),
            }
        )
    return {
        "coord": list(runtime.coord),
        "tp_ns": None if optimizer is None else optimizer.options.tp_ns.value,
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
        # Payloads, each collective once (the shard axis: one shard group's), before the
        # (n - 1) / n wire factor.
        "payload_bytes_per_step": per_step,
        "boundaries": boundaries,
        "rows_omitted": sum(b["packs_omitted"] for b in boundaries),
    }


def _sourced_payload(model: nn.Module, runtime: DedicatedRuntime) -> int:
    """The bytes the expert sources broadcast over their shard columns in one step: each
    sourced stack shard, as FSDP2's dim-0 split leaves it (see [Note: stepping expert
    sources])."""
    nbytes = 0
    for source in runtime.plan.expert_sources:
        stack = model.get_parameter(source.stack)
        held = experts_held(stack.shape[0], source.shard, runtime.layout.shard_size)
        nbytes += held * math.prod(stack.shape[1:]) * stack.dtype.itemsize
    return nbytes


def _tp_ns_payload(runtime: DedicatedRuntime, optimizer: Muon) -> dict[str, int]:
    """The TP axis's Newton–Schulz payload of one step, each dedicated TP matrix's once, as
    :class:`~.holder.TensorParallelNS` counts it; see [Note: Newton–Schulz under tensor
    parallelism]."""
    out = {"tp/gather": 0, "tp/scatter": 0, "tp/all_reduce": 0}
    ns, mode = optimizer.newton_schulz, optimizer.options.tp_ns
    for dp in runtime.params:
        tp_mode = dp.tp_mode(mode, ns) if dp.route is Route.MUON else None
        if tp_mode is None:
            continue
        assert dp.precision is not None, f"{dp.fqn}: packed by lazy_init"
        shape = MatrixView.of(dp.shape, dp.fqn).matrix_shape
        itemsize = dp.precision.optim.itemsize
        if tp_mode is TPMode.GRAM:
            gram = gram_of(ns)
            assert gram is not None, "choose() takes gram only for a Gram NewtonSchulz"
            # fp32 Gram matrices: the input's, then one per restart.
            out["tp/all_reduce"] += min(shape) ** 2 * 4 * (1 + len(gram.restarts))
        else:
            whole = shape[0] * shape[1] * itemsize
            out["tp/gather"] += whole
            out["tp/scatter"] += whole
    return out


def collect_forward_unshard_profile(
    model: nn.Module, synchronize: bool = False, *, clear: bool = False
) -> ForwardUnshardProfile:
    """What forward unsharding costs on this rank (a :class:`ForwardUnshardProfile`): per
    boundary, the bytes it receives (packs it neither owns nor replicates) and sends, whether
    its weights are resident now, and the collectives counted since the runtime's counter was
    last reset.

    The runtime records payloads and call counts, and, while the ``Muon`` built last on the
    model has ``StepOptions(profile=True)``, each boundary's wait for its broadcasts before its
    forward (``forward_wait_ms``; ``None`` once that optimizer is freed); the
    time of each collective itself needs a profiler trace (the ``dmuon::pre_forward`` and
    ``dmuon::prefetch`` ranges).
    ``synchronize=True`` waits for the device first so that the snapshot is settled.
    ``clear=True`` starts a new count once the snapshot is taken: it resets the runtime's
    collective counter (every dmuon collective counts there, not only the forward's) and the
    forward wait times, so the next call reports only what happened after this one.

    Args:
        model: the model given to ``dedicate_params`` (that object; another raises
            ``ValueError``).
        synchronize: ``True`` waits for the runtime's CUDA device before the snapshot (no
            effect off CUDA); ``False`` reads what has been recorded so far.
        clear: ``True`` resets the collective counter and the forward wait times after the
            snapshot; a bool (anything else raises ``ValueError``).
    """
    if not isinstance(clear, bool):
        raise ValueError(f"clear must be True or False, got {clear!r}")
    runtime = get_runtime(model)
    runtime.lazy_init()
    if synchronize and torch.cuda.is_available() and runtime.layout.device.type == "cuda":
        torch.cuda.synchronize(runtime.layout.device)
    waits = runtime.hooks.wait_timers
    boundaries: list[BoundaryUnshard] = []
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
                # StepOptions(profile=True); None otherwise, and after a clear until the next forward.
                "forward_wait_ms": (
                    waits[group.fqn].phases().get("wait") if waits is not None else None
                ),
            }
        )
    out: ForwardUnshardProfile = {
        "coord": list(runtime.coord),
        "reshard_after_forward": runtime.reshard_after_forward,
        "broadcast_rounds_per_step": 2 if runtime.reshard_after_forward else 1,
        "boundaries": boundaries,
        "collectives": runtime.counter.snapshot(),
    }
    if clear:
        runtime.counter.reset()
        # A timer's start() drops its marks, as each forward does before it measures again.
        for timer in (waits or {}).values():
            timer.start()
    return out
