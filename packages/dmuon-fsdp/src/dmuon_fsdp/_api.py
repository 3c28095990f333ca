"""Model-level entry points of the runtime: thin functions over :func:`get_runtime`."""

from __future__ import annotations

from torch import nn

from dmuon_ownership import Owner

from ._checks import is_int
from .holder import DedicatedParam
from .runtime import get_runtime
from .topology import DedicatedCommContext

__all__ = [
    "broadcast_all_updates",
    "broadcast_all_updates_async",
    "get_comm_ctx",
    "get_dedicated_params",
    "get_owned_params",
    "prepare_muon_grads",
    "wait_all_reduces",
    "wait_all_replicate_broadcasts",
]


def get_dedicated_params(model: nn.Module) -> list[DedicatedParam]:
    """Every dedicated parameter of ``model``, in plan order (the same list on every rank).

    Args:
        model: the model given to ``dedicate_params`` (that object: another one, a submodule
            included, raises ``ValueError``).
    """
    return list(get_runtime(model).params)


def get_owned_params(model: nn.Module, rank: int | tuple[int, int]) -> list[DedicatedParam]:
    """The dedicated parameters whose global owner is ``rank``: a global rank (int), or a grid
    coordinate ``(shard, replicate)`` in HSDP.

    Args:
        model: the model given to ``dedicate_params`` (that object: another one, a submodule
            included, raises ``ValueError``).
        rank: a global rank of this rank's grid (the ranks of its data-parallel mesh; with
            tensor parallelism, those of its TP index), or an owner's grid coordinate
            ``(shard, replicate)``, ``shard`` in ``range(shard_size)`` and ``replicate`` in
            ``range(replicas)`` (``(shard, 0)`` without HSDP). A global rank off the grid
            raises ``ValueError``, a coordinate off it matches nothing (an empty list), another
            type raises ``TypeError``.
    """
    runtime = get_runtime(model)
    if isinstance(rank, tuple):
        if len(rank) != 2 or not all(is_int(x) for x in rank):
            raise ValueError(
                f"rank must be an int (global rank) or a (shard, replicate) pair, got {rank!r}"
            )
        coord = Owner(*rank)
    elif is_int(rank):
        coord = runtime.layout.coord_of(rank)
    else:
        raise TypeError(
            f"rank must be an int (global rank) or a (shard, replicate) pair, got {rank!r}"
        )
    return [dp for dp in runtime.params if dp.owner == coord]


def get_comm_ctx(model: nn.Module) -> DedicatedCommContext:
    """The streams, process groups and byte counter of ``model``'s runtime.

    Args:
        model: the model given to ``dedicate_params`` (that object: another one, a submodule
            included, raises ``ValueError``).
    """
    return get_runtime(model).comm_ctx


def wait_all_reduces(model: nn.Module) -> None:
    """Wait until the owners' averaged gradients (``DedicatedParam.grad``) are final.

    Args:
        model: the model given to ``dedicate_params`` (that object: another one, a submodule
            included, raises ``ValueError``).
    """
    get_runtime(model).wait_all_reduces()


def prepare_muon_grads(model: nn.Module) -> list[DedicatedParam]:
    """Wait for pending reduces and return the owned parameters whose gradient is set.

    Args:
        model: the model given to ``dedicate_params`` (that object: another one, a submodule
            included, raises ``ValueError``).
    """
    runtime = get_runtime(model)
    runtime.wait_all_reduces()
    return [dp for dp in runtime.owned if dp.grad is not None]


def broadcast_all_updates(model: nn.Module) -> None:
    """After the owners changed their weights: publish them to every rank that keeps a copy
    and wait until it has landed (what ``step()`` does, and waits for, with
    ``StepOptions(replicate_async=False)``).

    Args:
        model: the model given to ``dedicate_params`` (that object: another one, a submodule
            included, raises ``ValueError``).
    """
    get_runtime(model).after_step(async_=False)


def broadcast_all_updates_async(model: nn.Module) -> None:
    """Like :func:`broadcast_all_updates`, but the HSDP publish is only launched; each
    boundary's next forward waits for its own part.

    Args:
        model: the model given to ``dedicate_params`` (that object: another one, a submodule
            included, raises ``ValueError``).
    """
    get_runtime(model).after_step(async_=True)


def wait_all_replicate_broadcasts(model: nn.Module) -> None:
    """Wait for every pending publish (HSDP and the replicated path) at once. A read or an
    in-place write of a published weight waits for its own publish by itself, and the
    checkpoint functions wait too, so this is only needed to wait for all of them in one place
    (before timing the next forward, say).

    Args:
        model: the model given to ``dedicate_params`` (that object: another one, a submodule
            included, raises ``ValueError``).
    """
    get_runtime(model).wait_all_replicate_broadcasts()
