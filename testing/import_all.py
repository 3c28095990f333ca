"""Import every module of one installed package; run inside a venv holding only that package and
its declared dependencies, so that an import of an undeclared sibling fails."""

import importlib
import pkgutil
import sys

package = sys.argv[1]
top = importlib.import_module(package.replace("-", "_"))
names = [top.__name__]
for info in pkgutil.walk_packages(top.__path__, prefix=top.__name__ + "."):
    importlib.import_module(info.name)
    names.append(info.name)
print(f"{package}: imported {len(names)} modules alone")
