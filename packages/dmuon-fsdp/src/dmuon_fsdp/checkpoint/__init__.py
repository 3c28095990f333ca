"""Checkpoints: the layout both formats share, full state dicts, and sharded DCP checkpoints."""

from ._checkpoint import (
    checked_on_every_rank,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from ._dcp import CHECKPOINT_KEY, AppState, load_checkpoint, save_checkpoint
from ._init import init_dedicated_
from ._integrity import CheckpointIntegrityError
from ._state_layout import check_optimizer

__all__ = [
    "CHECKPOINT_KEY",
    "AppState",
    "CheckpointIntegrityError",
    "check_optimizer",
    "checked_on_every_rank",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "init_dedicated_",
    "load_checkpoint",
    "save_checkpoint",
    "set_model_state_dict",
    "set_optimizer_state_dict",
]
