"""Profiler ranges: a clip names its phases in a trace, and enters no range without one."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from dmuon_clip import GradClipBucket, clip_grad_norm_buckets_


def _clip() -> None:
    grads = [torch.randn(7, 5), torch.randn(13)]
    clip_grad_norm_buckets_([GradClipBucket("a", grads)], max_norm=0.5)


def test_a_clip_shows_as_named_ranges_in_a_trace() -> None:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _clip()
    names = {event.name for event in prof.events()}
    assert {"dmuon::clip_grad_norm_buckets", "dmuon::clip_local_norms"} <= names


def test_no_range_is_entered_without_a_profiler(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: torch.profiler.record_function) -> None:
        raise AssertionError(f"record_function({self.name!r}) entered with no profiler running")

    # The class itself, however a module imported it.
    monkeypatch.setattr(torch.profiler.record_function, "__enter__", refuse)
    _clip()
