"""The environment dmuon-fsdp reads: only Triton's interpreter switch, in one function."""

from __future__ import annotations

from pathlib import Path

import dmuon_fsdp
from dmuon_fsdp.optim import _fused
from dmuon_testing.environment import (
    check_triton_interpret_rule,
    env_name_literals,
    environment_reads,
)

SRC = Path(dmuon_fsdp.__file__).parent


def test_one_function_reads_the_environment_and_names_only_tritons_switch() -> None:
    reads = {(read.module, read.function) for read in environment_reads(SRC)}
    assert reads == {("optim/_fused.py", "_interpreting")}
    assert env_name_literals(SRC, r"(DMUON|TRITON)_[A-Z0-9_]+") == {
        "optim/_fused.py": {"TRITON_INTERPRET"}
    }


def test_triton_interpret_follows_the_one_rule(monkeypatch) -> None:
    check_triton_interpret_rule(_fused._interpreting, monkeypatch)
