"""Import every module of one installed package; run inside a venv holding only that package and
its declared dependencies, so that an import of an undeclared sibling fails.

Modules that need an optional extra (Triton, quack, matplotlib) are reported and skipped when the
extra is absent; a missing dmuon sibling is always an error."""

import importlib
import pkgutil
import sys

OPTIONAL = {"triton", "quack", "cutlass", "gram_newton_schulz", "matplotlib"}

package = sys.argv[1]
top = importlib.import_module(package.replace("-", "_"))
imported, skipped = [top.__name__], []
for info in pkgutil.walk_packages(top.__path__, prefix=top.__name__ + "."):
    try:
        importlib.import_module(info.name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in OPTIONAL:
            raise
        skipped.append(f"{info.name} (needs {exc.name})")
        continue
    imported.append(info.name)
print(f"{package}: imported {len(imported)} modules alone; skipped {skipped or 'none'}")
