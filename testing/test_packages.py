"""``pytest`` at the repository root: every package's test suite, each in its own pytest process.

Each suite runs as ``nox -s tests`` runs it: from the package's directory, under that
package's own pytest configuration, with this interpreter. One process cannot hold the suites
together: they share module names (``conftest``, ``_reference``, ``test_distributed``), and
the distributed worker pools unpickle test functions by those names, so one suite would run
another's. A ``-m`` expression given at the root is passed on (``uv run pytest -m "not gpu"``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = sorted(p.parent.name for p in ROOT.glob("packages/*/tests"))
# pytest's exit code when every test was deselected (e.g. ``-m gpu`` on a CPU-only package).
NO_TESTS_COLLECTED = 5
TAIL_CHARS = 20_000


def test_every_package_has_a_suite() -> None:
    assert PACKAGES == sorted(p.parent.name for p in ROOT.glob("packages/*/pyproject.toml"))


@pytest.mark.parametrize("package", PACKAGES)
def test_package_suite(package: str, pytestconfig: pytest.Config) -> None:
    args = [sys.executable, "-m", "pytest", "-q"]
    markexpr = pytestconfig.getoption("markexpr")
    if markexpr:
        args += ["-m", markexpr]
    done = subprocess.run(
        args,
        cwd=ROOT / "packages" / package,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
    )
    if done.returncode == NO_TESTS_COLLECTED and markexpr:
        pytest.skip(f"{package}: no test matches -m {markexpr!r}")
    summary = done.stdout.strip().splitlines()[-1:] or ["(no output)"]
    if done.returncode != 0:
        pytest.fail(
            f"{package}: pytest exited {done.returncode}\n{done.stdout[-TAIL_CHARS:]}",
            pytrace=False,
        )
    print(f"{package}: {summary[0]}")
