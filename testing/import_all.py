"""Import every module of one installed package; run inside a venv holding only that package and
its declared dependencies, so that an import of an undeclared sibling fails.

A module that needs an optional dependency is reported and skipped when that dependency is
absent, and only then: the missing module must be the import name of a distribution that one of
the package's extras requires (its ``[project.optional-dependencies]``, read from the installed
metadata, a sibling's extra that it names, such as ``dmuon-ns[triton]``, included). Any other
missing module, a dmuon sibling above all, fails the check."""

import importlib
import importlib.metadata as metadata
import pkgutil
import re
import sys

# Distributions imported under another name than their own.
IMPORT_NAMES = {"quack-kernels": "quack", "nvidia-cutlass-dsl": "cutlass"}

_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?[^;]*(?:;(.*))?$")
_EXTRA = re.compile(r"""\bextra\s*==\s*['"]([^'"]+)['"]""")


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(distribution: str) -> list[tuple[str, set[str], str | None]]:
    """(distribution, its extras, the extra of ``distribution`` that requires it or None)."""
    found = []
    for line in metadata.requires(distribution) or []:
        match = _REQUIREMENT.match(line)
        if match is None:
            raise SystemExit(f"{distribution}: cannot read the requirement {line!r}")
        name, extras, marker = match.groups()
        extra = _EXTRA.search(marker or "")
        wanted = {_normal(e) for e in (extras or "").split(",") if e.strip()}
        found.append((_normal(name), wanted, _normal(extra.group(1)) if extra else None))
    return found


def optional_modules(distribution: str) -> dict[str, str]:
    """``{import name: "package[extra]"}`` for every distribution an extra of ``distribution``
    brings, through the extras of its siblings that it names."""
    modules: dict[str, str] = {}
    extras = metadata.metadata(distribution).get_all("Provides-Extra") or []
    pending = [(_normal(distribution), _normal(extra)) for extra in extras]
    seen = set()
    while pending:
        owner, extra = pending.pop()
        if (owner, extra) in seen:
            continue
        seen.add((owner, extra))
        requirements = _requirements(owner)
        required = {name for name, _, under in requirements if under is None}
        for name, wanted, under in requirements:
            if under != extra:
                continue
            if name not in required:  # not a sibling it always needs, as dmuon-ns[triton]
                modules[IMPORT_NAMES.get(name, name.replace("-", "_"))] = f"{owner}[{extra}]"
            pending += [(name, e) for e in wanted]
    return modules


package = sys.argv[1]
optional = optional_modules(package)
top = importlib.import_module(package.replace("-", "_"))
imported, skipped = [top.__name__], []
for info in pkgutil.walk_packages(top.__path__, prefix=top.__name__ + "."):
    try:
        importlib.import_module(info.name)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing not in optional:
            raise
        skipped.append(f"{info.name} (needs {missing}, from {optional[missing]})")
        continue
    imported.append(info.name)
print(f"{package}: imported {len(imported)} modules alone; skipped {skipped or 'none'}")
