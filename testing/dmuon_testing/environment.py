"""The environment rules every dmuon package follows, for its tests: where a package touches the
environment and which variables it names (read from its source), and the one rule for
Triton's ``TRITON_INTERPRET``.

    from dmuon_testing.environment import environment_reads, env_name_literals

    reads = environment_reads(Path(dmuon_ns.__file__).parent)
    assert {(r.module, r.function) for r in reads} == {("_environment.py", "kernel_override")}

Reading source (``ast``) rather than watching ``os.environ`` at run time finds every read,
including those on paths a test run never takes.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

__all__ = [
    "EnvironmentRead",
    "check_triton_interpret_rule",
    "env_name_literals",
    "environment_reads",
]

# (value, on) for ``TRITON_INTERPRET``: any value but "" and "0" means on; None: unset.
_TRITON_INTERPRET_CASES = [(None, False), ("", False), ("0", False), ("1", True), ("true", True)]

# ``os`` attributes through which a module reads (or writes) the environment.
_OS_ENVIRONMENT = frozenset({"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"})


class EnvironmentRead(NamedTuple):
    module: str  # path relative to the package directory, e.g. "_environment.py"
    function: str | None  # innermost enclosing function, None at module or class level
    line: int


def environment_reads(package_dir: Path) -> list[EnvironmentRead]:
    """Every place in ``package_dir``'s modules that uses ``os.environ``, ``os.getenv`` and
    the like, or imports them from ``os``."""
    reads = []
    for module, tree in _modules(package_dir):
        for node, function in _walk(tree, None):
            attribute = (
                isinstance(node, ast.Attribute)
                and node.attr in _OS_ENVIRONMENT
                and isinstance(node.value, ast.Name)
                and node.value.id == "os"
            )
            imported = (
                isinstance(node, ast.ImportFrom)
                and node.module == "os"
                and any(alias.name in _OS_ENVIRONMENT for alias in node.names)
            )
            if attribute or imported:
                reads.append(EnvironmentRead(module, function, node.lineno))
    return reads


def env_name_literals(package_dir: Path, pattern: str) -> dict[str, set[str]]:
    """module -> the string constants that match ``pattern`` whole, leaving out docstrings and
    ``__all__`` (names of Python objects, not values the code uses)."""
    regex = re.compile(pattern)
    found: dict[str, set[str]] = {}
    for module, tree in _modules(package_dir):
        skipped = {id(node) for node in _docstrings(tree)} | {id(node) for node in _exports(tree)}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in skipped
                and regex.fullmatch(node.value)
            ):
                found.setdefault(module, set()).add(node.value)
    return found


def check_triton_interpret_rule(helper: Callable[[], bool], monkeypatch: Any) -> None:
    """Assert that ``helper`` reads ``TRITON_INTERPRET`` by the one rule, value by value
    (``monkeypatch``: pytest's fixture, which restores the variable)."""
    for value, on in _TRITON_INTERPRET_CASES:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        if value is not None:
            monkeypatch.setenv("TRITON_INTERPRET", value)
        assert helper() is on, f"TRITON_INTERPRET={value!r} should read as {on}"


def _modules(package_dir: Path) -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(package_dir.rglob("*.py")):
        module = path.relative_to(package_dir).as_posix()
        yield module, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _walk(node: ast.AST, function: str | None) -> Iterator[tuple[ast.AST, str | None]]:
    yield node, function
    inner = node.name if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else function
    for child in ast.iter_child_nodes(node):
        yield from _walk(child, inner)


def _docstrings(tree: ast.Module) -> Iterator[ast.Constant]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                yield body[0].value


def _exports(tree: ast.Module) -> Iterator[ast.AST]:
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            yield from ast.walk(node.value)
