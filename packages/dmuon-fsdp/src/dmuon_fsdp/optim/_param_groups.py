"""Semantic parameter groups: user groups built from the wrapped model, split into
``<name>/muon`` and ``<name>/adamw`` optimizer subgroups.

[Note: what a user group decides]
A user group (``{"params": [...], "group_name": "base", "lr": ...}``) only carries
hyperparameters. Which subgroup a parameter lands in is decided by its route: parameters
dmuon holds (dedicated ones and Muon expert stacks) whose route is ``"muon"`` go to
``<name>/muon``, everything else (FSDP2 parameters, dedicated ``"adamw"`` parameters) to
``<name>/adamw``. Only an explicit ``dmuon_route`` (or its aliases ``dmuon_optimizer`` /
``matrix_optimizer``) in a group overrides the routes of that group's held parameters, all of
them at once. ``lr`` and ``weight_decay`` apply to both
subgroups unless ``muon_lr``/``adamw_lr`` or ``muon_weight_decay``/``adamw_weight_decay``
override them. Both subgroups always exist, even empty, so that the visible group names (and a
scheduler's or checkpoint's view of them) do not depend on which rank owns what.

[Note: validating against the wrapped model]
Every trainable parameter of the model must appear in exactly one user group, and every tensor
in a group must be a parameter of the model as it is now. The usual mistake is building the
groups before ``fully_shard``: FSDP2 replaces each parameter with a new DTensor parameter, so
the old tensors are "stale" and the new ones "missing". A stale tensor has no name of its own;
the error names the model parameters of the same shape that no group covers, which is almost
always the one it was meant to be.

[Note: hyperparameter values]
A hyperparameter is a real number: a Python or NumPy number, or a one-element tensor, as torch's
optimizers take an ``lr`` tensor. Numbers are kept as floats. Each optimizer group holds a
tensor of its own, copied at construction from the one given: one user group's ``lr`` feeds
both its ``/muon`` and its ``/adamw`` group, and a default feeds every group, while a scheduler
writes each group's value in place (``group["lr"].fill_(...)``, one factor per group); shared,
the last write would set every group's rate. The step reads and checks each group's values once at
its start (``group_numbers``: one host read per tensor value, not one per matrix), before
anything is updated, and again after the pre-step hooks if there are any (a hook may set the
step's lr), so ``param_groups[i]["lr"]`` changed in place reaches the next step. NS during
backward reads a Muon group's momentum once per backward, unchecked (``peeked_numbers``). The
same check runs at construction, on a replaced group and on a loaded state dict, so a value the
step ran with is never refused when its checkpoint loads.

[Note: edits to the groups]
The step plan keeps the group dicts construction made and reads their hyperparameters at every
step. Two edits the user (or a scheduler) makes outside them are taken in at the start of each
``step()``, before anything is read:

- a group dict replaced in ``param_groups`` (``param_groups[i] = {**g, "lr": ...}``), which a
  torch optimizer would step with: its values are copied into the dict it replaced, which goes
  back in its place (a replacement that holds other parameters, another optimizer or lacks a
  hyperparameter raises instead: the groups are fixed at construction);
- ``"momentum"`` written into an AdamW group: torch's schedulers that cycle momentum
  (``OneCycleLR``, ``CyclicLR``) write the first-moment coefficient under ``"momentum"`` in
  every group when the optimizer's ``defaults`` has that key (Muon's does), and under
  ``"betas"`` otherwise. It is AdamW's ``beta1``: it moves into ``betas``, so both optimizers
  follow the cycle, as a ``torch.optim.Muon`` and a ``torch.optim.AdamW`` would each under their
  own scheduler.

A group's parameters are the step plan's, fixed at construction: a ``"params"`` list edited
(a parameter removed, as a torch optimizer would then stop stepping it, or added; the key
assigned another list) raises at the next step, before anything changes, naming what was
removed and the fix (``requires_grad_(False)`` stops a parameter's training), as a replacement
that holds other parameters does; without it the step would go on stepping the parameters it
was built with, without a word. So do the group's other keys the plan fixes: its
``"param_names"`` (a checkpoint saves each state under them: one left out would be saved
without its state), its ``"optimizer"``, and a hyperparameter deleted (it raised ``KeyError``
in the step).

A key that no step reads but that means something elsewhere (``_INERT_KEYS``: torch.optim.Muon's
``ns_steps``, a user group's ``adamw_lr``, torch.optim.AdamW's ``foreach`` and ``fused``, ...)
raises instead, in place or in a replacement,
before anything is replaced, and in a loaded group (``Muon.load_state_dict``,
``dmuon.set_optimizer_state_dict``, ``dmuon.load_checkpoint``), before anything is loaded:
written silently it would change nothing. So do the other optimizer's hyperparameters
(``betas`` or ``eps`` in a Muon group, ``nesterov`` in an AdamW group: a loop over
``param_groups`` reaches both kinds) and a key that looks like a misspelt hyperparameter (a
near miss, ``weight_decy``, or another library's name, ``learning_rate``, ``wd``, ``beta1``),
which torch's optimizers would take without a word. Any other key is left alone: schedulers
keep their own in the groups (``initial_lr``, ``max_momentum``, ``swa_lr``, ...), and so may
a user.
"""

from __future__ import annotations

import difflib
import functools
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from dmuon_ownership import Route

from .._checks import check_bool
from .._matrix import MatrixView

__all__ = [
    "GROUP_REQUIRED",
    "BuiltParams",
    "GroupDefaults",
    "RoutedParam",
    "build_param_groups",
    "checked_group_values",
    "group_numbers",
    "peeked_numbers",
    "take_group_edits",
]

# The two optimizers a group can run; a group dict's "optimizer" holds one of them.
OPTIMIZERS = (Route.MUON, Route.ADAMW)

_ROUTE_KEYS = ("dmuon_route", "dmuon_optimizer", "matrix_optimizer")
_ALLOWED_KEYS = frozenset(
    {
        "params",
        "group_name",
        "lr",
        "weight_decay",
        "muon_lr",
        "adamw_lr",
        "muon_weight_decay",
        "adamw_weight_decay",
        "momentum",
        "nesterov",
        "adamw_betas",
        "adamw_eps",
        *_ROUTE_KEYS,
    }
)


class _HolderLike(Protocol):
    """What the groups read of a parameter dmuon holds (a dedicated one or an expert stack)."""

    fqn: str
    route: Route
    shape: Any


def _real(value: Any) -> float | None:
    """``value`` as a float if it is a real scalar: a Python or NumPy number (not a bool) or
    a one-element real tensor; else ``None``."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            return None
        return float(value.detach())
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def _number(value: Any, key: str, where: str, *, low: float = 0.0) -> float:
    """``value`` checked (see [Note: hyperparameter values]), as a float: one host read of a
    tensor."""
    number = _real(value)
    if number is None or not math.isfinite(number):
        raise ValueError(
            f"{where}: {key} must be a finite number (a float or a one-element tensor),"
            f" got {value!r}"
        )
    if number < low:
        raise ValueError(f"{where}: {key} must be >= {low}, got {value!r}")
    return number


def _fraction(value: Any, key: str, where: str) -> float:
    """A number in [0, 1): momentum and the AdamW betas."""
    number = _number(value, key, where)
    if number >= 1.0:
        raise ValueError(f"{where}: {key} must lie in [0, 1), got {value!r}")
    return number


def _kept(value: Any, number: float) -> Any:
    """What a group holds for a checked ``value``: the tensor itself (a scheduler writes it in
    place), else the float."""
    return value if isinstance(value, Tensor) else number


def _check_number(value: Any, key: str, where: str, *, low: float = 0.0) -> Any:
    """``value`` checked by ``_number``, as a group keeps it (``_kept``)."""
    return _kept(value, _number(value, key, where, low=low))


def _check_fraction(value: Any, key: str, where: str) -> Any:
    """``value`` checked by ``_fraction``, as a group keeps it (``_kept``)."""
    return _kept(value, _fraction(value, key, where))


def _betas(value: Any, where: str) -> tuple[float, float]:
    if not isinstance(value, Sequence) or len(value) != 2:
        raise ValueError(f"{where}: adamw_betas must be a pair (beta1, beta2), got {value!r}")
    return (
        _fraction(value[0], "adamw_betas[0]", where),
        _fraction(value[1], "adamw_betas[1]", where),
    )


def _check_betas(value: Any, where: str) -> tuple[Any, Any]:
    """``value`` checked by ``_betas``, each beta as a group keeps it (``_kept``)."""
    return tuple(map(_kept, value, _betas(value, where)))  # type: ignore[return-value]


# The keys construction puts in every group besides its hyperparameters.
_KNOWN_KEYS = frozenset({"params", "param_names", "group_name", "optimizer"})

# The hyperparameters each route's group steps with.
GROUP_REQUIRED: dict[Route, tuple[str, ...]] = {
    Route.MUON: ("lr", "weight_decay", "momentum", "nesterov"),
    Route.ADAMW: ("lr", "weight_decay", "betas", "eps"),
}


def group_numbers(group: Mapping[str, Any], route: Route, where: str) -> dict[str, Any]:
    """The hyperparameters a ``route`` group steps with, checked as construction checks them
    (``ValueError`` naming the key: a NaN lr written in place or loaded would otherwise reach
    the step) and read as Python numbers, once (a tensor's value costs a host read), ``betas``
    as a pair of floats. Raises ``KeyError`` for a missing one: the callers check presence
    first, with their own message."""
    if route is Route.MUON:
        return {
            "lr": _number(group["lr"], "lr", where),
            "weight_decay": _number(group["weight_decay"], "weight_decay", where),
            "momentum": _fraction(group["momentum"], "momentum", where),
            "nesterov": check_bool(f"{where}: nesterov", group["nesterov"]),
        }
    return {
        "lr": _number(group["lr"], "lr", where),
        "weight_decay": _number(group["weight_decay"], "weight_decay", where),
        "betas": _betas(group["betas"], where),
        "eps": _number(group["eps"], "eps", where),
    }


def peeked_numbers(group: Mapping[str, Any]) -> dict[str, Any]:
    """What NS during backward reads of a Muon group: its momentum (unchecked, NaN where it is
    not a real number) and Nesterov; ``lr`` and ``weight_decay`` NaN, unread (the early half
    uses neither, so a tensor lr costs no host read inside backward). Nothing here raises:
    each owner would stop its backward at another point, and the ranks' collectives part. The
    step checks the values, and an early result computed from others than it steps with is
    not used."""
    momentum = _real(group.get("momentum"))
    return {
        "lr": math.nan,
        "weight_decay": math.nan,
        "momentum": math.nan if momentum is None else momentum,
        "nesterov": group.get("nesterov") is True,
    }


def checked_group_values(group: Mapping[str, Any], route: Route, where: str) -> dict[str, Any]:
    """``group_numbers`` as a group keeps them: a tensor stays the tensor it was (a loaded
    group's tensor lr goes on being written in place by its scheduler), ``betas`` a tuple."""
    numbers = group_numbers(group, route, where)
    kept = {key: _kept(group[key], number) for key, number in numbers.items() if key != "betas"}
    if "betas" in numbers:
        kept["betas"] = tuple(map(_kept, group["betas"], numbers["betas"]))
    return kept


# torch.optim.AdamW's flags, which dmuon's AdamW does not take, with why (Muon() refuses them
# as keywords, a group refuses them as keys).
TORCH_ADAMW_FLAGS = {
    # torch.optim.AdamW's flags that change its arithmetic: dmuon's AdamW has neither.
    "maximize": "not an option of dmuon's optimizers (negate the loss instead)",
    "amsgrad": "not an option of dmuon's AdamW",
    # ... and those that choose its implementation: dmuon's AdamW has one.
    "foreach": "not an option of dmuon's AdamW, which always runs torch's fused AdamW kernel"
    " (the numbers of torch.optim.AdamW(fused=True))",
    "fused": "not an option of dmuon's AdamW, which always runs torch's fused AdamW kernel"
    " (the numbers of torch.optim.AdamW(fused=True))",
    "capturable": "not an option of dmuon's AdamW (a CUDA graph of the Muon phase is"
    " options=dmuon.StepOptions(cuda_graph=True))",
    "differentiable": "not an option of dmuon's optimizers, whose step runs without autograd",
    "decoupled_weight_decay": "not an option of dmuon's AdamW, whose weight decay is always"
    " decoupled (torch.optim.AdamW's)",
}

# torch.optim.Muon's eps, which Muon() refuses as a keyword and a Muon group as a key: not the
# number NewtonSchulz's eps is (see [Note: torch.optim.Muon's eps] in _usage_checks).
TORCH_MUON_EPS = (
    "torch.optim.Muon's eps is a floor on the norm its Newton–Schulz divides by (max(‖X‖, eps):"
    " only a momentum of a smaller norm feels it), not a value to carry over:"
    " dmuon.NewtonSchulz(eps=...) is added to the norm (‖X‖ + eps), which scales every input"
    " down; leave it at its default, 1e-7"
)


# Keys a step never reads that mean something elsewhere, with where that is: torch.optim.Muon's
# per-group options, which dmuon fixes at construction for every group, the keys of a user
# group, which construction turns into the optimizer groups' own, and torch.optim.AdamW's flags.
# Written into an optimizer group they would change nothing without a word (see
# take_group_edits).
_INERT_KEYS = {
    "ns_steps": "Muon(ns_steps=...) or ns_backend=dmuon.NewtonSchulz(steps=...), fixed when"
    " Muon is built",
    "ns_coefficients": "ns_backend=dmuon.NewtonSchulz(coefficients=[(a, b, c)]) (torch's one"
    " row, in a list of rows), fixed when Muon is built",
    "adjust_lr_fn": "options=dmuon.StepOptions(lr_scaling=...), fixed when Muon is built",
    "muon_lr": "'lr' of the '.../muon' group",
    "adamw_lr": "'lr' of the '.../adamw' group",
    "muon_weight_decay": "'weight_decay' of the '.../muon' group",
    "adamw_weight_decay": "'weight_decay' of the '.../adamw' group",
    "adamw_betas": "'betas' of the '.../adamw' group",
    "adamw_eps": "'eps' of the '.../adamw' group",
    **{key: "Muon(model, param_groups=[...]), fixed when Muon is built" for key in _ROUTE_KEYS},
    **TORCH_ADAMW_FLAGS,
}


# The hyperparameters of the other route that a group holds without reading them: AdamW's in a
# Muon group, Muon's in an AdamW group ("momentum" there is its beta1, see take_group_edits).
# A loop over param_groups that sets one optimizer's key reaches both kinds of group.
_OTHER_ROUTE_KEYS = {Route.MUON: ("betas", "eps"), Route.ADAMW: ("nesterov",)}
# Every hyperparameter a step reads (either route's), which a misspelt key is compared with,
# and the names other libraries give some of them.
_READ_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "betas", "eps")
_ALIASES = {
    "learning_rate": "lr",
    "wd": "weight_decay",
    "beta1": "betas",
    "beta2": "betas",
    "epsilon": "eps",
}


@functools.lru_cache(maxsize=256)
def _meant(key: str) -> str | None:
    """The hyperparameter a group key that no step reads looks meant for (a case-insensitive
    near miss, ``"weight_decy"``, or another library's name, ``"learning_rate"``), else
    ``None``; see [Note: edits to the groups]. Cached: a scheduler's own keys (``initial_lr``,
    ``max_momentum``, ...) are looked at once per name, not at every step."""
    folded = key.casefold()
    if folded in _ALIASES:
        return _ALIASES[folded]
    close = difflib.get_close_matches(folded, _READ_KEYS, n=1, cutoff=0.85)
    return close[0] if close else None


def _unread_keys(group: Mapping[str, Any], route: Route) -> dict[str, str]:
    """Each key of a ``route`` group that no step reads although it names a hyperparameter,
    with where its meaning lives: ``_INERT_KEYS``, the other route's hyperparameters
    (``_OTHER_ROUTE_KEYS``) and misspelt ones (``_meant``)."""
    other = Route.ADAMW if route is Route.MUON else Route.MUON
    only = (
        f"{other.value}'s, and this group steps with {route.value!r}: write it into the"
        f" '.../{other.value}' groups only (if group['optimizer'] == {other.value!r})"
    )
    found = {key: _INERT_KEYS[key] for key in _INERT_KEYS if key in group}
    for key in group:
        if key in found or not isinstance(key, str):
            continue
        if key in _OTHER_ROUTE_KEYS[route]:
            found[key] = only
            if key == "eps":  # what it is to a torch.optim.Muon recipe, too
                found[key] += f" ({TORCH_MUON_EPS})"
        elif key not in _READ_KEYS and key not in _KNOWN_KEYS:
            meant = _meant(key)
            if meant in GROUP_REQUIRED[route]:
                found[key] = f"{meant!r} misspelt: set group[{meant!r}] instead"
            elif meant is not None:
                found[key] = f"{meant!r} misspelt, which is " + only
    return found


def check_no_inert_keys(group: Mapping[str, Any], where: str, route: Route) -> None:
    """Raise ``ValueError`` naming every key of a ``route`` group that no step reads although
    it names a hyperparameter (``_unread_keys``): in a group written or replaced, and in a
    group a state dict or checkpoint would load."""
    inert = _unread_keys(group, route)
    if inert:
        raise ValueError(
            f"{where} holds {list(inert)}, which no step reads (the step would go on without"
            " them):"
            + ";".join(f" {key} is {meaning}" for key, meaning in inert.items())
            + ". Delete the key from the group"
        )


class BuiltParams(NamedTuple):
    """The parameters of one optimizer group as construction made it, and their names: what
    the step plan steps, whatever the group's ``"params"`` holds later."""

    params: tuple[Tensor, ...]
    names: tuple[str, ...]
    ids: tuple[int, ...]  # the parameters' ids, compared at every step (the step holds them)
    optimizer: Route

    @classmethod
    def of(cls, group: Mapping[str, Any]) -> BuiltParams:
        params = tuple(group["params"])
        names = tuple(group["param_names"])
        return cls(params, names, tuple(map(id, params)), Route(group["optimizer"]))


def take_group_edits(
    groups: list[dict[str, Any]],
    built: Sequence[dict[str, Any]],
    built_params: Sequence[BuiltParams],
) -> dict[int, dict[str, Any]]:
    """Bring what the user changed in ``groups`` (the optimizer's ``param_groups``) into the
    group dicts the step plan reads (``built``, the ones construction made, with the
    parameters ``built_params``), in place; see [Note: edits to the groups]. Returns each
    built group's ``group_numbers`` by the group's ``id``: the values this step computes with,
    read once. Raises ``ValueError`` for a group whose parameters changed (its ``"params"``
    edited, or the group replaced by one that holds others) and for a replaced group that is
    not the same group (another optimizer, a hyperparameter missing)."""
    if len(groups) != len(built):
        raise ValueError(
            f"Muon.param_groups holds {len(groups)} groups but Muon was built with"
            f" {len(built)}: its groups are fixed at construction; change a group's"
            " hyperparameters in place (param_groups[i]['lr'] = ...), or build Muon with the"
            " groups you need (Muon(model, param_groups=[...]))"
        )
    # Every group's fixed keys first, so that a refused edit leaves every group as it was.
    for group, own, made in zip(groups, built, built_params, strict=True):
        if group is own:
            _check_fixed_keys(own, made)
    numbers: dict[int, dict[str, Any]] = {}
    for i, (group, own, made) in enumerate(zip(groups, built, built_params, strict=True)):
        if group is not own:
            _check_replacement(group, own, made)
            own.clear()
            own.update(group)
            groups[i] = own
        where = f"Muon.param_groups: group {own['group_name']!r}"
        check_no_inert_keys(own, where, own["optimizer"])
        if own["optimizer"] == Route.ADAMW and "momentum" in own:
            beta1 = _check_fraction(own.pop("momentum"), "momentum", where)
            own["betas"] = (beta1, own["betas"][1])
        # A value written in place (param_groups[i]["lr"] = nan) is checked before the step
        # reads it, as a replaced group is.
        numbers[id(own)] = group_numbers(own, own["optimizer"], where)
    return numbers


def _check_fixed_keys(group: dict[str, Any], made: BuiltParams) -> None:
    """Refuse a group changed in place where the step plan does not follow it: its
    ``"params"`` (``_check_params_unchanged``), its ``"param_names"`` (the checkpoints' names
    of its parameters), its ``"optimizer"``, or a hyperparameter deleted; each raised
    ``KeyError`` or ``AttributeError`` in the step, or went on without a word."""
    where = f"Muon.param_groups: group {group.get('group_name')!r}"
    _check_params_unchanged(group, made)
    names = group.get("param_names")
    if not isinstance(names, (list, tuple)) or tuple(names) != made.names:
        raise ValueError(
            f"{where}: its 'param_names' were changed since Muon was built; they name the"
            " group's parameters in its checkpoints (a parameter left out would be saved"
            " without its state): put them back"
        )
    if group.get("optimizer") != made.optimizer:
        raise ValueError(
            f"{where} steps with {made.optimizer.value!r}, and its 'optimizer' was changed to"
            f" {group.get('optimizer')!r}: a group's optimizer is fixed at construction; put"
            f" {made.optimizer.value!r} back. To step parameters with the other optimizer,"
            " route them when Muon is built (Muon(model, param_groups=[{'params': [...],"
            " 'dmuon_route': 'adamw'}]))"
        )
    group["optimizer"] = made.optimizer  # the same route written back as a plain str
    absent = [k for k in GROUP_REQUIRED[made.optimizer] if k not in group]
    if absent:
        raise ValueError(
            f"{where} lacks {absent}, deleted since Muon was built, which its step reads: set"
            f" them again (group[{absent[0]!r}] = ...)"
        )


def _check_params_unchanged(group: Mapping[str, Any], made: BuiltParams) -> None:
    """Refuse a group whose ``"params"`` changed in place (a parameter removed or added, the
    key assigned another list): torch would step what the list holds, the step plan steps
    what construction gave it."""
    params = group.get("params")
    if isinstance(params, (list, tuple)) and tuple(map(id, params)) == made.ids:
        return
    try:
        now = {id(p) for p in params} if params is not None else set()
    except TypeError:  # not a collection of tensors at all
        now = set()
    kept = {id(p) for p in made.params}
    dropped = [n for p, n in zip(made.params, made.names, strict=True) if id(p) not in now]
    added = len(now - kept)
    what = []
    if dropped:
        what.append(
            f"without {dropped[:3]}" + (f" and {len(dropped) - 3} more" if len(dropped) > 3 else "")
        )
    if added:
        what.append(f"with {added} tensor(s) it was not built with")
    raise ValueError(
        f"Muon.param_groups: group {group['group_name']!r}: its 'params' list was changed since"
        f" Muon was built ({', '.join(what) or 'reordered'}), and the step would go on stepping"
        " the parameters it was built with. Muon's groups are fixed at construction: put the"
        " list back; to stop training a parameter, freeze it (p.requires_grad_(False): a"
        " parameter without a gradient is not stepped and keeps its value); to train other"
        " ones, build Muon with the groups you need (Muon(model, param_groups=[...]))"
    )


def _check_replacement(group: Any, own: Mapping[str, Any], made: BuiltParams) -> None:
    name, route = own["group_name"], own["optimizer"]
    where = f"Muon.param_groups: group {name!r}"
    params = group.get("params", ()) if isinstance(group, Mapping) else ()
    if tuple(map(id, params)) != made.ids:
        raise ValueError(
            f"{where} was replaced by a dict that holds other parameters; Muon's groups are"
            " fixed at construction: change a group's hyperparameters in place"
            " (param_groups[i]['lr'] = ...), or build Muon with the groups you need"
            " (Muon(model, param_groups=[...]))"
        )
    required = ("group_name", "param_names", "optimizer", *GROUP_REQUIRED[route])
    absent = [k for k in required if k not in group]
    if absent:
        raise ValueError(
            f"{where} was replaced by a dict without {absent}; copy the group with its keys"
            " ({**group, 'lr': ...}) or set the value in place"
        )
    names = group["param_names"]
    if not isinstance(names, (list, tuple)) or tuple(names) != made.names:
        raise ValueError(
            f"{where} was replaced by a dict whose 'param_names' were changed; they name the"
            " group's parameters in its checkpoints: copy the group with its keys"
            " ({**group, 'lr': ...})"
        )
    if group["optimizer"] != route:
        raise ValueError(
            f"{where} steps with {route.value!r}; the dict that replaced it says"
            f" {group['optimizer']!r}: a group's optimizer is fixed at construction"
        )
    check_no_inert_keys(group, where, route)  # before it replaces anything
    group_numbers(group, route, where)


@dataclass(frozen=True)
class GroupDefaults:
    """Optimizer-wide hyperparameters, the values a user group does not override; validated
    at construction (a bad value raises ``ValueError`` naming the argument)."""

    lr: float = 0.02
    weight_decay: float = 0.0
    momentum: float = 0.95
    nesterov: bool = True
    adamw_lr: float = 1e-3
    adamw_betas: tuple[float, float] = (0.9, 0.999)
    adamw_eps: float = 1e-8
    adamw_weight_decay: float = 0.01

    def __post_init__(self) -> None:
        where = "Muon"
        for key in ("lr", "weight_decay", "adamw_lr", "adamw_eps", "adamw_weight_decay"):
            object.__setattr__(self, key, _check_number(getattr(self, key), key, where))
        object.__setattr__(self, "momentum", _check_fraction(self.momentum, "momentum", where))
        object.__setattr__(self, "adamw_betas", _check_betas(self.adamw_betas, where))
        object.__setattr__(self, "nesterov", check_bool(f"{where}: nesterov", self.nesterov))


@dataclass(frozen=True)
class RoutedParam:
    """A trainable parameter of the wrapped model and the optimizer that steps it."""

    fqn: str
    param: Tensor
    optimizer: Route  # Route.MUON or Route.ADAMW


class _UserGroup(NamedTuple):
    """One entry of ``param_groups`` after parsing."""

    position: int  # index in ``param_groups``
    name: str | None
    options: Mapping[str, Any]
    params: list[RoutedParam]


def _forced_route(group: Mapping[str, Any], where: str) -> Route | None:
    given = {k: group[k] for k in _ROUTE_KEYS if k in group}
    if not given:
        return None
    values = {str(v) for v in given.values()}
    if len(values) != 1:
        raise ValueError(f"{where}: {sorted(given)} disagree ({given}); set only one of them")
    route = values.pop()
    if route not in OPTIMIZERS:
        raise ValueError(
            f"{where}: {next(iter(given))}={route!r} is not a route the optimizer can force;"
            f" use 'muon' or 'adamw' (communication routes are set by dedicate_params' param_policy)"
        )
    return Route(route)


def _route_of(
    fqn: str, p: Tensor, holders: Mapping[int, _HolderLike], forced: Route | None, where: str
) -> RoutedParam:
    dp = holders.get(id(p))
    if dp is None:
        return RoutedParam(fqn, p, Route.ADAMW)
    route = (
        forced if forced is not None else (Route.MUON if dp.route is Route.MUON else Route.ADAMW)
    )
    if route is Route.MUON and dp.route is not Route.MUON and not _is_matrix(dp.shape):
        raise ValueError(
            f"{where}: forces route 'muon' on {fqn!r} of shape {tuple(dp.shape)}, but Muon needs"
            " a 2-D matrix; move this parameter to a group without a route override"
        )
    return RoutedParam(fqn, p, route)


def _is_matrix(shape: Any) -> bool:
    """Whether a dedicated parameter of ``shape`` is one matrix (the dedicated Muon step's)."""
    try:
        return MatrixView.of(shape).experts is None
    except ValueError:
        return False


def _user_params(group: Mapping[str, Any], where: str) -> list[tuple[str | None, Tensor]]:
    if "params" not in group:
        raise ValueError(f"{where} has no 'params'; give a list of the model's parameters")
    raw = group["params"]
    if isinstance(raw, Tensor):
        raw = [raw]
    if isinstance(raw, set | frozenset):
        raise ValueError(f"{where}: 'params' must be an ordered list, not a set")
    out: list[tuple[str | None, Tensor]] = []
    for item in raw:
        name, tensor = item if isinstance(item, tuple) and len(item) == 2 else (None, item)
        if not isinstance(tensor, Tensor):
            raise ValueError(
                f"{where}: 'params' holds a {type(item).__name__}; give tensors or"
                " (name, tensor) pairs from model.named_parameters()"
            )
        out.append((None if name is None else str(name), tensor))
    return out


def _describe(fqn: str, holders: Mapping[int, _HolderLike], p: Tensor) -> str:
    dp = holders.get(id(p))
    shape = tuple(dp.shape) if dp is not None else tuple(p.shape)
    return f"{fqn!r} {shape}"


def _parse_groups(
    user_groups: Sequence[Mapping[str, Any]],
    trainable: Mapping[int, tuple[str, Tensor]],
    holders: Mapping[int, _HolderLike],
) -> tuple[list[_UserGroup], list[tuple[str, str | None, Tensor]]]:
    """Each user group's name, options and routed parameters (in group order), and the
    tensors that are not trainable parameters of the model (``(where, given name, tensor)``).
    Raises on a malformed group or a parameter listed twice."""
    seen: dict[int, str] = {}
    names: set[str] = set()
    stale: list[tuple[str, str | None, Tensor]] = []
    parsed: list[_UserGroup] = []
    for index, group in enumerate(user_groups):
        if not isinstance(group, Mapping):
            raise ValueError(f"param_groups[{index}] must be a dict, got {type(group).__name__}")
        name = group.get("group_name")
        where = f"param_groups[{index}]" + (f" ({name!r})" if name is not None else "")
        if name is not None:
            name = str(name)
            if "/" in name or not name:
                raise ValueError(f"{where}: group_name must be non-empty and contain no '/'")
            if name in names:
                raise ValueError(
                    f"{where}: group_name {name!r} is used twice; names must be unique"
                )
            names.add(name)
        unknown = sorted(set(group) - _ALLOWED_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(_ALLOWED_KEYS)}")
        forced = _forced_route(group, where)
        routed: list[RoutedParam] = []
        for given_name, p in _user_params(group, where):
            entry = trainable.get(id(p))
            if entry is None:
                if p.requires_grad:
                    stale.append((where, given_name, p))
                continue  # frozen parameters are never stepped
            fqn = entry[0]
            if id(p) in seen:
                raise ValueError(
                    f"{where}: parameter {fqn!r} is also in {seen[id(p)]}; every trainable"
                    " parameter must be in exactly one group — remove one of the two"
                )
            seen[id(p)] = where
            routed.append(_route_of(fqn, p, holders, forced, where))
        parsed.append(_UserGroup(index, name, group, routed))
    return parsed, stale


def _check_coverage(
    parsed: Sequence[_UserGroup],
    stale: Sequence[tuple[str, str | None, Tensor]],
    trainable: Mapping[int, tuple[str, Tensor]],
    holders: Mapping[int, _HolderLike],
) -> None:
    """Every group tensor is a parameter of the model and every trainable parameter is in a
    group; see [Note: validating against the wrapped model]."""
    covered = {id(r.param) for group in parsed for r in group.params}
    uncovered = [(key, fqn, q) for key, (fqn, q) in trainable.items() if key not in covered]
    if stale:
        where, given_name, p = stale[0]
        shape = tuple(p.shape)
        candidates = [
            _describe(fqn, holders, q)
            for key, fqn, q in uncovered
            if tuple(holders[key].shape if key in holders else q.shape) == shape
        ]
        label = f"{given_name!r}" if given_name is not None else f"a tensor of shape {shape}"
        hint = (
            f" (it looks like the pre-wrapping {', '.join(candidates[:3])})" if candidates else ""
        )
        raise ValueError(
            f"{where} holds {label}, which is not a parameter of the wrapped model{hint};"
            " build param_groups from model.named_parameters() after dedicate_params() and"
            " fully_shard()"
        )
    if uncovered:
        missing = [fqn for _, fqn, _ in uncovered]
        shown = ", ".join(repr(m) for m in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(
            f"param_groups is missing trainable parameter(s) {shown}{more}; every trainable"
            " parameter must be in exactly one group — add them to a group (or set"
            " requires_grad=False to freeze them)"
        )


def _split_by_route(
    group: _UserGroup, defaults: GroupDefaults, prefix: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``<prefix>muon`` and ``<prefix>adamw`` optimizer groups of one user group."""
    options, where = group.options, f"param_groups[{group.position}]"
    lr = options.get("lr")
    wd = options.get("weight_decay")

    def subgroup(route: Route, **hyper: Any) -> dict[str, Any]:
        members = [r for r in group.params if r.optimizer is route]
        return {
            "params": [r.param for r in members],
            "param_names": [r.fqn for r in members],
            "group_name": f"{prefix}{route.value}",
            "optimizer": route,
            **{key: _own_copy(value) for key, value in hyper.items()},
        }

    def number(key: str, shared: Any, default: float) -> float:
        """``key`` from the group, else its ``lr``/``weight_decay``, else the default."""
        return _check_number(options.get(key, default if shared is None else shared), key, where)

    muon = subgroup(
        Route.MUON,
        lr=number("muon_lr", lr, defaults.lr),
        weight_decay=number("muon_weight_decay", wd, defaults.weight_decay),
        momentum=_check_fraction(options.get("momentum", defaults.momentum), "momentum", where),
        nesterov=check_bool(f"{where}: nesterov", options.get("nesterov", defaults.nesterov)),
    )
    adamw = subgroup(
        Route.ADAMW,
        lr=number("adamw_lr", lr, defaults.adamw_lr),
        weight_decay=number("adamw_weight_decay", wd, defaults.adamw_weight_decay),
        betas=_check_betas(options.get("adamw_betas", defaults.adamw_betas), where),
        eps=number("adamw_eps", None, defaults.adamw_eps),
    )
    return muon, adamw


def _own_copy(value: Any) -> Any:
    """A group's own copy of a tensor hyperparameter (in a pair too); other values as they are
    (see [Note: hyperparameter values])."""
    if isinstance(value, tuple):
        return tuple(_own_copy(item) for item in value)
    return value.detach().clone() if isinstance(value, Tensor) else value


def build_param_groups(
    named_params: Iterable[tuple[str, Tensor]],
    holders: Mapping[int, _HolderLike],
    user_groups: Sequence[Mapping[str, Any]] | None,
    defaults: GroupDefaults,
) -> list[dict[str, Any]]:
    """The optimizer's param groups: ``muon`` and ``adamw`` without user groups, otherwise
    ``<name>/muon`` and ``<name>/adamw`` per user group (see [Note: what a user group decides]).

    ``named_params`` are the wrapped model's parameters (``model.named_parameters()``);
    ``holders`` maps ``id(param)`` of each parameter dmuon holds to its holder (a
    ``DedicatedParam`` or an ``ExpertStack``).
    Each returned dict holds ``params``, ``param_names`` (FQNs), ``group_name``, ``optimizer``
    (``Route.MUON``/``Route.ADAMW``) and that optimizer's hyperparameters.
    """
    trainable: dict[int, tuple[str, Tensor]] = {}
    for fqn, p in named_params:
        if p.requires_grad and id(p) not in trainable:
            trainable[id(p)] = (fqn, p)

    is_default = user_groups is None
    if user_groups is None:
        user_groups = [{"params": [p for _, p in trainable.values()]}]
    elif not isinstance(user_groups, Sequence):  # a dict is no Sequence
        raise ValueError(
            "param_groups must be a list of dicts like"
            " [{'params': [...], 'group_name': 'base', 'lr': ...}], got"
            f" {type(user_groups).__name__}"
        )
    elif len(user_groups) == 0:
        raise ValueError("param_groups is empty; pass None for the default groups or list groups")

    parsed, stale = _parse_groups(user_groups, trainable, holders)
    _check_coverage(parsed, stale, trainable, holders)
    out: list[dict[str, Any]] = []
    named = {group.name for group in parsed}
    for group in parsed:
        if is_default:
            prefix = ""
        elif group.name is not None:
            prefix = f"{group.name}/"
        else:
            prefix = f"group{group.position}/"
            if prefix[:-1] in named:  # checkpoints key the groups by name
                raise ValueError(
                    f"param_groups[{group.position}] has no group_name, and its default name "
                    f"{prefix[:-1]!r} is another group's; give it a group_name"
                )
        out.extend(_split_by_route(group, defaults, prefix))
    return out
