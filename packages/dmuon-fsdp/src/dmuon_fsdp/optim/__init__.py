"""The optimizer: ``Muon`` and its step phases, the Muon and AdamW math, the fused Triton
passes, semantic param groups, and QK-clip."""

from ._muon_math import fresh_state, step_dtype
from ._optimizer import Muon, MuonClipGrads, MuonStepStats, StepOptions, optim_dtype
from ._qk_clip import QKClip, QKRowMap

__all__ = [
    "Muon",
    "MuonClipGrads",
    "MuonStepStats",
    "QKClip",
    "QKRowMap",
    "StepOptions",
    "fresh_state",
    "optim_dtype",
    "step_dtype",
]
