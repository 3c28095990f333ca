"""Which dtype a dedicated parameter has where.

[Note: mixed precision]

A dedicated parameter has four dtypes (:class:`Precision`):

- ``master``: the owner's authoritative weight (``DedicatedParam.full``), the one the optimizer
  updates: the parameter's own dtype, or ``param_policy``'s ``master_dtype``;
- ``compute``: what is broadcast and what forward and backward read: ``param_policy``'s
  ``param_dtype``, else the ``param_dtype`` of the ``MixedPrecisionPolicy`` of the nearest
  ``fully_shard`` module that holds the parameter (its hook boundary's, or one applied to a
  module inside the boundary, which casts that module's inputs), else the master dtype;
- ``reduce``: what the gradient is summed in on its way to the owner (and then the dtype of
  ``DedicatedParam.grad``): ``grad_dtype``, else FSDP2's ``reduce_dtype``, else the compute
  dtype (FSDP2's own rule);
- ``optim``: the optimizer states (momentum, Adam moments): ``optim_dtype``, else the master
  dtype.

With ``compute == master`` the owner's pack buffer is its weight (no copy). Otherwise the
owner keeps the master apart and casts it into the pack buffer each time the boundary is
unsharded; the registered parameter points at the compute copy while it is unsharded and at
the master in between, so reading it on the owner outside forward gives the master, as
reading an FSDP2 parameter outside forward gives its sharded master. Peers only ever hold the
compute copy, for the span of their layer's forward and backward, so the broadcast moves
compute-dtype bytes (half of fp32's for bf16). On the replicated (DDP) path every rank keeps
the compute copy resident instead and the owner publishes it, cast from the new master, after
each step (see [Note: compute copies on the replicated path] in ``setup/_replicate``).

The optimizer steps the master. The gradient stays in the reduce dtype up to the step, as
``DedicatedParam.grad``; the AdamW step upcasts it to the master dtype first (once per step, as
FSDP2 upcasts its reduce-scattered gradient to the parameter's dtype; torch's fused AdamW takes
one dtype for weight and gradient), and the Muon momentum pass reads it as it is and computes
in the momentum's dtype.

[Note: accumulating in the reduce dtype]
Under ``no_sync`` (and a pipeline schedule, whose backwards run with gradient sync off) each
rank sums its micro-batches' local gradients before one reduce sends the sum. autograd adds
each backward's gradient into ``.grad``, in the compute dtype: with bf16 compute that rounds the
sum to bf16 at every micro-batch (1.5e-3 to 1.9e-3 relative for four micro-batches of the tiny
test model), while FSDP2 keeps its own unsharded sums in its ``reduce_dtype`` between unsynced
backwards (``FSDPParam.unsharded_accumulated_grad``). So the post-accumulate-grad hook of a
backward under ``no_sync`` replaces a local gradient whose dtype is narrower than the reduce
dtype with its cast (``DedicatedParam.widen_local_grad``), once per accumulation: the parameter
then takes a ``.grad`` of another dtype (``param.grad_dtype = None``, which also stops the
autograd engine casting an incoming gradient to the parameter's dtype; incoming gradients are
in the compute dtype anyway), and autograd adds each later micro-batch, the synced one too,
into that ``.grad`` in place, computing in the reduce dtype (``fp32 += bf16``: FSDP2's
arithmetic, no copy of the incoming gradient). The sum stays in ``.grad``, so whatever acts on
``.grad`` before the reduce still reaches it: a pipeline schedule's ``scale_grads`` divides
it, ``zero_grad`` drops it; the reduce takes it as it takes any local gradient (``pack_grads``
copies it into the reduce buffer, in the reduce dtype already, and drops it). The result is
the micro-batches' gradients summed in the reduce dtype one after the other, then over the
ranks: bit for bit what the reduces of synced micro-batches give where that arithmetic is
exact in the reduce dtype (bf16 gradients summed in fp32 usually are, and a division by a
power-of-two world size is), as FSDP2's own gradients are. Nothing changes
where the dtypes match (fp32 compute, the common case: no copy, no check beyond one dtype
comparison per gradient under ``no_sync``), nor where the reduce dtype is the narrower one (a
bf16 ``grad_dtype`` under fp32 compute: the sum stays fp32 until the reduce casts it, where
FSDP2 would accumulate in its bf16 ``reduce_dtype``). The cost: between the first backward
under ``no_sync`` and the reduce, every rank holds the local gradient of each dedicated matrix
in the reduce dtype rather than the compute dtype (4 instead of 2 bytes an element for bf16 and
fp32: the same as FSDP2's unsharded fp32 sums of its own parameters), and a cast holds both
dtypes of one gradient at a time.

The dtypes are resolved when the runtime packs its parameters (the first forward,
``Muon(...)`` or a checkpoint call, whichever comes first), because ``fully_shard`` and its
policy come after ``dedicate_params``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from dmuon_ownership import ResolvedPolicy

from .._torch_internals import fsdp_mp_policy

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = [
    "Precision",
    "fsdp_modules",
    "fsdp_modules_above",
    "mp_policy_above",
    "resolve_precision",
]


class Precision(NamedTuple):
    master: torch.dtype
    compute: torch.dtype
    reduce: torch.dtype
    optim: torch.dtype

    @property
    def mixed(self) -> bool:
        """Whether the owner keeps its master apart from the compute copy."""
        return self.compute != self.master


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def fsdp_modules(model: nn.Module) -> list[tuple[str, FSDPModule]]:
    """The modules of ``model`` that ``fully_shard`` was applied to, by name."""
    from torch.distributed.fsdp import FSDPModule

    return [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def fsdp_modules_above(
    lookup: Callable[[str], nn.Module | None], path: str
) -> Iterator[FSDPModule]:
    """The ``fully_shard`` modules at or above the module ``path``, nearest first (``lookup``
    finds a module by name)."""
    from torch.distributed.fsdp import FSDPModule

    parts = path.split(".") if path else []
    for depth in range(len(parts), -1, -1):
        module = lookup(".".join(parts[:depth]))
        if isinstance(module, FSDPModule):
            yield module


def mp_policy_above(modules: Mapping[str, nn.Module], path: str) -> Any:
    """The ``MixedPrecisionPolicy`` of the nearest ``fully_shard`` module at or above the
    module ``path`` (``None`` when there is none)."""
    nearest = next(fsdp_modules_above(modules.get, path), None)
    return None if nearest is None else fsdp_mp_policy(nearest)


def resolve_precision(param_dtype: torch.dtype, policy: ResolvedPolicy, mp: Any) -> Precision:
    """See [Note: mixed precision]."""
    master = _dtype(policy.master_dtype) or param_dtype
    fsdp_param = getattr(mp, "param_dtype", None)
    fsdp_reduce = getattr(mp, "reduce_dtype", None)
    compute = _dtype(policy.param_dtype) or fsdp_param or master
    reduce = _dtype(policy.grad_dtype) or fsdp_reduce or compute
    optim = _dtype(policy.optim_dtype) or master
    return Precision(master, compute, reduce, optim)
