"""The optimizer: ``Muon`` and its step phases, the Muon and AdamW math, the fused Triton
passes, semantic param groups, and QK-clip."""

from ._muon_math import STATE_FIELDS, fresh_state, optim_dtype, step_dtype
from ._optimizer import Muon, MuonClipGrads, MuonStepStats, StepOptions
from ._param_groups import GROUP_REQUIRED, check_no_inert_keys, group_numbers
from ._parts import MuonParts
from ._qk_clip import QKClip, QKRowMap

__all__ = [
    "GROUP_REQUIRED",
    "STATE_FIELDS",
    "Muon",
    "MuonClipGrads",
    "MuonParts",
    "MuonStepStats",
    "QKClip",
    "QKRowMap",
    "StepOptions",
    "check_no_inert_keys",
    "fresh_state",
    "group_numbers",
    "optim_dtype",
    "step_dtype",
]
