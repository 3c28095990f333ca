"""What the planner is told about a parameter (:class:`WorkItem`) and where it lands (:class:`Owner`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from ._checks import int_at_least
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
    ``matrices`` declares a split (``"muon"`` items only): the ``(count, rows, cols)`` stacks
    of the pieces its owner orthogonalises apart, which cover the weight once (see [Note:
    declared splits] in ``_split``); empty: the weight is orthogonalised whole.

    A ``"muon"`` item needs at least two dimensions; leading dimensions beyond the last two
    count as a batch of matrices, as the Newton–Schulz front end treats them.
    """

    name: str
    shape: tuple[int, ...]
    boundary: str
    route: Route = Route.MUON
    itemsize: int = 2
    tp: int = 1
    matrices: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"WorkItem.name must be a non-empty str, got {self.name!r}")
        who = f"WorkItem {self.name!r}"
        try:
            shape = tuple(self.shape)
        except TypeError:
            shape = None
        if shape is None or not all(int_at_least(d, 0) for d in shape):
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
            if not int_at_least(value, 1):
                raise ValueError(f"{who}: {field_name} must be an int >= 1, got {value!r}")
        self._check_matrices(who)

    def _check_matrices(self, who: str) -> None:
        try:
            stacks = tuple(tuple(stack) for stack in self.matrices)
        except TypeError:
            stacks = None
        if stacks is None or not all(
            len(stack) == 3 and all(int_at_least(d, 1) for d in stack) for stack in stacks
        ):
            raise ValueError(
                f"{who}: matrices must be (count, rows, cols) triples of ints >= 1, got "
                f"{self.matrices!r}"
            )
        object.__setattr__(self, "matrices", stacks)
        if not stacks:
            return
        if self.route is not Route.MUON:
            raise ValueError(
                f"{who}: matrices (a declared split) are what Muon orthogonalises, but its "
                f"route is {self.route.value!r}; drop them or route it to 'muon'"
            )
        covered = sum(math.prod(stack) for stack in stacks)
        if covered != self.numel:
            raise ValueError(
                f"{who}: its matrices {stacks} hold {covered} elements, but its shape "
                f"{self.shape} holds {self.numel}; the pieces of a split cover the weight once"
            )

    @property
    def stacks(self) -> tuple[tuple[int, ...], ...]:
        """The shapes whose optimizer work adds up to this item's: its pieces' stacks under a
        declared split, else its own shape."""
        return self.matrices or (self.shape,)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize
