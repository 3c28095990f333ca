"""dmuon.plan's modules import one another one way only: no import cycle, counting imports
inside functions and under ``TYPE_CHECKING`` too."""

from __future__ import annotations

import ast
from pathlib import Path

import dmuon.plan

PLAN = Path(dmuon.plan.__file__).parent


def _imports() -> dict[str, set[str]]:
    """Module -> the dmuon.plan modules it imports (by relative or absolute import)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PLAN.glob("*.py")):
        module = path.stem
        graph[module] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or node.module is None:
                continue
            if node.level == 1:
                graph[module].add(node.module.split(".")[0])
            elif node.module.startswith("dmuon.plan."):
                graph[module].add(node.module.split(".")[2])
    return graph


def test_the_plan_modules_form_no_import_cycle() -> None:
    graph = _imports()
    assert {"_forecast", "_figures", "_cli", "_model_shapes"} <= set(graph)
    assert "_figures" in graph["_forecast"]  # the scan sees relative imports
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        if module in path:
            cycle = " -> ".join((*path[path.index(module) :], module))
            raise AssertionError(f"import cycle in dmuon.plan: {cycle}")
        if module in done:
            return
        for imported in graph.get(module, ()):
            visit(imported, (*path, module))
        done.add(module)

    for module in graph:
        visit(module, ())
