"""Package test suites run from the repository root (``testing/test_packages.py``).

Each suite runs in a pytest process of its own. Its output is passed on line by line under the
package's name while it runs (``dmuon-ns | ........ [ 35%]``), and its summary line is kept,
so that the root run can report every package's counts and their total after its own summary,
whose "N passed" counts one test per package.

    result = run_suite("dmuon-ns", ROOT / "packages" / "dmuon-ns", ["-m", "not gpu"], print)
    result.counts  # {"passed": 212, "skipped": 3, "deselected": 9}
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["OUTCOMES", "SuiteResult", "format_counts", "parse_counts", "run_suite", "total"]

# The outcomes of pytest's summary line, in the order it prints them.
OUTCOMES = ("failed", "passed", "skipped", "deselected", "xfailed", "xpassed", "warnings", "errors")
_COUNT = re.compile(
    r"\b(\d+) (failed|passed|skipped|deselected|xfailed|xpassed|warnings?|errors?)\b"
)
_SINGULAR = {"warning": "warnings", "error": "errors"}


@dataclass(frozen=True)
class SuiteResult:
    package: str
    returncode: int
    summary: str  # pytest's last line, e.g. "66 passed, 1 skipped in 6.30s"
    output: str
    counts: dict[str, int] = field(default_factory=dict)


def parse_counts(summary: str) -> dict[str, int]:
    """Outcome -> number, from a pytest summary line ("1 failed, 3 passed, 1 error in 2s")."""
    found: dict[str, int] = {}
    for number, outcome in _COUNT.findall(summary):
        key = _SINGULAR.get(outcome, outcome)
        found[key] = found.get(key, 0) + int(number)
    return found


def total(results: Iterable[SuiteResult]) -> dict[str, int]:
    summed: Counter[str] = Counter()
    for result in results:
        summed.update(result.counts)
    return dict(summed)


def format_counts(counts: dict[str, int]) -> str:
    plural = {v: k for k, v in _SINGULAR.items()}
    shown = [
        f"{n} {plural[k] if n == 1 and k in plural else k}"
        for k in OUTCOMES
        if (n := counts.get(k, 0))
    ]
    return ", ".join(shown) or "no tests ran"


def run_suite(
    package: str, directory: Path, args: Sequence[str], on_line: Callable[[str], None]
) -> SuiteResult:
    """``python -m pytest -q *args`` in ``directory`` with this interpreter, each output line
    handed to ``on_line`` as it comes, prefixed with the package's name."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # lines as they are written, not in blocks
    lines = []
    with subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", *args],
        cwd=directory,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    ) as child:
        assert child.stdout is not None
        for line in child.stdout:
            lines.append(line)
            on_line(f"{package} | {line.rstrip()}")
    summary = next((line.strip() for line in reversed(lines) if line.strip()), "(no output)")
    return SuiteResult(package, child.returncode, summary, "".join(lines), parse_counts(summary))
