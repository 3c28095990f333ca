"""Every private torch API dmuon uses, behind small named functions.

[Note: private torch]

dmuon reaches below torch's public API in a few places where no public API does the job. All
of them live here, each in one function that says what it uses and why nothing public serves,
so that a torch upgrade is checked in one file and the rest of ``dmuon_fsdp`` reads as public
torch (``tests/test_structure.py`` fails when another module reaches private torch, but for
``checkpoint/_integrity.py``, whose checksum reader subclasses DCP's reader and overrides one of
its private methods). Tested
with torch 2.11 (the GPU machine) and torch 2.13 (CI).

Two public substitutes were chosen over private names elsewhere: ``torch.distributed.group.WORLD``
for the default process group, and ``torch.compiler.is_compiling()``. The patch of
``fully_shard`` (``setup/_fsdp_integration.py``) gets the FSDP2 module it wraps from
:func:`fsdp_init_module`, and the names of the wrapped functions from
:data:`FSDP_DISCOVERY_FUNCTIONS`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import re
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from types import FrameType, ModuleType
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, cast

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils import _pytree

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = [
    "FSDP_DISCOVERY_FUNCTIONS",
    "caller_frames",
    "compiled_autograd_on",
    "default_group_timeout",
    "disable_dynamo",
    "disable_torch_function_subclass",
    "dtensor_shard_offsets",
    "foreach_copy_",
    "foreach_lerp_",
    "foreach_max_abs",
    "foreach_mul_",
    "fsdp_all_reduce_hook_reader",
    "fsdp_forward_method_running",
    "fsdp_gradient_divide_factor",
    "fsdp_gradient_sync",
    "fsdp_gradient_sync_reader",
    "fsdp_init_module",
    "fsdp_init_running",
    "fsdp_manages",
    "fsdp_mp_policy",
    "fsdp_offloads_to_cpu",
    "fsdp_reshards_after_forward",
    "fsdp_unreduced_grads_dropper",
    "in_backward",
    "local_shard",
    "local_tensor",
    "optimizer_state_dict_hooks_taken",
    "parse_to_args",
    "pipeline_metadata_inference_running",
    "pipeline_warmup_sends_to_self",
    "profiler_enabled",
    "queue_backward_callback",
    "refused_by_compiled_autograd",
    "set_fqn_modifiers",
    "torch_optim_state_dict_running",
    "torch_state_dict_function",
    "tree_leaves",
    "tree_map_tensors",
    "watch_pipeline_metadata_inference",
    "will_run",
]

_P = ParamSpec("_P")
_T = TypeVar("_T")


def default_group_timeout() -> timedelta | None:
    """The timeout of the default process group (``init_process_group(timeout=...)``);
    ``None`` when torch does not say.

    Uses ``ProcessGroup._device_types`` and ``_get_backend(device).options._timeout``: no
    public function reads a group's timeout, and ``new_group(timeout=None)`` takes torch's
    default (30 minutes for gloo, 10 for NCCL), not the default group's."""
    import torch.distributed as dist

    try:
        group = dist.group.WORLD
        assert group is not None
        backend = group._get_backend(group._device_types[0])
        timeout = backend.options._timeout  # type: ignore[attr-defined]
    except (AttributeError, IndexError, RuntimeError, AssertionError):
        return None
    return timeout if isinstance(timeout, timedelta) else None


def profiler_enabled() -> bool:
    """Whether a ``torch.profiler`` (or autograd profiler) is recording on this thread.

    Uses ``torch._C._autograd._profiler_enabled``. The public ``record_function`` costs about
    20 µs of host time even with no profiler running, and no public query says whether one is
    (see [Note: profiler ranges] in ``_profile``)."""
    return bool(torch._C._autograd._profiler_enabled())


def parse_to_args(
    *args: Any, **kwargs: Any
) -> tuple[torch.device | None, torch.dtype | None, bool, torch.memory_format | None]:
    """``Tensor.to``'s arguments (after the tensor) as ``(device, dtype, non_blocking,
    memory_format)``, ``None`` for what they leave unchanged.

    Uses ``torch._C._nn._parse_to``, the parser ``Tensor.to`` itself runs: ``to`` takes a device,
    a dtype, a tensor or strings, by position or keyword, and rewriting those overloads would
    drift from torch's. No public function parses them."""
    return torch._C._nn._parse_to(*args, **kwargs)  # type: ignore[no-any-return]


def disable_torch_function_subclass() -> AbstractContextManager[Any]:
    """A context in which operations on tensor subclasses skip their ``__torch_function__``
    (what ``torch.Tensor.__torch_function__`` does to return plain results).

    Uses ``torch._C.DisableTorchFunctionSubclass``: it is the context ``torch.compile`` traces
    through in a subclass's handler; the public ``torch.overrides`` offers no such context."""
    return torch._C.DisableTorchFunctionSubclass()


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread (activation
    checkpointing re-runs forwards there).

    Uses ``torch._C._current_graph_task_id``, as FSDP2 does for the same question; no public
    API tells a forward hook that it runs inside backward."""
    return bool(torch._C._current_graph_task_id() != -1)


def will_run(node: Any) -> bool:
    """Whether the backward under way runs autograd ``node`` (call it from inside that
    backward). Uses ``torch._C._will_engine_execute_node``, the check behind torch's public
    ``torch.autograd.graph.register_multi_grad_hook``: torch has no public one."""
    return bool(torch._C._will_engine_execute_node(node))


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the current backward pass has finished (its last gradient is
    accumulated).

    Uses ``torch.autograd.Variable._execution_engine.queue_callback``, as FSDP2 does for its
    post-backward; no public hook fires at the end of a whole backward pass."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]


def compiled_autograd_on() -> bool:
    """Whether torch's compiled autograd captures or runs the current backward
    (``torch._dynamo.compiled_autograd._enable``, which ``torch._dynamo.config.compiled_autograd``
    turns on for a compiled function's backward).

    Reads the flags of ``torch._dynamo.compiled_autograd``, which has no public query, and only
    when that module is already imported (so that it imports nothing)."""
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return module is not None and bool(
        module.compiled_autograd_enabled or module.in_compiled_autograd_region
    )


_Function = TypeVar("_Function", bound=type[torch.autograd.Function])


def refused_by_compiled_autograd(
    refusal: Callable[[], BaseException],
) -> Callable[[_Function], _Function]:
    """A class decorator: torch's compiled autograd raises ``refusal()`` for a backward whose
    graph holds a node of the decorated custom autograd function, before it captures the graph
    (on every rank alike: nothing runs yet); eager backward is unaffected.

    Overrides ``Function._compiled_autograd_key``, the cache key compiled autograd asks of every
    custom node as it walks the graph before capturing it, and nothing else calls: torch has no
    public hook at the start of a compiled-autograd backward."""

    def key(ctx: Any) -> tuple[int, ...]:
        raise refusal()

    def decorate(function: _Function) -> _Function:
        function._compiled_autograd_key = staticmethod(key)  # type: ignore[method-assign]
        return function

    return decorate


def disable_dynamo(fn: Callable[_P, _T], reason: str | None = None) -> Callable[_P, _T]:
    """``fn``, never traced by ``torch.compile``: a compiled caller runs it eagerly.

    Uses ``torch._disable_dynamo``, which imports the compiler only when ``fn`` is first called.
    The public ``torch.compiler.disable`` imports it when applied, and the decorator is applied
    at import (importing dmuon must not import the compiler).

    With a ``reason`` it is the public ``torch.compiler.disable``, which dynamo quotes wherever
    it meets ``fn`` (a graph-break log, the error of ``fullgraph=True``): what
    ``torch._disable_dynamo`` makes is, to dynamo, an anonymous function of a file it skips.
    That imports the compiler now, so a reason is only for functions made at run time (a
    boundary's hooks at ``dedicate_params``, ``Muon``'s entry points at ``Muon(model)``), which
    FSDP2's ``fully_shard`` imports it for anyway."""
    if reason is None:
        return torch._disable_dynamo(fn)
    return torch.compiler.disable(fn, reason=reason)


def fsdp_mp_policy(module: FSDPModule) -> Any:
    """The ``MixedPrecisionPolicy`` that ``fully_shard`` was given for ``module`` (an
    ``FSDPModule``).

    Uses ``module._get_fsdp_state()._mp_policy``: FSDP2 keeps the policy on the module's state
    and has no public getter, and dmuon resolves a dedicated parameter's dtypes from it (see
    [Note: mixed precision] in ``holder/_precision``)."""
    return module._get_fsdp_state()._mp_policy


def _fsdp_param_groups(modules: Sequence[FSDPModule]) -> list[Any]:
    """The FSDP2 parameter groups (``FSDPParamGroup``) of ``modules``, through
    ``module._get_fsdp_state()``: FSDP2 has no public accessor (torch 2.13 holds a list of groups
    in ``_fsdp_param_groups``, torch 2.11 one group or none in ``_fsdp_param_group``)."""
    groups = []
    for module in modules:
        state = module._get_fsdp_state()
        many = getattr(state, "_fsdp_param_groups", None)
        if many is not None:
            groups.extend(many)
        elif state._fsdp_param_group is not None:
            groups.append(state._fsdp_param_group)
    return groups


def after_fsdp_root_post_backward(module: FSDPModule, after: Callable[[], None]) -> None:
    """Make ``module``'s FSDP2 state call ``after()`` each time its root post-backward callback
    has run (on this state only: an instance attribute over the bound method).

    Wraps ``fully_shard.state(module)._root_post_backward_final_callback``: FSDP2 queues it
    at the end of each backward, and ``torch.distributed.pipelining``'s schedules call it by
    hand after the last micro-batch (``_PipelineStageBase.perform_reduce_grad``), once they have
    turned gradient sync back on and run FSDP2's post-backward; nothing public tells a
    module that this end of backward ran (see [Note: the pipeline schedule's reduce])."""
    state = module._get_fsdp_state()
    final = state._root_post_backward_final_callback

    def callback() -> None:
        final()
        after()

    functools.update_wrapper(callback, final)
    state._root_post_backward_final_callback = callback  # type: ignore[method-assign]


def fsdp_gradient_sync(module: FSDPModule) -> bool:
    """Whether ``module``'s own FSDP2 parameter groups reduce their gradients (what
    ``module.set_requires_gradient_sync(flag, recurse=False)`` set last; ``True`` for a module
    without parameters). Reads ``FSDPParamGroup.reduce_grads``, as
    :func:`fsdp_gradient_sync_reader` does."""
    return all(group.reduce_grads for group in _fsdp_param_groups([module]))


def fsdp_gradient_sync_reader(modules: Sequence[FSDPModule]) -> Callable[[], bool]:
    """How to read whether ``set_requires_gradient_sync(False)`` is in effect on every FSDP2
    parameter group of ``modules`` (the reader returns ``False`` when they have none).

    Reads ``FSDPParamGroup.reduce_grads``: FSDP2 keeps the flag on its parameter groups and has
    no public getter. ``fully_shard`` makes a module's groups once and the setter sets the flag
    on them, so the groups are found here once and the reader reads only their flags."""
    groups = _fsdp_param_groups(modules)
    return lambda: bool(groups) and not any(group.reduce_grads for group in groups)


def fsdp_unreduced_grads_dropper(modules: Sequence[FSDPModule]) -> Callable[[], None]:
    """How to drop the gradients FSDP2 holds on its unsharded parameters between a backward
    that did not reduce-scatter them and the one that does (see [Note: FSDP2's held
    gradients] in ``runtime/_runtime``).

    FSDP2 keeps them in ``FSDPParam._unsharded_param.grad``, or, with a ``reduce_dtype`` other
    than the parameter's, in ``FSDPParam.unsharded_accumulated_grad``; it has no public way to
    clear either (``model.zero_grad()`` reaches the first only while the module is gathered).
    The groups are found here once, as in :func:`fsdp_gradient_sync_reader`."""
    params = [p for group in _fsdp_param_groups(modules) for p in group.fsdp_params]

    def drop() -> None:
        for fsdp_param in params:
            fsdp_param.unsharded_accumulated_grad = None
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None

    return drop


def fsdp_all_reduce_hook_reader(
    modules: Sequence[tuple[str, FSDPModule]],
) -> Callable[[], str | None]:
    """How to read which of ``modules`` (``(name, module)`` pairs) ``set_all_reduce_hook``
    gave a hook (FSDP2 calls it on the reduced gradients of the module's parameters): the
    reader returns the first one's name, ``None`` while none has one.

    Reads ``FSDPParamGroup._all_reduce_hook``: FSDP2 keeps the hook on its parameter groups
    and has no public getter. ``fully_shard`` makes a module's groups once and
    ``set_all_reduce_hook`` sets the hook on them, so the groups are found here once and the
    reader reads only their hooks: a hook set later is seen, at a few attribute reads per
    module (finding the groups through ``_get_fsdp_state`` took about 0.8 µs a module)."""
    groups = [(name, group) for name, module in modules for group in _fsdp_param_groups([module])]

    def first_hooked() -> str | None:
        for name, group in groups:
            if getattr(group, "_all_reduce_hook", None) is not None:
                return name
        return None

    return first_hooked


def fsdp_gradient_divide_factor(module: FSDPModule) -> Callable[[], float | None] | None:
    """How to read what ``set_gradient_divide_factor`` gave ``module`` (the reader returns
    ``None`` where it was not called: FSDP2 then divides by its data-parallel world size), as
    FSDP2 reads it at each reduce; ``None`` when ``fully_shard`` left the module no parameters.

    Reads ``FSDPParamGroup.gradient_divide_factor`` (the setter gives every group of the module
    the same): FSDP2 keeps the factor on its parameter groups and has no public getter."""
    groups = _fsdp_param_groups([module])
    if not groups:
        return None
    group = groups[0]
    return lambda: group.gradient_divide_factor


def fsdp_offloads_to_cpu(module: FSDPModule) -> bool:
    """Whether ``fully_shard`` was given a ``CPUOffloadPolicy`` for ``module``.

    Reads ``FSDPParamGroup.offload_policy``: FSDP2 keeps the policy on its parameter groups and
    has no public getter."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return any(
        isinstance(group.offload_policy, CPUOffloadPolicy) for group in _fsdp_param_groups([module])
    )


def fsdp_reshards_after_forward(module: FSDPModule) -> bool | None:
    """Whether FSDP2 frees ``module``'s gathered parameters after its forward
    (``reshard_after_forward`` not ``False``; an int reshards to a smaller group); ``None``
    when ``fully_shard`` left it no parameters.

    Reads ``FSDPParamGroup.post_forward_mesh_info``, ``None`` exactly when FSDP2 keeps them:
    FSDP2 has no public getter. For a module inside another ``fully_shard`` module it is what
    ``fully_shard`` was given; the outermost one's FSDP2 sets to ``None`` at its lazy init (the
    first forward) unless it was given ``True``, since backward follows at once."""
    groups = _fsdp_param_groups([module])
    if not groups:
        return None
    return any(group.post_forward_mesh_info is not None for group in groups)


def active_ddp() -> torch.nn.Module | None:
    """The ``DistributedDataParallel`` whose forward is running, or ``None`` outside one.

    Reads ``DistributedDataParallel._get_active_ddp_module()``, which DDP sets around its
    forward for the compiler: nothing public tells a module that a DDP is running it. (Unset
    under ``optimize_ddp="python_reducer"``.)"""
    return DistributedDataParallel._get_active_ddp_module()


def ddp_reduced_params(ddp: torch.nn.Module) -> list[Tensor]:
    """The parameters the reducer of ``ddp`` (a ``DistributedDataParallel``) all-reduces.

    Reads ``DistributedDataParallel._module_parameters``, its list without the frozen and the
    ignored parameters (``_ddp_params_and_buffers_to_ignore``); nothing public lists them. A
    torch without it gives the trainable parameters of the module it wraps."""
    reduced = getattr(ddp, "_module_parameters", None)
    if reduced is None:
        wrapped = cast(torch.nn.Module, ddp.module)
        reduced = [p for p in wrapped.parameters() if p.requires_grad]
    return list(reduced)


def ddp_modules(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The ``DistributedDataParallel`` wrappers among ``module``'s submodules (itself too, as
    ``""``), by name."""
    return [(n, m) for n, m in module.named_modules() if isinstance(m, DistributedDataParallel)]


def local_tensor(t: DTensor) -> Tensor:
    """The local tensor object a ``DTensor`` holds (writing its ``.data`` reaches the DTensor).

    Uses ``DTensor._local_tensor``: the public ``to_local()`` returns a new autograd view while
    grad mode is on, not the object itself, and dmuon swaps that object's storage for a view
    into its packed buffers (see [Note: storage of a dedicated parameter] in
    ``holder/_dedicated``)."""
    return t._local_tensor


def local_shard(t: Tensor) -> Tensor:
    """What this rank holds of ``t``: a DTensor's local tensor (:func:`local_tensor`, the
    object itself), or ``t`` itself."""
    return local_tensor(t) if isinstance(t, DTensor) else t


def foreach_max_abs(tensors: Sequence[Tensor]) -> list[Tensor]:
    """The largest absolute value of each of ``tensors`` (``inf``/``nan`` when it holds one),
    as 0-dim tensors, in one fused launch per device and dtype.

    Uses ``torch._foreach_norm(tensors, inf)``: no public function reduces a list of tensors
    to per-tensor values without one launch per tensor."""
    return list(torch._foreach_norm(list(tensors), float("inf")))


def foreach_mul_(tensors: Sequence[Tensor], factors: Sequence[Tensor]) -> None:
    """``tensors[i] *= factors[i]`` in place for every ``i``, one fused launch per device and
    dtype.

    Uses ``torch._foreach_mul_``: no public function multiplies a list of tensors in one
    launch."""
    torch._foreach_mul_(list(tensors), list(factors))


def foreach_copy_(targets: Sequence[Tensor], sources: Sequence[Tensor]) -> None:
    """``targets[i].copy_(sources[i])`` for every ``i`` (each converted to its target's dtype),
    in one fused launch per device and dtype pair.

    Uses ``torch._foreach_copy_``: no public function copies a list of tensors in one
    launch."""
    torch._foreach_copy_(list(targets), list(sources))


def foreach_lerp_(
    tensors: Sequence[Tensor], ends: Sequence[Tensor], weight: float | Tensor
) -> None:
    """``tensors[i] += weight·(ends[i] − tensors[i])`` in place for every ``i``, one fused
    launch per device and dtype; ``weight`` a float or a 0-dim tensor (read on the device).

    Uses ``torch._foreach_lerp_``: no public function interpolates a list of tensors in one
    launch (its stubs do not list the 0-dim tensor weight, which the op takes)."""
    torch._foreach_lerp_(list(tensors), list(ends), weight)  # type: ignore[arg-type]


def dtensor_shard_offsets(t: DTensor) -> tuple[int, ...]:
    """Where this rank's local shard of ``t`` starts in the global tensor, per dim.

    Uses ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``, DTensor's
    own rule for its (possibly uneven) shards; ``DTensor`` has no public method that returns
    the offsets, and recomputing them per placement would drift from torch's."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(int(o) for o in offsets)


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of a module's inputs or outputs, found as FSDP2 finds the tensors it hooks:
    inside the containers torch's pytree knows (tuples, lists, dicts, named tuples, and the
    classes registered there, such as transformers' ``ModelOutput``) and inside dataclasses it
    does not know, every field in order.

    Uses ``torch.utils._pytree``'s node registry (``SUPPORTED_NODES``, ``_get_node_type``):
    torch has no public pytree module, and one level at a time is what lets
    :func:`tree_map_tensors` rebuild only what changed. A dataclass left closed would hide its
    tensors from the backward hooks (a Z3 weight never gathered again for backward, a reduce
    point missing where a rank skips a weight)."""
    return _leaves(tree, 0)


def _leaves(tree: Any, depth: int) -> list[Any]:
    if isinstance(tree, Tensor):
        return [tree]
    kind = type(tree)
    if kind in _BUILTIN_NODES and depth <= _MAX_DEPTH:  # see _BUILTIN_NODES
        children = tree.values() if kind is dict else tree
        return [leaf for child in children for leaf in _leaves(child, depth + 1)]
    node = _node(tree, depth)
    if node is None:
        return [tree]
    return [leaf for child in node[0] for leaf in _leaves(child, depth + 1)]


def tree_map_tensors(fn: Callable[[Tensor], Any], tree: Any) -> Any:
    """``tree`` with each tensor leaf replaced by ``fn(leaf)``, in :func:`tree_leaves`'s
    order. Only a container with a child that changed is rebuilt (as FSDP2's
    ``replace_grad_tensors`` does): a list or a dataclass a layer writes into stays the
    caller's object when no tensor in it changes. A dataclass is rebuilt as a shallow copy
    with the changed fields set (no ``__init__`` runs; frozen and ``init=False`` fields
    alike)."""
    return _mapped(fn, tree, 0)


def _mapped(fn: Callable[[Tensor], Any], tree: Any, depth: int) -> Any:
    if isinstance(tree, Tensor):
        return fn(tree)
    kind = type(tree)
    if kind in _BUILTIN_NODES and depth <= _MAX_DEPTH:  # see _BUILTIN_NODES
        children = list(tree.values()) if kind is dict else tree
        mapped = [_mapped(fn, child, depth + 1) for child in children]
        if all(n is c for n, c in zip(mapped, children, strict=True)):
            return tree
        return dict(zip(tree, mapped, strict=True)) if kind is dict else kind(mapped)
    node = _node(tree, depth)
    if node is None:
        return tree
    children, rebuild = node
    new = [_mapped(fn, child, depth + 1) for child in children]
    if all(n is c for n, c in zip(new, children, strict=True)):
        return tree
    return rebuild(new)


# Deeper than any module's inputs or outputs: a structure that refers back to itself.
_MAX_DEPTH = 64

# The containers every layer call passes (its ``(args, kwargs)``, a tuple of tensors), opened
# without asking pytree's registry: pytree flattens exactly these types (no subclass: a named
# tuple or an ``OrderedDict`` is a node of its own) into their items, a dict into its values in
# order, and rebuilds them with ``tuple``, ``list`` and ``dict(zip(keys, values))``, as here;
# they cannot be registered again. The lookup through ``_node`` cost the forward hooks about
# 8 µs a layer.
_BUILTIN_NODES = frozenset({tuple, list, dict})


def _node(tree: Any, depth: int) -> tuple[list[Any], Callable[[list[Any]], Any]] | None:
    """``tree``'s children one level down and how to rebuild it from new ones; ``None`` for a
    leaf (a tensor, a number, an object neither pytree nor ``dataclasses`` knows)."""
    if isinstance(tree, Tensor):
        return None
    if depth > _MAX_DEPTH:
        raise RuntimeError(
            f"a module's inputs or outputs nest deeper than {_MAX_DEPTH} containers (a"
            f" {type(tree).__qualname__} that refers back to itself?); dmuon looks for the"
            " tensors in them as FSDP2 does"
        )
    node_type = _pytree._get_node_type(tree)
    if node_type in _pytree.SUPPORTED_NODES:
        spec = _pytree.SUPPORTED_NODES[node_type]
        children, context = spec.flatten_fn(tree)
        return list(children), lambda new: spec.unflatten_fn(new, context)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        names = [field.name for field in dataclasses.fields(tree)]
        old = [getattr(tree, name) for name in names]

        def rebuild(new: list[Any]) -> Any:
            copied = copy.copy(tree)
            for name, before, after in zip(names, old, new, strict=True):
                if after is not before:
                    object.__setattr__(copied, name, after)  # frozen dataclasses too
            return copied

        return old, rebuild
    return None


# The two functions of FSDP2's ``_fsdp_init`` that receive ``ignored_params``, looked up as
# module globals by ``_get_modules_and_states``, the one entry point of ``fully_shard`` and
# of ``replicate`` (torch 2.11 to 2.13).
FSDP_DISCOVERY_FUNCTIONS = ("_get_managed_modules", "_get_managed_states")


def fsdp_init_module() -> ModuleType:
    """``torch.distributed.fsdp._fully_shard._fsdp_init``, whose
    :data:`FSDP_DISCOVERY_FUNCTIONS` the optional ``fully_shard`` patch wraps.

    ``dedicate_params`` installs the patch unless told not to (see [Note: FSDP2 integration]
    in ``setup/_fsdp_integration``); ``ignored_params`` is the patch-free way. Imported on
    call: importing dmuon does not import FSDP2's internals."""
    from torch.distributed.fsdp._fully_shard import _fsdp_init

    return _fsdp_init


# How many of torch's pipeline metadata inferences are running (see
# :func:`pipeline_metadata_inference_running`).
_METADATA_INFERENCES = [0]
# The private methods of ``torch.distributed.pipelining``'s ``PipelineStage`` that run the
# stage's module on stand-in inputs before the first micro-batch: torch 2.13's dynamic metadata
# inference, forward and backward (whose backward runs the recompute of an activation
# checkpoint), and the shape inference of earlier releases.
_METADATA_INFERENCE_METHODS = (
    "_forward_metadata_inference",
    "_backward_metadata_inference",
    "_shape_inference",
)


def watch_pipeline_metadata_inference() -> None:
    """Make :func:`pipeline_metadata_inference_running` true while a ``PipelineStage`` of
    ``torch.distributed.pipelining`` runs its module to infer the shapes it sends (once per
    schedule, before the first micro-batch, and again after a switch between training and
    evaluation), forward or backward (an activation checkpoint's recompute runs the forward
    again there). Wraps the class's private :data:`_METADATA_INFERENCE_METHODS` (once: a
    second call changes nothing); the wrapper only counts. No public API tells a module's
    forward that it runs on a stage's stand-in inputs: torch 2.13 runs it with gradients on,
    the first stage on its real first micro-batch, the others on ``torch.empty`` tensors,
    whose values are whatever the memory held."""
    from torch.distributed.pipelining import PipelineStage

    for name in _METADATA_INFERENCE_METHODS:
        method = getattr(PipelineStage, name, None)
        if method is None or getattr(method, "_dmuon_counted", False):
            continue

        def counted(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
            _METADATA_INFERENCES[0] += 1
            try:
                return _method(*args, **kwargs)
            finally:
                _METADATA_INFERENCES[0] -= 1

        functools.update_wrapper(counted, method)
        counted._dmuon_counted = True  # type: ignore[attr-defined]
        setattr(PipelineStage, name, counted)


def pipeline_warmup_sends_to_self() -> bool:
    """Whether this torch's pipeline schedules warm up a stage and its neighbour on the same
    rank with a send and a receive (torch 2.11; see [Note: V schedules over gloo] in
    ``optim/_parts.py``). torch 2.13 warms up with ``PipelineStage._warmup_forward_vote``,
    which skips a neighbour on the same rank; no public API says which a torch does."""
    from torch.distributed.pipelining import PipelineStage

    version = tuple(int(v) for v in re.findall(r"\d+", torch.__version__)[:2])
    return version < (2, 13) and not hasattr(PipelineStage, "_warmup_forward_vote")


def pipeline_metadata_inference_running() -> bool:
    """Whether a pipeline stage's metadata inference is running (once
    :func:`watch_pipeline_metadata_inference` was called)."""
    return _METADATA_INFERENCES[0] > 0


_FSDP_SOURCES = ("torch/distributed/fsdp/_fully_shard/", "torch\\distributed\\fsdp\\_fully_shard\\")


def fsdp_init_running() -> bool:
    """Whether the calling code runs inside FSDP2's ``fully_shard`` (a frame of the function
    ``fully_shard`` of its private ``_fully_shard`` package is on the stack). Asked only on the
    way to an error (a dedicated weight read where it is not held), to say that ``fully_shard``
    took a dedicated parameter instead of naming the operation it failed on: no public API
    says which caller a tensor operation comes from."""
    return _fsdp_frame("fully_shard")


def fsdp_forward_method_running() -> bool:
    """Whether the calling code runs inside a method that ``register_fsdp_forward_method``
    wrapped (its ``wrapped_method``, which runs FSDP2's pre- and post-forward around the
    method, not the module's forward hooks). Asked only on the way to an error, as
    :func:`fsdp_init_running`."""
    return _fsdp_frame("wrapped_method")


_DCP_STATE_DICT_SOURCES = (
    "torch/distributed/checkpoint/state_dict.py",
    "torch\\distributed\\checkpoint\\state_dict.py",
)


@contextlib.contextmanager
def optimizer_state_dict_hooks_taken(
    optimizer: torch.optim.Optimizer, *, load: bool
) -> Iterator[tuple[list[Callable[..., Any]], list[Callable[..., Any]]]]:
    """The pre- and post-hooks of ``optimizer.state_dict`` (``load=False``) or of
    ``optimizer.load_state_dict`` (``load=True``), taken out of the optimizer for the block, so
    that torch's method called inside it runs none and the caller runs them around its whole
    work (a hook registered inside the block is kept).

    Uses ``Optimizer._optimizer_{load_,}state_dict_{pre,post}_hooks``: torch runs the hooks
    inside its own method, around torch's part of a subclass's dictionary, and no public API
    runs them apart from it."""
    kind = "load_state_dict" if load else "state_dict"
    names = (f"_optimizer_{kind}_pre_hooks", f"_optimizer_{kind}_post_hooks")
    held = [getattr(optimizer, name) for name in names]
    for name in names:
        setattr(optimizer, name, OrderedDict())
    try:
        yield list(held[0].values()), list(held[1].values())
    finally:
        for name, hooks in zip(names, held, strict=True):
            hooks.update(getattr(optimizer, name))
            setattr(optimizer, name, hooks)


def torch_optim_state_dict_running() -> bool:
    """Whether the calling code runs inside ``torch.distributed.checkpoint.state_dict``'s
    ``_get_optim_state_dict`` for its getters (``get_optimizer_state_dict``,
    ``get_state_dict``), which take ``optimizer.state_dict()`` for every rank's whole state or
    its DTensor shards. Not for its setters: ``_load_optim_state_dict`` asks the same function
    for the dictionary it loads into, which a dmuon optimizer's own ``load_state_dict``
    completes. No public API says which caller asks for a state dict."""
    names = {
        frame.f_code.co_name
        for frame in caller_frames()
        if any(s in frame.f_code.co_filename for s in _DCP_STATE_DICT_SOURCES)
    }
    return "_get_optim_state_dict" in names and "_load_optim_state_dict" not in names


def torch_state_dict_function() -> str | None:
    """The function of ``torch.distributed.checkpoint.state_dict`` the calling code runs
    inside, named by its outermost frame of that file (the public one the user called:
    ``get_optimizer_state_dict``, ``set_state_dict``, ...), or ``None``. Asked by
    :func:`set_fqn_modifiers`' callable, which only those functions call."""
    found = None
    for frame in caller_frames():
        if any(s in frame.f_code.co_filename for s in _DCP_STATE_DICT_SOURCES):
            found = frame.f_code.co_name
    return found


# The module attribute that torch.distributed.checkpoint.state_dict calls to learn which
# names its state_dict() leaves out of its keys (``dsd_fqn_modifiers``).
_FQN_MODIFIERS = "_fqn_modifiers"


def set_fqn_modifiers(
    module: torch.nn.Module, make: Callable[[Callable[[], dict[str, str]] | None], Any]
) -> None:
    """Replace ``module._fqn_modifiers`` by ``make(previous)`` (``previous``: the module's own,
    or ``None``). torch.distributed.checkpoint.state_dict's functions call it for every module
    on the path of every parameter name (``_get_fqns``) in ``_verify_options``, the first thing
    each of them does, on every rank alike, before it touches a tensor, an optimizer or a
    process group; nothing else in torch calls it. No public API runs code there."""
    previous = getattr(module, _FQN_MODIFIERS, None)
    setattr(module, _FQN_MODIFIERS, make(previous))


def _fsdp_frame(function: str) -> bool:
    return any(
        frame.f_code.co_name == function
        and any(s in frame.f_code.co_filename for s in _FSDP_SOURCES)
        for frame in caller_frames()
    )


def caller_frames() -> Iterator[FrameType]:
    """The Python frames on the stack, innermost first: how the errors above tell which code
    made a tensor operation (no public API says). Walked only on the way to an error."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        yield frame
        frame = frame.f_back


def fsdp_manages(fsdp_module: FSDPModule, module: torch.nn.Module, name: str) -> bool:
    """Whether ``fully_shard`` applied to ``fsdp_module`` manages the parameter ``name`` of
    ``module`` (it replaced it with its DTensor shard, or in a forward with its unsharded copy).
    Reads FSDP2's parameter groups (:func:`_fsdp_param_groups`) and each ``FSDPParam``'s
    ``_module_info``: told apart from a parameter replaced by an assignment, which no public
    API does."""
    return any(
        p._module_info.module is module and p._module_info.param_name == name
        for group in _fsdp_param_groups([fsdp_module])
        for p in group.fsdp_params
    )
