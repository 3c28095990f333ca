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
from torch.distributed.tensor import DTensor, Shard

from dmuon_ownership import Owner, ResolvedPolicy, Route

from .._matrix import MatrixView
from .._torch_internals import local_tensor
from ._precision import Precision

__all__ = [
    "DedicatedParam",
    "LocalMuonParam",
    "Role",
    "check_expert_split",
    "counts_once",
    "local_shard",
]


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
    # Whether a backward since the last reduce gave this rank a local gradient (see [Note: a
    # parameter without a gradient] in _collectives).
    saw_grad: bool = False
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


@dataclass(eq=False)
class LocalMuonParam:
    """A Muon expert stack that stays where FSDP2 (and expert parallelism) puts it.

    [Note: expert stacks]
    A 3-D expert stack ``(E, out, in)`` selected for the Muon route is not dedicated: FSDP2
    shards it on dim 0 (its default placement), so after its reduce-scatter every rank holds
    the complete, averaged gradients of whole experts, and steps them where they are: momentum
    on its shard, its experts' matrices in the NS batches of their shape, the update on its
    shard, and FSDP2's next all-gather publishes them. No dmuon broadcast or reduce moves a
    byte of them. ``torch.chunk`` decides which experts a rank holds (``E % N != 0`` and
    ``E < N`` leave some ranks with fewer or none: an empty shard steps nothing). Expert
    parallelism (a DTensor sharded on dim 0 by an EP mesh, then by FSDP2) is the same. Every
    mesh dim that does not shard dim 0 must replicate it (HSDP replicas each step their
    identical shard, which stays identical); a stack split on another dim (FSDP2 ``Shard(1)``,
    experts split by tensor parallelism) cannot be stepped per expert and is refused with the
    fix. FSDP2 replaces the parameter object, so the stack is found through its module.
    """

    fqn: str
    module: nn.Module
    name: str  # attribute name on ``module``
    view: MatrixView
    policy: ResolvedPolicy = field(default_factory=ResolvedPolicy)
    route: Route = Route.MUON
    shape: torch.Size = field(init=False)

    def __post_init__(self) -> None:
        self.shape = self.param.shape

    @property
    def param(self) -> nn.Parameter:
        """The parameter the module holds now (FSDP2's DTensor after ``fully_shard``)."""
        param = self.module._parameters[self.name]
        assert param is not None, f"{self.fqn} was removed from its module"
        return param


def check_expert_split(fqn: str, param: torch.Tensor) -> None:
    """Raise unless ``param``, an expert stack, can be stepped per expert where it lies: every
    mesh dim must shard its dim 0 or replicate it (see [Note: expert stacks])."""
    if not isinstance(param, DTensor):
        return
    mesh = param.device_mesh
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    bad = [
        (name, placement)
        for name, placement in zip(names, param.placements)
        if isinstance(placement, Shard) and placement.dim % param.ndim != 0
    ]
    if not bad:
        return
    where = ", ".join(f"{p} on mesh dim {name!r}" for name, p in bad)
    raise ValueError(
        f"expert stack {fqn!r} (shape {tuple(param.shape)}) is split by {where}, which cuts "
        "every expert; Muon steps whole experts where they lie: shard it on dim 0 (FSDP2's "
        "default; with torchtitan-style meshes pass fully_shard(..., shard_placement_fn="
        "lambda p: Shard(0)) for the experts), or leave it out of the predicate"
    )


def counts_once(param: torch.Tensor) -> bool:
    """Whether this rank's shard of ``param`` is the one copy to count in a global sum (a norm):
    on every mesh dim that replicates it this rank is the first, and a plain tensor (the
    replicated path, or one rank) counts on global rank 0."""
    if not isinstance(param, DTensor):
        return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    coordinate = param.device_mesh.get_coordinate()
    assert coordinate is not None, "a DTensor on a mesh this rank is not part of"
    return all(c == 0 for c, p in zip(coordinate, param.placements) if p.is_replicate())
