"""What one ``Muon.step`` touches, worked out once: the owned Muon matrices with their views,
shape batches and tensor-parallel NS, and the tensors each AdamW group steps.

[Note: the step plan]
Which matrices a rank steps, how they are batched for Newton–Schulz, and how a
tensor-parallel matrix is orthogonalised depend only on the owner plan, the param groups and
the packing, all fixed once ``Muon(model)`` is built (it finishes the runtime's packing
first). So :class:`StepPlan` is built once, in the optimizer's constructor, and a step only
reads what changes every step: the gradients (a matrix without one this step drops out of its
batch), the hyperparameters of its group (a scheduler may change them) and the optimizer
state, created on first use. The tensors themselves are read through their
``DedicatedParam`` at each step, so nothing here goes stale when a checkpoint load writes
into them.

[Note: the post-update hook]
``Muon.register_post_update_hook(hook)`` runs ``hook(optimizer, parts)`` on every rank inside
``step()``, after Muon and AdamW have updated the weights this rank steps and before the
runtime publishes them (HSDP replicas, the replicated path's peers) or drops the copies
peers keep (Z2). ``parts`` maps the FQN of every parameter this rank steps to a
:class:`WeightPart`: the tensor it updates in place (the owner's full master of a dedicated
matrix, this rank's TP shard of it, the local shard of an FSDP2 parameter, a replicated
parameter whole) and where that part sits in the full parameter. A hook that changes a part in
place changes what every rank computes with from the next forward on: dedicated weights reach
peers through the next broadcast and replicas through the publish that follows the hook, and
FSDP2 shards through FSDP2's own all-gather. Peers never see the weight as it was between the
update and the hook. A hook must treat every rank's parts alike (it runs on every rank, with
the parts that rank holds, possibly none), may issue collectives that every rank issues, and
must not change shapes or dtypes. QK-clip is its first user.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from dmuon_ownership import Route

from .._matrix import LrScaling, MatrixView
from .._torch_internals import dtensor_shard_offsets
from ..runtime._param import DedicatedParam, LocalMuonParam, check_expert_split
from ..runtime._runtime import DedicatedRuntime
from ._muon_math import NSFunction, local_tensor, shape_batches
from ._tp_ns import TensorParallelNS, TPMode
from ._tp_ns import choose as choose_tp_mode

__all__ = ["AdamWEntry", "MuonEntry", "StepPlan", "WeightPart"]


class WeightPart(NamedTuple):
    """The part of one parameter that this rank steps (see [Note: the post-update hook])."""

    tensor: Tensor  # the values this rank updates, changed in place by a hook
    offsets: tuple[int, ...]  # index of tensor's first element in the full parameter, per dim
    shape: tuple[int, ...]  # the full parameter's shape


class MuonEntry(NamedTuple):
    """One Muon parameter this rank steps: the key of its optimizer state, its FQN, its view,
    the learning-rate scale of its matrices, how many matrices this rank holds, its runtime
    record (``None``: an expert stack stepped where FSDP2 holds it, see [Note: expert stacks]
    in ``runtime/_param``), its tensor-parallel NS (``None``: held whole) and the dtype of its
    momentum."""

    group: dict[str, Any]
    param: Tensor
    fqn: str
    view: MatrixView
    scale: float
    matrices: int
    dp: DedicatedParam | None
    tp_ns: TensorParallelNS | None
    state_dtype: torch.dtype


class AdamWEntry(NamedTuple):
    """One parameter an AdamW group steps on this rank (``dp``: a dedicated weight, which
    its owner steps through ``dp.full``; ``None``: an FSDP2 or replicated parameter)."""

    param: Tensor
    dp: DedicatedParam | None


class StepPlan:
    """See [Note: the step plan]."""

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        dedicated: Mapping[int, DedicatedParam],
        local: Mapping[int, LocalMuonParam],
        runtime: DedicatedRuntime,
        ns: NSFunction,
        *,
        lr_scaling: LrScaling,
        ns_batch_bytes: int | None,
        tp_ns: TPMode,
    ) -> None:
        self.muon: list[MuonEntry] = []
        self.adamw: list[tuple[dict[str, Any], list[AdamWEntry]]] = []
        for group in param_groups:
            if group["optimizer"] == Route.MUON:
                for name, p in zip(group["param_names"], group["params"]):
                    dp = dedicated.get(id(p))
                    if dp is None:
                        self.muon.append(_stack_entry(group, name, p, local, lr_scaling))
                    elif dp.is_owner:
                        self.muon.append(_owned_entry(group, dp, runtime, ns, lr_scaling, tp_ns))
            elif group["optimizer"] == Route.ADAMW:
                entries = []
                for p in group["params"]:
                    dp = dedicated.get(id(p))
                    if dp is None or dp.is_owner:
                        entries.append(AdamWEntry(p, dp))
                self.adamw.append((group, entries))
        # Same-shape matrices share an NS call; a tensor-parallel matrix runs on its own; an
        # empty shard of an expert stack runs nothing.
        plain = [entry for entry in self.muon if entry.tp_ns is None and entry.matrices]
        self.batches = shape_batches(plain, _batch_key, _batch_size, ns_batch_bytes)
        self.tensor_parallel = [entry for entry in self.muon if entry.tp_ns is not None]
        self._names = {
            id(p): name
            for group in param_groups
            for name, p in zip(group["param_names"], group["params"])
        }
        self._parts: dict[str, WeightPart] | None = None

    def weight_parts(self, runtime: DedicatedRuntime) -> dict[str, WeightPart]:
        """Every part of a parameter this rank steps, by FQN (built at the first call)."""
        if self._parts is None:
            parts: dict[str, WeightPart] = {}
            for entry in self.muon:
                dp = entry.dp
                parts[entry.fqn] = _dedicated_part(dp, runtime) if dp else _local_part(entry.param)
            for _, entries in self.adamw:
                for p, dp in entries:
                    name = self._names[id(p)]
                    parts[name] = _dedicated_part(dp, runtime) if dp else _local_part(p)
            self._parts = parts
        return self._parts


def _owned_entry(
    group: dict[str, Any],
    dp: DedicatedParam,
    runtime: DedicatedRuntime,
    ns: NSFunction,
    lr_scaling: LrScaling,
    tp_ns: TPMode,
) -> MuonEntry:
    assert dp.precision is not None, f"{dp.fqn}: the runtime has not packed its parameters"
    view = MatrixView.of(dp.shape, dp.fqn)
    tp = _tensor_parallel_ns(dp, runtime, ns, tp_ns)
    scale = view.lr_scale(lr_scaling)
    return MuonEntry(group, dp.param, dp.fqn, view, scale, 1, dp, tp, dp.precision.optim)


def _stack_entry(
    group: dict[str, Any],
    fqn: str,
    p: Tensor,
    local: Mapping[int, LocalMuonParam],
    lr_scaling: LrScaling,
) -> MuonEntry:
    """An expert stack: this rank's shard of it, as FSDP2 left it (see [Note: expert
    stacks])."""
    stack = local[id(p)]
    check_expert_split(stack.fqn, p)
    view = stack.view
    matrices = view.count(local_tensor(p).shape)
    return MuonEntry(group, p, fqn, view, view.lr_scale(lr_scaling), matrices, None, None, p.dtype)


def _batch_key(entry: MuonEntry) -> Hashable:
    return entry.view.matrix_shape, entry.state_dtype, entry.param.device


def _batch_size(entry: MuonEntry) -> tuple[int, int]:
    rows, cols = entry.view.matrix_shape
    itemsize = torch.empty((), dtype=entry.state_dtype).element_size()
    return entry.matrices, rows * cols * itemsize


def _tensor_parallel_ns(
    dp: DedicatedParam, runtime: DedicatedRuntime, ns: NSFunction, mode: TPMode
) -> TensorParallelNS | None:
    if dp.tp_dim is None:
        return None
    comm = runtime.comm_ctx
    assert comm.tp_group is not None
    shape = MatrixView.of(dp.shape, dp.fqn).matrix_shape
    owner = runtime.layout.tp_ranks(dp.owner)[runtime.plan.tp_owner_of(dp.fqn)]
    return TensorParallelNS(
        ns,
        shape=shape,
        tp_dim=dp.tp_dim,
        mode=choose_tp_mode(mode, shape, dp.tp_dim, ns),
        group=comm.tp_group,
        tp_owner=owner,
        counter=comm.counter,
    )


def _dedicated_part(dp: DedicatedParam, runtime: DedicatedRuntime) -> WeightPart:
    """The owner's master of ``dp``: whole, or its TP shard at this rank's TP index."""
    assert dp.full is not None, f"{dp.fqn}: the owner holds no full weight"
    offsets = [0] * len(dp.shape)
    if dp.tp_dim is not None:
        offsets[dp.tp_dim] = runtime.layout.tp_index * int(dp.local_shape[dp.tp_dim])
    return WeightPart(dp.full, tuple(offsets), tuple(dp.shape))


def _local_part(p: Tensor) -> WeightPart:
    """This rank's shard of an FSDP2 (or other DTensor) parameter, or a plain one whole."""
    if not isinstance(p, DTensor):
        return WeightPart(p.detach(), (0,) * p.dim(), tuple(p.shape))
    return WeightPart(local_tensor(p).detach(), dtensor_shard_offsets(p), tuple(p.shape))
