"""``pytest`` at the repository root: every package's test suite, each in its own pytest process.

Each suite runs as ``nox -s tests`` runs it: from the package's directory, under that
package's own pytest configuration, with this interpreter. One process cannot hold the suites
together: they share module names (``conftest``, ``_reference``, ``test_distributed``), and
the distributed worker pools unpickle test functions by those names, so one suite would run
another's. A ``-m`` expression given at the root is passed on (``uv run pytest -m "not gpu"``).

The suites' output is shown as they run, one line at a time under the package's name, and
after pytest's own summary (which counts one test per package) comes each package's summary
and their total (``conftest.py``, ``dmuon_testing.suites``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from dmuon_testing.suites import SuiteResult, format_counts, parse_counts, run_suite, total

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = sorted(p.parent.name for p in ROOT.glob("packages/*/tests"))
# pytest's exit code when every test was deselected (e.g. ``-m gpu`` on a CPU-only package).
NO_TESTS_COLLECTED = 5
TAIL_CHARS = 20_000


def test_every_package_has_a_suite() -> None:
    assert PACKAGES == sorted(p.parent.name for p in ROOT.glob("packages/*/pyproject.toml"))


@pytest.mark.parametrize("package", PACKAGES)
def test_package_suite(
    package: str,
    pytestconfig: pytest.Config,
    suite_results: list[SuiteResult],
    show_progress: Callable[[str], None],
) -> None:
    markexpr = pytestconfig.getoption("markexpr")
    args = ["-m", markexpr] if markexpr else []
    result = run_suite(package, ROOT / "packages" / package, args, show_progress)
    suite_results.append(result)
    if result.returncode == NO_TESTS_COLLECTED and markexpr:
        pytest.skip(f"{package}: no test matches -m {markexpr!r}")
    if result.returncode != 0:
        pytest.fail(
            f"{package}: pytest exited {result.returncode}\n{result.output[-TAIL_CHARS:]}",
            pytrace=False,
        )
    assert result.counts.get("passed", 0) > 0, f"{package}: no test passed: {result.summary}"


def test_summary_lines_are_counted_and_totalled() -> None:
    # The root's report adds up the packages' own summary lines, in pytest's wording.
    lines = [
        "1 failed, 210 passed, 3 skipped, 9 deselected, 1 warning in 61.20s (0:01:01)",
        "66 passed, 2 errors in 6.30s",
        "1 error in 0.50s",
    ]
    counts = [parse_counts(line) for line in lines]
    assert counts[0] == {"failed": 1, "passed": 210, "skipped": 3, "deselected": 9, "warnings": 1}
    assert counts[1] == {"passed": 66, "errors": 2} and counts[2] == {"errors": 1}
    results = [
        SuiteResult(f"p{i}", 1, line, line, c) for i, (line, c) in enumerate(zip(lines, counts))
    ]
    assert format_counts(total(results)) == (
        "1 failed, 276 passed, 3 skipped, 9 deselected, 1 warning, 3 errors"
    )
    assert format_counts({}) == "no tests ran"
