"""The one environment variable dmuon-clip reads, read here and nowhere else.

``TRITON_INTERPRET`` is Triton's own switch: on, Triton runs kernels in its CPU interpreter,
which is how the fused clip kernels are tested without a GPU (the fast path then accepts CPU
tensors; ``_fastpath``'s [Note: fast-path contract]). One rule: any value but ``""`` and ``"0"``
means on. (Triton itself takes ``1``, ``true`` and ``on``; set it to ``1``.)
"""

from __future__ import annotations

import os

__all__ = ["TRITON_INTERPRET_ENV", "triton_interpreting"]

TRITON_INTERPRET_ENV = "TRITON_INTERPRET"


def triton_interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` is on (any value but ``""`` and ``"0"``)."""
    return os.environ.get(TRITON_INTERPRET_ENV, "") not in ("", "0")
