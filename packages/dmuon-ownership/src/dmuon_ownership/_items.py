"""What the planner is told about a parameter (:class:`WorkItem`) and where it lands (:class:`Owner`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from ._route import Route, parse_route

__all__ = ["Owner", "WorkItem"]


class Owner(NamedTuple):
    """A coordinate on the shard × replicate grid; slot index = ``replicate * shard_size + shard``."""

    shard: int
    replicate: int


@dataclass(frozen=True)
class WorkItem:
    """One trainable parameter as the planner sees it.

    ``shape`` is the full (unsharded, and for tensor parallelism un-TP-sharded) shape: the owner
    runs the optimizer on the whole matrix. ``boundary`` names the module whose forward hooks
    issue this parameter's collectives. ``itemsize`` is bytes per element of the communicated
    dtype. ``tp`` is the tensor-parallel degree the parameter is sharded over (1: not TP).

    A ``"muon"`` item needs at least two dimensions; leading dimensions beyond the last two
    count as a batch of matrices, as the Newton–Schulz front end treats them.
    """

    name: str
    shape: tuple[int, ...]
    boundary: str
    route: Route = Route.MUON
    itemsize: int = 2
    tp: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"WorkItem.name must be a non-empty str, got {self.name!r}")
        who = f"WorkItem {self.name!r}"
        try:
            shape = tuple(self.shape)
        except TypeError:
            shape = None
        if shape is None or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise ValueError(
                f"{who}: shape must be a sequence of non-negative ints, got {self.shape!r}"
            )
        object.__setattr__(self, "shape", shape)
        if not isinstance(self.boundary, str):
            raise ValueError(
                f"{who}: boundary must be a str (the hook module's name), got {self.boundary!r}"
            )
        route = parse_route(self.route, f"{who}: route")
        object.__setattr__(self, "route", route)
        if route is Route.MUON and len(shape) < 2:
            raise ValueError(
                f"{who}: route 'muon' needs a matrix but shape is {shape}; "
                "route it to 'adamw' or 'sharded_adamw'"
            )
        for field_name in ("itemsize", "tp"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{who}: {field_name} must be an int >= 1, got {value!r}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize
