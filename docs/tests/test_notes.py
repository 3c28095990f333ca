"""The design notes: every ``[Note: <name>]`` the sources, the tests, the benchmarks and the
docs refer to is defined exactly once in ``packages/*/src`` (see ``docs/_notes.py``), and the
API reference carries the text of each note a public docstring refers to.

When a note is renamed, the test names every reference left behind; when a note is moved, its
references need no change (a name is enough to find it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs"))

import _notes  # noqa: E402

REFERRING = [
    *ROOT.glob("packages/*/src/**/*.py"),
    *ROOT.glob("packages/*/tests/**/*.py"),
    *ROOT.glob("packages/*/README.md"),
    *ROOT.glob("benchmarks/*.py"),
    *ROOT.glob("testing/**/*.py"),
    *(p for p in ROOT.glob("docs/**/*.md") if "_build" not in p.parts),
    ROOT / "ARCHITECTURE.md",
    ROOT / "README.md",
]


def test_every_note_is_defined_once_with_its_text() -> None:
    notes = _notes.definitions()
    twice = {
        name: [f"{n.path}:{n.line}" for n in found]
        for name, found in notes.items()
        if len(found) > 1
    }
    assert not twice, f"notes defined more than once (rename one): {twice}"
    short = [
        f"{found[0].path}:{found[0].line}" for found in notes.values() if len(found[0].text) < 80
    ]
    assert not short, f"notes whose text was not found after their name: {short}"


def test_every_reference_names_a_defined_note() -> None:
    notes = _notes.definitions()
    dangling = [
        f"{path.relative_to(ROOT)}: [Note: {name}]"
        for path in REFERRING
        for name in _notes.references(path.read_text())
        if name not in notes
    ]
    assert not dangling, f"references to notes that are not defined anywhere: {dangling}"


@pytest.mark.parametrize(
    "obj", ["dmuon.Muon.step", "dmuon.EMA", "dmuon.get_model_state_dict"], ids=str
)
def test_a_public_docstring_gets_the_text_of_the_notes_it_refers_to(obj: str) -> None:
    import importlib
    import inspect

    module, _, attribute = obj.partition(".")
    target = importlib.import_module(module)
    for part in attribute.split("."):
        target = getattr(target, part)
    lines = inspect.getdoc(target).splitlines()
    names = _notes.references("\n".join(lines))
    assert names, obj
    _notes._SHOWN.clear()  # a new page: every note in full
    _notes.append_notes(None, "", obj, target, None, lines)
    text = "\n".join(lines)
    for name in names:
        note = _notes.definitions()[name][0]
        assert f"**[Note: {name}]** (``{note.path}``" in text
        last = note.text.splitlines()[-1].strip()
        assert _notes._ROLE.sub(r"``\1``", _notes._without_pointers(last)) in text


def test_a_page_shows_a_note_in_full_once_and_no_type_docstrings() -> None:
    """The second docstring of a page that cites a note gets a pointer to the first; a note
    a docstring defines itself is not appended to it; sphinx roles do not reach the literal
    blocks; a constant shows no docstring of its type."""
    _notes._SHOWN.clear()
    first = ["Reads the notes (see [Note: the forecast] in ``_forecast``)."]
    second = ["Also [Note: the forecast]."]
    _notes.append_notes(None, "", "first", None, None, first)
    _notes.append_notes(None, "", "second", None, None, second)
    assert first[0] == "Reads the notes (see [Note: the forecast])."
    assert sum("**[Note: the forecast]** (``" in line for line in first) == 1
    assert not any(":attr:`" in line or ":class:`" in line for line in first)
    assert "**[Note: the forecast]**: shown above, under ``first``." in second
    own = ["[Note: the forecast]", "Its text, then a citation of [Note: the forecast]."]
    _notes.append_notes(None, "", "own", None, None, own)
    assert len(own) == 2
    constant = ["Built-in immutable sequence."]
    _notes.hide_type_docstrings(None, "data", "X", (1, 2), None, constant)
    assert constant == []
