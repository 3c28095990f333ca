"""Predicted Newton–Schulz times from a table of measured ones.

[Note: predicted NS times]

The package ships the NS times dmuon measured on one card (``ns_times_h200.json``: the card,
the date, the run and the software it came from, and per measured call its batch, matrix shape
and median milliseconds). A call that was not measured is predicted through the FLOP model of
:func:`ns_flops`: each measured call gives a rate, FLOPs of the call (batch × ``ns_flops``) per
millisecond; the rate of another call is interpolated linearly in log FLOPs between the two
measured calls around it, and held at the nearest end outside the measured range; the time is
its FLOPs over that rate. The rate grows with the call's size (on the H200 from ~220 model
TFLOP/s at one 1024×4096 matrix to ~1270 at 8192×28672), which a single constant would miss by
up to 6×. Below the smallest measured call (77 GFLOP) a call is bound by kernel launches more
than by FLOPs, so its prediction is optimistic; above the largest (37 TFLOP) the card runs at
its power cap, where the rate no longer grows, so holding it is the measured behaviour.
Every figure computed from this table is a prediction and is labelled so.

Two tables ship: ``ns_times_h200.json`` (``"auto"`` with quack installed, the ``cute`` extra)
and ``ns_times_h200_no_quack.json`` (the faster of the Triton and torch kernels per problem,
kernel-only times from the same run's autotune verdicts: what ``"auto"`` runs without quack;
Triton is 4–44 % slower than quack there). Pick the one that matches the software of the run.
Each table also carries the card's streaming bandwidth (``elementwise.gb_s``, measured by a
memory-bound kernel on the same card), which prices the step's elementwise passes ([Note: the
forecast]).

Only H200 tables exist. For another card (:meth:`NSTimes.scaled`) every NS time is
multiplied by the ratio of the two cards' dense bf16 rates (NS is matrix products, bound by
the tensor cores: on an A100, 989 / 312 = 3.17 times the H200's), and the streaming bandwidth
by the ratio of their memory bandwidths. The scaled table names both cards and the factors,
and every report made from it says "scaled from" the measured card: it is not a measurement.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from typing import Any

from dmuon_ownership import ns_flops

from ._gpus import GPU

__all__ = ["NSTimes", "load_ns_times"]

_DEFAULT = "ns_times_h200.json"


@dataclass(frozen=True)
class NSTimes:
    """Measured NS calls and the predictions they give (see [Note: predicted NS times]).

    Args:
        card: the card the times were measured on.
        date: when they were measured.
        source: the command or benchmark that measured them.
        steps: NS iterations per call, an int >= 1.
        restarts: Gram NS restarts per call.
        measured: ``(batch, rows, cols, ms)`` per measured call: batch, rows and cols >= 1,
            ms > 0.
        stream_gb_s: the GB/s the card's elementwise passes stream at (> 0).
        scaled_from: on a table scaled to another card, the card the times were measured on;
            ``None``: measured on ``card``.
        time_scale: the factor every measured time is multiplied by (> 0; 1.0: as measured).
    """

    card: str
    date: str
    source: str
    steps: int
    restarts: int
    measured: tuple[tuple[int, int, int, float], ...]
    stream_gb_s: float  # bytes per ns the card's elementwise passes stream at
    # Set on a table scaled to another card (see scaled): the card the times were measured
    # on, and the factor every measured time is multiplied by.
    scaled_from: str | None = None
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.measured:
            raise ValueError("NSTimes: the table has no measured calls")
        for batch, rows, cols, ms in self.measured:
            if min(batch, rows, cols) < 1 or not (math.isfinite(ms) and ms > 0):
                raise ValueError(
                    f"NSTimes: measured call {(batch, rows, cols, ms)} needs batch, rows and cols "
                    ">= 1 and a time > 0 ms"
                )
        if not (math.isfinite(self.stream_gb_s) and self.stream_gb_s > 0):
            raise ValueError(f"NSTimes: stream_gb_s must be > 0, got {self.stream_gb_s!r}")
        if not (math.isfinite(self.time_scale) and self.time_scale > 0):
            raise ValueError(f"NSTimes: time_scale must be > 0, got {self.time_scale!r}")

    @classmethod
    def from_json(cls, text: str) -> NSTimes:
        data: Any = json.loads(text)
        return cls(
            card=data["card"],
            date=data["date"],
            source=data["source"],
            steps=data["ns"]["steps"],
            restarts=data["ns"]["restarts"],
            measured=tuple(
                (e["batch"], e["rows"], e["cols"], float(e["ms"])) for e in data["entries"]
            ),
            stream_gb_s=float(data["elementwise"]["gb_s"]),
        )

    def flops(self, batch: int, rows: int, cols: int) -> int:
        return batch * ns_flops(rows, cols, self.steps, restarts=self.restarts)

    @cached_property
    def _curve(self) -> tuple[list[float], list[float]]:
        """log FLOPs and FLOPs per ms of the measured calls, by FLOPs."""
        points = sorted((self.flops(b, r, c), ms) for b, r, c, ms in self.measured)
        return [math.log(f) for f, _ in points], [f / ms for f, ms in points]

    def predict_ms(self, batch: int, rows: int, cols: int) -> float:
        """Predicted milliseconds of one NS call on ``batch`` matrices of ``rows × cols``
        (see [Note: predicted NS times])."""
        return self.ms_of_flops(self.flops(batch, rows, cols))

    def ms_of_flops(self, work: float) -> float:
        """Predicted milliseconds of an NS call of ``work`` FLOPs, at the rate of the measured
        calls of that size."""
        if work == 0:
            return 0.0
        logs, rates = self._curve
        x = math.log(work)
        right = bisect.bisect_left(logs, x)
        if right == 0:
            rate = rates[0]
        elif right == len(logs):
            rate = rates[-1]
        else:
            left = right - 1
            share = (x - logs[left]) / (logs[right] - logs[left])
            rate = rates[left] + share * (rates[right] - rates[left])
        return work / rate * self.time_scale

    def stream_ms(self, nbytes: float) -> float:
        """Predicted milliseconds of elementwise passes that read and write ``nbytes``."""
        return nbytes / (self.stream_gb_s * 1e6)

    def label(self) -> str:
        if self.scaled_from is not None:
            return f"{self.card}, scaled from {self.scaled_from} (measured {self.date})"
        return f"{self.card}, measured {self.date}"

    def scaled(self, source: GPU, target: GPU) -> NSTimes:
        """This table, measured on ``source``, as a prediction for ``target`` (see [Note:
        predicted NS times]): times x ``source.bf16_tflops / target.bf16_tflops``, streaming
        bandwidth x ``target.hbm_gb_s / source.hbm_gb_s``."""
        if self.scaled_from is not None:
            raise ValueError(
                f"NSTimes.scaled: this table is already scaled from {self.scaled_from}; scale "
                "the measured table (load_ns_times()) instead"
            )
        return dataclasses.replace(
            self,
            card=target.label,
            scaled_from=self.card,
            time_scale=source.bf16_tflops / target.bf16_tflops,
            stream_gb_s=self.stream_gb_s * target.hbm_gb_s / source.hbm_gb_s,
        )


def load_ns_times(name: str = _DEFAULT) -> NSTimes:
    """A measured table shipped with the package (see [Note: predicted NS times]).

    Args:
        name: ``"ns_times_h200.json"`` (the default, NS with quack) or
            ``"ns_times_h200_no_quack.json"``.
    """
    text = resources.files(__package__).joinpath(name).read_text(encoding="utf-8")
    return NSTimes.from_json(text)
