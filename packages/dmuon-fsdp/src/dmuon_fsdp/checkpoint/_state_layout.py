"""The layout of a dmuon checkpoint: every tensor a model and its ``Muon`` optimizer save, with
its full shape and dtype, and the checks that compare a checkpoint against it before anything
is loaded. The flat format (:mod:`._checkpoint`) and DCP (:mod:`._dcp`) share both.

[Note: complete optimizer state]
A checkpoint holds an optimizer state entry for every parameter the optimizer steps. A
parameter that has not been stepped yet is saved with the state its first step creates (zero
momentum; AdamW step 0 and zero moments), which steps exactly as no state does. So a missing
entry always means a damaged checkpoint (a truncated file, keys dropped): loading one raises
naming the parameters, unless the caller passes ``strict=False``, which starts those
parameters from fresh state. It also lets a DCP load into a fresh optimizer ask for every
tensor it will hold, since DCP reads into tensors that exist before the read.

[Note: what the checks compare]
Keys are FQNs (``model.state_dict()`` keys; optimizer state by parameter FQN and field), and
shapes are full shapes, never shards, so the layout is the same on every rank and at every
world size: each rank checks the whole checkpoint and reaches the same verdict without a
collective. A tensor must have the shape and dtype dmuon keeps it in; the AdamW ``step`` is a
scalar counter of any dtype (it is loaded as the dtype ``torch.optim.AdamW`` uses).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, NoReturn

import torch
from torch import Tensor, nn

from ..holder import DedicatedParam
from ..optim import (
    GROUP_REQUIRED,
    STATE_FIELDS,
    Muon,
    check_no_inert_keys,
    fresh_state,
    group_numbers,
    optim_dtype,
)
from ..runtime import DedicatedRuntime

__all__ = [
    "GROUP_REQUIRED",
    "STATE_FIELDS",
    "TensorSpec",
    "check_model",
    "check_optimizer",
    "check_optimizer_state",
    "check_param_groups",
    "fresh_state",
    "keys_error",
    "model_entries",
    "model_specs",
    "optim_dtype",
    "optimizer_params",
    "optimizer_specs",
    "state_keys",
]


class TensorSpec(NamedTuple):
    """A tensor's full shape and dtype (``None``: any dtype, for the AdamW step)."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None

    @classmethod
    def of(cls, value: Tensor) -> TensorSpec:
        return cls(tuple(value.shape), value.dtype)

    @classmethod
    def of_saved(cls, value: object) -> TensorSpec | None:
        """The spec of a value a checkpoint holds (``None``: it is not a tensor, or one on the
        meta device, which holds no data to load)."""
        return cls.of(value) if isinstance(value, Tensor) and not value.is_meta else None


# -- what a model and an optimizer save ---------------------------------------------------------


def model_entries(
    model: nn.Module, runtime: DedicatedRuntime
) -> list[tuple[str, Tensor, DedicatedParam | None]]:
    """``(key, value, DedicatedParam or None)`` for every entry of ``model.state_dict()``.
    Values are the model's own tensors (``keep_vars``: nothing is read yet, which a peer could
    not do for a dedicated weight), and a weight registered under two keys (tied) is found by
    identity under both."""
    dedicated = {id(dp.param): dp for dp in runtime.params}
    return [
        (key, value, dedicated.get(id(value)))
        for key, value in model.state_dict(keep_vars=True).items()
    ]


def model_specs(
    entries: Sequence[tuple[str, Tensor, DedicatedParam | None]],
) -> dict[str, TensorSpec]:
    return {
        key: TensorSpec(tuple(dp.shape), dp.dtype) if dp is not None else TensorSpec.of(value)
        for key, value, dp in entries
    }


def check_optimizer(model: nn.Module, optimizer: object) -> Muon:
    """``optimizer``, which must be the ``Muon`` built on ``model`` (checkpoints and
    diagnostics take no other)."""
    if not isinstance(optimizer, Muon):
        raise ValueError(
            f"optimizer must be the dmuon.Muon built on this model, got {type(optimizer).__name__}"
        )
    if optimizer.model is not model:
        raise ValueError(
            "optimizer was built on a different model object; pass the model given to Muon()"
        )
    return optimizer


def state_keys(optimizer: Muon) -> list[list[str]]:
    """Per param group, the key of each of its parameters in the checkpoints: the
    parameter's key in ``model.state_dict()`` (the first, for a tied one), which is also the
    model state dict's key.

    [Note: optimizer state keys]
    A group's ``param_names`` are ``model.named_parameters()``' names, as torch's optimizers
    keep them, and the code that finds a parameter's module goes by them. A wrapper may drop
    its own prefix from the state dict only: activation checkpointing's ``checkpoint_wrapper``
    names a weight ``layers.0._checkpoint_wrapped_module.mlp.w`` among the parameters and
    ``layers.0.mlp.w`` in ``state_dict()``. The optimizer state is keyed as the model state, so
    a checkpoint taken with such a wrapper loads without it, and the other way round, as
    torch's ``get_optimizer_state_dict`` allows."""
    keys: dict[int, str] = {}
    for key, value in optimizer.model.state_dict(keep_vars=True).items():
        keys.setdefault(id(value), key)
    return [
        [keys.get(id(p), name) for name, p in zip(group["param_names"], group["params"])]
        for group in optimizer.param_groups
    ]


def optimizer_params(optimizer: Muon) -> list[tuple[str, Tensor, dict[str, Any]]]:
    """``(key, parameter, param group)`` for every parameter the optimizer steps (see [Note:
    optimizer state keys])."""
    return [
        (key, p, group)
        for group, keys in zip(optimizer.param_groups, state_keys(optimizer), strict=True)
        for key, p in zip(keys, group["params"])
    ]


def optimizer_specs(optimizer: Muon) -> dict[str, dict[str, TensorSpec]]:
    """``fqn -> field -> spec`` of every state tensor (see [Note: complete optimizer state]):
    the full shape, and the dtype :func:`fresh_state` gives it (derived on the meta device)."""
    specs: dict[str, dict[str, TensorSpec]] = {}
    for fqn, p, group in optimizer_params(optimizer):
        dp = optimizer.dedicated_param(p)
        shape, dtype = (dp.shape, dp.dtype) if dp is not None else (p.shape, p.dtype)
        like = torch.empty(shape, dtype=dtype, device="meta")
        fresh = fresh_state(group["optimizer"], like, optim_dtype(dp))
        specs[fqn] = {
            field: TensorSpec((), None) if field == "step" else TensorSpec.of(fresh[field])
            for field in STATE_FIELDS[group["optimizer"]]
        }
    return specs


# -- checks ---------------------------------------------------------------------------------------


def keys_error(what: str, missing: list[str], unexpected: list[str], fix: str) -> ValueError:
    parts = []
    if missing:
        parts.append(f"missing key(s) {missing[:5]}" + (" ..." if len(missing) > 5 else ""))
    if unexpected:
        parts.append(
            f"unexpected key(s) {unexpected[:5]}" + (" ..." if len(unexpected) > 5 else "")
        )
    return ValueError(f"{what}: {' and '.join(parts)}; {fix}")


def _check_tensor(
    where: str, key: str, got: TensorSpec | None, want: TensorSpec, holder: str
) -> None:
    if got is None:
        raise ValueError(
            f"{where}: {key} holds no tensor with data in the checkpoint (not a tensor, or one "
            f"on the meta device); {holder} keeps one"
        )
    if got.shape != want.shape:
        if want.shape == ():
            raise ValueError(
                f"{where}: {key} has shape {got.shape} in the checkpoint but is a scalar"
                " (shape ()) here; the checkpoint is damaged or not dmuon's"
            )
        raise ValueError(
            f"{where}: {key} has shape {got.shape} in the checkpoint but {holder} expects"
            f" {want.shape}; the checkpoint is from a different model definition"
        )
    if want.dtype is not None and got.dtype != want.dtype:
        # [Note: a dtype that changed since the save] A sharded checkpoint's tensors cannot be
        # cast before load_checkpoint reads them, so its fix is a build that keeps the saved
        # dtypes (or, for the optimizer, fresh state); a full-state dictionary can be cast.
        if holder == "the optimizer":
            kept = "param_policy's optim_dtype, else the weight's master dtype"
            other = (
                ", or take the weights alone with load_checkpoint(path, model, None) and"
                " start the optimizer's state afresh"
            )
        else:
            kept = "the model's dtype, or param_policy's master_dtype for a dedicated weight"
            other = (
                ", or convert it (dcp_to_torch_save), cast it and load it with set_model_state_dict"
            )
        if not where.startswith("load_checkpoint"):
            other = f", or cast the dictionary's tensors to {want.dtype} before loading"
        raise ValueError(
            f"{where}: {key} is {got.dtype} in the checkpoint but {holder} keeps {want.dtype}"
            f" ({kept}); build it with the dtypes it was saved with{other}"
        )


def check_model(
    where: str, specs: Mapping[str, TensorSpec], got: Mapping[str, TensorSpec | None], fix: str
) -> None:
    """Raise unless ``got`` (key -> the checkpoint's spec, ``None`` for a non-tensor) holds
    exactly the keys of ``specs`` with their shapes and dtypes."""
    missing = [k for k in specs if k not in got]
    unexpected = [k for k in got if k not in specs]
    if missing or unexpected:
        raise keys_error(where, missing, unexpected, fix)
    for key, want in specs.items():
        _check_tensor(where, repr(key), got[key], want, "the model")


def check_param_groups(where: str, optimizer: Muon, saved_groups: Any) -> None:
    """Raise unless ``saved_groups`` (group name -> group dict) has this optimizer's groups,
    each with the same parameters, optimizer and required hyperparameters, and no key that no
    step reads."""
    if not isinstance(saved_groups, Mapping):
        raise ValueError(f"{where}: 'param_groups' must map group name -> group dict")
    names = [g["group_name"] for g in optimizer.param_groups]
    missing = [n for n in names if n not in saved_groups]
    unexpected = [n for n in saved_groups if n not in names]
    if missing or unexpected:
        raise keys_error(
            f"{where}: param_groups",
            missing,
            unexpected,
            "build the optimizer with the same param_groups (group names) as when saving",
        )
    for group, expected in zip(optimizer.param_groups, state_keys(optimizer), strict=True):
        name = group["group_name"]
        saved = saved_groups[name]
        if not isinstance(saved, Mapping):
            raise ValueError(f"{where}: param_groups[{name!r}] must be a dict")
        got = list(saved.get("params", []))
        if got != expected and sorted(got) == sorted(expected):
            raise ValueError(
                f"{where}: param_groups[{name!r}] lists this group's parameters in another "
                "order than the optimizer (each state entry is keyed by name, but the order "
                "is the group's); build the optimizer as when saving"
            )
        if got != expected:
            raise keys_error(
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
        absent = [k for k in GROUP_REQUIRED[group["optimizer"]] if k not in saved]
        if absent:
            raise keys_error(
                f"{where}: param_groups[{name!r}]", absent, [], "the group lacks hyperparameters"
            )
        group_numbers(saved, group["optimizer"], f"{where}: param_groups[{name!r}]")
        # Loaded, it would make every step raise (see take_group_edits).
        check_no_inert_keys(saved, f"{where}: param_groups[{name!r}]", group["optimizer"])


_ALL_FIELDS = frozenset(f for fields in STATE_FIELDS.values() for f in fields)


def _rerouted(where: str, keys: Sequence[str]) -> NoReturn:
    shown = ", ".join(repr(k) for k in keys[:4]) + (" ..." if len(keys) > 4 else "")
    raise ValueError(
        f"{where}: the checkpoint holds {shown}: optimizer state of another route than the "
        "parameter takes here (Muon keeps momentum_buffer; AdamW step, exp_avg and "
        "exp_avg_sq), so it was saved with another predicate or param_policy. Build the "
        "optimizer with the routes it was saved with"
        + (
            ", or take the weights alone with load_checkpoint(path, model, None) (the"
            " optimizer keeps its state)"
            if where.startswith("load_checkpoint")
            else ""
        )
    )


def check_optimizer_state(
    where: str,
    specs: Mapping[str, Mapping[str, TensorSpec]],
    got: Mapping[str, Mapping[str, TensorSpec | None]],
    unexpected: Sequence[str],
    *,
    strict: bool,
) -> list[str]:
    """Check the checkpoint's state entries ``got`` (fqn -> field -> spec; a parameter without
    any entry left out) against ``specs``; ``unexpected`` are the checkpoint's keys that belong
    to no parameter. Returns the parameters without an entry, which only ``strict=False``
    accepts (see [Note: complete optimizer state])."""
    # A field of a parameter this optimizer has, but of the other route's state.
    rerouted = [key for key in unexpected if key.rpartition(".")[0] in specs]
    if rerouted:
        _rerouted(where, rerouted)
    if unexpected:
        raise keys_error(
            f"{where}: state", [], list(unexpected), "the checkpoint is from a different model"
        )
    for fqn, fields in specs.items():
        entry = got.get(fqn)
        if entry is None:
            continue
        missing = [f"{fqn}.{f}" for f in fields if f not in entry]
        extra = [f"{fqn}.{f}" for f in entry if f not in fields]
        if extra and all(f in _ALL_FIELDS for f in entry):
            _rerouted(where, extra)
        if missing or extra:
            raise keys_error(
                f"{where}: state[{fqn!r}]",
                missing,
                extra,
                f"this parameter's state holds exactly {list(fields)}",
            )
        for field, want in fields.items():
            _check_tensor(where, f"state[{fqn!r}][{field!r}]", entry[field], want, "the optimizer")
    absent = [fqn for fqn in specs if got.get(fqn) is None]
    if absent and strict:
        raise ValueError(
            f"{where}: the checkpoint has no optimizer state for {len(absent)} of"
            f" {len(specs)} parameters ({absent[:5]}{' ...' if len(absent) > 5 else ''}), though"
            " a dmuon checkpoint holds an entry for every parameter: the file is truncated or"
            " entries were dropped. Load a complete checkpoint, or pass strict=False to start"
            " those parameters from fresh optimizer state"
        )
    return absent
