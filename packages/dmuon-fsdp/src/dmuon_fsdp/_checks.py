"""What an argument must be, decided in one place for every layer.

A ``bool`` is an ``int`` to Python, so "an int" and "a number" each take two checks; the
predicates here say them once for every validator. Callers raise their own errors, whose
messages name the argument and the fix (``check_bool`` is the one message that reads the same
everywhere).
"""

from __future__ import annotations

from typing import TypeGuard

__all__ = ["check_bool", "is_int", "is_number"]


def is_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an int and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """Whether ``value`` is an int or a float and not a bool."""
    return is_int(value) or isinstance(value, float)


def check_bool(name: str, value: object) -> bool:
    """``value``, which must be a bool (a string such as ``"no"`` would be truthy)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value
