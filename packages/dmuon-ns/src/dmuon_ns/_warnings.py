"""Warnings that point at the line the user wrote, whichever public route reached them.

dmuon-ns warns deep inside a call (an autotune verdict, a failed CUDA-graph capture), reached
from ``newton_schulz``, a ``NewtonSchulz`` call or ``dmuon.Muon.step()``: a fixed
``stacklevel`` names dmuon-ns's own line on every route. ``warn`` counts instead the frames up
to the first one whose module lies outside dmuon's packages, torch, ``transformers``,
``accelerate`` and Lightning's (what Python 3.12's ``skip_file_prefixes`` does; 3.11 has no
such argument).
The twin of dmuon-fsdp's (see [Note: a warning's line] in ``dmuon_fsdp._warnings``), kept here
as dmuon-ns imports no sibling package.
"""

from __future__ import annotations

import sys
import warnings
from types import FrameType

__all__ = ["warn"]

# The top-level modules whose frames lie between a warning and the user's line.
_LIBRARY = frozenset(
    {
        "dmuon",
        "dmuon_clip",
        "dmuon_fsdp",
        "dmuon_ns",
        "dmuon_ownership",
        "torch",
        "transformers",
        "accelerate",
        "lightning",
        "pytorch_lightning",
        "lightning_fabric",
    }
)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` at the first caller outside dmuon, torch and the
    training libraries of Hugging Face and Lightning (the outermost frame if every one is
    inside)."""
    frame, level = sys._getframe(0), 1
    while frame.f_back is not None and _inside(frame):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def _inside(frame: FrameType) -> bool:
    return str(frame.f_globals.get("__name__", "")).partition(".")[0] in _LIBRARY
