"""The runtime's shape, checked on its source: modules import each other in one direction, and
only the group reads or writes its own state (callers use its verbs)."""

from __future__ import annotations

import ast
from pathlib import Path

import dmuon_fsdp

PACKAGE = Path(dmuon_fsdp.__file__).parent
SUBPACKAGES = ("topology", "runtime", "setup", "optim", "checkpoint")
# The layers, bottom up ("": the top-level helper modules every layer may use, such as
# _profile and _torch_internals). setup and optim sit side by side: neither imports the other.
LAYERS = (
    "",
    "topology",
    "runtime",
    "setup",
    "optim",
    "checkpoint",
    "_diagnostics",
    "_api",
    "__init__",
)


def _module_name(path: Path) -> str:
    """``runtime._group`` for ``runtime/_group.py``; ``__init__`` files are named after their
    package (``runtime``; the top one ``__init__``)."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts) or "__init__"


def _modules() -> dict[str, ast.Module]:
    return {
        _module_name(path): ast.parse(path.read_text(), str(path))
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def _internal_imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """Every ``dmuon_fsdp`` module that module ``name`` imports, at any level (``TYPE_CHECKING``
    blocks and function bodies included: an import cycle hidden there is still a cycle)."""
    is_package = name in SUBPACKAGES or name == "__init__"
    here = [] if name == "__init__" else name.split(".")
    package = here if is_package else here[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
            elif node.module and node.module.split(".")[0] == "dmuon_fsdp":
                base = []
            else:
                continue
            module = [] if node.level == 0 else base
            dotted = (node.module or "").split(".") if node.module else []
            if node.level == 0:
                dotted = dotted[1:]
            stem = ".".join([*module, *dotted])
            targets = [f"{stem}.{a.name}" if stem else a.name for a in node.names] + [stem]
        elif isinstance(node, ast.Import):
            targets = [
                a.name.removeprefix("dmuon_fsdp.")
                for a in node.names
                if a.name.startswith("dmuon_fsdp.")
            ]
        for target in targets:
            if target in known and target != name:
                found.add(target)
    return found


def _layer(module: str) -> int:
    """The rank of a module's layer: a module may import only from its own layer or below."""
    top = module.split(".")[0]
    return LAYERS.index(top) if top in LAYERS else LAYERS.index("")


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
    graph = {name: _internal_imports(name, tree, set(modules)) for name, tree in modules.items()}
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"


def test_layers_import_downwards() -> None:
    """topology <- runtime <- setup, optim <- checkpoint <- diagnostics, api (ARCHITECTURE.md)."""
    modules = _modules()
    upward = []
    for name, tree in modules.items():
        if name in SUBPACKAGES:
            continue  # a sub-package's __init__ holds only its docstring
        for target in _internal_imports(name, tree, set(modules)):
            if target in SUBPACKAGES:
                continue
            if _layer(target) > _layer(name) or {name.split(".")[0], target.split(".")[0]} == {
                "setup",
                "optim",
            }:
                upward.append(f"{name} -> {target}")
    assert not upward, upward
    assert _layer("optim._optimizer") > _layer("runtime._group") > _layer("topology._comm")


def test_internal_imports_resolve() -> None:
    tree = ast.parse(
        "from ..runtime._group import X\nfrom ._fused import Y\nfrom .. import _profile"
    )
    known = {"runtime._group", "optim._fused", "_profile", "optim._optimizer"}
    assert _internal_imports("optim._optimizer", tree, known) == {
        "runtime._group",
        "optim._fused",
        "_profile",
    }


def test_only_the_group_touches_its_state() -> None:
    offenders = []
    for name, tree in _modules().items():
        if name == "runtime._group":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id == "GroupState":
                offenders.append(f"{name}: GroupState")
            elif isinstance(node, ast.alias) and node.name == "GroupState":
                offenders.append(f"{name}: imports GroupState")
            elif isinstance(node, ast.Attribute) and node.attr == "_state":
                offenders.append(f"{name}: ._state")
    assert not offenders, offenders
    assert not hasattr(dmuon_fsdp.runtime._group.DedicatedGroup, "state"), "state must stay private"
