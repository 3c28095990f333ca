"""``replicate``: the other half of the replicated (DDP) path.

[Note: the replicated path]

Smaller runs replicate the model on every rank, as ``DistributedDataParallel`` does, instead of
sharding it. dmuon's version keeps that memory model and still runs Newton–Schulz once per
matrix in the world:

- ``dedicate_params_ddp(model, mesh, predicate)`` gives each selected matrix an owner, as
  ``dedicate_params`` does, but every rank keeps every weight whole: nothing is broadcast before
  forward, nothing is freed after it;
- after backward, each dedicated gradient is reduced (summed) to its owner, which divides once
  by the world size, exactly as on the sharded path;
- ``replicate(model, mesh)`` takes every other trainable parameter: its gradient is all-reduced
  and averaged on every rank, and every rank steps it with AdamW, as DDP would;
- after ``step()`` each owner broadcasts its updated matrices to the shard group (waited at the
  boundary's next forward with ``replicate_async``, at once without; a read of a parameter
  before then waits for it, see [Note: reads before a publish lands]).

Per step the shard group carries each Muon element once in the reduce and once in the
broadcast: ``2(N−1)/N·P_M`` per rank, the all-reduce bound DDP pays for the same matrices,
while NS runs once per matrix, not on every rank. At setup every replicated parameter and
buffer is broadcast from rank 0 (as DDP does), and each owner's dedicated weights to everyone.
``no_sync`` skips both the reduces and the all-reduces.

[Note: compute copies on the replicated path]

``param_policy`` dtypes apply as on the sharded path (see [Note: mixed precision]). With a
compute dtype below the master (``param_dtype="bfloat16"``, ``master_dtype="float32"``) every
rank keeps the compute copy, resident, for forward and backward, and the parameter reads as it
on every rank, so ``model.state_dict()`` is the same everywhere; the owner keeps the master
apart, steps it, and publishes the compute copy cast from it. ``dmuon.get_model_state_dict``
gives the masters. ``model.load_state_dict`` writes the masters too: each module that holds a
dedicated parameter has a load pre-hook that copies the loaded value into its owner's master
before torch copies it into the compute copy (otherwise the next step would step the old master
and publish it over the load). Other in-place writes into the compute copy reach the master at
the next step (see [Note: writes into a resident compute copy] in ``runtime/_runtime``).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from .._torch_internals import local_shard
from ..holder import DedicatedParam, is_dedicated
from ..runtime import get_runtime
from ..topology import MeshLayout

__all__ = ["broadcast_from_first_rank", "replicate", "replicate_tp"]


def replicate(model: nn.Module, mesh: DeviceMesh) -> None:
    """Replicate the parameters of ``model`` that ``dedicate_params_ddp`` left (see [Note: the
    replicated path]): broadcast them and the buffers from rank 0, and average their gradients
    over ``mesh`` after each synced backward. Call it after ``dedicate_params_ddp`` and before
    ``Muon(model)``; on a tensor-parallel model ``mesh`` is the data-parallel dimension of the
    (dp, tp) mesh (TP shards are recognised by their DTensor placements). Collective.

    Args:
        model: the model :func:`dedicate_params_ddp` was called on, materialised (one still
            on the meta device raises ``ValueError``: ``to_empty`` first); a model dedicated
            with :func:`dedicate_params` raises ``ValueError``, a second call
            ``RuntimeError``.
        mesh: the 1-D ``DeviceMesh`` given to :func:`dedicate_params_ddp` (the same ranks;
            otherwise ``ValueError``).
    """
    runtime = get_runtime(model)
    if not runtime.config.replicated:
        raise ValueError(
            "replicate() is the replicated (DDP) path's other half: call "
            "dmuon.dedicate_params_ddp(model, mesh, predicate) first; a model dedicated with "
            "dedicate_params is sharded with fully_shard instead"
        )
    if runtime.replicated_params:
        raise RuntimeError("replicate() was already called on this model; call it once")
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError(
            f"replicate() takes the 1-D data-parallel mesh given to dedicate_params_ddp, got "
            f"{mesh!r}"
        )
    # The ranks, not the size: with tensor parallelism mesh['tp'] has as many as mesh['dp'].
    ranks = tuple(sorted(int(r) for r in mesh.mesh.flatten().tolist()))
    grid = tuple(sorted(rank for row in runtime.layout.rank_of for rank in row))
    if ranks != grid:
        raise ValueError(
            f"replicate(): the mesh holds ranks {ranks} but dedicate_params_ddp's grid holds "
            f"ranks {grid}; pass the same mesh (with tensor parallelism its data-parallel "
            "dimension, mesh['dp'], not mesh['tp'])"
        )
    params = [p for p in model.parameters() if p.requires_grad and not is_dedicated(p)]
    on_meta = [
        name
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if t.is_meta and not is_dedicated(t)
    ]
    if on_meta:
        # to_empty would then replace the parameters replicate took: none would be synced.
        raise ValueError(
            f"replicate(): {on_meta[0]!r} is still on the meta device; replicate broadcasts "
            "rank 0's values, so call it after model.to_empty(device=...) and the "
            "initialisation or load, as DistributedDataParallel is built: dedicate_params_ddp "
            "-> to_empty -> init -> replicate -> Muon(model)"
        )
    taken = {id(p) for p in params} | {id(dp.param) for dp in runtime.params}
    for module in model.modules():  # before every other load hook: see _refuse_assign
        module.register_load_state_dict_pre_hook(functools.partial(_refuse_assign, taken))
    broadcast_from_first_rank([*params, *model.buffers()], runtime.layout, runtime.world_group)
    runtime.replicate(params)
    held: dict[nn.Module, list[DedicatedParam]] = {}
    for dp in runtime.params:
        held.setdefault(dp.module, []).append(dp)
    for module, dps in held.items():
        module.register_load_state_dict_pre_hook(functools.partial(_load_masters, dps))
        module.register_load_state_dict_post_hook(functools.partial(_loaded, dps))


def broadcast_from_first_rank(
    tensors: Iterable[Tensor], layout: MeshLayout, group: ProcessGroup
) -> None:
    """Give every rank of the grid (``group``) the values of ``tensors`` that the grid's first
    rank holds, as ``DistributedDataParallel`` does when it is built: global rank 0 on a 1-D
    mesh; of a tensor-parallel shard, its own grid's copies. Nothing on a grid of one rank."""
    if layout.world_size == 1:
        return
    source = layout.rank_of[0][0]
    with torch.no_grad():
        for tensor in tensors:
            dist.broadcast(local_shard(tensor).detach(), src=source, group=group)


def _refuse_assign(
    taken: set[int],
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    *_: Any,
) -> None:
    """Refuse ``load_state_dict(..., assign=True)`` with a value for a parameter dmuon took
    (``taken``: their ids).

    [Note: loads that replace parameters]
    ``assign=True`` makes torch put each loaded tensor in its module as a new parameter
    instead of copying it into the old one. On the replicated path every rank holds every
    weight, so torch's load goes on, and the run trained on without a word while nothing
    reached the new parameters: dmuon's runtime reduces, steps and publishes the old objects,
    and ``dmuon.Muon`` keys its state by them (over three more steps a dedicated matrix never
    moved and the loss rose: 3.450, 3.460, 3.482 against 3.450, 3.437, 3.436 without
    ``assign``). Every module carries this pre-hook, so the module ``load_state_dict`` was
    called on raises first, before anything is loaded; ``model.load_state_dict(state_dict)``
    copies the values into the parameters (and the masters)."""
    if not local_metadata.get("assign_to_params_buffers", False):
        return
    for name, param in module.named_parameters(remove_duplicate=False):
        if prefix + name in state_dict and id(param) in taken:
            raise RuntimeError(
                f"load_state_dict(..., assign=True) would replace {prefix + name!r} by a new "
                "parameter, which dmuon's runtime and dmuon.Muon do not know: it would never "
                "be reduced, stepped or published again. Nothing was loaded. Call "
                "model.load_state_dict(state_dict) without assign (it copies the values into "
                "the parameters), or dmuon.set_model_state_dict(model, state_dict)"
            )


def _load_masters(
    dps: list[DedicatedParam], module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any
) -> None:
    """Copy the loaded values of ``dps`` into their owner's masters, where those are kept
    apart from the compute copy (see [Note: compute copies on the replicated path]). A value of
    another shape is left to torch, which reports it."""
    with torch.no_grad():
        for dp in dps:
            value = state_dict.get(prefix + dp.name)
            master = dp.full
            if master is None or dp.precision is None or not dp.precision.mixed:
                continue
            # A write into the copy before the load, where the load leaves it (strict=False).
            dp.adopt_written_copy()
            if isinstance(value, Tensor) and local_shard(value).shape == master.shape:
                master.copy_(local_shard(value))


def _loaded(dps: list[DedicatedParam], module: nn.Module, incompatible_keys: Any) -> None:
    """After torch copied the loaded values into the compute copies: they match the masters
    (see [Note: writes into a resident compute copy] in ``runtime/_runtime``)."""
    for dp in dps:
        if dp.full is not None and dp.precision is not None and dp.precision.mixed:
            dp.copy_matches_master()


def replicate_tp(model: nn.Module, mesh: DeviceMesh) -> None:
    """Deprecated: :func:`replicate` under another name (it recognises tensor-parallel
    parameters by their DTensor placements). Warns, then calls it."""
    warnings.warn(
        "dmuon.replicate_tp is deprecated and will be removed: call "
        "dmuon.replicate(model, mesh['dp']), the same function",
        DeprecationWarning,
        stacklevel=2,
    )
    replicate(model, mesh)
