"""The runtime's shape, checked on its source: modules import each other in one direction, each
sub-package is reached through its ``__init__`` only, only the holder sub-package names the kinds
of parameters, and only the group reads or writes its own state (callers use its verbs)."""

from __future__ import annotations

import ast
from pathlib import Path

import dmuon_fsdp

PACKAGE = Path(dmuon_fsdp.__file__).parent
SUBPACKAGES = ("topology", "holder", "runtime", "setup", "optim", "checkpoint")
# The layers, bottom up ("": the top-level helper modules every layer may use, such as
# _profile and _torch_internals). setup and optim sit side by side: neither imports the other.
LAYERS = (
    "",
    "topology",
    "holder",
    "runtime",
    "setup",
    "optim",
    "checkpoint",
    "_diagnostics",
    "_ema",
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
            targets = [f"{stem}.{a.name}" if stem else a.name for a in node.names]
            if node.module or stem != ".".join(package):
                # ``from . import _x`` names a sibling, not the package's own ``__init__``.
                targets.append(stem)
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
    """topology <- holder <- runtime <- setup, optim <- checkpoint <- diagnostics, api
    (ARCHITECTURE.md)."""
    modules = _modules()
    upward = []
    for name, tree in modules.items():
        for target in _internal_imports(name, tree, set(modules)):
            if _layer(target) > _layer(name) or {name.split(".")[0], target.split(".")[0]} == {
                "setup",
                "optim",
            }:
                upward.append(f"{name} -> {target}")
    assert not upward, upward
    assert (
        _layer("optim._optimizer")
        > _layer("runtime._group")
        > _layer("holder._dedicated")
        > _layer("topology._comm")
    )


def _past_the_init(name: str, target: str) -> bool:
    """Whether module ``name`` imports ``target``, a private module of another sub-package,
    instead of that sub-package's ``__init__``."""
    package, _, rest = target.partition(".")
    return package in SUBPACKAGES and bool(rest) and name.split(".")[0] != package


def test_sub_packages_are_reached_through_their_init() -> None:
    """Each sub-package exports what its neighbours use from its ``__init__``; nothing outside
    it imports its private modules."""
    modules = _modules()
    reaching = sorted(
        f"{name} -> {target}"
        for name, tree in modules.items()
        for target in _internal_imports(name, tree, set(modules))
        if _past_the_init(name, target)
    )
    assert not reaching, reaching
    for package in SUBPACKAGES:
        exported = getattr(dmuon_fsdp, package).__all__
        assert exported and all(hasattr(getattr(dmuon_fsdp, package), n) for n in exported)


def test_the_init_finder_finds_a_reach_past_it() -> None:
    tree = ast.parse("from ..runtime._group import X\nfrom ..runtime import Y\nfrom ._a import Z")
    known = {"runtime", "runtime._group", "optim._a", "optim._b"}
    found = _internal_imports("optim._b", tree, known)
    assert found == {"runtime", "runtime._group", "optim._a"}
    assert [t for t in sorted(found) if _past_the_init("optim._b", t)] == ["runtime._group"]


# The kinds of parameters (see [Note: the kinds of holders] in holder/_kinds): the families the
# runtime is typed with (DedicatedParam, ExpertStack) may be named anywhere; the kinds that
# narrow them, and the registry's list, only inside the holder sub-package.
KIND_NAMES = frozenset({"TensorParallelParam", "SourcedExpertStack", "KINDS"})


def test_only_the_holder_sub_package_names_the_kinds() -> None:
    offenders = []
    for name, tree in _modules().items():
        if name.split(".")[0] == "holder":
            continue
        for node in ast.walk(tree):
            named = (
                node.id
                if isinstance(node, ast.Name)
                else node.attr
                if isinstance(node, ast.Attribute)
                else node.name
                if isinstance(node, ast.alias)
                else None
            )
            if named in KIND_NAMES:
                offenders.append(f"{name}: {named}")
    assert not offenders, offenders


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


# -- private torch ---------------------------------------------------------------------------------

# The modules that may reach private torch (see [Note: private torch] in _torch_internals):
# the door, and checkpoint._integrity, whose checksum reader overrides DCP's
# FileSystemReader._slice_file (a subclass cannot live behind a function).
PRIVATE_TORCH_ALLOWED = frozenset({"_torch_internals", "checkpoint._integrity"})
# Private attributes of torch objects (FSDP2 modules, DTensors, the autograd engine) that no
# import or ``torch.`` chain reveals.
PRIVATE_TORCH_ATTRIBUTES = frozenset(
    {
        "_local_tensor",
        "_get_fsdp_state",
        "_mp_policy",
        "_execution_engine",
        "_C",
        "_dynamo",
        "_slice_file",
    }
)


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _is_torch(module: str) -> bool:
    return module == "torch" or module.startswith("torch.")


def _dotted(node: ast.expr) -> list[str] | None:
    """``["torch", "_C", "_nn"]`` for the expression ``torch._C._nn`` (``None`` when the chain
    does not start at a name)."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _private_torch_uses(tree: ast.Module) -> set[str]:
    """Every private torch name a module reaches: an import from a torch module with a private
    component (or of a private name), an attribute chain from a name bound to torch with a
    private component, or one of ``PRIVATE_TORCH_ATTRIBUTES`` on any object."""
    bound: dict[str, str] = {}  # local name -> the torch path it stands for
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_torch(alias.name):
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        bound[alias.name.split(".")[0]] = "torch"
                    if any(_private(p) for p in alias.name.split(".")):
                        found.add(f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and not node.level and _is_torch(node.module or ""):
            module = node.module or ""
            for alias in node.names:
                path = f"{module}.{alias.name}"
                bound[alias.asname or alias.name] = path
                if any(_private(p) for p in path.split(".")):
                    found.add(f"from {module} import {alias.name}")
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE_TORCH_ATTRIBUTES:
            found.add(f".{node.attr}")
        if isinstance(node, ast.FunctionDef) and node.name in PRIVATE_TORCH_ATTRIBUTES:
            found.add(f"def {node.name}")  # overriding a private method of a torch class
        if not isinstance(node, ast.Attribute) or isinstance(parents.get(node), ast.Attribute):
            continue  # whole chains only, from their last attribute
        chain = _dotted(node)
        if chain is None or chain[0] not in bound:
            continue
        path = [*bound[chain[0]].split("."), *chain[1:]]
        if any(_private(p) for p in path):
            found.add(".".join(path))
    return found


def test_private_torch_finder_finds_every_form() -> None:
    source = (
        "import torch\n"
        "import torch.distributed as dist\n"
        "from torch.utils import _pytree\n"
        "from torch.distributed.fsdp._fully_shard import _fsdp_init\n"
        "from torch.autograd import Variable\n"
        "torch._C._nn._parse_to(x)\n"
        "dist.distributed_c10d._get_default_group()\n"
        "Variable._execution_engine.queue_callback(f)\n"
        "module._get_fsdp_state()._mp_policy\n"
        "t._local_tensor\n"
        "class R(FileSystemReader):\n    def _slice_file(self, f, s): ...\n"
        "torch.__version__, torch.compiler.is_compiling(), dist.group.WORLD, self._private\n"
    )
    assert _private_torch_uses(ast.parse(source)) == {
        "from torch.utils import _pytree",
        "from torch.distributed.fsdp._fully_shard import _fsdp_init",
        "torch._C._nn._parse_to",
        "._C",
        "torch.distributed.distributed_c10d._get_default_group",
        "torch.autograd.Variable._execution_engine.queue_callback",
        "._execution_engine",
        "._get_fsdp_state",
        "._mp_policy",
        "._local_tensor",
        "def _slice_file",
    }


def test_private_torch_is_reached_from_at_most_two_modules() -> None:
    """Private torch lives behind _torch_internals (plus at most one other module), so that a
    torch upgrade is checked in one place."""
    uses = {name: _private_torch_uses(tree) for name, tree in _modules().items()}
    reaching = {name for name, found in uses.items() if found}
    assert uses["_torch_internals"], "the finder sees nothing in the door: it would be vacuous"
    assert len(PRIVATE_TORCH_ALLOWED) <= 2
    offenders = {name: sorted(uses[name]) for name in sorted(reaching - PRIVATE_TORCH_ALLOWED)}
    assert not offenders, (
        "private torch outside dmuon_fsdp._torch_internals (add a named function there): "
        f"{offenders}"
    )
