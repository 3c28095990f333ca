"""Flat, full-tensor checkpoints of a dmuon model and its ``Muon`` optimizer.

[Note: the checkpoint format]
Model: ``{fqn: full tensor}`` with the keys of ``model.state_dict()``, the format a plain
single-process model loads with ``load_state_dict``. Dedicated parameters come from their
owners (one broadcast each on the runtime's world group); FSDP2 DTensors come from
``full_tensor()``; buffers and plain tensors are copied.

Optimizer: ``{"state": {fqn: {...}}, "param_groups": {group_name: {...}}}``. A Muon matrix's
state is ``{"momentum_buffer"}``, an AdamW parameter's ``{"step", "exp_avg", "exp_avg_sq"}``,
all full tensors (the step a scalar); each group keeps its hyperparameters (scheduler keys such
as ``initial_lr`` included) and ``"params"``, the FQNs it holds. Nothing in either dictionary
depends on the topology, so a checkpoint taken at one world size loads at another.

[Note: validate, then apply]
``set_*_state_dict`` checks the whole dictionary (keys, fields, shapes, group names and
membership) before it writes anything, so a bad checkpoint raises ``ValueError`` naming the
offending key and leaves model and optimizer exactly as they were. Loading needs no
collective: every rank holds the full dictionary and takes its own part (the owner its full
weight or state, FSDP2 parameters their shard).

Every function here is collective over the runtime's ranks (get_*: broadcasts and
``full_tensor``; set_model_state_dict: the runtime's ``after_step``) and first drains the
runtime's pending collectives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.profiler import record_function
from torch.distributed.tensor import DTensor, distribute_tensor

from dmuon_ownership import Route

from ._muon_math import step_dtype
from ._optimizer import Muon
from ._param import DedicatedParam
from ._runtime import DedicatedRuntime, get_runtime

__all__ = [
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
]

_STATE_FIELDS = {
    Route.MUON: ("momentum_buffer",),
    Route.ADAMW: ("step", "exp_avg", "exp_avg_sq"),
}
_GROUP_REQUIRED = {
    Route.MUON: ("lr", "weight_decay", "momentum", "nesterov"),
    Route.ADAMW: ("lr", "weight_decay", "betas", "eps"),
}


def _keys_error(what: str, missing: list[str], unexpected: list[str], fix: str) -> ValueError:
    parts = []
    if missing:
        parts.append(f"missing key(s) {missing[:5]}" + (" ..." if len(missing) > 5 else ""))
    if unexpected:
        parts.append(
            f"unexpected key(s) {unexpected[:5]}" + (" ..." if len(unexpected) > 5 else "")
        )
    return ValueError(f"{what}: {' and '.join(parts)}; {fix}")


def _broadcast_from_owner(
    runtime: DedicatedRuntime, dp: DedicatedParam, local: Tensor | None, shape: Any, dtype: Any
) -> Tensor:
    """The owner's ``local`` on every rank (a fresh tensor)."""
    device = dp.param.device
    if dp.is_owner:
        assert local is not None, f"{dp.fqn}: the owner has no tensor to send"
        out = local.detach().to(device).clone()
    else:
        out = torch.empty(shape, dtype=dtype, device=device)
    if dist.get_world_size(runtime.world_group) > 1:
        dist.broadcast(out, src=runtime.global_rank(dp.owner), group=runtime.world_group)
    return out


def _to_full(value: Tensor) -> Tensor:
    if isinstance(value, DTensor):
        return value.full_tensor().detach()
    return value.detach().clone()


def _offload(t: Tensor, cpu_offload: bool) -> Tensor:
    return t.cpu() if cpu_offload else t


def _shard_like(full: Tensor, like: Tensor) -> Tensor:
    """``full`` laid out as ``like``: a DTensor with ``like``'s mesh and placements (this
    rank's shard, no communication), or a plain tensor on ``like``'s device."""
    value = full.detach().to(device=like.device, dtype=like.dtype)
    if isinstance(like, DTensor):
        return distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)
    return value.clone()


# -- model ------------------------------------------------------------------------------------


def _entries(model: nn.Module, runtime: DedicatedRuntime) -> list[tuple[str, Tensor, Any]]:
    """``(key, value, DedicatedParam or None)`` for every entry of ``model.state_dict()``.
    Values are the model's own tensors (``keep_vars``: nothing is read yet, which a peer could
    not do for a dedicated weight), and a weight registered under two keys (tied) is found by
    identity under both."""
    dedicated = {id(dp.param): dp for dp in runtime.params}
    return [
        (key, value, dedicated.get(id(value)))
        for key, value in model.state_dict(keep_vars=True).items()
    ]


def get_model_state_dict(model: nn.Module, *, cpu_offload: bool = False) -> dict[str, Tensor]:
    """``{fqn: full tensor}`` for every entry of ``model.state_dict()``; collective.

    ``cpu_offload`` moves each tensor to the CPU as soon as it is gathered."""
    runtime = get_runtime(model)
    with record_function("dmuon::checkpoint_get_model"):
        runtime.drain()
        out: dict[str, Tensor] = {}
        for key, value, dp in _entries(model, runtime):
            if dp is not None:
                full = _broadcast_from_owner(runtime, dp, dp.full, dp.shape, dp.dtype)
            else:
                full = _to_full(value)
            out[key] = _offload(full, cpu_offload)
        return out


def set_model_state_dict(model: nn.Module, state_dict: Mapping[str, Tensor]) -> None:
    """Load a full ``{fqn: tensor}`` dictionary (as :func:`get_model_state_dict` returns, or a
    plain model's ``state_dict()``); raises before modifying anything when a key is missing or
    unexpected or a shape differs. Collective."""
    runtime = get_runtime(model)
    with record_function("dmuon::checkpoint_set_model"):
        runtime.drain()
        if not isinstance(state_dict, Mapping):
            raise ValueError(
                f"state_dict must be a mapping fqn -> tensor, got {type(state_dict).__name__}"
            )
        entries = _entries(model, runtime)
        keys = [key for key, _, _ in entries]
        missing = [k for k in keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in set(keys)]
        if missing or unexpected:
            raise _keys_error(
                "set_model_state_dict",
                missing,
                unexpected,
                "the checkpoint must hold exactly the keys of model.state_dict() (same model"
                " definition; take it with dmuon.get_model_state_dict)",
            )
        for key, target, dp in entries:
            value = state_dict[key]
            if not isinstance(value, Tensor):
                raise ValueError(
                    f"set_model_state_dict: {key!r} holds a {type(value).__name__}, not a tensor"
                )
            expected = tuple(dp.shape if dp is not None else target.shape)
            if tuple(value.shape) != expected:
                raise ValueError(
                    f"set_model_state_dict: {key!r} has shape {tuple(value.shape)} but the model"
                    f" expects {expected}; the checkpoint is from a different model definition"
                )
        with torch.no_grad():
            for key, target, dp in entries:
                value = state_dict[key]
                if dp is not None:
                    if dp.full is not None:
                        dp.full.copy_(value)
                elif isinstance(target, DTensor):
                    local = _shard_like(value, target)
                    assert isinstance(local, DTensor)
                    target.to_local().copy_(local.to_local())
                else:
                    target.copy_(value)
        # Owned weights changed: drop kept copies (Z2) and publish to replicas (HSDP).
        runtime.after_step(async_=False)


# -- optimizer --------------------------------------------------------------------------------


def _optimizer_params(optimizer: Muon) -> list[tuple[str, Tensor, dict[str, Any]]]:
    return [
        (name, p, group)
        for group in optimizer.param_groups
        for name, p in zip(group["param_names"], group["params"])
    ]


def _check_optimizer(model: nn.Module, optimizer: object) -> Muon:
    if not isinstance(optimizer, Muon):
        raise ValueError(
            f"optimizer must be the dmuon.Muon built on this model, got {type(optimizer).__name__}"
        )
    if optimizer.model is not model:
        raise ValueError(
            "optimizer was built on a different model object; pass the model given to Muon()"
        )
    return optimizer


def get_optimizer_state_dict(
    model: nn.Module, optimizer: Muon, *, cpu_offload: bool = False
) -> dict[str, Any]:
    """Full, FQN-keyed optimizer state (see [Note: the checkpoint format]); collective."""
    optimizer = _check_optimizer(model, optimizer)
    runtime = get_runtime(model)
    with record_function("dmuon::checkpoint_get_optimizer"):
        runtime.drain()
        entries = _optimizer_params(optimizer)
        # Only owners know whether a dedicated parameter has state yet: agree on it first.
        dedicated_entries = [
            (name, p, group, dp)
            for name, p, group in entries
            if (dp := optimizer.dedicated_param(p)) is not None
        ]
        has_state: list[bool] = []
        if dedicated_entries:
            device = dedicated_entries[0][3].param.device
            flags = torch.tensor(
                [
                    1 if dp.is_owner and optimizer.state.get(p) else 0
                    for _, p, _, dp in dedicated_entries
                ],
                dtype=torch.int32,
                device=device,
            )
            if dist.get_world_size(runtime.world_group) > 1:
                dist.all_reduce(flags, group=runtime.world_group)
            has_state = [bool(f) for f in flags.tolist()]
        flag_of = {id(p): has for (_, p, _, _), has in zip(dedicated_entries, has_state)}

        state: dict[str, dict[str, Tensor]] = {}
        for name, p, group in entries:
            dp = optimizer.dedicated_param(p)
            if dp is not None:
                if not flag_of[id(p)]:
                    continue
                local = optimizer.state.get(p, {}) if dp.is_owner else {}
                entry = {}
                for field in _STATE_FIELDS[group["optimizer"]]:
                    if field == "step":
                        step = local["step"].to(step_dtype()) if local else None
                        t = _broadcast_from_owner(runtime, dp, step, (), step_dtype())
                        entry[field] = t.cpu()
                    else:
                        t = _broadcast_from_owner(runtime, dp, local.get(field), dp.shape, dp.dtype)
                        entry[field] = _offload(t, cpu_offload)
                state[name] = entry
            else:
                local = optimizer.state.get(p)
                if not local:
                    continue
                state[name] = {
                    field: (
                        local[field].detach().clone()
                        if field == "step"
                        else _offload(_to_full(local[field]), cpu_offload)
                    )
                    for field in _STATE_FIELDS[group["optimizer"]]
                }
        groups = {
            group["group_name"]: {
                **{k: v for k, v in group.items() if k not in ("params", "param_names")},
                "optimizer": str(group["optimizer"]),
                "params": list(group["param_names"]),
            }
            for group in optimizer.param_groups
        }
        return {"state": state, "param_groups": groups}


def _validate_optimizer_state(optimizer: Muon, state_dict: Any) -> None:
    where = "set_optimizer_state_dict"
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"{where}: expected a dict with 'state' and 'param_groups'")
    top_missing = [k for k in ("state", "param_groups") if k not in state_dict]
    top_unexpected = [k for k in state_dict if k not in ("state", "param_groups")]
    if top_missing or top_unexpected:
        raise _keys_error(
            where, top_missing, top_unexpected, "take it with dmuon.get_optimizer_state_dict"
        )
    saved_groups = state_dict["param_groups"]
    if not isinstance(saved_groups, Mapping):
        raise ValueError(f"{where}: 'param_groups' must map group name -> group dict")
    names = [g["group_name"] for g in optimizer.param_groups]
    missing = [n for n in names if n not in saved_groups]
    unexpected = [n for n in saved_groups if n not in names]
    if missing or unexpected:
        raise _keys_error(
            f"{where}: param_groups",
            missing,
            unexpected,
            "build the optimizer with the same param_groups (group names) as when saving",
        )
    kind_of: dict[str, Route] = {}
    shape_of: dict[str, tuple] = {}
    for group in optimizer.param_groups:
        name = group["group_name"]
        saved = saved_groups[name]
        if not isinstance(saved, Mapping):
            raise ValueError(f"{where}: param_groups[{name!r}] must be a dict")
        expected = list(group["param_names"])
        got = list(saved.get("params", []))
        if got != expected:
            raise _keys_error(
                f"{where}: param_groups[{name!r}]['params']",
                [f for f in expected if f not in got],
                [f for f in got if f not in expected],
                "the checkpoint groups the parameters differently (other param_groups or"
                " routes); build the optimizer as when saving",
            )
        if saved.get("optimizer", group["optimizer"]) != group["optimizer"]:
            raise ValueError(
                f"{where}: param_groups[{name!r}] is a {saved.get('optimizer')!r} group in the"
                f" checkpoint but a {group['optimizer']!r} group here"
            )
        absent = [k for k in _GROUP_REQUIRED[group["optimizer"]] if k not in saved]
        if absent:
            raise _keys_error(
                f"{where}: param_groups[{name!r}]", absent, [], "the group lacks hyperparameters"
            )
        for fqn, p in zip(group["param_names"], group["params"]):
            kind_of[fqn] = group["optimizer"]
            dp = optimizer.dedicated_param(p)
            shape_of[fqn] = tuple(dp.shape if dp is not None else p.shape)
    saved_state = state_dict["state"]
    if not isinstance(saved_state, Mapping):
        raise ValueError(f"{where}: 'state' must map parameter fqn -> state dict")
    unexpected = [k for k in saved_state if k not in kind_of]
    if unexpected:
        raise _keys_error(
            f"{where}: state", [], unexpected, "the checkpoint is from a different model"
        )
    for fqn, entry in saved_state.items():
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}: state[{fqn!r}] must be a dict of tensors")
        fields = _STATE_FIELDS[kind_of[fqn]]
        missing = [f"{fqn}.{f}" for f in fields if f not in entry]
        unexpected = [f"{fqn}.{f}" for f in entry if f not in fields]
        if missing or unexpected:
            raise _keys_error(
                f"{where}: state[{fqn!r}] ({kind_of[fqn]})",
                missing,
                unexpected,
                f"a {kind_of[fqn]} parameter's state holds exactly {list(fields)}",
            )
        for field in fields:
            value = entry[field]
            if not isinstance(value, Tensor):
                raise ValueError(f"{where}: state[{fqn!r}][{field!r}] must be a tensor")
            expected_shape = () if field == "step" else shape_of[fqn]
            if field == "step" and value.numel() != 1:
                raise ValueError(f"{where}: state[{fqn!r}]['step'] must be a scalar tensor")
            if field != "step" and tuple(value.shape) != expected_shape:
                raise ValueError(
                    f"{where}: state[{fqn!r}][{field!r}] has shape {tuple(value.shape)} but the"
                    f" parameter has shape {expected_shape}"
                )


def set_optimizer_state_dict(
    model: nn.Module, optimizer: Muon, state_dict: Mapping[str, Any]
) -> None:
    """Restore momentum buffers, Adam moments, steps and group hyperparameters from a full
    optimizer state dict; raises before modifying anything when it does not fit."""
    optimizer = _check_optimizer(model, optimizer)
    runtime = get_runtime(model)
    with record_function("dmuon::checkpoint_set_optimizer"):
        runtime.drain()
        _validate_optimizer_state(optimizer, state_dict)
        saved_state = state_dict["state"]
        saved_groups = state_dict["param_groups"]
        optimizer.state.clear()
        for group in optimizer.param_groups:
            saved = saved_groups[group["group_name"]]
            for key, value in saved.items():
                if key not in ("params", "param_names", "group_name", "optimizer"):
                    group[key] = tuple(value) if key == "betas" else value
        with torch.no_grad():
            for name, p, group in _optimizer_params(optimizer):
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
                new: dict[str, Tensor] = {}
                for field in _STATE_FIELDS[group["optimizer"]]:
                    value = entry[field]
                    if field == "step":
                        new[field] = value.detach().reshape(()).to("cpu").clone()
                    else:
                        new[field] = _shard_like(value, like)
                optimizer.state[p] = new
