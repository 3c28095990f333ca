"""What ``Muon.state_dict()`` records of the rank that saved it, and the check
``Muon.load_state_dict`` makes with it.

[Note: loading another rank's optimizer state dict]

``optimizer.state_dict()`` is torch's per-rank dictionary: it holds the state this rank steps, a
dedicated matrix's only on its owner and an FSDP2 parameter's as this rank's shard. The usual
DDP checkpoint (rank 0 saves ``optimizer.state_dict()``, every rank loads it) would therefore
restore momentum only for the matrices rank 0 owns; every other owner would restart its
matrices from zero state and the resumed run drift from the uninterrupted one without an
error. Gathering every
owner's state in ``state_dict()`` would need a collective in a call that DDP scripts make on
rank 0 alone, where it would hang.

So ``state_dict()`` adds one entry, ``"dmuon_holdings"``: the saving rank, the world size and,
per parameter (by torch's parameter index), which state that rank holds: ``("owner", 0)`` for a
dedicated matrix it owns whole, ``("owner", tp_index, "of", tp_size)`` for its TP shard of one,
``("shard", *coordinate, "of", *sizes)`` for a DTensor parameter (its coordinate on the mesh
dimensions that shard it, and their sizes: rank 0 of 3 and rank 0 of 2 hold other rows),
``("whole",)`` for a plain one (the same on every rank), nothing for a dedicated matrix another
rank owns. ``load_state_dict`` compares it with this rank's holdings before anything is loaded,
and raises, naming ``dmuon.get_optimizer_state_dict`` / ``dmuon.set_optimizer_state_dict`` (the
collective, full-state functions), when some state this rank steps is not the one in the
dictionary. Every state tensor is also checked against the shape this rank steps (a dictionary
built by hand has no holdings to compare): torch's load does not compare shapes, and its fused
AdamW would write past the end of a smaller shard (a heap corruption on the CPU; a dictionary
saved on 3 ranks and loaded on 2 did). A dictionary loaded on the rank that saved it (or,
on the replicated path, any rank whose owned matrices the saver also owned, such as a world of
one) resumes bit for bit. A dictionary without the entry (built by hand, or by an older dmuon)
is refused when it holds some state but none for a dedicated matrix this rank owns.

The dictionary holds plain Python values and tensors only (each param group's route is
written as its string), so ``torch.load``'s default ``weights_only=True`` reads it back; loading
turns the route back into a :class:`~dmuon_ownership.Route` and refuses a group whose route
differs from the optimizer's.

Loading also keeps each dedicated matrix's state in its optimizer dtype on the master's
device. torch casts every loaded state to its parameter's dtype, and a dedicated parameter may
read as its compute copy (bf16 on the replicated path with ``param_dtype``): fp32 moments would
come back rounded to bf16. Those entries are installed here instead of by torch, and entries
for matrices this rank does not own are dropped, as they would never be stepped here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from itertools import chain
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon_ownership import Route

from .._torch_internals import local_shard
from ..holder import DedicatedParam, tensor_view
from ._muon_math import STATE_FIELDS
from ._param_groups import GROUP_REQUIRED, check_no_inert_keys, checked_group_values

__all__ = ["HOLDINGS_KEY", "for_saving", "install_dedicated_state", "split_for_load"]

HOLDINGS_KEY = "dmuon_holdings"

Holding = tuple[Any, ...]


def _holding(param: Tensor, dp: DedicatedParam | None) -> Holding | None:
    """Which state of ``param`` this rank holds (``None``: none); see [Note: loading another
    rank's optimizer state dict]."""
    return tensor_view(param).holding() if dp is None else dp.holding()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _indexed(groups: list[dict[str, Any]]) -> Iterator[tuple[int, Tensor, str]]:
    """Every parameter with the index ``torch.optim.Optimizer.state_dict`` gives it, and its
    name."""
    seen: set[int] = set()
    index = 0
    for group in groups:
        for param, name in zip(group["params"], group["param_names"]):
            if id(param) not in seen:
                seen.add(id(param))
                yield index, param, name
            index += 1


def for_saving(
    optimizer: torch.optim.Optimizer,
    dedicated: Mapping[int, DedicatedParam],
    state_dict: dict[str, Any],
) -> dict[str, Any]:
    """``state_dict`` (torch's) with the routes as strings and the saving rank's holdings."""
    params = {
        index: _holding(param, dedicated.get(id(param)))
        for index, param, _ in _indexed(optimizer.param_groups)
    }
    groups = [{**g, "optimizer": str(g["optimizer"])} for g in state_dict["param_groups"]]
    return {
        **state_dict,
        "param_groups": groups,
        HOLDINGS_KEY: {"rank": _rank(), "world_size": _world_size(), "params": params},
    }


def _routes_back(groups: list[dict[str, Any]], saved_groups: Sequence[Any]) -> list[dict[str, Any]]:
    """``saved_groups`` with each route a ``Route`` again; raises when one differs from the
    optimizer's group at its place."""
    restored = []
    for group, saved in zip(groups, saved_groups):
        route = saved.get("optimizer", group["optimizer"]) if isinstance(saved, Mapping) else None
        if route != group["optimizer"]:
            raise ValueError(
                f"Muon.load_state_dict: param group {group['group_name']!r} steps with "
                f"{_route_name(group['optimizer'])!r} but the state dict's group at its place "
                f"with {_route_name(route)!r}; load a state dict of an optimizer built with the "
                "same param_groups"
            )
        where = f"Muon.load_state_dict: param group {group['group_name']!r}"
        absent = [k for k in GROUP_REQUIRED[group["optimizer"]] if k not in saved]
        if absent:
            raise ValueError(
                f"{where} lacks {absent}; load a state dict of this optimizer's state_dict()"
            )
        check_no_inert_keys(saved, where, group["optimizer"])  # every step would raise for it
        values = checked_group_values(saved, group["optimizer"], where)
        restored.append({**saved, **values, "optimizer": Route(route)})
    return restored


def _route_name(route: Any) -> Any:
    return route.value if isinstance(route, Route) else route


def _as_holding(value: Any) -> Holding | None:
    return tuple(value) if isinstance(value, list | tuple) else None


def _unfit(entry: Any, route: Route, shape: tuple[int, ...]) -> str:
    """What in a parameter's loaded state ``entry`` does not fit the ``route`` this rank steps
    it with on a tensor of ``shape``: a missing field (the next step would raise ``KeyError``
    for it, every step after the load), a tensor without data (the meta device) or of another
    shape on this rank (a DTensor's local shard; the 0-dim AdamW step aside). Empty when it
    fits."""
    if not isinstance(entry, Mapping):
        return "not a dict of tensors"
    problems = [f"no {field!r}" for field in STATE_FIELDS[route] if field not in entry]
    for key, value in entry.items():
        if not isinstance(value, Tensor):
            continue
        local = local_shard(value)
        got = tuple(local.shape)
        if local.is_meta:
            problems.append(f"{key} on the meta device (no data)")
        elif got and got != shape:
            problems.append(f"{key} {got} for {shape}")
    return ", ".join(problems)


def _paired(
    groups: list[dict[str, Any]], saved_groups: Sequence[Any]
) -> dict[Any, tuple[Tensor, str, Route]] | None:
    """Each saved parameter index with its live parameter, name and route, paired by position
    as torch's load pairs them; ``None`` where torch's load would refuse the groups (another
    structure or group sizes)."""
    try:
        saved_ids = [list(g["params"]) for g in saved_groups]
    except (KeyError, TypeError):
        return None
    if [len(ids) for ids in saved_ids] != [len(g["params"]) for g in groups]:
        return None
    live = [
        (p, name, g["optimizer"]) for g in groups for p, name in zip(g["params"], g["param_names"])
    ]
    return dict(zip(chain.from_iterable(saved_ids), live))


def split_for_load(
    optimizer: torch.optim.Optimizer,
    dedicated: Mapping[int, DedicatedParam],
    state_dict: Mapping[str, Any],
) -> tuple[dict[str, Any], dict[Tensor, tuple[DedicatedParam, Mapping[str, Any]]]]:
    """Check that ``state_dict`` holds the state this rank keeps (raises otherwise, before
    anything is loaded) and split it into what torch loads and the owned dedicated matrices'
    entries, which :func:`install_dedicated_state` installs. Anything but a dict raises
    ``TypeError``, the full dictionary of ``get_optimizer_state_dict`` a ``ValueError``; a
    dictionary torch would refuse (another structure or group sizes) is handed on as it is, for
    torch's own error."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            "Muon.load_state_dict: state_dict must be a dict, as optimizer.state_dict() "
            f"returns, got {type(state_dict).__name__}"
        )
    if isinstance(state_dict.get("param_groups"), Mapping):
        raise ValueError(
            "Muon.load_state_dict: this is a full optimizer state dict (param groups by name, "
            "as dmuon.get_optimizer_state_dict returns); load it with "
            "dmuon.set_optimizer_state_dict(model, optimizer, state_dict) on every rank. "
            "Nothing was loaded"
        )
    torch_part = {k: v for k, v in state_dict.items() if k != HOLDINGS_KEY}
    saved_state = state_dict.get("state")
    saved_groups = state_dict.get("param_groups")
    if not isinstance(saved_state, Mapping) or not isinstance(saved_groups, list | tuple):
        return torch_part, {}
    groups = optimizer.param_groups
    id_map = _paired(groups, saved_groups)
    if id_map is None:
        return torch_part, {}
    torch_part["param_groups"] = _routes_back(groups, saved_groups)
    recorded = state_dict.get(HOLDINGS_KEY)
    if not isinstance(recorded, Mapping):
        recorded = {}
    holdings = recorded.get("params")
    lacking: list[str] = []
    misshapen: list[str] = []
    state: dict[Any, Any] = {}
    owned: dict[Tensor, tuple[DedicatedParam, Mapping[str, Any]]] = {}
    for saved_id, entry in saved_state.items():
        if saved_id not in id_map:
            state[saved_id] = entry  # not a parameter's: torch keeps it as it is
    for saved_id, (param, name, route) in id_map.items():
        dp = dedicated.get(id(param))
        holding = _holding(param, dp)
        if holding is None:
            continue  # another rank's matrix: never stepped here
        if isinstance(holdings, Mapping):
            if _as_holding(holdings.get(saved_id)) != holding:
                lacking.append(name)
                continue
        elif dp is not None and saved_state and saved_id not in saved_state:
            lacking.append(name)
            continue
        if saved_id not in saved_state:
            continue
        entry = saved_state[saved_id]
        stepped = tuple(dp.full.shape) if dp is not None and dp.full is not None else None
        wrong = _unfit(entry, route, stepped or tuple(local_shard(param).shape))
        if wrong:
            misshapen.append(f"{name!r} ({wrong})")
        elif dp is not None:
            owned[param] = (dp, entry)
        else:
            state[saved_id] = entry
    if misshapen:
        _refuse_misshapen(misshapen)
    if lacking:
        _refuse_lacking(lacking, recorded)
    torch_part["state"] = state
    return torch_part, owned


def _refuse_misshapen(misshapen: Sequence[str]) -> NoReturn:
    """``split_for_load``'s refusal of states (``misshapen``: each parameter's name and what
    does not fit) that do not fit what this rank steps."""
    shown = ", ".join(misshapen[:4]) + (" ..." if len(misshapen) > 4 else "")
    raise ValueError(
        f"Muon.load_state_dict on rank {_rank()}: the state of {len(misshapen)} "
        f"parameter(s) does not fit what this rank steps: {shown}. A dictionary of "
        "another topology (world size, mesh or tensor parallelism) has another shape than "
        "this rank steps: optimizer.state_dict() only loads where it was saved. Across "
        "topologies save with dmuon.get_optimizer_state_dict(model, optimizer) and load "
        "with dmuon.set_optimizer_state_dict(model, optimizer, state_dict) (or DCP: "
        "dmuon.save_checkpoint / dmuon.load_checkpoint). Nothing was loaded"
    )


def _refuse_lacking(lacking: Sequence[str], recorded: Mapping[str, Any]) -> NoReturn:
    """``split_for_load``'s refusal of a dictionary without the state this rank steps for the
    parameters ``lacking``, naming the rank that saved it (from its ``recorded`` holdings)."""
    saver, size = recorded.get("rank"), recorded.get("world_size")
    source = "another rank" if saver is None else f"rank {saver}"
    if saver is not None and size is not None and size != _world_size():
        source += f" of {size} (this is rank {_rank()} of {_world_size()})"
    shown = ", ".join(repr(n) for n in lacking[:6]) + (" ..." if len(lacking) > 6 else "")
    raise ValueError(
        f"Muon.load_state_dict on rank {_rank()}: this optimizer state dict was saved on "
        f"{source} and does not hold the state this rank steps for {len(lacking)} "
        f"parameter(s): {shown}. optimizer.state_dict() holds only its own rank's state (a "
        "dedicated matrix's on its owner, an FSDP2 parameter's shard on its rank), so "
        "loading rank 0's dictionary on every rank would restart the others' parameters "
        "from fresh state. Save the full state with dmuon.get_optimizer_state_dict(model, "
        "optimizer) and load it with dmuon.set_optimizer_state_dict(model, optimizer, "
        "state_dict) (both collective: call them on every rank), or load each rank's own "
        "optimizer.state_dict() on that rank. Nothing was loaded"
    )


def install_dedicated_state(
    optimizer: torch.optim.Optimizer,
    owned: Mapping[Tensor, tuple[DedicatedParam, Mapping[str, Any]]],
) -> None:
    """Install the owned dedicated matrices' loaded state in their optimizer dtype on the
    master's device (the AdamW ``step`` as loaded, as torch keeps it)."""
    for param, (dp, entry) in owned.items():
        assert dp.full is not None and dp.precision is not None
        device, dtype = dp.full.device, dp.precision.optim
        optimizer.state[param] = {
            key: value.to(device=device, dtype=dtype if value.is_floating_point() else None)
            if isinstance(value, Tensor) and key != "step"
            else value
            for key, value in entry.items()
        }
