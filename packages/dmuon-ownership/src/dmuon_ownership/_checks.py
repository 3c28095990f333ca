"""Checks shared by the planner's inputs."""

from __future__ import annotations

from typing import TypeGuard

__all__ = ["int_at_least"]


def int_at_least(value: object, minimum: int) -> TypeGuard[int]:
    """Whether ``value`` is an int (a bool is not one) of at least ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
