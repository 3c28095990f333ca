"""How a later ``fully_shard`` leaves dedicated parameters alone.

[Note: FSDP2 integration]

``fully_shard(module, ignored_params=...)`` already knows how to leave parameters out: they
are not sharded, not moved, not reduced, and a submodule whose parameters are all ignored is
not managed at all. dmuon makes every ``fully_shard`` pass the dedicated parameters there, so
that a training script written for FSDP2 needs no change after ``dedicate_params``::

    dmuon.dedicate_params(model, mesh, predicate)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

``dedicate_params`` installs, by default (``patch_fully_shard=True``), a wrapper around the
two private functions of FSDP2 that receive ``ignored_params`` (``FSDP_DISCOVERY_FUNCTIONS``
of the module ``_torch_internals.fsdp_init_module`` returns, see [Note: private torch]): every
parameter marked as dedicated joins the caller's ``ignored_params``. The wrapper changes
nothing for unmarked parameters, so a model without dmuon behaves exactly as before; it is
never installed at import, installing it twice is a no-op, and :func:`uninstall_patch`
restores torch's functions.

The patch-free way is the public argument itself: with ``patch_fully_shard=False``, pass
``ignored_params=dedicated_params_of(model)`` to every ``fully_shard`` call (layers and
root). Both ways train bit for bit alike (a test runs both).

Without either, ``fully_shard`` takes the dedicated parameters it reaches. Every rank then
stops with one error that names both fixes (see [Note: a fully_shard that takes a dedicated
parameter] in ``runtime/_runtime``): at that ``fully_shard`` on the ranks where sharding reads
a weight they do not hold, at ``Muon(model)`` (or the first forward, or a checkpoint or
diagnostics call) on the others, before any collective. Call order is enforced too:
``dedicate_params`` raises when any module of the model is already an FSDP module, or when a
selected parameter is already a DTensor on the data-parallel mesh.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from .._torch_internals import FSDP_DISCOVERY_FUNCTIONS, fsdp_init_module
from ..holder import fsdp_modules, is_dedicated

__all__ = [
    "check_call_order",
    "dedicated_params_of",
    "install_patch",
    "is_dedicated",
    "is_installed",
    "uninstall_patch",
]

_ORIGINAL_ATTR = "_dmuon_original"


def dedicated_params_of(model: nn.Module) -> set[nn.Parameter]:
    """The parameters of ``model`` that ``dedicate_params`` took over: pass them as
    ``fully_shard(..., ignored_params=...)`` (see [Note: FSDP2 integration]).

    Args:
        model: the model given to ``dedicate_params``, or any of its submodules (a layer):
            the dedicated parameters among its parameters, an empty set when it holds none.
    """
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
    module = fsdp_init_module()
    missing = [n for n in FSDP_DISCOVERY_FUNCTIONS if not callable(getattr(module, n, None))]
    if missing:
        raise RuntimeError(
            f"torch {torch.__version__} has no {', '.join(missing)} in {module.__name__}, "
            "which dmuon's fully_shard patch wraps; call dedicate_params(..., "
            "patch_fully_shard=False) and pass fully_shard(..., "
            "ignored_params=dmuon.dedicated_params_of(model)) instead"
        )
    return module


def install_patch() -> None:
    """Make ``fully_shard`` (and torch's composable ``replicate``, which shares its parameter
    discovery) skip dedicated parameters; idempotent.

    ``dedicate_params`` calls it unless given ``patch_fully_shard=False``; the patch-free way
    is ``fully_shard(..., ignored_params=dmuon.dedicated_params_of(model))``; see [Note: FSDP2
    integration].
    """
    module = _fsdp_init()
    for name in FSDP_DISCOVERY_FUNCTIONS:
        fn = getattr(module, name)
        if hasattr(fn, _ORIGINAL_ATTR):
            continue
        # Managed modules are found from the roots down; managed states per module.
        setattr(module, name, _wrap(fn, recurse=name == "_get_managed_modules"))


def uninstall_patch() -> None:
    """Restore torch's own functions (a no-op when the patch is not installed)."""
    module = _fsdp_init()
    for name in FSDP_DISCOVERY_FUNCTIONS:
        original = getattr(getattr(module, name), _ORIGINAL_ATTR, None)
        if original is not None:
            setattr(module, name, original)


def is_installed() -> bool:
    module = fsdp_init_module()
    return all(hasattr(getattr(module, n, None), _ORIGINAL_ATTR) for n in FSDP_DISCOVERY_FUNCTIONS)


def check_call_order(
    model: nn.Module,
    selected: Iterable[tuple[str, nn.Parameter]],
    mesh: object,
    replicate_mesh: object = None,
) -> tuple[DeviceMesh | None, dict[str, int]]:
    """Raise when FSDP2 (or any DTensor wrapper on the data-parallel ``mesh``) got to the
    model before dedicate_params; return the tensor-parallel mesh of the selected parameters
    that are TP shards (DTensors on another mesh of more than one rank), or where none is, of
    the model's other weights (:func:`_other_tp_mesh`), or ``None``, and the dim each TP shard
    splits, by FQN. Raises when they do not fit dmuon's tensor parallelism (see [Note:
    tensor-parallel grids] in _mesh); a DTensor on a one-rank mesh is a whole matrix (see
    [Note: degree-1 mesh dimensions] in _mesh)."""
    sharded = fsdp_modules(model)
    if sharded:
        name = sharded[0][0]
        where = f"module {name!r}" if name else "the root module"
        raise RuntimeError(
            f"fully_shard was already applied to {where}: call "
            "dmuon.dedicate_params(model, mesh, predicate) before fully_shard (order: "
            "dedicate_params -> fully_shard(layers) -> fully_shard(model) -> Muon)"
        )
    tp_mesh: DeviceMesh | None = None
    tp_dims: dict[str, int] = {}
    selected = list(selected)
    for fqn, param in selected:
        if not isinstance(param, DTensor):
            continue
        if param.device_mesh == mesh:
            raise RuntimeError(
                f"parameter {fqn!r} is already a DTensor on the mesh passed to dedicate_params: "
                "if FSDP2 sharded it, call dmuon.dedicate_params(model, mesh, predicate) first "
                "(before fully_shard); if it is a tensor-parallel shard, pass the data-parallel "
                "dimension (mesh['dp'] of a ('dp', 'tp') mesh), not the TP one"
            )
        if param.device_mesh.size() == 1:
            continue
        tp_dims[fqn] = _tp_dim(fqn, param)
        if tp_mesh is None:
            tp_mesh = param.device_mesh
        elif param.device_mesh != tp_mesh:
            raise ValueError(
                f"tensor-parallel parameter {fqn!r} lives on another mesh than the other selected "
                "ones; dmuon's tensor parallelism takes one TP mesh for every dedicated matrix"
            )
    if tp_mesh is None:
        tp_mesh = _other_tp_mesh(model, {id(p) for _, p in selected}, (mesh, replicate_mesh))
    return tp_mesh, tp_dims


def _other_tp_mesh(
    model: nn.Module, selected: set[int], data_parallel: tuple[object, ...]
) -> DeviceMesh | None:
    """The TP mesh of a model whose selected matrices are no TP shards: a pipeline stage or
    model part of a tensor-parallel world that holds only weights outside the Muon route
    (torchtitan's part of the embedding alone, or of the norm and the head, each parallelized
    on the TP mesh). Its grids are still the world's TP grids, so the mesh is the one 1-D mesh
    of more than one rank that the model's other DTensor weights lie on and that meets the
    ``data_parallel`` meshes at this rank only, as a TP dimension does; an expert-parallel mesh
    taken from the data-parallel ranks meets them elsewhere too, and is no TP mesh. ``None``
    where there is no such mesh, or more than one."""
    dp_ranks: set[int] = set()
    for dp in data_parallel:
        if isinstance(dp, DeviceMesh):
            dp_ranks.update(dp.mesh.flatten().tolist())
    found: list[DeviceMesh] = []
    for param in model.parameters():
        if id(param) in selected or not isinstance(param, DTensor):
            continue
        other = param.device_mesh
        if other.ndim != 1 or other.size() == 1 or any(other == m for m in found):
            continue
        if len(dp_ranks.intersection(other.mesh.flatten().tolist())) == 1:
            found.append(other)
    return found[0] if len(found) == 1 else None


def _tp_dim(fqn: str, param: DTensor) -> int:
    """The dim a tensor-parallel parameter's shards split; raises unless dmuon can dedicate
    it (one 1-D TP mesh, equal ``Shard`` shards)."""
    mesh, placements = param.device_mesh, param.placements
    dims = mesh.mesh_dim_names or ("unnamed",)
    placement = placements[0]
    if mesh.ndim != 1 or len(placements) != 1 or not isinstance(placement, Shard):
        raise NotImplementedError(
            f"parameter {fqn!r} is a DTensor with placements {tuple(placements)} on mesh dims "
            f"{dims}: dmuon dedicates tensor-parallel matrices sharded on one 1-D TP mesh "
            "(ColwiseParallel or RowwiseParallel: Shard(0) or Shard(1)); leave replicated "
            "parameters (SequenceParallel norms) out of the predicate"
        )
    dim = placement.dim % param.ndim
    size = param.shape[dim]
    if size % mesh.size():
        raise ValueError(
            f"tensor-parallel parameter {fqn!r} splits a dim of {size} over {mesh.size()} ranks "
            "unevenly; dmuon needs equal TP shards (pick a TP degree that divides it)"
        )
    return dim
