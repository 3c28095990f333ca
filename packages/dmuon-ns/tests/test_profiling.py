"""Profiler ranges: an NS call names itself in a trace, and enters no range without one."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from dmuon_ns import NewtonSchulz


def _names(prof: profile) -> set[str]:
    return {event.name for event in prof.events()}


def test_a_call_is_a_named_range_in_a_trace() -> None:
    g = torch.randn(16, 40)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        NewtonSchulz()(g)
    assert "dmuon::newton_schulz" in _names(prof)


def test_no_range_is_entered_without_a_profiler(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: torch.profiler.record_function) -> None:
        raise AssertionError(f"record_function({self.name!r}) entered with no profiler running")

    # The class itself, however a module imported it.
    monkeypatch.setattr(torch.profiler.record_function, "__enter__", refuse)
    NewtonSchulz()(torch.randn(16, 40))
