"""Reads and writes of a published weight between a step and the publish wait for that publish.

[Note: reads before a publish lands]

After ``step()`` each owner publishes its updated weights to the ranks that keep a copy: every
rank of the shard group on the replicated (DDP) path, the owner's shard column in HSDP. The
publish is asynchronous by default (``replicate_async``) and each boundary's next forward waits
for it, so it overlaps with whatever runs before that layer. Until then a receiving rank's copy
still holds the previous step's values, and a read there would return them without a word:
``model.state_dict()`` right after ``step()`` on two ranks would give the old values of some
of the matrices the other rank owns (a different count from run to run), and so would an EMA
over ``model.parameters()``, ``p.data``, ``p.detach()``, a weight norm logged after the step or
``torch.save`` of a parameter.

The owner's side of a publish has the mirror problem: the broadcast reads the owner's buffer
while the step has already returned, so a write there (``p.mul_(0.5)``, ``p.copy_(ema)``,
``p.clamp_(...)`` or a re-initialisation right after ``step()``, on every rank) could land
before the broadcast reads it, as it nearly always does on gloo: the other ranks would receive
the written weight and write it again (halving every weight after each of eight steps on two
ranks would leave a quarter of it on the receiver in some (step, matrix) pairs), and the next
forward would compute with weights that differ across ranks, without a word.

A ``state_dict`` pre-hook would cover the first of those reads and none of the others. So from
the publish until it is waited on, each parameter the publish reads or writes (the senders'
and the receivers') is a :class:`PendingParameter`
(:class:`PendingDTensor` under tensor parallelism): the same object, its class switched in
place by its holder (the ``RECEIVING`` state of [Note: a holder's states] in :mod:`._holder`), whose ``__torch_function__`` waits for its
boundary's publish before any operation that reads values (everything but metadata) and turns
every parameter of that boundary back into a plain one. Metadata (shape, dtype, ``.grad``,
``requires_grad``, hooks) reads without waiting, so ``optimizer.zero_grad()`` after ``step()``
keeps the overlap. The boundary's forward waits for the publish anyway (its pre-forward hook),
which turns the parameters back before the layer reads them: a training loop pays one class
switch per received parameter per step, and nothing per operation. On CUDA the wait orders the
current stream after the publish (no host synchronisation), which is all a later kernel reading
the weight needs. The wait runs outside any graph ``torch.compile`` traces (a graph break where
compiled code reads a pending weight; a compiled forward never does).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .._torch_internals import disable_dynamo
from ._guard import RUN, StateClass, holder_of, instances, is_safe

__all__ = ["PendingDTensor", "PendingParameter"]


def _reads_values(func: Any) -> bool:
    # ``untyped_storage()`` is metadata to the guard (a freed weight's storage is empty), but
    # here it hands out the values.
    return not is_safe(func) or getattr(func, "__name__", "") == "untyped_storage"


@disable_dynamo
def _land(values: Iterable[Any]) -> None:
    """Wait for the publish of every pending parameter among ``values`` (one level of lists
    and tuples, as torch passes tensor lists)."""
    for value in instances(values, _Pending):
        holder = holder_of(value)
        if holder is not None:  # gone with its model: nothing publishes into it any more
            holder.land()


class _Pending(StateClass):
    """What both pending classes share: a read of values waits for the publish first; see
    [Note: reads before a publish lands]."""

    __slots__ = ()

    @classmethod
    def _intercept(cls, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if _reads_values(func):
            _land([*args, *kwargs.values()])
        return RUN


class PendingParameter(_Pending, nn.Parameter):
    """A dedicated ``nn.Parameter`` whose publish is in flight (sent or received)."""

    # nn.Parameter's own copy and pickling read the class and ``__dict__`` before the values.
    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        _land([self])
        return nn.Parameter.__deepcopy__(self, memo)

    def __reduce_ex__(self, proto: Any) -> Any:
        _land([self])
        return nn.Parameter.__reduce_ex__(self, proto)


class PendingDTensor(_Pending, DTensor):
    """A dedicated tensor-parallel parameter whose publish is in flight (sent or received);
    its methods that reach the local shard without an operation wait too."""

    def to_local(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        _land([self])
        return DTensor.to_local(self, *args, **kwargs)

    def redistribute(self, *args: Any, **kwargs: Any) -> DTensor:
        _land([self])
        return DTensor.redistribute(self, *args, **kwargs)

    def full_tensor(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        _land([self])
        return DTensor.full_tensor(self, *args, **kwargs)
