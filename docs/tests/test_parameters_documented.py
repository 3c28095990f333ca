"""Every parameter the API reference shows is documented in its docstring.

The reference (docs/api.md) renders each public function, class and listed method with Sphinx
autodoc and napoleon (Google style, docs/conf.py). A parameter counts as documented when the
docstring, converted by napoleon as the build converts it, holds a ``:param NAME:`` (or
``:keyword NAME:``) field with a description: in Google style, an entry ``NAME: what it does``
of an ``Args:`` (or ``Keyword Args:``) section. A mention of the name in prose does not count,
and neither does the empty entry ``autodoc_typehints = "description"`` adds for the type.

Checked: each ``autofunction`` (its parameters), each ``autoclass`` / ``autoexception`` (its
constructor's parameters, the dataclass fields included, documented in the class docstring,
which is what autodoc shows) and each method of a ``:members:`` list; ``self``, ``cls``,
``*args`` and ``**kwargs`` are not parameters to document.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, cast

from sphinx.config import Config as SphinxConfig
from sphinx.ext.napoleon import Config
from sphinx.ext.napoleon.docstring import GoogleDocstring
from sphinx.util.inspect import getdoc

DOCS = Path(__file__).resolve().parent.parent
DIRECTIVE = re.compile(
    r"^\.\. auto(function|class|exception)::\s+(dmuon(?:\.\w+)+)\s*$"
    r"(?:\n[ \t]+:members:[ \t]*(.*)$)?",
    re.M,
)
# The field names Sphinx's Python domain reads as a parameter's description.
FIELD = re.compile(r"^:(?:param|parameter|arg|argument|key|keyword|kwarg|kwparam)\s+(.+?):(.*)$")
SKIPPED = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
Kind = Literal["function", "class", "method"]


@functools.cache
def napoleon_config() -> Config:
    """The napoleon settings of docs/conf.py, so that the docstrings convert as in the build."""
    conf: dict[str, Any] = {}
    exec(compile((DOCS / "conf.py").read_text(encoding="utf-8"), "conf.py", "exec"), conf)
    return Config(**{k: v for k, v in conf.items() if k.startswith("napoleon_")})


def resolve(dotted: str) -> Any:
    """The object ``dmuon.MODULE.NAME`` (or ``dmuon.NAME``) names."""
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def reference() -> Iterator[tuple[str, Kind, Callable[..., Any], str]]:
    """(qualified name, kind, object, docstring) for every callable docs/api.md shows."""
    for directive, dotted, members in DIRECTIVE.findall((DOCS / "api.md").read_text("utf-8")):
        obj = resolve(dotted)
        kind: Kind = "function" if directive == "function" else "class"
        yield dotted, kind, obj, getdoc(obj) or ""
        for member in filter(None, (m.strip() for m in members.split(","))):
            if isinstance(inspect.getattr_static(obj, member), property):
                continue  # a property takes no parameter
            method = getattr(obj, member)
            doc = getdoc(method, allow_inherited=True, cls=obj, name=member) or ""
            yield f"{dotted}.{member}", "method", method, doc


def parameters(obj: Callable[..., Any]) -> list[str]:
    """The parameters autodoc prints in the signature (bound methods drop ``self``/``cls``)."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # an exception class without its own __init__: none shown
        return []
    return [
        p.name for p in signature.parameters.values() if p.kind not in SKIPPED and p.name != "self"
    ]


def documented(doc: str, kind: Kind, name: str, obj: Any) -> dict[str, str]:
    """``{parameter: description}`` of the parameter fields napoleon makes of ``doc``."""
    # GoogleDocstring takes napoleon's own Config (its documented use outside a build), which
    # the type stubs do not list.
    config = cast(SphinxConfig, napoleon_config())
    lines = str(
        GoogleDocstring(inspect.cleandoc(doc), config, what=kind, name=name, obj=obj)
    ).splitlines()
    fields: dict[str, str] = {}
    for i, line in enumerate(lines):
        match = FIELD.match(line)
        if match is None:
            continue
        body = [match.group(2).strip()]
        for following in lines[i + 1 :]:
            if not following.startswith((" ", "\t")):
                break
            body.append(following.strip())
        # ``:param int x:`` carries a type before the name; the name is the last word.
        fields[match.group(1).split()[-1].lstrip("\\*")] = " ".join(filter(None, body))
    return fields


def test_the_reference_shows_every_public_callable() -> None:
    # Guards the walk below: it must see the API, not an empty list.
    names = [name for name, *_ in reference()]
    assert len(names) >= 60, names
    assert {"dmuon.Muon", "dmuon.Muon.step", "dmuon.StepOptions", "dmuon.plan.Forecast.rank"} <= {
        *names
    }


def test_every_public_parameter_is_documented() -> None:
    missing = []
    for name, kind, obj, doc in reference():
        fields = documented(doc, kind, name, obj)
        missing += [f"{name}: {p}" for p in parameters(obj) if not fields.get(p)]
    assert not missing, (
        f"{len(missing)} public parameters have no description; give each an entry "
        "'name: what it changes, its valid range' in the docstring's Args: section "
        "(a class documents its constructor's parameters, dataclass fields included):\n"
        + "\n".join(missing)
    )


def test_no_docstring_documents_a_parameter_that_does_not_exist() -> None:
    stale = []
    for name, kind, obj, doc in reference():
        try:
            takes_keywords = any(
                p.kind is inspect.Parameter.VAR_KEYWORD
                for p in inspect.signature(obj).parameters.values()
            )
        except (TypeError, ValueError):
            takes_keywords = False
        if takes_keywords:
            continue  # its Args: may describe the keywords **kwargs takes
        real = set(parameters(obj))
        stale += [f"{name}: {p}" for p in documented(doc, kind, name, obj) if p not in real]
    assert not stale, (
        "docstrings document parameters their callable does not take (renamed or removed?):\n"
        + "\n".join(stale)
    )


def test_the_rule_reads_args_sections_and_not_prose() -> None:
    def sample(alpha: int, beta: int = 0, *, gamma: str = "x") -> None:
        """Do it with ``beta`` in prose.

        Args:
            alpha: the count, >= 1.
            gamma:
        """

    fields = documented(sample.__doc__ or "", "function", "sample", sample)
    assert fields == {"alpha": "the count, >= 1.", "gamma": ""}
    assert parameters(sample) == ["alpha", "beta", "gamma"]
    undocumented = [p for p in parameters(sample) if not fields.get(p)]
    assert undocumented == ["beta", "gamma"]
