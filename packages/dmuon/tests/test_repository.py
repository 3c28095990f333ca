"""Rules that hold over the whole repository's source: the library reads only its two
documented environment variables, and nothing cites a document outside the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SOURCES = sorted(ROOT.glob("packages/*/src/**/*.py"))
# The only switches the library takes from the environment (Triton's own TRITON_INTERPRET is
# read through one helper per package, checked in that package's tests).
ALLOWED_ENV = {"DMUON_NS_KERNEL", "DMUON_NS_CACHE_DIR"}
_ENV_NAME = re.compile(r"\bDMUON_[A-Z0-9_]+\b")
# Spelled in two parts so that this file does not cite them itself.
_CITATIONS = ("SP" + "EC", "../" + "shared", "GPU" + ".md")
# A numbered issue of a tracker the repository does not hold (not "may issue 16-byte loads").
_ISSUE = re.compile(r"\bissue" r" #?\d+(?![\w-])", re.I)
# Where the repository's own text lives (the lab notebook of measurements included).
TEXT = [
    *ROOT.glob("packages/**/*.py"),
    *ROOT.glob("packages/**/*.md"),
    *ROOT.glob("packages/**/*.toml"),
    *ROOT.glob("benchmarks/*.py"),
    *ROOT.glob("benchmarks/*.md"),
    *ROOT.glob("docs/**/*.md"),
    *ROOT.glob("docs/**/*.py"),
    *ROOT.glob("*.md"),
    ROOT / "noxfile.py",
]


def test_the_sources_are_found() -> None:
    assert len(SOURCES) > 30, f"expected the packages' sources under {ROOT}"


def test_library_reads_only_the_documented_environment_variables() -> None:
    found: dict[str, list[str]] = {}
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for name in _ENV_NAME.findall(node.value):
                    found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    extra = {name: where for name, where in found.items() if name not in ALLOWED_ENV}
    assert not extra, f"environment variables outside {sorted(ALLOWED_ENV)}: {extra}"


def test_nothing_cites_a_document_outside_the_repository() -> None:
    offenders = []
    for path in TEXT:
        if any(part in (".nox", ".venv", "node_modules") for part in path.parts):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if any(citation in line for citation in _CITATIONS) or _ISSUE.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
