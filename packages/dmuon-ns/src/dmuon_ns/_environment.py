"""Every environment variable dmuon-ns reads, each read here and nowhere else.

[Note: environment variables]
Switches are arguments; the environment holds only what a launcher must be able to set for
processes it does not control the code of:

- ``DMUON_NS_KERNEL`` names the kernel that ``kernel="auto"`` runs (``"auto"`` or empty:
  unset). Where it stands among the other rules is ``_registry``'s [Note: kernel precedence].
- ``DMUON_NS_CACHE_DIR`` is the directory of the autotune verdicts (empty: unset, the default
  ``~/.cache/dmuon/ns-autotune``); see ``_verdict_cache``'s [Note: the on-disk cache].
- ``TRITON_INTERPRET`` is Triton's own switch: on, Triton runs kernels in its CPU interpreter,
  which is how the Triton kernel is tested without a GPU. One rule here: any value but ``""``
  and ``"0"`` means on. (Triton itself takes ``1``, ``true`` and ``on``; set it to ``1``.)
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "CACHE_DIR_ENV",
    "KERNEL_ENV",
    "TRITON_INTERPRET_ENV",
    "cache_dir_override",
    "kernel_override",
    "triton_interpreting",
]

KERNEL_ENV = "DMUON_NS_KERNEL"
CACHE_DIR_ENV = "DMUON_NS_CACHE_DIR"
TRITON_INTERPRET_ENV = "TRITON_INTERPRET"


def kernel_override() -> str | None:
    """The kernel ``DMUON_NS_KERNEL`` names; ``None`` when it is unset, empty or ``"auto"``."""
    value = os.environ.get(KERNEL_ENV, "").strip()
    if not value or value.lower() == "auto":
        return None
    return value


def cache_dir_override() -> Path | None:
    """The directory ``DMUON_NS_CACHE_DIR`` names (``~`` expanded); ``None`` when unset or empty."""
    value = os.environ.get(CACHE_DIR_ENV, "")
    return Path(value).expanduser() if value else None


def triton_interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` is on (any value but ``""`` and ``"0"``)."""
    return os.environ.get(TRITON_INTERPRET_ENV, "") not in ("", "0")
