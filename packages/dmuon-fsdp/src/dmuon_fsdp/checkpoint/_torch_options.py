"""torch's ``StateDictOptions``, read by dmuon's full state-dict functions.

[Note: torch's options]
``get_model_state_dict``, ``set_model_state_dict``, ``get_optimizer_state_dict`` and
``set_optimizer_state_dict`` carry the names of ``torch.distributed.checkpoint.state_dict``'s
functions, which refuse a dmuon model and name these instead. A script moved over from torch
passes what it passed there, ``options=StateDictOptions(full_state_dict=True,
cpu_offload=True)`` for a Hugging Face export in torchtitan's style, so dmuon's functions take
``options=`` too and read it as torch does:

- ``full_state_dict`` must be ``True``: these functions return and take full tensors. torch's
  default, a sharded state dict for DCP, is ``dmuon.AppState(model, optimizer)`` or
  ``dmuon.save_checkpoint`` / ``load_checkpoint`` for a dmuon model, which the error names.
- ``cpu_offload``: with ``full_state_dict``, torch returns the dictionary on rank 0 alone, on
  the CPU, and ``{}`` on every other rank; without it every rank gets the tensors on the
  device. So ``cpu_offload=True`` is ``cpu_offload=True, rank0_only=True`` here, and ``False``
  is ``cpu_offload=False, rank0_only=False``.
- ``broadcast_from_rank0`` (``set_model_state_dict``): only rank 0 holds the dictionary.
- ``strict``: ``set_optimizer_state_dict``'s own ``strict``. ``set_model_state_dict`` loads
  every key or none (a missing or unexpected key raises before anything is written), so
  ``strict=False`` raises rather than load part of a model silently.
- ``ignore_frozen_params=True`` and ``flatten_optimizer_state_dict=True`` change the
  dictionary's keys, which dmuon's format ([Note: the checkpoint format]) does not do: refused
  with the field named. ``keep_submodule_prefixes`` only acts with torch's ``submodules``
  argument, which these functions do not have, and ``dsd_fqn_modifiers`` names a hook of
  torch's own functions: both are ignored, as torch ignores them here.

``options`` and the functions' own keyword arguments are two spellings of one choice, so a
call that passes both (a keyword away from its default) raises ``TypeError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.state_dict import StateDictOptions

__all__ = ["from_torch_options"]

# The fields no function here can honour, and why.
_REFUSED = {
    "ignore_frozen_params": "a dmuon state dict holds every parameter, frozen ones included",
    "flatten_optimizer_state_dict": (
        "dmuon's optimizer state dict is keyed by parameter name already"
        " ({'state': {fqn: ...}, 'param_groups': {group_name: ...}})"
    ),
}


def from_torch_options(
    function: str,
    options: object,
    given: Mapping[str, Any],
    defaults: Mapping[str, Any],
) -> dict[str, Any]:
    """The keyword arguments of ``function`` (one of the four above) that torch's ``options``
    stand for (see [Note: torch's options]); ``given`` holds the call's own keyword arguments
    and ``defaults`` their defaults, which must be untouched beside ``options``."""
    if not isinstance(options, StateDictOptions):
        raise TypeError(
            f"dmuon.{function}: options must be a"
            " torch.distributed.checkpoint.state_dict.StateDictOptions, got"
            f" {type(options).__name__}"
        )
    changed = [name for name, value in given.items() if value != defaults[name]]
    if changed:
        raise TypeError(
            f"dmuon.{function}: pass either options=StateDictOptions(...) or"
            f" {', '.join(f'{name}=' for name in changed)}, not both (they set the same"
            " choices)"
        )
    if not options.full_state_dict:
        raise ValueError(
            f"dmuon.{function}: options=StateDictOptions(full_state_dict=False) asks for a"
            " sharded state dict; dmuon's state dict functions give and take full tensors"
            " (pass full_state_dict=True). For a sharded checkpoint of a dmuon model use"
            " dmuon.save_checkpoint / dmuon.load_checkpoint, or put dmuon.AppState(model,"
            " optimizer) in the dictionary you hand to dcp.save / dcp.load"
        )
    for field, why in _REFUSED.items():
        if getattr(options, field):
            raise ValueError(f"dmuon.{function}: options.{field}=True is not supported: {why}")
    if function.startswith("get_"):
        offload = bool(options.cpu_offload)
        return {"cpu_offload": offload, "rank0_only": offload}
    if function == "set_model_state_dict":
        if not options.strict:
            raise ValueError(
                "dmuon.set_model_state_dict: options.strict=False is not supported: dmuon loads"
                " every key of the model or none. For a partial dictionary, start from"
                " dmuon.get_model_state_dict(model), update it with yours and load that"
            )
        return {"broadcast_from_rank0": bool(options.broadcast_from_rank0)}
    if options.broadcast_from_rank0:
        raise ValueError(
            "dmuon.set_optimizer_state_dict: options.broadcast_from_rank0=True is not"
            " supported: every rank passes the whole optimizer state dict (load it on every"
            " rank, e.g. torch.load(..., map_location='cpu'))"
        )
    return {"strict": bool(options.strict)}
