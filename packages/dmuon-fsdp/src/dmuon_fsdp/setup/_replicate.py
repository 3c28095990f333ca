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
  boundary's next forward with ``replicate_async``, at once without).

Per step the shard group carries each Muon element once in the reduce and once in the
broadcast: ``2(N−1)/N·P_M`` per rank, the all-reduce bound DDP pays for the same matrices,
while NS runs once per matrix, not on every rank. At setup every replicated parameter and
buffer is broadcast from rank 0 (as DDP does), and each owner's dedicated weights to everyone.
``no_sync`` skips both the reduces and the all-reduces.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..runtime._guard import is_dedicated
from ..runtime._param import local_shard
from ..runtime._runtime import get_runtime

__all__ = ["replicate", "replicate_tp"]


def replicate(model: nn.Module, mesh: DeviceMesh) -> None:
    """Replicate the parameters of ``model`` that ``dedicate_params_ddp`` left (see [Note: the
    replicated path]): broadcast them and the buffers from rank 0, and average their gradients
    over ``mesh`` after each synced backward. Call it after ``dedicate_params_ddp`` and before
    ``Muon(model)``; on a tensor-parallel model ``mesh`` is the data-parallel dimension of the
    (dp, tp) mesh (TP shards are recognised by their DTensor placements). Collective."""
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
    if mesh.size() != runtime.layout.world_size:
        raise ValueError(
            f"replicate(): the mesh has {mesh.size()} ranks but dedicate_params_ddp's has "
            f"{runtime.layout.world_size}; pass the same mesh"
        )
    params = [p for p in model.parameters() if p.requires_grad and not is_dedicated(p)]
    source = runtime.layout.rank_of[0][0]  # the grid's first rank, global rank 0 on a 1-D mesh
    if runtime.layout.world_size > 1:
        with torch.no_grad():
            for tensor in [*params, *model.buffers()]:
                local = local_shard(tensor).detach()  # a TP shard: its grid's copies
                dist.broadcast(local, src=source, group=runtime.world_group)
    runtime.replicate(params)


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
