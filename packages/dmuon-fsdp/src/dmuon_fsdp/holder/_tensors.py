"""What this rank holds of a tensor dmuon does not take over: a shard, or the whole tensor.

[Note: tensor views]
The parameters dmuon does not take over (FSDP2's shards, the replicated path's parameters), a
model's buffers, and the optimizer states laid out as them are either a ``DTensor``, of which
this rank holds a shard, or a plain tensor that every rank holds whole. :func:`tensor_view`
tells the two apart, once, and its view answers what the step, the diagnostics and the
checkpoints ask of such a tensor, as a holder answers for a parameter dmuon takes over (see
[Note: parameter holders] in :mod:`._holder`): what the AdamW step updates (the step view of a
parameter without a holder), the part a post-update hook sees, which state of it an optimizer
state dict holds, whether this rank's copy is the one a global sum counts, the whole tensor,
and a whole tensor written into it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from .._torch_internals import dtensor_shard_offsets, local_shard, local_tensor
from ..topology import MeshLayout
from ._holder import WeightPart
from ._precision import mp_policy_above

__all__ = ["ShardedTensor", "TensorView", "WholeTensor", "tensor_view"]


class TensorView:
    """What both views share: the step view of a parameter dmuon does not take over, which
    every rank steps where it is, in its own dtype."""

    steps_here = True
    optim_dtype: torch.dtype | None = None
    route: str  # how the diagnostics name a parameter of this view

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor

    def step_tensors(self) -> tuple[Tensor | None, Tensor | None]:
        return self.tensor, self.tensor.grad

    def clip_grad(self, layout: MeshLayout) -> tuple[tuple[Tensor, ...], bool] | None:
        """This rank's part of the gradient and whether another rank counts it (a copy: scaled,
        not counted; see [Note: global quantities] in ``topology/_comm``); ``None``: no
        gradient."""
        grad = self.tensor.grad
        if grad is None:
            return None
        return (local_shard(grad),), not (self.counts_once() and self.counted_in_grid(layout))

    def counted_in_grid(self, layout: MeshLayout) -> bool:
        """Whether this rank's TP grid counts it in a sum over every grid."""
        return True

    def counts_once(self) -> bool:
        """Whether this rank's copy is the one a global sum counts."""
        raise NotImplementedError

    @property
    def split_over_ranks(self) -> bool:
        """Whether ranks hold different parts of it, so its own norm needs a collective."""
        return False


class WholeTensor(TensorView):
    """A plain tensor, which every rank holds whole (the replicated path's parameters, one
    rank's, a buffer)."""

    route = "replicated"

    def weight_part(self, layout: MeshLayout | None = None) -> WeightPart:
        t = self.tensor
        return WeightPart(t.detach(), (0,) * t.dim(), tuple(t.shape))

    def holding(self) -> tuple[Any, ...]:
        """Which state of it an optimizer state dict holds: all of it, on every rank."""
        return ("whole",)

    def counts_once(self) -> bool:
        """Whether this rank's copy is the one a global sum counts: global rank 0's."""
        return not dist.is_initialized() or dist.get_rank() == 0

    def mesh_dims(self) -> list[tuple[str, Placement]]:
        """Each mesh dim that lays the tensor out, by name, and how."""
        return []

    def mp_policy(self, modules: Mapping[str, nn.Module], fqn: str) -> Any:
        """The ``MixedPrecisionPolicy`` FSDP2 applies to the parameter ``fqn`` (none)."""
        return None

    def gathered(self) -> tuple[Tensor, bool]:
        """The whole tensor, and whether it is a new one (else the tensor itself)."""
        return self.tensor, False

    def like(self, full: Tensor) -> Tensor:
        """A new tensor laid out as this one (its device and dtype) holding ``full``."""
        t = self.tensor
        return full.detach().to(device=t.device, dtype=t.dtype).clone()

    def write(self, full: Tensor) -> None:
        """Write the whole tensor ``full`` into this one (this rank's part of it)."""
        self.tensor.copy_(full)

    def receives_in_place(self, device: torch.device) -> bool:
        """Whether a collective on ``device`` can write the whole tensor straight into it."""
        return self.tensor.is_contiguous() and self.tensor.device == device


class ShardedTensor(TensorView):
    """A ``DTensor`` (an FSDP2 parameter, or a state laid out as one), of which this rank
    holds a shard."""

    route = "fsdp2"
    tensor: DTensor

    def counted_in_grid(self, layout: MeshLayout) -> bool:
        """A tensor laid out without the TP mesh dim (a norm, the embedding of a
        tensor-parallel model) is kept by every TP grid alike: grid 0 counts it."""
        if layout.tp_mesh is None or layout.tp_index == 0:
            return True
        names = self.tensor.device_mesh.mesh_dim_names or ()
        return any(name in names for name in layout.tp_mesh.mesh_dim_names or ())

    @property
    def split_over_ranks(self) -> bool:
        t = self.tensor
        return any(p.is_shard() and t.device_mesh.size(i) > 1 for i, p in enumerate(t.placements))

    def weight_part(self, layout: MeshLayout | None = None) -> WeightPart:
        t = self.tensor
        return WeightPart(local_tensor(t).detach(), dtensor_shard_offsets(t), tuple(t.shape))

    def holding(self) -> tuple[Any, ...]:
        """This rank's coordinate on the mesh dims that shard it, and their sizes: the same
        coordinate on a mesh of another size holds other rows."""
        t = self.tensor
        mesh = t.device_mesh
        coordinate = tuple(mesh.get_coordinate() or ())
        dims = [i for i, p in enumerate(t.placements) if p.is_shard()]
        return ("shard", *(coordinate[i] for i in dims), "of", *(mesh.size(i) for i in dims))

    def counts_once(self) -> bool:
        """On every mesh dim that replicates it this rank is the first."""
        t = self.tensor
        coordinate = t.device_mesh.get_coordinate()
        assert coordinate is not None, "a DTensor on a mesh this rank is not part of"
        return all(c == 0 for c, p in zip(coordinate, t.placements) if p.is_replicate())

    def mesh_dims(self) -> list[tuple[str, Placement]]:
        mesh = self.tensor.device_mesh
        names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
        return list(zip(names, self.tensor.placements))

    def mp_policy(self, modules: Mapping[str, nn.Module], fqn: str) -> Any:
        """That of the nearest ``fully_shard`` module above the parameter ``fqn``."""
        return mp_policy_above(modules, fqn.rpartition(".")[0])

    def gathered(self) -> tuple[Tensor, bool]:
        """All shards gathered (collective over its mesh)."""
        t = self.tensor
        full = t.full_tensor()
        return full, not _may_alias(full, local_tensor(t))

    def like(self, full: Tensor) -> DTensor:
        """A ``DTensor`` on this one's mesh and placements holding this rank's shard of
        ``full`` (no communication)."""
        t = self.tensor
        value = full.detach().to(device=t.device, dtype=t.dtype)
        return distribute_tensor(value, t.device_mesh, t.placements, src_data_rank=None)

    def write(self, full: Tensor) -> None:
        local_tensor(self.tensor).copy_(local_tensor(self.like(full)))

    def receives_in_place(self, device: torch.device) -> bool:
        return False


def _may_alias(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` may share ``b``'s memory (then a caller that keeps ``a`` copies it). A
    tensor subclass may have no storage of its own to compare (torchao's float8 weight,
    ``WeightWithDynamicFloat8CastTensor``, an FSDP2 local tensor under
    ``enable_fsdp_float8_all_gather=True``, raises on ``untyped_storage()``): it may."""
    if any(type(x) not in (Tensor, nn.Parameter) for x in (a, b)):
        return True
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def tensor_view(t: Tensor) -> WholeTensor | ShardedTensor:
    """What this rank holds of ``t`` (see [Note: tensor views])."""
    return ShardedTensor(t) if isinstance(t, DTensor) else WholeTensor(t)
