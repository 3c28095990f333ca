"""Initialising a meta-device model's dedicated weights where they are kept.

[Note: owners-only initialisation]
After ``to_empty`` a dedicated weight has storage only on the ranks that keep it (see [Note:
meta-device models] in ``runtime._runtime``). :func:`init_dedicated_` runs the user's ``fn`` on
each weight the rank owns, whole, with a ``torch.Generator`` seeded from ``seed`` and a stable
hash of the weight's FQN, so each weight's values depend on its name and the seed only: the
same at every world size, HSDP shape and owner plan, and independent of the order of the
parameters or of what else draws from torch's global generator. Replicas (HSDP) and the
replicated path's copies then receive the owner's values by a publish, and a peer computes
nothing. A tensor-parallel matrix is initialised whole on each of its owner's TP ranks, which
keep their shards.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.autograd.profiler import record_function

from .._checks import is_int
from ..runtime import get_runtime

__all__ = ["init_dedicated_", "param_seed"]


def param_seed(fqn: str, seed: int) -> int:
    """A 63-bit seed from ``seed`` and ``fqn`` that no process, platform or Python hash salt
    changes."""
    digest = hashlib.sha256(f"{seed}:{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def init_dedicated_(
    model: nn.Module, fn: Callable[[str, Tensor, torch.Generator], object], *, seed: int = 0
) -> None:
    """Initialise every dedicated weight of ``model`` on its owner (each TP rank of it);
    HSDP replicas and the replicated path's copies receive it by the closing publish. ``fn(fqn,
    weight, generator)`` fills ``weight`` (the full weight, in its master dtype) in place,
    drawing from ``generator`` (see [Note: owners-only initialisation]). Call it after
    ``model.to_empty(device=...)``; the other parameters (FSDP2's shards, buffers) are the
    caller's to initialise. Collective: in HSDP and on the replicated path it ends with the
    owners' publish.

    Args:
        model: the model given to ``dedicate_params`` (that object; another raises
            ``ValueError``).
        fn: ``fn(fqn, weight, generator)``, called once per dedicated weight on its owner
            (a tensor-parallel weight whole, then split); it fills ``weight`` in
            place, drawing random numbers from ``generator`` (on the weight's device), and its
            return value is ignored. Not callable: ``TypeError``.
        seed: any int; each weight's generator is seeded from ``seed`` and the weight's FQN,
            so that its values do not depend on the world size or on which rank owns it.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable as fn(fqn, weight, generator), got {fn!r}")
    if not is_int(seed):
        raise TypeError(f"seed must be an int, got {seed!r}")
    runtime = get_runtime(model)
    with record_function("dmuon::init_dedicated"):
        runtime.drain()
        with torch.no_grad():
            for dp in runtime.owned:
                assert dp.full is not None
                generator = torch.Generator(device=dp.full.device)
                generator.manual_seed(param_seed(dp.fqn, seed))
                if dp.tp_dim is None:
                    fn(dp.fqn, dp.full, generator)
                    continue
                whole = torch.empty(dp.shape, dtype=dp.full.dtype, device=dp.full.device)
                fn(dp.fqn, whole, generator)
                dp.full.copy_(dp.local_part(whole))
        # Owned weights changed: drop kept copies (Z2) and publish to replicas (HSDP).
        runtime.after_step(async_=False)
