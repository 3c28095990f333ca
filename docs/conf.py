"""Sphinx configuration for the dmuon documentation site (`python3 -m nox -s docs`)."""

from __future__ import annotations

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
autodoc_default_options = {"members": False}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = "dmuon"
