"""The root run's report of the package suites that ``test_packages.py`` runs: their output
while they run, and after pytest's own summary each package's counts and their total."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dmuon_testing.suites import SuiteResult, format_counts, total

_RESULTS = pytest.StashKey[list[SuiteResult]]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_RESULTS] = []


@pytest.fixture
def suite_results(pytestconfig: pytest.Config) -> list[SuiteResult]:
    """Where a test puts each package suite's result, for the final report."""
    return pytestconfig.stash[_RESULTS]


@pytest.fixture
def show_progress(pytestconfig: pytest.Config) -> Callable[[str], None]:
    """Writes a line to the terminal at once, past pytest's output capture."""
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    reporter = pytestconfig.pluginmanager.getplugin("terminalreporter")

    def show(line: str) -> None:
        if capture is None or reporter is None:
            return
        with capture.global_and_fixture_disabled():
            reporter.write_line(line)

    return show


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    results = config.stash.get(_RESULTS, [])
    if not results:
        return
    terminalreporter.section("package suites (each in its own pytest process)")
    width = max(len(r.package) for r in results)
    for r in results:
        status = "" if r.returncode in (0, 5) else f"  (exit code {r.returncode})"
        terminalreporter.write_line(f"{r.package:<{width}}  {r.summary}{status}")
    packages = f"{len(results)} package{'s' if len(results) > 1 else ''}"
    terminalreporter.write_line(f"total over {packages}: {format_counts(total(results))}")
