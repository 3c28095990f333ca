"""How a later ``fully_shard`` leaves dedicated parameters alone.

[Note: FSDP2 integration]

``fully_shard(module, ignored_params=...)`` already knows how to leave parameters out: they
are not sharded, not moved, not reduced, and a submodule whose parameters are all ignored is
not managed at all. That public argument is the integration: after ``dedicate_params``, pass
``ignored_params=dedicated_params_of(model)`` to every ``fully_shard`` call (layers and
root)::

    dedicated = dmuon.dedicated_params_of(model)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=dedicated)
    fully_shard(model, mesh=mesh, ignored_params=dedicated)

As a convenience for code that calls ``fully_shard`` without that argument (existing training
scripts, libraries that wrap it), ``dedicate_params(..., patch_fully_shard=True)`` (the
default) installs :func:`install_patch`: it wraps the two functions of
``torch.distributed.fsdp._fully_shard._fsdp_init`` that receive ``ignored_params``
(``_get_managed_modules`` and ``_get_managed_states``, looked up as module globals by
``_get_modules_and_states``, the one entry point of ``fully_shard`` and of ``replicate`` in
torch 2.11 to 2.13) so that every parameter marked as dedicated joins the caller's
``ignored_params``. The wrapper changes nothing for unmarked parameters, so a model without
dmuon behaves exactly as before; it is never installed at import, is idempotent, and
:func:`uninstall_patch` restores torch's functions.

Either way the first forward checks that every dedicated parameter is still the one registered
on its module: a ``fully_shard`` that took one (replaced it with a DTensor) raises instead of
training silently wrong. Call order is enforced too: ``dedicate_params`` raises when any module
of the model is already an FSDP module, or when a selected parameter is already a DTensor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ._guard import is_dedicated

__all__ = [
    "check_call_order",
    "dedicated_params_of",
    "install_patch",
    "is_dedicated",
    "is_installed",
    "uninstall_patch",
]

_TARGETS = ("_get_managed_modules", "_get_managed_states")
_ORIGINAL_ATTR = "_dmuon_original"


def dedicated_params_of(model: nn.Module) -> set[nn.Parameter]:
    """The parameters of ``model`` that ``dedicate_params`` took over: pass them as
    ``fully_shard(..., ignored_params=...)`` (see [Note: FSDP2 integration])."""
    return {p for p in model.parameters() if is_dedicated(p)}


def _dedicated_in(modules: Iterable[nn.Module], recurse: bool) -> set[nn.Parameter]:
    return {p for m in modules for p in m.parameters(recurse=recurse) if is_dedicated(p)}


def _wrap(fn: Callable[..., Any], recurse: bool) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(
        modules: Any, ignored_params: set[nn.Parameter] | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        roots = [modules] if isinstance(modules, nn.Module) else list(modules)
        dedicated = _dedicated_in(roots, recurse)
        if dedicated:
            ignored_params = set(ignored_params or ()) | dedicated
        return fn(modules, ignored_params, *args, **kwargs)

    setattr(wrapper, _ORIGINAL_ATTR, fn)
    return wrapper


def _fsdp_init() -> Any:
    from torch.distributed.fsdp._fully_shard import _fsdp_init

    missing = [name for name in _TARGETS if not callable(getattr(_fsdp_init, name, None))]
    if missing:
        raise RuntimeError(
            f"torch {torch.__version__} has no {', '.join(missing)} in "
            "torch.distributed.fsdp._fully_shard._fsdp_init, which dmuon's fully_shard patch "
            "wraps; pass dedicate_params(..., patch_fully_shard=False) and "
            "fully_shard(..., ignored_params=dmuon.dedicated_params_of(model)) instead"
        )
    return _fsdp_init


def install_patch() -> None:
    """Make ``fully_shard`` (and ``replicate``) skip dedicated parameters; idempotent.

    ``dedicate_params(..., patch_fully_shard=True)`` calls it; see [Note: FSDP2 integration].
    """
    module = _fsdp_init()
    for name in _TARGETS:
        fn = getattr(module, name)
        if hasattr(fn, _ORIGINAL_ATTR):
            continue
        # Managed modules are found from the roots down; managed states per module.
        setattr(module, name, _wrap(fn, recurse=name == "_get_managed_modules"))


def uninstall_patch() -> None:
    """Restore torch's own functions (a no-op when the patch is not installed)."""
    module = _fsdp_init()
    for name in _TARGETS:
        original = getattr(getattr(module, name), _ORIGINAL_ATTR, None)
        if original is not None:
            setattr(module, name, original)


def is_installed() -> bool:
    from torch.distributed.fsdp._fully_shard import _fsdp_init

    return all(hasattr(getattr(_fsdp_init, n, None), _ORIGINAL_ATTR) for n in _TARGETS)


def check_call_order(
    model: nn.Module, selected: Iterable[tuple[str, nn.Parameter]], mesh: object
) -> None:
    """Raise when FSDP2 (or any DTensor wrapper) got to the model before dedicate_params, or
    when a selected parameter is tensor-parallel (a DTensor on a mesh other than ``mesh``)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            where = f"module {name!r}" if name else "the root module"
            raise RuntimeError(
                f"fully_shard was already applied to {where}: call "
                "dmuon.dedicate_params(model, mesh, predicate) before fully_shard (order: "
                "dedicate_params -> fully_shard(layers) -> fully_shard(model) -> Muon)"
            )
    for fqn, param in selected:
        if isinstance(param, DTensor) and param.device_mesh != mesh:
            dims = param.device_mesh.mesh_dim_names or ("unnamed",)
            raise NotImplementedError(
                f"parameter {fqn!r} is tensor-parallel (a DTensor with placements "
                f"{tuple(param.placements)} on mesh dims {dims}): this version of dmuon does not "
                "support tensor parallelism; train with dmuon on a data-parallel mesh (1-D, or "
                "HSDP) without parallelize_module, or use FSDP2 + AdamW for the TP model"
            )
        if isinstance(param, DTensor):
            raise RuntimeError(
                f"parameter {fqn!r} is already a DTensor (FSDP2 manages it): dedicate it before "
                "fully_shard, i.e. call dmuon.dedicate_params(model, mesh, predicate) first"
            )
