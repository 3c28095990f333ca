"""The API reference (docs/api.md) documents every public name of ``dmuon``, and nothing else."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import dmuon

DOCS = Path(__file__).resolve().parent.parent
DIRECTIVE = re.compile(
    r"^\.\. auto(?:function|class|data|exception)::\s+dmuon\.((?:\w+\.)?\w+)(?:\(\))?\s*$", re.M
)


def documented() -> list[str]:
    """Every name docs/api.md documents: ``NAME`` for ``dmuon.NAME``, ``MODULE.NAME`` for
    ``dmuon.MODULE.NAME``."""
    return DIRECTIVE.findall((DOCS / "api.md").read_text(encoding="utf-8"))


def public() -> set[str]:
    """The top-level names, and each topic module's names that are not also top-level ones
    (``dmuon.clip.clip_grad_norm_`` is ``dmuon.clip_grad_norm_``: documented once)."""
    names = set(dmuon.__all__)
    for info in pkgutil.iter_modules(dmuon.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"dmuon.{info.name}")
        names |= {f"{info.name}.{n}" for n in getattr(module, "__all__", ()) if n not in names}
    return names


def test_every_public_name_is_in_the_api_reference() -> None:
    missing = sorted(public() - set(documented()))
    assert not missing, (
        f"public names missing from docs/api.md: {missing}; add an autodoc directive "
        "(.. autofunction:: dmuon.NAME, .. autoclass:: dmuon.MODULE.NAME) for each"
    )


def test_the_api_reference_documents_only_public_names_once() -> None:
    names = documented()
    assert len(names) >= len(dmuon.__all__) > 0
    stale = sorted(set(names) - public())
    assert not stale, f"docs/api.md documents names dmuon no longer exports: {stale}"
    twice = sorted({n for n in names if names.count(n) > 1})
    assert not twice, f"docs/api.md documents these names more than once: {twice}"


def test_pages_state_behaviour_without_citing_outside_documents() -> None:
    # The site must stand alone: no pointer to documents that live beside the repository.
    outside = re.compile(r"\bSP" r"EC\b|\.\./" r"shared|\bseeds/")
    hits = [
        f"{page.relative_to(DOCS)}:{number}: {line.strip()}"
        for page in sorted(DOCS.rglob("*.md"))
        if "_build" not in page.parts
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        if outside.search(line)
    ]
    assert not hits, "docs cite a document outside the repository:\n" + "\n".join(hits)
