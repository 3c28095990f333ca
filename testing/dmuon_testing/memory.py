"""Memory accounting by live tensor storage, not by an allocator: the bytes of every storage
reachable from Python before a call, plus the peak of the storages that the call's ops create
(a ``TorchDispatchMode`` sees every op's output). The figures are the same on any device and
count exactly what a GPU allocator would hold for tensors, so a CPU run measures them.

    before = live_storages()
    with StoragePeak(set(before)) as peak:
        optimizer.step()
    print(sum(before.values()), peak.peak)   # bytes alive before, bytes the call added at most
"""

from __future__ import annotations

import gc
import warnings
import weakref
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["StoragePeak", "live_storages", "storage_of"]


def storage_of(t: Tensor) -> torch.UntypedStorage | None:
    """The storage behind ``t`` (a DTensor's local shard's), or ``None`` when it holds no data."""
    local = t.to_local() if hasattr(t, "to_local") else t
    try:
        storage = local.untyped_storage()
        return storage if storage.data_ptr() else None
    except RuntimeError:  # a storage resized away or without data
        return None


def live_storages() -> dict[int, int]:
    """``{data_ptr: bytes}`` of every storage a tensor reachable from Python holds (a
    parameter's ``.grad`` is reachable only through the parameter: add it yourself)."""
    gc.collect()
    live: dict[int, int] = {}
    with warnings.catch_warnings():
        # isinstance() on some of torch's module objects warns of their deprecation.
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, Tensor)]
    for t in tensors:
        storage = storage_of(t)
        if storage is not None:
            live[storage.data_ptr()] = storage.nbytes()
    return live


class StoragePeak(TorchDispatchMode):
    """While on: ``peak``, the most bytes that storages created by ops (and not in
    ``baseline``, a set of ``data_ptr``) held alive at once."""

    def __init__(self, baseline: set[int]) -> None:
        super().__init__()
        self.baseline = baseline
        self.outputs: list[weakref.ref[Tensor]] = []
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.outputs.extend(weakref.ref(t) for t in tree_flatten(out)[0] if isinstance(t, Tensor))
        alive, current = [], {}
        for ref in self.outputs:
            t = ref()
            if t is None:
                continue
            alive.append(ref)
            storage = storage_of(t)
            if storage is not None and storage.data_ptr() not in self.baseline:
                current[storage.data_ptr()] = storage.nbytes()
        self.outputs = alive
        self.peak = max(self.peak, sum(current.values()))
        return out
