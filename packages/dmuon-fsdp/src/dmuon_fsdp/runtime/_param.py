"""One dedicated parameter: the ``nn.Parameter`` the module keeps, its owner and its storage.

[Note: storage of a dedicated parameter]

The module keeps its registered ``nn.Parameter`` object for the whole run (so
``named_parameters()``, ``state_dict()`` keys and parameter identity in the optimizer never
change). Only ``param.data`` is swapped, once, at setup: it becomes a view into the packed
buffer of its (boundary, owner) unit (see :mod:`._group`). On the sender of the unit (the
owner, and in HSDP every rank of the owner's shard column) that buffer always holds the
weight; everywhere else its storage is resized to zero between uses, so the parameter keeps
its full shape but holds no memory. Resizing the *storage* (not reassigning ``.data``) is
what lets autograd's saved tensors, which alias that storage, see the weight again when it is
re-broadcast before backward. ``param.data = view`` keeps the parameter's own version
counter, so writes into the buffer never bump the counter autograd checks on the parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dmuon_ownership import Owner, ResolvedPolicy, Route

from .._torch_internals import local_tensor
from ._precision import Precision

__all__ = ["DedicatedParam", "Role", "local_shard"]


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (the object it holds, so writing its ``.data`` reaches the
    DTensor), or ``t`` itself."""
    return local_tensor(t) if isinstance(t, DTensor) else t


class Role(StrEnum):
    """This rank's relation to a parameter."""

    OWNER = "owner"  # the global owner: authoritative weight, gradient, optimizer step
    REPLICA = "replica"  # HSDP: same shard column as the owner; keeps a published copy
    PEER = "peer"  # receives the weight for forward/backward, holds nothing in between


@dataclass(eq=False)
class DedicatedParam:
    """A parameter whose optimizer step runs only on its global owner.

    ``full`` is the owner's authoritative full weight, in the master dtype (the tensor the
    optimizer updates in place; ``None`` on other ranks); ``grad`` is the owner's averaged full
    gradient after a synced backward, in the reduce dtype (``None`` elsewhere and after
    ``zero_grad``). ``precision`` says which dtype is used where (see [Note: mixed precision]);
    it and ``full`` are set when the runtime packs its parameters.
    """

    fqn: str
    param: nn.Parameter
    module: nn.Module
    name: str  # attribute name on ``module``
    boundary: str  # FQN of the hook boundary module ("" for the root)
    owner: Owner
    role: Role
    route: Route
    policy: ResolvedPolicy = field(default_factory=ResolvedPolicy)
    precision: Precision | None = None
    offset: int = 0  # element offset inside the unit's packed buffer
    full: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    # Tensor parallelism: the dim the TP shards split (None: not tensor-parallel); the runtime
    # then moves and steps this rank's shard (see [Note: tensor-parallel grids] in _mesh).
    tp_dim: int | None = None
    # Names the parameter, its owner and this rank's role in errors (see _guard).
    where: str = ""
    shape: torch.Size = field(init=False)  # the full (global) shape
    local_shape: torch.Size = field(init=False)  # this rank's shard's (the full one without TP)
    dtype: torch.dtype = field(init=False)  # the master dtype

    def __post_init__(self) -> None:
        self.shape = self.param.shape
        self.local_shape = self.tensor.shape
        self.dtype = self.param.dtype

    @property
    def tensor(self) -> torch.Tensor:
        """What dmuon packs and steps: the parameter, or its local shard when it is a DTensor."""
        return local_shard(self.param)

    def local_grad(self) -> torch.Tensor | None:
        grad = self.param.grad
        return None if grad is None else local_shard(grad)

    @property
    def is_owner(self) -> bool:
        return self.role is Role.OWNER

    @property
    def numel(self) -> int:
        """Elements this rank packs (its TP shard's)."""
        return math.prod(self.local_shape)

    def __repr__(self) -> str:
        return (
            f"DedicatedParam({self.fqn!r}, shape={tuple(self.shape)}, owner={tuple(self.owner)}, "
            f"role={self.role.value}, route={self.route.value!r})"
        )
