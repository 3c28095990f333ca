"""Warnings that point at the line the user wrote, whichever public route reached them.

[Note: a warning's line]

``warnings.warn``'s ``stacklevel`` counts frames, and the depth from a warning to the user's
call differs by route: ``Muon.step()`` called directly or through an LR scheduler's wrapper
(one more torch frame); ``grads_for_clip`` called by the user, through ``muon_grads_for_clip``
or by dmuon-clip's functions; ``Muon(model)`` built by the user or by
``dmuon.integrations.hf.dmuon_optimizer``; ``dedicate_params`` or the deprecated entry that
calls it. A fixed count names dmuon's or torch's line on every route but one. ``warn`` counts
instead the frames up to the first one whose module lies outside dmuon's packages and torch
(what Python 3.12's ``skip_file_prefixes`` does; 3.11 has no such argument). Hugging Face's
``transformers`` and ``accelerate`` count as inside too: under ``DmuonTrainer`` the user's
line is ``trainer.train()``, with the Trainer's loop, its callbacks and accelerate's optimizer
wrapper between it and dmuon, and a transformers model's forward lies between the user's call
and dmuon's hooks. Lightning counts as inside too (``lightning``, and ``pytorch_lightning``
and ``lightning_fabric``, the same code under its standalone packages' names): under its
``Trainer`` the user's line is ``trainer.fit()``, with the loops, the ``LightningOptimizer``,
the strategy and the precision plugin between it and ``Muon.step()``, and the step's closure
runs backward inside that step. dmuon-ns keeps a twin of it (``dmuon_ns._warnings``), as it
imports no sibling package.
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
