"""Reads of a dedicated weight where it is not held raise a clear error instead of crashing.

[Note: reads on a peer]

Between uses a peer's dedicated parameter keeps its full shape but its storage is resized to
zero (see [Note: storage of a dedicated parameter] in :mod:`._dedicated`). Any kernel that read it
then would read out of bounds: ``p.norm()`` or ``parameters_to_vector`` would crash the
process with SIGSEGV, ``print(p)`` and ``torch.save(model.state_dict())`` fail deep inside
torch.

So while its weight is not held on this rank, a dedicated parameter is a
:class:`GuardedParameter`: the same object the module registered (its class is switched in
place, so identity, names and ``isinstance(p, nn.Parameter)`` are unchanged), with a
``__torch_function__`` that refuses every operation that would touch its storage and raises a
``RuntimeError`` naming the parameter, its owner and the supported ways to read it. While the
weight is held (always on its owner; on a peer during its layer's forward and backward) the
parameter is a plain ``nn.Parameter`` again (its holder's state decides its class, see [Note:
a holder's states] in :mod:`._holder`), so its operations cost nothing
extra (a Python ``__torch_function__`` runs on every operation of a guarded class, which a
small model's forward would pay hundreds of times a step). Metadata
stays readable (shape, dtype, device, ``requires_grad``, ``.grad``, ``numel()``, hooks), and
``repr(p)`` says where the weight lives instead of printing values. Code that ``torch.compile``
traces skips the check (compiled blocks read their weights inside forward and backward, where
they are held, and so see a plain parameter), so the guard adds nothing to a compiled graph.

Conversions that would change nothing go through (``_unchanged``): ``p.to(device)``,
``p.cuda()``, ``p.cpu()`` or ``p.float()`` on the device and dtype ``p`` already has return
``p`` itself, which is how ``model.to(device)`` and its kin, which scripts call after building
the model as a matter of habit, find that a dedicated weight needs no conversion (see [Note:
conversions after packing] in ``_runtime``). Any real conversion (another dtype or device)
would read the values, and is refused like any other read.

A tensor-parallel dedicated parameter is a ``DTensor`` whose local shard is freed the same
way; its operations reach that shard through ``DTensor``'s dispatch, below any check on the
shard, and its methods ``to_local``, ``redistribute`` and ``full_tensor`` reach it without an
operation at all (reading it would crash with SIGSEGV). So while it is not held it is a
:class:`GuardedDTensor`, the same check in front of ``DTensor``'s dispatch and in those three
methods, and while it is held (on its owner, and on a peer during its layer's forward and
backward) it is a plain ``DTensor`` again: compiled code asserts the exact class of its
``DTensor`` inputs, and it only ever runs while the weight is held. Its TP partners
at the same data-parallel index share its role (one plan per TP grid), so a refused
``full_tensor`` (a collective over the TP mesh) is refused on each of them alike.

``DistributedDataParallel`` would broadcast and all-reduce the weights itself (and so read
them on peers): every module above a dedicated parameter carries a
``_ddp_params_and_buffers_to_ignore`` that raises when DDP reads it, on every rank alike, with
a message that names dmuon's replicated path (``dedicate_params_ddp`` + ``replicate``).

[Note: torch's paths that cannot reach a dedicated weight]
Four of torch's own paths would touch dedicated weights only where they happen to be held, and
fail or do nothing elsewhere, without a word:

- ``model.load_state_dict(state_dict)`` copies each value into its parameter module by module
  and reports the failures at the end: on the owner a dedicated weight would take the new
  value while FSDP2's shards refuse theirs, leaving the model a mix of two checkpoints
  (torch's ``set_model_state_dict`` reaches the same copies). So on the sharded path
  (``dedicate_params``) every module that holds dedicated parameters has a load pre-hook
  (``refuse_module_load``) that raises when the dictionary has a value for one of them, before
  the module loads anything, naming dmuon's loads. Modules loaded before it hold no dedicated
  weight; FSDP2's shards among them refuse plain values as without dmuon. (The replicated
  path, where every rank keeps every weight, loads through ``model.load_state_dict``.)
- a torch optimizer given a dedicated parameter (``AdamW(model.parameters())``) would never
  change it: its gradient goes to the owner through dmuon's runtime and never reaches
  ``.grad``, which an optimizer reads as "no gradient this step". So ``dedicate_params``
  installs one global step pre-hook (``refuse_foreign_optimizers``) that raises in the first
  ``step()`` of any optimizer other than dmuon's whose groups hold a dedicated parameter, and
  again whenever its groups change size.
- the functions of ``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict``,
  ``get_optimizer_state_dict``, ``get_state_dict`` and their ``set_`` twins) read and write
  each weight and its optimizer state where it is held, and start a fresh optimizer with a
  step of their own at lr 0 after setting every ``.grad``. The ranks that do not hold a
  weight would raise ``NotHeldError`` there, while a rank that owns every matrix would go on
  into that step's collectives (or a full state dict's gathers), which the others never
  reach, with its learning rates left at 0; ``set_model_state_dict(broadcast_from_rank0=True)``
  would write every FSDP2 shard before the first dedicated module's load refused. Every
  module that holds dedicated parameters therefore carries a ``_fqn_modifiers``
  (``refuse_torch_state_dict``): each of those functions calls it for every parameter name as
  its first step (``_verify_options``), on every rank alike, before anything is read, changed
  or communicated, and it raises there, naming dmuon's function. On the replicated path,
  where every rank holds every weight, torch's model functions go on; those that take the
  optimizer raise there too.
- ``model.state_dict()`` is what a hand-written ``dcp.save({"model": model.state_dict()})``
  (or ``dcp.save({"model": model})``, a ``Stateful``) saves. The ranks that do not hold a
  weight would raise ``NotHeldError`` at it, while a rank that owns every matrix would get a
  dictionary and go on into ``dcp.save``'s collectives alone (a hang until the timeout). No
  value of a state dict can stand for "whole on one rank, absent elsewhere" as FSDP2's
  ``DTensor`` shards do for theirs, so where some rank does not hold the dedicated weights
  (more than one rank per shard group, on the sharded path) every module that holds one has a
  state-dict pre-hook (``refuse_module_state_dict``) that raises ``NotHeldError`` on every
  rank alike, its owner's included, before the module reads anything, naming
  ``dmuon.AppState`` and ``dmuon.save_checkpoint`` (and, where a known caller such as
  ``save_pretrained`` made the call, what to do there). ``state_dict(keep_vars=True)`` reads no
  value (it hands back the parameters, whose metadata a peer can read) and goes on: dmuon's
  own checkpoints list the keys through it. ``dedicate_params`` registers these hooks before
  the runtime registers its own state-dict pre-hook on the same modules (see [Note: state
  dicts see the parameters] in ``runtime/_hooks``), so a refused call changes nothing.

A module that registers a dedicated weight under another name (a head tied to a dedicated
embedding) holds it as much as the module it was dedicated under: ``model.lm_head.state_dict()``
or ``load_state_dict`` reaches the weight through it alone. It carries the same refusals, and
``DistributedDataParallel`` around it is refused too.

The optimizers' step pre-hook (``refuse_foreign_optimizers``) also refuses a torch optimizer over a parameter that a ``dmuon.Muon`` alive steps
(``register_dmuon_optimizer``), FSDP2's included: ``Muon(model)`` steps every trainable
parameter, the ones it does not orthogonalise with AdamW, so a second optimizer beside it (the
Adam of a Muon + Adam recipe such as modded-nanogpt's, kept for the embeddings and the head)
would step them twice per step, without a word. It raises again when its groups change size or
a ``dmuon.Muon`` is built after its last check. An optimizer that holds others in
``optimizers`` (torchtitan's ``OptimizersContainer``, whose own groups hold all of its members'
parameters, dmuon.Muon's too) is left to them: its ``step()`` steps each member, whose own
``step()`` the hook checks.

The empty ``.grad`` of a dedicated weight also makes accelerate's
``Accelerator.clip_grad_norm_(model.parameters(), ...)`` (and ``clip_grad_value_``) silently
wrong: it takes the norm of the gradients it finds in
``.grad``, the FSDP2 ones, and clips them alone, so the dedicated weights' gradients count
for nothing and keep their size. dmuon does not import accelerate; ``refuse_accelerate_clip``,
called by ``dedicate_params`` and at the end of every backward (a clip follows one, and the
check costs a dictionary lookup), wraps those two methods once accelerate is imported, so
that given a dedicated parameter they raise on every rank alike, before anything is clipped,
naming dmuon's clip; other parameters go to accelerate's own.
``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` and ``clip_grad_value_`` miss them
the same way, the first line of clipping in an FSDP2 script that gains dmuon.
``refuse_torch_clip``, called by ``dedicate_params``, wraps both, in ``torch.nn.utils`` and
``torch.nn.utils.clip_grad``, so that given a dedicated parameter they raise on every rank alike
before anything is clipped; other parameters go to torch's own. A script that bound
``clip_grad_norm_`` before (``from torch.nn.utils import clip_grad_norm_`` at its top) calls
torch's function itself, which takes the norm and then calls ``_clip_grads_with_norm_`` by its
module's name: that name is wrapped too, so the clip still raises, alike on every rank, after a
norm that every rank took alike and before anything is scaled. ``clip_grads_with_norm_`` (the
public name of the same function) is left as it is: torchtitan's clip hands it every
parameter and clips the FSDP2 gradients by a norm it took over them, beside the Muon clip of
the torchtitan integration.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .._torch_internals import (
    caller_frames,
    compiled_autograd_on,
    disable_torch_function_subclass,
    fsdp_forward_method_running,
    fsdp_init_running,
    parse_to_args,
    set_fqn_modifiers,
    torch_state_dict_function,
)

__all__ = [
    "DEEPCOPY_FIX",
    "FULLY_SHARD_FIX",
    "RUN",
    "STEPS_DEDICATED",
    "GuardedDTensor",
    "GuardedParameter",
    "NotHeldError",
    "StateClass",
    "attach_holder",
    "compiled_autograd_error",
    "guard_parameter",
    "holder_of",
    "instances",
    "is_dedicated",
    "is_safe",
    "refuse_accelerate_clip",
    "refuse_ddp",
    "refuse_foreign_optimizers",
    "refuse_module_load",
    "refuse_module_state_dict",
    "refuse_torch_clip",
    "refuse_torch_state_dict",
    "register_dmuon_optimizer",
]

# Tensor-valued properties: each returns a tensor aliasing the (absent) storage.
_ALIASING_PROPERTIES = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})
# Methods that read metadata only, or register hooks.
_METADATA_METHODS = frozenset(
    {
        "numel",
        "nelement",
        "dim",
        "ndimension",
        "size",
        "stride",
        "storage_offset",
        "element_size",
        "is_floating_point",
        "is_complex",
        "is_contiguous",
        "is_signed",
        "get_device",
        "untyped_storage",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "requires_grad_",
        "__len__",
        "__hash__",
        "_has_compatible_shallow_copy_type",  # nn.Module._apply compares tensor types
        # New tensors that take only the dtype and device (``*_like``: and the shape) of the
        # weight and none of its values: an initialisation may assemble a weight from
        # ``w.new_empty(...)`` pieces and ``copy_`` them in (torchtitan's fused q/k/v does), or
        # make its bounds with ``w.new_tensor(bound)`` (torch's ``trunc_normal_`` does).
        "new_tensor",
        "new_empty",
        "new_zeros",
        "new_ones",
        "new_full",
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
    }
)
_WHERE = "_dmuon_where"


class NotHeldError(RuntimeError):
    """A dedicated weight (or its ``.grad``) was read or written on a rank that does not hold
    it right now; or ``state_dict()`` was called on a module that holds one where some rank
    does not hold it (the sharded path with more than one rank per shard group), which raises
    on every rank, its owner's included."""


FULLY_SHARD_FIX = (
    "Let dedicate_params install its fully_shard patch (the default, patch_fully_shard=True) "
    "so that a plain fully_shard(layer, mesh=mesh) skips dedicated parameters, or pass "
    "ignored_params=dmuon.dedicated_params_of(model) to every fully_shard call (each layer and "
    "the root, after dedicate_params)"
)


def is_safe(func: Any) -> bool:
    """Whether ``func`` reads only a tensor's metadata (or registers a hook on it)."""
    name = _name(func)
    if name in ("__get__", "__set__", "__delete__"):
        return name == "__get__" and _attribute(func) not in _ALIASING_PROPERTIES
    return name in _METADATA_METHODS


def _drops_grad(func: Any, args: tuple[Any, ...]) -> bool:
    """Whether ``func`` drops the parameter's gradient (``p.grad = None``, ``del p.grad``):
    what ``zero_grad`` does to every parameter, a peer's too, whose gradient is its own local
    one while ``no_sync`` accumulates (see ``runtime/_no_sync``). It reads no weight."""
    name = _name(func)
    if name not in ("__set__", "__delete__"):
        return False
    if _attribute(func) != "grad":
        return False
    return name == "__delete__" or (len(args) > 1 and args[1] is None)


def _accumulator_view(func: Any, args: tuple[Any, ...]) -> bool:
    """Whether ``func`` is ``p.view_as(p)``, the idiom that finds a parameter's gradient
    accumulator (``.grad_fn.next_functions[0][0]`` of the view)."""
    return _name(func) == "view_as" and len(args) == 2 and args[1] is args[0]


def _name(func: Any) -> str:
    return getattr(func, "__name__", "")


def _attribute(func: Any) -> str:
    """The name of the attribute whose descriptor ``func`` (a ``__get__``, ``__set__`` or
    ``__delete__``) belongs to: ``"grad"`` for ``.grad``'s."""
    return getattr(getattr(func, "__self__", None), "__name__", "")


# Tensor methods that convert to one dtype (``nn.Module.float()`` and its kin call them).
_DTYPE_METHODS = {
    "float": torch.float32,
    "double": torch.float64,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _unchanged(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``func`` is a conversion that leaves the tensor ``args[0]`` as it is (and so
    returns it); see [Note: reads on a peer]."""
    name = _name(func)
    t = args[0] if args else None
    if not isinstance(t, torch.Tensor):
        return False
    memory_format = kwargs.get("memory_format")
    if name == "to":
        if kwargs.get("copy"):
            return False
        rest = {k: v for k, v in kwargs.items() if k != "copy"}
        device, dtype, _, memory_format = parse_to_args(*args[1:], **rest)
    elif name in ("cuda", "cpu") and len(args) <= 2:
        requested = args[1] if len(args) == 2 else kwargs.get("device")
        device = torch.device("cpu") if name == "cpu" else _cuda_device(requested)
        dtype = None
    elif name in _DTYPE_METHODS and len(args) == 1:
        device, dtype = None, _DTYPE_METHODS[name]
    else:
        return False
    return (
        _same_device(device, t.device)
        and dtype in (None, t.dtype)
        and memory_format in (None, torch.preserve_format)
    )


def _cuda_device(requested: Any) -> torch.device:
    if isinstance(requested, int):
        return torch.device("cuda", requested)
    return torch.device(requested) if requested is not None else torch.device("cuda")


def _same_device(requested: torch.device | None, actual: torch.device) -> bool:
    if requested is None:
        return True
    requested = torch.device(requested)
    if requested.type != actual.type:
        return False
    if requested.index is None and actual.type == "cuda":
        return actual.index == torch.cuda.current_device()
    return requested.index is None or requested.index == actual.index


def instances(values: Iterable[Any], cls: type) -> Iterator[Any]:
    """The ``cls`` instances among ``values`` and one level of their lists and tuples (torch
    passes tensor lists as arguments)."""
    for value in values:
        items = value if isinstance(value, list | tuple) else (value,)
        yield from (item for item in items if isinstance(item, cls))


# What ``StateClass._intercept`` returns to let an operation run as on a plain tensor.
RUN = object()


class StateClass:
    """What the classes a holder gives its parameter in a state share (see [Note: a holder's
    states] in ``_holder``): every torch function on one passes :meth:`_intercept` first, and
    then runs as on a plain tensor."""

    __slots__ = ()  # a mixin: the classes it joins keep torch.Tensor's layout

    @classmethod
    def __torch_function__(
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        result = cls._intercept(func, args, kwargs)
        if result is not RUN:
            return result
        # What nn.Parameter's own handler does (results stay plain tensors), written so that
        # torch.compile traces it: see [Note: reads on a peer].
        with disable_torch_function_subclass():
            return func(*args, **kwargs)

    @classmethod
    def _intercept(cls, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The result of ``func`` when this state decides it, else ``RUN``."""
        return RUN


class _Guard(StateClass):
    """What both guarded classes share: the check before every operation and what ``repr``
    says of an absent weight; see [Note: reads on a peer]. A parameter has a guarded class
    exactly while its holder does not hold its weight."""

    __slots__ = ()

    @classmethod
    def _intercept(cls, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if torch.compiler.is_compiling() or is_safe(func) or _drops_grad(func, args):
            return RUN
        absent = next(instances([*args, *kwargs.values()], _Guard), None)
        if absent is None:
            return RUN
        if _unchanged(func, args, kwargs):
            return args[0]
        if _writes_unplaced(func, args, kwargs):
            return _write_to_scratch(func, args, kwargs)
        holder = holder_of(absent)
        if fsdp_init_running():
            # See [Note: a fully_shard that takes a dedicated parameter] in runtime/_runtime.
            raise RuntimeError(
                f"{holder.where} was taken by fully_shard (it read the weight to shard it). "
                f"{FULLY_SHARD_FIX}"
            )
        if compiled_autograd_on():
            # See [Note: compiled autograd].
            raise compiled_autograd_error()
        operation = _qualname(func)
        if operation in _AUTOGRAD_CALLS:
            hint = _AUTOGRAD
        elif _accumulator_view(func, args) and holder.reduced_at_step:
            hint = _SPLIT_BACKWARD
        elif operation == "set .grad":
            hint = _GRAD_BY_HAND
        else:
            hint = _read_from(absent)
        raise NotHeldError(holder.not_held_message(operation, hint))

    def _absent_repr(self) -> str:
        """What ``repr`` says while the weight is not held here."""
        t = cast(torch.Tensor, self)
        return (
            f"{type(self).__name__}(shape={tuple(t.shape)}, dtype={t.dtype}, "
            f"device={t.device}: {holder_of(self).where}, not held on this rank between steps)"
        )


class GuardedParameter(_Guard, nn.Parameter):
    """The class of a dedicated ``nn.Parameter`` while its weight is not held here; see
    [Note: reads on a peer]."""

    def __repr__(self) -> str:  # type: ignore[override]  # as nn.Parameter's own
        return self._absent_repr()


class GuardedDTensor(_Guard, DTensor):
    """The class of a dedicated tensor-parallel parameter (a ``DTensor``) while its local
    shard is freed, on a peer between uses: the check runs before ``DTensor``'s own dispatch,
    and before its methods that reach the local shard without an operation (``to_local``,
    ``redistribute``, ``full_tensor``)."""

    def __repr__(self) -> str:  # type: ignore[override]  # DTensor's own takes no arguments
        return self._absent_repr()

    def _refuse(self, method: Any) -> None:
        raise NotHeldError(holder_of(self).not_held_message(_qualname(method), _read_from(self)))

    def to_local(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._refuse(DTensor.to_local)
        return super().to_local(*args, **kwargs)

    def redistribute(self, *args: Any, **kwargs: Any) -> DTensor:
        self._refuse(DTensor.redistribute)
        return super().redistribute(*args, **kwargs)

    def full_tensor(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._refuse(DTensor.full_tensor)
        return super().full_tensor(*args, **kwargs)


_PARAMETRIZE_FILES = ("nn/utils/parametrize.py", "nn/utils/parametrizations.py")
# What to do instead of copying a model after dedicate_params (here and the runtime's refusal).
DEEPCOPY_FIX = (
    "For an average of the weights use dmuon.EMA(optimizer), which keeps it where each weight "
    "is stepped; for a copy of the weights as they are now (after training, say), build the "
    "model again and load dmuon.get_model_state_dict(model) into it (collective: call it on "
    "every rank); to start another run from the same initial weights, copy the model before "
    "dedicate_params"
)
_NO_DEEPCOPY = (
    "copy.deepcopy cannot copy a model after dedicate_params (torch.optim.swa_utils."
    "AveragedModel copies its model so), as it cannot copy one after fully_shard: its weights "
    f"live on their owners and its hooks reach dmuon's process groups. {DEEPCOPY_FIX}."
)

# Hugging Face calls that read every weight of a model: (function, file, what to do instead).
_SAVE_PRETRAINED = (
    "transformers' save_pretrained reads every weight of the model: gather them with "
    "dmuon.get_model_state_dict(model, rank0_only=True) on every rank and write them from a "
    "copy of the model on the meta device (the checkpoints guide, 'Hugging Face export')."
)
_ACCELERATE = (
    "accelerate read every weight of the model (its FSDP plugin's prepare, save_state, "
    "get_state_dict or save_model): use no FSDP plugin, and dmuon.save_checkpoint for "
    "checkpoints (the Hugging Face guide, 'A training loop of your own with accelerate')."
)
_PEFT_SAVE_PRETRAINED = (
    "PEFT's save_pretrained reads every weight of the model (its state_dict) to keep the "
    "adapter's: hand it the gathered weights, model.save_pretrained(path, "
    "state_dict=dmuon.get_model_state_dict(model, rank0_only=True), is_main_process=rank == 0), "
    "called on every rank (the FAQ, 'Adapters and LoRA')."
)
_PEFT_MERGE = (
    "PEFT's merge adds each adapter into its base weight, which FSDP2 holds sharded and dmuon "
    "whole on the adapter's owner only: gather the weights with dmuon.get_model_state_dict(model) "
    "on every rank and merge in an unsharded copy of the PEFT model loaded from them (the FAQ, "
    "'Adapters and LoRA')."
)
_FLOAT8_AFTER = (
    "torchao's convert_to_float8_training swaps the modules that hold the weights (and wraps "
    "each weight under enable_fsdp_float8_all_gather=True), which dmuon's hooks and guards "
    "are on: call it before dedicate_params, with enable_fsdp_float8_all_gather=False for the "
    "modules of the Muon matrices (the torchtitan guide, 'Float8 training')."
)
_FSDP1 = (
    "torch's FSDP1 (FullyShardedDataParallel) flattens every weight of the model it wraps into "
    "its own shards, dedicated ones too: dmuon works with FSDP2's fully_shard, not FSDP1. "
    "Replace FullyShardedDataParallel(model, ...) by fully_shard(layer, mesh=mesh) for each "
    "layer, then fully_shard(model, mesh=mesh), after dedicate_params."
)
_WHOLE_MODEL_READERS = (
    ("__init__", "torch/distributed/fsdp/fully_sharded_data_parallel.py", _FSDP1),
    ("from_float", "torchao/float8/float8_linear.py", _FLOAT8_AFTER),
    ("save_pretrained", "transformers/modeling_utils.py", _SAVE_PRETRAINED),
    ("save_pretrained", "peft/peft_model.py", _PEFT_SAVE_PRETRAINED),
    ("merge_and_unload", "peft/tuners/tuners_utils.py", _PEFT_MERGE),
    ("merge_adapter", "peft/tuners/tuners_utils.py", _PEFT_MERGE),
    ("prepare", "accelerate/accelerator.py", _ACCELERATE),
    ("save_state", "accelerate/accelerator.py", _ACCELERATE),
    ("get_state_dict", "accelerate/accelerator.py", _ACCELERATE),
    ("save_model", "accelerate/accelerator.py", _ACCELERATE),
)

# torch.autograd.grad(outputs, inputs) and Tensor.backward(inputs=...) given a dedicated weight.
_AUTOGRAD_CALLS = ("grad", "backward", "Tensor.backward")


def compiled_autograd_error() -> RuntimeError:
    """The error of a backward that torch's compiled autograd captures; see [Note: compiled
    autograd]."""
    return RuntimeError(
        "dmuon does not support compiled autograd (torch._dynamo.compiled_autograd, or "
        "torch._dynamo.config.compiled_autograd=True): its capture reads every dedicated weight, "
        "which a peer does not hold between forward and backward, and dmuon's backward hooks "
        "issue collectives and queue a callback on the autograd engine, which a captured "
        "backward cannot run. Run loss.backward() with compiled autograd off; torch.compile of "
        "the blocks, the model or the loss function works (see the torch.compile guide). After "
        "this error, recover as after any backward that raised: model.reset_iter_state() on "
        "the root module, then optimizer.zero_grad()"
    )


_AUTOGRAD = (
    "torch.autograd.grad and backward(inputs=...) cannot take a dedicated weight: its gradient "
    "reaches its owner through the reduce that a backward of the whole loss starts on every "
    "rank (FSDP2's sharded parameters get no gradient from them either). Call loss.backward() "
    "without inputs on every rank; to differentiate with respect to activations, pass those."
)

# p.grad = g on a dedicated weight (see [Note: a gradient set by hand] in runtime/_runtime).
_GRAD_BY_HAND = (
    "A .grad written by hand (p.grad = g after torch.autograd.grad(loss, params)) never reaches "
    "the owner: a dedicated gradient travels only from a backward's gradient accumulation. "
    "Compute the gradients with loss.backward() on every rank."
)


# A zero-bubble or V schedule's backward of the stage's inputs looks up every weight's gradient
# accumulator first (see [Note: weight gradients a schedule writes] in runtime/_hooks).
_SPLIT_BACKWARD = (
    "A zero-bubble or V pipeline schedule (ScheduleInterleavedZeroBubble, "
    "ScheduleZBVZeroBubble, ScheduleDualPipeV) computes the weights' gradients apart from the "
    "inputs', after the layer's backward, when ZeRO-3 has freed a peer's weights again. Keep "
    "them gathered through the schedule: dedicate_params(..., reshard_after_forward=False) "
    "(ZeRO-2), with fully_shard(..., reshard_after_forward=False) as torchtitan sets under a "
    "pipeline; or use a schedule without a split backward (ScheduleGPipe, Schedule1F1B, "
    "ScheduleInterleaved1F1B, ScheduleLoopedBFS)."
)


def _whole_model_reader() -> str:
    """What to do instead of the known caller on the stack that reads every weight of the
    model (``save_pretrained``, accelerate's state functions, ...); empty when none."""
    for frame in caller_frames():
        file = frame.f_code.co_filename.replace("\\", "/")
        for function, source, hint in _WHOLE_MODEL_READERS:
            if frame.f_code.co_name == function and file.endswith(source):
                return hint
    return ""


def _read_from(param: Any) -> str:
    """What the caller's stack says of a refused read (walked only when one is refused): a
    parametrization being registered, or the forward of a module that does not hold the
    weight. Empty when neither."""
    if fsdp_forward_method_running():
        return (
            "It was read in a method registered with register_fsdp_forward_method, which "
            "gathers FSDP2's parameters but not dmuon's: a dedicated weight is gathered for "
            "its layer's forward (a call of the module). Call the layer itself from that "
            "method, or register the method on the root module and have it call the layers."
        )
    for frame in caller_frames():
        code = frame.f_code
        if code.co_name == "deepcopy" and code.co_filename.endswith("copy.py"):
            return _NO_DEEPCOPY
        file = code.co_filename.replace("\\", "/")
        for function, source, hint in _WHOLE_MODEL_READERS:
            if code.co_name == function and file.endswith(source):
                return hint
        if file.endswith(_PARAMETRIZE_FILES):
            return (
                "A parametrization (torch.nn.utils.parametrize, weight_norm, spectral_norm, "
                "orthogonal) reads the weight when it is registered: register it before "
                "dedicate_params, whose predicate then selects the matrix it keeps: "
                "'<module>.parametrizations.weight.original' ('original1', the direction, "
                "under weight_norm, whose 'original0' is the (out, 1) magnitude)."
            )
        module = frame.f_locals.get("self") if code.co_name == "forward" else None
        if isinstance(module, nn.Module):
            if any(p is param for p in module.parameters()):
                return ""
            return (
                f"It was read in the forward of a {type(module).__name__} that does not hold "
                "it: a dedicated weight is gathered for the forward and backward of its own "
                "layer, so another layer finds it freed on the ranks that do not own it (and "
                "its owner waits for them). Use the weight in its own module or in a module "
                "that holds both uses, or keep it gathered from its forward to its backward "
                "(reshard_after_forward=False) where a later layer reads an earlier one's."
            )
    return ""


def _qualname(func: Any) -> str:
    """How a refused operation is named: an attribute's setter by its attribute (``set .grad``:
    torch's optimizer state functions set every parameter's gradient), else the function."""
    name = _name(func)
    if name in ("__set__", "__delete__"):
        return f"{'set' if name == '__set__' else 'delete'} .{_attribute(func) or '?'}"
    return str(getattr(func, "__qualname__", None) or name or repr(func))


def _written(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The tensor an in-place function writes: its first argument (``nn.init`` functions pass
    it to ``__torch_function__`` as the keyword ``tensor``)."""
    return args[0] if args else kwargs.get("tensor", kwargs.get("input"))


def _writes_unplaced(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``func`` writes in place into a peer's plain dedicated weight that was never
    packed (a meta-device model's after ``to_empty``)."""
    holder = holder_of(_written(args, kwargs))
    return _name(func).endswith("_") and holder is not None and holder.unplaced


def _write_to_scratch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run the in-place ``func`` on a scratch tensor of the written weight's shape, dtype and
    device, and return the scratch instead of the weight: an initialisation run on every rank
    draws from the generators exactly as on the owner (see [Note: meta-device models] in
    ``runtime/_runtime``), also one that reads back what it drew through the returned tensor
    (torch's ``trunc_normal_`` redraws the values that fall outside its bounds: how often it
    draws depends on them). The peer keeps nothing once the caller drops the scratch."""
    t = _written(args, kwargs)
    with disable_torch_function_subclass():
        scratch = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        if args:
            func(scratch, *args[1:], **kwargs)
        else:
            func(**{k: scratch if v is t else v for k, v in kwargs.items()})
    return scratch


def check_guardable(param: nn.Parameter, where: str) -> None:
    """Raise ``TypeError`` unless :func:`guard_parameter` can take ``param`` (``dedicate_params``
    asks it of every parameter before it takes any)."""
    if type(param) not in (nn.Parameter, GuardedParameter) and not isinstance(param, DTensor):
        fix = (
            _FSDP_ALL_GATHER_FIX
            if callable(getattr(param, "fsdp_pre_all_gather", None))
            else "leave it out of the predicate"
        )
        raise TypeError(
            f"{where}: dmuon can dedicate a plain nn.Parameter or a tensor-parallel DTensor "
            f"parameter, not a {type(param).__name__}; {fix}"
        )


# [Note: a weight that customises FSDP2's all-gather]
# A parameter class with ``fsdp_pre_all_gather`` changes what FSDP2's all-gather sends (torchao's
# ``WeightWithDynamicFloat8CastTensor``, which ``convert_to_float8_training`` gives each weight
# under ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``, sends it in float8). A
# dedicated weight is never all-gathered: its owner broadcasts it whole, in its own dtype, and
# ``Float8Linear`` casts a plain weight to float8 in its forward with the same tensor-wise
# scale, so the Muon modules need no such class and keep their float8 matmuls without it.
_FSDP_ALL_GATHER_FIX = (
    "its class customises FSDP2's all-gather (fsdp_pre_all_gather: torchao's float8 "
    "all-gather weight), which dmuon's broadcast of a dedicated weight never runs. Convert "
    "the modules of the Muon matrices with Float8LinearConfig(enable_fsdp_float8_all_gather="
    "False) (their matmuls stay float8: the owner broadcasts the weight and Float8Linear casts "
    "it), and the others with it on if you like, in two convert_to_float8_training calls with "
    "module_filter_fn; or leave the parameter out of the predicate"
)


def guard_parameter(param: nn.Parameter, where: str) -> None:
    """Mark ``param`` as dedicated (see [Note: reads on a peer]); ``where`` names it and its
    owner in error messages. Its holder (:func:`attach_holder`) then decides its class."""
    check_guardable(param, where)
    param.__dict__[_WHERE] = where


# Each dedicated parameter's holder, by the parameter's id (a holder owns its parameter, so
# the id names one live object for as long as the entry lives). Kept out of the parameter's
# ``__dict__``, which pickling a parameter saves and ``torch.load(weights_only=True)`` reads.
_HOLDERS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def attach_holder(param: nn.Parameter, holder: object, replaced: object = None) -> None:
    """Let the guard of ``param`` reach its holder (``replaced``: the holder's previous
    parameter, which leaves it)."""
    if replaced is not None and replaced is not param:
        _HOLDERS.pop(id(replaced), None)
    _HOLDERS[id(param)] = holder


def holder_of(param: object) -> Any:
    """The holder of ``param`` (``None``: it has none)."""
    return _HOLDERS.get(id(param))


def is_dedicated(param: object) -> bool:
    """Whether ``dedicate_params`` took ``param`` over."""
    return _WHERE in getattr(param, "__dict__", {})


class _RefuseDDP:
    """The value of ``_ddp_params_and_buffers_to_ignore`` on a module that holds dedicated
    parameters: DistributedDataParallel reads it first, on every rank, and fails here.

    [Note: DDP around a model already sharded]
    A framework may wrap every model it is handed in DDP: accelerate's ``prepare(model)`` does
    without an FSDP plugin, Lightning's DDP strategies do. A model that ``fully_shard`` already
    sharded needs no wrapper, and telling its user to apply ``dedicate_params`` + ``fully_shard``,
    which they did, sends them in a circle; so the message says to keep the framework from
    wrapping it, and how for these two. Lightning wraps the LightningModule, which holds the
    sharded model as a child: a ``fully_shard`` anywhere inside the module tells, alike on
    every rank.
    """

    def __init__(self, module: nn.Module, where: str) -> None:
        self.module = weakref.ref(module)
        self.where = where

    def __iter__(self) -> Iterator[str]:
        module = self.module()
        if module is not None and any(isinstance(m, FSDPModule) for m in module.modules()):
            raise RuntimeError(
                f"DistributedDataParallel cannot wrap {self.where}: fully_shard already "
                "sharded it (or modules inside it), and FSDP2 and dmuon reduce its gradients, "
                "so it needs no DDP wrapper. Keep the framework from wrapping it: under accelerate, prepare the "
                "model with accelerator.prepare_model(model, device_placement=False, "
                "evaluation_mode=True) and the optimizer, scheduler and data with "
                "accelerator.prepare(...) (the Hugging Face guide, 'A training loop of your own "
                "with accelerate'); under Lightning, use ModelParallelStrategy"
            )
        raise RuntimeError(
            f"DistributedDataParallel cannot wrap {self.where}: its dedicated parameters are "
            "held whole only on their owner ranks, and DDP would broadcast and all-reduce them "
            "on every rank. For replicated data parallelism use dmuon.dedicate_params_ddp(model, "
            "mesh, predicate) + dmuon.replicate(model, mesh) instead; to shard, dedicate_params "
            "+ fully_shard (HSDP with replicate_mesh=... to replicate across nodes)"
        )


def refuse_ddp(module: nn.Module, where: str) -> None:
    """Make ``DistributedDataParallel(module)`` raise with a message naming dmuon's path."""
    module._ddp_params_and_buffers_to_ignore = _RefuseDDP(module, where)  # type: ignore[assignment]


def refuse_module_load(module: nn.Module, names: Mapping[str, str]) -> None:
    """Make ``load_state_dict`` raise at ``module`` when the dictionary has a value for one of
    its dedicated parameters (``names``: attribute name -> FQN), before the module loads
    anything; see [Note: torch's paths that cannot reach a dedicated weight]."""

    def refuse(module: nn.Module, state_dict: Mapping[str, Any], prefix: str, *_: Any) -> None:
        for name, fqn in names.items():
            if prefix + name in state_dict:
                raise RuntimeError(
                    f"load_state_dict: {prefix + name!r} is the dedicated parameter {fqn!r},"
                    " which dmuon keeps whole on its owner rank only, so torch's"
                    " load_state_dict would change it there alone; nothing of dmuon's weights"
                    " was changed. Load a full state dict with dmuon.set_model_state_dict("
                    "model, state_dict) (collective; broadcast_from_rank0=True reads it on rank"
                    " 0 only) and a sharded checkpoint with dmuon.load_checkpoint(path, model,"
                    " optimizer) or dmuon.AppState(model, optimizer); torch's"
                    " set_model_state_dict cannot reach them either"
                )

    module.register_load_state_dict_pre_hook(refuse)


def refuse_module_state_dict(module: nn.Module, name: str, fqn: str, owner: int) -> None:
    """Make ``module.state_dict()`` raise ``NotHeldError`` on every rank, before the module
    reads anything, unless ``keep_vars=True``: ``module`` holds the dedicated parameter
    ``fqn`` (its attribute ``name``, owned by rank ``owner``), which some rank does not hold;
    see [Note: torch's paths that cannot reach a dedicated weight]."""

    def refuse(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if keep_vars:
            return
        hint = _whole_model_reader()
        key = "" if prefix + name == fqn else f" (key {prefix + name!r})"
        raise NotHeldError(
            f"{type(module).__name__}.state_dict() would read the dedicated parameter"
            f" {fqn!r}{key}, which dmuon keeps whole on its owner, rank {owner}, alone: the"
            " other ranks could not read it, and a dictionary that held it"
            " on its owner only would send the owner on into the collectives of whatever"
            " takes it (dcp.save), which the others never reach. So state_dict() is refused"
            " on every rank, the owner's included, before anything is read."
            f"{' ' + hint if hint else ''} For a sharded checkpoint use"
            " dmuon.save_checkpoint(path, model, optimizer), or put dmuon.AppState(model,"
            " optimizer) in the dictionary you hand to dcp.save / dcp.load in place of the"
            " model's state dict; for the full weights dmuon.get_model_state_dict(model)"
            " (collective: call it on every rank). state_dict(keep_vars=True) lists the"
            " parameters without reading them"
        )

    module.register_state_dict_pre_hook(refuse)


# What to call instead of each of torch.distributed.checkpoint.state_dict's functions.
_DMUON_STATE_DICT_FUNCTIONS = {
    "get_model_state_dict": "dmuon.get_model_state_dict(model)",
    "set_model_state_dict": "dmuon.set_model_state_dict(model, state_dict)",
    "get_optimizer_state_dict": "dmuon.get_optimizer_state_dict(model, optimizer)",
    "set_optimizer_state_dict": "dmuon.set_optimizer_state_dict(model, optimizer, state_dict)",
    "get_state_dict": (
        "dmuon.get_model_state_dict(model) and dmuon.get_optimizer_state_dict(model, optimizer)"
    ),
    "set_state_dict": (
        "dmuon.set_model_state_dict(model, model_state_dict) and"
        " dmuon.set_optimizer_state_dict(model, optimizer, optim_state_dict)"
    ),
}
# The functions that reach the model alone: allowed on the replicated path, where every rank
# holds every weight.
_MODEL_STATE_DICT_FUNCTIONS = ("get_model_state_dict", "set_model_state_dict")


class _RefuseTorchStateDict:
    """The ``_fqn_modifiers`` of a module that holds the dedicated parameter ``fqn``: raises
    when a function of ``torch.distributed.checkpoint.state_dict`` calls it (on the replicated
    path one that takes the optimizer), and otherwise answers as the module's own
    ``previous`` one (none: no modifiers)."""

    def __init__(
        self, fqn: str, replicated: bool, previous: Callable[[], dict[str, str]] | None
    ) -> None:
        self.fqn = fqn
        self.replicated = replicated
        self.previous = previous

    def __call__(self) -> dict[str, str]:
        function = torch_state_dict_function()
        if function is not None and not (
            self.replicated and function in _MODEL_STATE_DICT_FUNCTIONS
        ):
            instead = _DMUON_STATE_DICT_FUNCTIONS.get(
                function, "dmuon's functions of the same names"
            )
            raise RuntimeError(
                f"torch.distributed.checkpoint.state_dict.{function} cannot take a dmuon"
                f" model or optimizer: the dedicated parameter {self.fqn!r} and its optimizer"
                " state are whole on its owner rank only, and torch's state dict functions"
                " read and write them where they are held and start a fresh optimizer with"
                " a step of their own, so the ranks that own every matrix would go on into"
                " a collective the others never reach. Nothing was read or changed, on any"
                f" rank (each raises this). Use {instead} instead (full state dicts,"
                " collective: call them on every rank; they read torch's"
                " options=StateDictOptions(full_state_dict=True, ...) as torch does), or for a"
                " sharded checkpoint"
                " dmuon.save_checkpoint / dmuon.load_checkpoint, or dmuon.AppState(model,"
                " optimizer) in your own dcp.save / dcp.load"
            )
        return {} if self.previous is None else self.previous()


def refuse_torch_state_dict(module: nn.Module, fqn: str, *, replicated: bool) -> None:
    """Make the functions of ``torch.distributed.checkpoint.state_dict`` raise on every rank,
    before they read or change anything, when they reach ``module``, which holds the dedicated
    parameter ``fqn`` (on the replicated path only those that take the optimizer); see [Note:
    torch's paths that cannot reach a dedicated weight]."""
    set_fqn_modifiers(module, lambda previous: _RefuseTorchStateDict(fqn, replicated, previous))


# The optimizers refuse_foreign_optimizers has checked, with the parameter count checked and
# the number of dmuon optimizers registered by then.
_CHECKED_OPTIMIZERS: weakref.WeakKeyDictionary[Any, tuple[int, int]] = weakref.WeakKeyDictionary()
# Every dmuon optimizer alive, with the parameters it steps (by id: it holds them) and their
# names; how many were registered so far.
_DMUON_OPTIMIZERS: weakref.WeakKeyDictionary[Any, dict[int, str]] = weakref.WeakKeyDictionary()
_registered = 0
# A class attribute of dmuon's own optimizers, which step dedicated parameters themselves.
STEPS_DEDICATED = "_steps_dedicated_params"


@functools.cache
def refuse_foreign_optimizers() -> None:
    """Make ``step()`` of every optimizer but dmuon's raise when its groups hold a dedicated
    parameter (installed once per process); see [Note: torch's paths that cannot reach a
    dedicated weight]."""
    register_optimizer_step_pre_hook(_refuse_foreign_step)


def _refuse_foreign_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    inner = optimizer
    for _ in range(4):  # dmuon's, or a wrapper around it (``.optimizer``: accelerate's)
        if getattr(inner, STEPS_DEDICATED, False):
            return
        inner = getattr(inner, "optimizer", None)
    members = getattr(optimizer, "optimizers", None)
    if (
        isinstance(members, list | tuple)
        and members
        and all(isinstance(member, torch.optim.Optimizer) for member in members)
    ):
        return  # a container (torchtitan's): its groups are its members', each checked at its step
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if _CHECKED_OPTIMIZERS.get(optimizer) == (count, _registered):
        return
    stepped = [params for params in _DMUON_OPTIMIZERS.values() if params]
    for group in optimizer.param_groups:
        for p in group["params"]:
            if name := next((params[id(p)] for params in stepped if id(p) in params), None):
                kind = type(optimizer).__name__
                raise ValueError(
                    f"{kind}.step(): its param_groups hold {name!r}, which dmuon.Muon steps"
                    f" already: dmuon.Muon(model) steps every trainable parameter, those it"
                    f" does not orthogonalize with AdamW, so {kind} would step it a second"
                    " time. Leave this optimizer out and give its values to dmuon.Muon, which"
                    " replaces both optimizers of a Muon + Adam recipe: adamw_lr=,"
                    " adamw_betas=, adamw_eps=, adamw_weight_decay= (per group with"
                    " param_groups=[...]); nothing was stepped"
                )
            if is_dedicated(p):
                kind = type(optimizer).__name__
                raise ValueError(
                    f"{kind}.step(): its param_groups hold the dedicated parameter"
                    f" {holder_of(p).fqn!r}, whose gradient goes to its owner rank through"
                    f" dmuon's runtime and never reaches .grad, so {kind} would leave it"
                    " unchanged. Step the model with dmuon.Muon(model, ...), which runs AdamW"
                    " on the parameters it does not orthogonalize (param_policy routes a"
                    " dedicated weight to AdamW), or leave the parameter out of"
                    " dedicate_params' predicate"
                )
    _CHECKED_OPTIMIZERS[optimizer] = (count, _registered)


def register_dmuon_optimizer(optimizer: Any, params: Mapping[int, str]) -> None:
    """Record that ``optimizer`` (dmuon's, alive while it is) steps ``params`` (each
    parameter's ``id``, which the optimizer's groups keep alive, and its name): another
    optimizer's ``step()`` over one of them raises (see [Note: torch's paths that cannot reach
    a dedicated weight])."""
    global _registered
    refuse_foreign_optimizers()
    _DMUON_OPTIMIZERS[optimizer] = dict(params)
    _registered += 1


# What accelerate's refused clip is told to use instead, by method.
_DMUON_CLIPS = {
    "clip_grad_norm_": "dmuon.clip_grad_norm_(muon, max_norm, params='all')",
    "clip_grad_value_": "dmuon.clip.clip_grad_value_(muon, clip_value, params='all')",
}
# Set on the wrappers refuse_accelerate_clip installs (they are installed once).
_REFUSES_DEDICATED = "_dmuon_refuses_dedicated"


def refuse_accelerate_clip() -> None:
    """Make accelerate's ``Accelerator.clip_grad_norm_`` and ``clip_grad_value_`` raise when
    their parameters hold a dedicated one, if accelerate is imported (a no-op otherwise, and
    once installed); see [Note: torch's paths that cannot reach a dedicated weight]."""
    module = sys.modules.get("accelerate.accelerator")
    accelerator = getattr(module, "Accelerator", None)
    if accelerator is None:
        return
    for name in _DMUON_CLIPS:
        original = getattr(accelerator, name, None)
        if callable(original) and not getattr(original, _REFUSES_DEDICATED, False):
            setattr(accelerator, name, _refusing_dedicated(original, name))


# torch's clip functions refused a dedicated parameter (see [Note: torch's paths that cannot
# reach a dedicated weight]): the public ones by name, and the one torch's clip_grad_norm_ calls
# through its module after taking the norm.
_TORCH_CLIPS = {
    "clip_grad_norm_": "dmuon.clip_grad_norm_(optimizer, max_norm, params='all')",
    "clip_grad_value_": "dmuon.clip.clip_grad_value_(optimizer, clip_value, params='all')",
    "_clip_grads_with_norm_": "dmuon.clip_grad_norm_(optimizer, max_norm, params='all')",
}


def refuse_torch_clip() -> None:
    """Make ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` raise when their
    parameters hold a dedicated one (once installed, a no-op); see [Note: torch's paths that
    cannot reach a dedicated weight]."""
    from torch.nn import utils
    from torch.nn.utils import clip_grad

    for module in (utils, clip_grad):
        for name in _TORCH_CLIPS:
            if name.startswith("_") and module is utils:
                continue  # the private name lives in clip_grad only
            original = getattr(module, name, None)
            if callable(original) and not getattr(original, _REFUSES_DEDICATED, False):
                setattr(module, name, _torch_clip_refusing_dedicated(original, name))


def _torch_clip_refusing_dedicated(original: Any, name: str) -> Any:
    """torch's clip function ``original``, raising first when given a dedicated parameter."""

    @functools.wraps(original)
    def clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        parameters, dedicated = _with_first_dedicated(parameters)
        if dedicated is not None:
            value = name == "clip_grad_value_"
            public = "clip_grad_value_" if value else "clip_grad_norm_"
            missed = "unclamped" if value else "out of the norm and unclipped"
            raise ValueError(
                f"torch.nn.utils.{public}: its parameters hold the dedicated parameter"
                f" {holder_of(dedicated).fqn!r}, whose gradient lives on its owner rank, not in"
                f" .grad, so torch would leave it {missed} (it sees the FSDP2 gradients"
                f" alone). Clip with {_TORCH_CLIPS[name]}, where optimizer is the"
                " dmuon.Muon: it reaches every gradient the optimizer steps, wherever it"
                " lives. Nothing was clipped"
            )
        return original(parameters, *args, **kwargs)

    setattr(clip, _REFUSES_DEDICATED, True)
    return clip


def _with_first_dedicated(parameters: Any) -> tuple[Any, torch.Tensor | None]:
    """A clip's ``parameters`` as the clip then takes them (an iterator such as
    ``model.parameters()`` read into a list, read here and by the clip), and the first
    dedicated parameter among them, ``None`` if there is none."""
    if isinstance(parameters, torch.Tensor):
        return parameters, parameters if is_dedicated(parameters) else None
    parameters = list(parameters)
    return parameters, next((p for p in parameters if is_dedicated(p)), None)


def _refusing_dedicated(original: Any, name: str) -> Any:
    """accelerate's clip method ``original``, raising first when given a dedicated parameter."""

    @functools.wraps(original)
    def clip(self: Any, parameters: Any, *args: Any, **kwargs: Any) -> Any:
        parameters, dedicated = _with_first_dedicated(parameters)
        if dedicated is not None:
            raise ValueError(
                f"accelerator.{name}: its parameters hold the dedicated parameter"
                f" {holder_of(dedicated).fqn!r}, whose gradient lives on its owner rank, not in"
                " .grad, so accelerate would leave it out of the norm and unclipped (it"
                f" sees the FSDP2 gradients alone). Clip with {_DMUON_CLIPS[name]}, where"
                " muon is the dmuon.Muon (optimizer.optimizer under accelerate's"
                " AcceleratedOptimizer); under the Trainer, DmuonTrainer does it for"
                " max_grad_norm. Nothing was clipped"
            )
        return original(self, parameters, *args, **kwargs)

    setattr(clip, _REFUSES_DEDICATED, True)
    return clip
