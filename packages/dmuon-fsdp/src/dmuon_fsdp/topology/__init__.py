"""Where the ranks are and how they talk: the data-parallel grid (1-D, HSDP, one grid per
tensor-parallel index) and the comm context (process groups, streams, byte counter)."""

from ._comm import Axis, CommCounter, CommKind, DedicatedCommContext, ProcessGroupPolicy
from ._mesh import MeshLayout, all_gather_numbers, resolve_layout

__all__ = [
    "Axis",
    "CommCounter",
    "CommKind",
    "DedicatedCommContext",
    "MeshLayout",
    "ProcessGroupPolicy",
    "all_gather_numbers",
    "resolve_layout",
]
