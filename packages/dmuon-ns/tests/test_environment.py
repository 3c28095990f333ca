"""The environment variables dmuon-ns reads: three, each in one function of ``_environment``."""

from __future__ import annotations

from pathlib import Path

import dmuon_ns
from dmuon_ns import _environment
from dmuon_testing.environment import (
    check_triton_interpret_rule,
    env_name_literals,
    environment_reads,
)

SRC = Path(dmuon_ns.__file__).parent
ENV_NAME = r"(DMUON|TRITON)_[A-Z0-9_]+"


def test_only_the_environment_module_reads_the_environment() -> None:
    reads = {(read.module, read.function) for read in environment_reads(SRC)}
    assert reads == {
        ("_environment.py", "kernel_override"),
        ("_environment.py", "cache_dir_override"),
        ("_environment.py", "triton_interpreting"),
    }


def test_the_library_names_only_its_two_variables_and_tritons_switch() -> None:
    assert env_name_literals(SRC, ENV_NAME) == {
        "_environment.py": {"DMUON_NS_KERNEL", "DMUON_NS_CACHE_DIR", "TRITON_INTERPRET"}
    }


def test_the_scan_finds_every_way_of_reading(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text(
        "import os\nfrom os import getenv\nX = os.environ['DMUON_X']\n__all__ = ['DMUON_ALL']\n"
        "def f():\n    '''DMUON_DOCSTRING is prose.'''\n    return os.getenv('TRITON_Y')\n"
    )
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text(
        "import os\nclass C:\n    def g(self):\n        return 'DMUON_Z' in os.environ\n"
    )
    reads = {(read.module, read.function, read.line) for read in environment_reads(tmp_path)}
    assert reads == {("a.py", None, 2), ("a.py", None, 3), ("a.py", "f", 7), ("sub/b.py", "g", 4)}
    assert env_name_literals(tmp_path, ENV_NAME) == {
        "a.py": {"DMUON_X", "TRITON_Y"},
        "sub/b.py": {"DMUON_Z"},
    }


def test_triton_interpret_has_one_rule(monkeypatch) -> None:
    check_triton_interpret_rule(_environment.triton_interpreting, monkeypatch)


def test_the_kernel_and_cache_overrides(monkeypatch, tmp_path: Path) -> None:
    for value, expected in [("", None), (" auto ", None), ("AUTO", None), ("triton", "triton")]:
        monkeypatch.setenv("DMUON_NS_KERNEL", value)
        assert _environment.kernel_override() == expected
    monkeypatch.setenv("DMUON_NS_CACHE_DIR", "")
    assert _environment.cache_dir_override() is None
    monkeypatch.setenv("DMUON_NS_CACHE_DIR", str(tmp_path))
    assert _environment.cache_dir_override() == tmp_path
