"""dmuon-clip reads one environment variable, Triton's own switch, in one function."""

from __future__ import annotations

from pathlib import Path

import dmuon_clip
from dmuon_clip import _environment
from dmuon_testing.environment import (
    check_triton_interpret_rule,
    env_name_literals,
    environment_reads,
)

SRC = Path(dmuon_clip.__file__).parent


def test_only_the_triton_switch_is_read_in_one_function() -> None:
    reads = {(read.module, read.function) for read in environment_reads(SRC)}
    assert reads == {("_environment.py", "triton_interpreting")}
    assert env_name_literals(SRC, r"(DMUON|TRITON)_[A-Z0-9_]+") == {
        "_environment.py": {"TRITON_INTERPRET"}
    }


def test_triton_interpret_has_one_rule(monkeypatch) -> None:
    check_triton_interpret_rule(_environment.triton_interpreting, monkeypatch)
