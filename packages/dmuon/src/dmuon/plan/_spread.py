"""The unit of a forecast's rows: one figure over every rank, as its largest value and its
mean."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

__all__ = ["Spread"]


class Spread(NamedTuple):
    """A per-rank figure over every rank: its largest value and its mean.

    Args:
        max: the largest value of any rank.
        mean: the mean over the ranks.
    """

    max: float
    mean: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread:
        values = list(values)
        return cls(max(values), math.fsum(values) / len(values)) if values else cls(0.0, 0.0)

    @classmethod
    def uniform(cls, value: float) -> Spread:
        return cls(value, value)
