"""The runtime's shape, checked on its source: modules import each other in one direction, and
only the group reads or writes its own state (callers use its verbs)."""

from __future__ import annotations

import ast
from pathlib import Path

import dmuon_fsdp

PACKAGE = Path(dmuon_fsdp.__file__).parent


def _modules() -> dict[str, ast.Module]:
    return {
        path.stem: ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.glob("*.py"))
    }


def _internal_imports(tree: ast.Module) -> set[str]:
    """Every ``dmuon_fsdp`` module this one imports, at any level (``TYPE_CHECKING`` blocks and
    function bodies included: an import cycle hidden there is still a cycle)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                found.add(node.module.split(".")[0])
            elif node.level == 1:
                found.update(alias.name for alias in node.names)
            elif node.module and node.module.startswith("dmuon_fsdp."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("dmuon_fsdp."):
                    found.add(alias.name.split(".")[1])
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module -> modules it imports), or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_in_dmuon_fsdp() -> None:
    modules = _modules()
    graph = {
        name: _internal_imports(tree) - {"__init__"}
        for name, tree in modules.items()
        if name != "__init__"
    }
    assert set().union(*graph.values()) <= set(graph), "an import of a module that does not exist"
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"


def test_only_the_group_touches_its_state() -> None:
    offenders = []
    for name, tree in _modules().items():
        if name == "_group":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id == "GroupState":
                offenders.append(f"{name}: GroupState")
            elif isinstance(node, ast.alias) and node.name == "GroupState":
                offenders.append(f"{name}: imports GroupState")
            elif isinstance(node, ast.Attribute) and node.attr == "_state":
                offenders.append(f"{name}: ._state")
    assert not offenders, offenders
    assert not hasattr(dmuon_fsdp._group.DedicatedGroup, "state"), "state must stay private"
