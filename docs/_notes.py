"""The design notes of the packages' sources, for the API reference.

A note is written once, where the code it explains lives (a package's source, a test, a
benchmark): a line that starts with
``[Note: <name>]`` (in a docstring, or after ``#`` in a comment), the note's text following
it. Elsewhere the code and the docs refer to it as ``[Note: <name>]`` (a name may wrap over
lines). The API reference is built from docstrings, where such a reference would point into
source a reader of the site does not have; so ``append_notes`` (an ``autodoc-process-docstring``
handler, see ``conf.py``) adds the text of every note a docstring refers to at its end.
``docs/tests/test_notes.py`` checks that every reference, in the sources and in the docs,
names a note defined exactly once.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent

# A definition starts its line (after indentation, a comment's "#" or a docstring's quotes) and
# is followed by the end of the line or by a sentence.
DEFINITION = re.compile(
    r'^[ \t]*(?:#[ \t]*|r?""")?\[Note: ([^\]\n]+)\](?=[ \t]*$|[ \t]+[A-Z`])', re.M
)
REFERENCE = re.compile(r"\[Note:\s+([^\]]+)\]")
# Where a note in a function's docstring gives way to its argument sections.
_SECTION = re.compile(r"^\s*(Args|Arguments|Returns|Raises|Yields|Example|Examples):\s*$")


class Note(NamedTuple):
    name: str
    path: str  # relative to the repository root
    line: int  # 1-based, of the definition
    text: str  # the note's text, dedented, without its name


def normalise(name: str) -> str:
    """A note's name as written in one place, wrapped over lines or not."""
    return " ".join(name.replace("#", " ").split())


def references(text: str) -> list[str]:
    """The names of the notes ``text`` refers to (definitions included), in order, once each."""
    return list(dict.fromkeys(normalise(m.group(1)) for m in REFERENCE.finditer(text)))


def python_files(root: Path = ROOT) -> list[Path]:
    """Where notes are defined: the packages' sources and tests, the benchmarks, the shared
    test helpers."""
    patterns = ("packages/*/src/**/*.py", "packages/*/tests/**/*.py", "benchmarks/*.py")
    return sorted(p for pattern in (*patterns, "testing/**/*.py") for p in root.glob(pattern))


def definitions(root: Path = ROOT) -> dict[str, list[Note]]:
    """Every note defined in ``python_files``, by name (a list: a name must be defined once,
    which ``test_notes`` checks)."""
    found: dict[str, list[Note]] = {}
    for path in python_files(root):
        source = path.read_text()
        lines = source.splitlines()
        for match in DEFINITION.finditer(source):
            index = source.count("\n", 0, match.start())
            name = normalise(match.group(1))
            # A definition starts its line (``^``), so its end is a column of that line.
            text = _text(lines, index, match.end() - match.start())
            rel = path.relative_to(root).as_posix()
            found.setdefault(name, []).append(Note(name, rel, index + 1, text))
    return found


def _text(lines: list[str], index: int, header_end: int) -> str:
    """The note whose definition is on ``lines[index]``, ending at ``header_end`` there: the
    rest of that line and what follows it, up to the end of its comment block or docstring,
    the next note's definition or an argument section."""
    first = lines[index]
    comment = first.lstrip().startswith("#")
    body = [first[header_end:].strip()]
    for line in lines[index + 1 :]:
        stripped = line.strip()
        if comment:
            if not stripped.startswith("#"):
                break
            body.append(stripped[1:].strip())
            continue
        if DEFINITION.match(line) or _SECTION.match(line):
            break
        if stripped.endswith('"""'):
            body.append(line.rstrip()[:-3].rstrip())
            break
        body.append(line)
    indent = min((len(line) - len(line.lstrip()) for line in body[1:] if line.strip()), default=0)
    return "\n".join([body[0], *(line[indent:] for line in body[1:])]).strip()


# "[Note: x] in ``runtime/_runtime``", "``_prepare``'s [Note: x]", "``_iterations``' [Note:
# x]": where a note lives, for
# readers of the sources; the site shows the note itself, so the pointer goes.
_POINTER_AFTER = re.compile(r"(\[Note:[^\]]+\])\s+in\s+``[\w./]+``")
_POINTER_BEFORE = re.compile(r"``[\w./]+``'s?\s+(\[Note:)")
# A Sphinx role, which a literal block would show raw.
_ROLE = re.compile(r":(?:py:)?[a-z]+:`~?\.?([^`]+)`")
# The notes each page has shown in full, and under which object.
_SHOWN: dict[str, dict[str, str]] = {}


def append_notes(app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """Add to a docstring (``lines``, reStructuredText) the text of each note it cites: in
    full the first time a page cites it, then as a pointer to that first object. A note the
    docstring defines itself is not repeated."""
    text = "\n".join(lines)
    defined_here = {normalise(m.group(1)) for m in DEFINITION.finditer(text)}
    names = [n for n in references(text) if n not in defined_here]
    if not names:
        return
    lines[:] = _without_pointers(text).splitlines()
    page = getattr(getattr(app, "env", None), "docname", "")
    shown = _SHOWN.setdefault(page, {})
    notes = _cached_definitions()
    lines += ["", ".. rubric:: Design notes referred to above", ""]
    for note_name in names:
        (note,) = notes[note_name]
        if note_name in shown:
            lines += [f"**[Note: {note_name}]**: shown above, under ``{shown[note_name]}``.", ""]
            continue
        shown[note_name] = name
        lines += [f"**[Note: {note_name}]** (``{note.path}``, line {note.line})::", ""]
        body = _ROLE.sub(r"``\1``", _without_pointers(note.text))
        lines += [f"    {line}" if line else "" for line in body.splitlines()]
        lines.append("")


def _without_pointers(text: str) -> str:
    return _POINTER_BEFORE.sub(r"\1", _POINTER_AFTER.sub(r"\1", text))


def hide_type_docstrings(
    app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    """A documented constant (a tuple, a str) has no docstring of its own: drop the one its
    type would lend it ("Built-in immutable sequence..."); the page's text describes it."""
    if what == "data" and type(obj).__doc__ and obj.__doc__ == type(obj).__doc__:
        lines.clear()


_CACHE: dict[str, list[Note]] = {}


def _cached_definitions() -> dict[str, list[Note]]:
    if not _CACHE:
        _CACHE.update(definitions())
    return _CACHE
