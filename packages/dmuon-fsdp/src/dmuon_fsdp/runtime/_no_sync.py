"""``no_sync``: gradient accumulation without communication, for dmuon and FSDP2 together.

Inside the context dmuon issues no gradient reduce: every rank keeps accumulating its local
gradient in ``param.grad``, in the reduce dtype where that is wider than the compute dtype (see
[Note: accumulating in the reduce dtype] in holder/_precision; Z2 also keeps its broadcast
weights, so later micro-batches do not broadcast again), and FSDP2 modules of the model skip their reduce-scatter
(``set_requires_gradient_sync(False)``). The first backward after the context reduces the
accumulated sum, so k micro-batches under ``no_sync`` plus one synced micro-batch give the
gradient of their union (the mean over micro-batches if each loss is divided by k + 1).

[Note: FSDP2's gradient sync]
An FSDP2 user turns reduces off with ``model.set_requires_gradient_sync(False)`` on the root,
which recurses into every ``fully_shard`` module; accelerate's ``no_sync`` and the Hugging Face
``Trainer`` do the same for a model sharded with FSDP2. dmuon follows that flag too: a backward
that starts while FSDP2's gradient sync is off on every parameter group of the model reduces
no dedicated gradient either, exactly as inside ``no_sync``. The flags are read once per
backward, at its first hook, so every rank (which sets them at the same point of its loop)
decides alike. Sync off on some modules only (``recurse=False``), or HSDP's
``set_requires_all_reduce(False)`` alone (reduce-scatter but no all-reduce across replicas),
leaves dmuon reducing in full, which costs traffic, never correctness.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from .._torch_internals import fsdp_gradient_sync
from ..holder import fsdp_modules
from ._runtime import get_runtime

__all__ = ["no_sync"]


@contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Skip gradient synchronisation for the backward passes run inside the context; on exit
    dmuon's and FSDP2's flags are as the context found them (it nests, also in FSDP2's own
    ``set_requires_gradient_sync(False)``).

    Args:
        model: the model given to ``dedicate_params`` (that object; another raises
            ``ValueError``): its dedicated parameters and every ``fully_shard`` module in it
            skip their gradient reduce until the context exits.
    """
    runtime = get_runtime(model)
    # Each flag as found, restored on exit: a no_sync nested in another, or entered while
    # FSDP2's own sync is off, leaves the outer one in force.
    sharded = [(module, fsdp_gradient_sync(module)) for _, module in fsdp_modules(model)]
    previous = runtime.requires_gradient_sync
    runtime.set_requires_gradient_sync(False)
    for module, _ in sharded:
        module.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        runtime.set_requires_gradient_sync(previous)
        for module, synced in sharded:
            module.set_requires_gradient_sync(synced, recurse=False)
