"""Sphinx configuration for the dmuon documentation site (`python3 -m nox -s docs`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sphinx.application import Sphinx

project = "dmuon"
author = "the dmuon authors"
copyright = "2026, the dmuon authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "tests", "examples"]
myst_enable_extensions = ["colon_fence", "dollarmath", "deflist"]
myst_heading_anchors = 3

# The API reference documents the names `dmuon` exports, where users import them from.
autodoc_default_options: dict[str, object] = {}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = "dmuon"


def setup(app: Sphinx) -> None:
    """A public docstring that refers to a design note gets the note's text at its end, and a
    constant no docstring of its type (see ``docs/_notes.py``)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _notes import append_notes, hide_type_docstrings

    app.connect("autodoc-process-docstring", append_notes)
    app.connect("autodoc-process-docstring", hide_type_docstrings)
