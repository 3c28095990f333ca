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

[Note: stepping expert sources]
Under HSDP the plan may name an expert stack shard's *source* replica (see [Note: expert
sources] in dmuon_ownership): that replica steps it for all, every other replica of the shard
only advances its momentum (the same elementwise arithmetic, so the state stays identical) and
receives the updated shard in the source's broadcast after the post-update hooks. Replicas
stay bit-identical only if each replica that steps a matrix computes it exactly as the
others do, and an NS kernel may pick its algorithm by batch size: so under HSDP the stacks
every replica steps for itself form NS batches of their own (identical on every replica of a
shard), apart from the owned and sourced matrices, whose results reach the other replicas by
broadcast. A sourced stack must lie where the plan assumed (FSDP2 on dmuon's replicate x shard
mesh, ``Shard(0)`` over the shard axis); anything else is refused with the fix.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from dmuon_ownership import Route

from .._matrix import LrScaling, MatrixView
from .._torch_internals import dtensor_shard_offsets
from ..runtime._param import DedicatedParam, LocalMuonParam, check_expert_split
from ..runtime._runtime import DedicatedRuntime
from ..topology._mesh import MeshLayout
from ._muon_math import NSFunction, local_tensor, shape_batches
from ._tp_ns import TensorParallelNS, TPMode
from ._tp_ns import choose as choose_tp_mode

__all__ = ["AdamWEntry", "MuonEntry", "StepPlan", "WeightPart"]


class WeightPart(NamedTuple):
    """The part of one parameter that this rank steps (see [Note: the post-update hook]).

    Args:
        tensor: the values this rank updates: the owner's full master of a dedicated weight or
            its tensor-parallel shard, this rank's shard of an FSDP2 parameter, or a
            replicated parameter whole. A post-update hook may change it in place (never its
            shape or dtype); every rank's next forward reads the result.
        offsets: the index of ``tensor``'s first element in the full parameter, one int per
            dimension (all zeros for a whole weight).
        shape: the full parameter's shape.
    """

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
    # An expert stack shard stepped on one replica for all: that replica's global rank (see
    # [Note: stepping expert sources]); None: this rank steps its own.
    source: int | None = None
    # Whether every replica steps this matrix itself (an expert stack shard without a source),
    # so that its NS batch must be the same on every replica.
    replica_stepped: bool = False


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
                        self.muon.append(_stack_entry(group, name, p, local, lr_scaling, runtime))
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
        # empty shard of an expert stack runs nothing; a stack shard another replica steps
        # only advances its momentum here, then takes the source's broadcast.
        rank = runtime.layout.global_rank(runtime.layout.coord)
        stepped = [e for e in self.muon if e.matrices and e.source in (None, rank)]
        plain = [entry for entry in stepped if entry.tp_ns is None]
        self.batches = shape_batches(plain, _batch_key, _batch_size, ns_batch_bytes)
        self.momentum_only = [e for e in self.muon if e.matrices and e.source not in (None, rank)]
        self.sourced = [e for e in self.muon if e.matrices and e.source is not None]
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
    runtime: DedicatedRuntime,
) -> MuonEntry:
    """An expert stack: this rank's shard of it, as FSDP2 left it (see [Note: expert
    stacks]), and who steps it (see [Note: stepping expert sources])."""
    stack = local[id(p)]
    check_expert_split(stack.fqn, p)
    view = stack.view
    matrices = view.count(local_tensor(p).shape)
    layout = runtime.layout
    source = None
    if any(s.stack == stack.fqn for s in runtime.plan.expert_sources):
        _check_source_layout(stack.fqn, p, layout)
        replica = runtime.plan.expert_source(stack.fqn, layout.coord.shard)
        if replica is not None:
            source = layout.rank_of[replica][layout.coord.shard]
    return MuonEntry(
        group,
        p,
        fqn,
        view,
        view.lr_scale(lr_scaling),
        matrices,
        None,
        None,
        p.dtype,
        source=source,
        replica_stepped=layout.is_hsdp and source is None,
    )


def _check_source_layout(fqn: str, p: Tensor, layout: MeshLayout) -> None:
    """A stack with expert sources must be sharded by FSDP2 on dmuon's own replicate x shard
    mesh, as the plan assumed (see [Note: stepping expert sources])."""
    grid = [list(row) for row in layout.rank_of]
    ok = (
        isinstance(p, DTensor)
        and p.device_mesh.ndim == 2
        and p.device_mesh.mesh.tolist() == grid
        and p.placements == (Replicate(), Shard(0))
    )
    if not ok:
        where = (
            f"mesh {p.device_mesh.mesh.tolist()} with placements {p.placements}"
            if isinstance(p, DTensor)
            else "a plain tensor"
        )
        raise ValueError(
            f"expert stack {fqn!r} is {where}, but dmuon planned its experts over the HSDP "
            f"grid {grid} (replicate x shard), where one replica steps some expert shards for "
            "all; fully_shard the experts' module with the mesh whose 'shard' and 'replicate' "
            "dimensions dedicate_params was given (FSDP2's default Shard(0))"
        )


def _batch_key(entry: MuonEntry) -> Hashable:
    shape = entry.view.matrix_shape
    return shape, entry.state_dtype, entry.param.device, entry.replica_stepped


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
