"""Every error message the packages can show a user has an entry in docs/troubleshooting.md.

An entry is a level-3 heading made of one or more inline-code phrases, e.g.
``### `has no hook boundary` ``. A message is covered when one of those phrases is a substring
of the fixed text of the message (the parts of an f-string outside ``{...}``; a phrase never
spans a placeholder). The messages are read from the source: every ``SomethingError("...")``
or ``SomethingError(f"...")`` call in ``packages/*/src`` whose first argument is a string
literal with a fixed run of at least ``MIN_FIXED`` characters (shorter ones, such as
``f"{name} must be {bound}, got {value!r}"``, hold no phrase that could single them out; their
entries name them in prose). ``AssertionError`` marks an internal invariant, not a user error,
and is left out. A module-level string named ``*_REASON`` counts as a message too: the reason
given to ``torch.compiler.disable``, which dynamo quotes in its own ``Unsupported`` error.

When a message changes, the test names it (file:line and its fixed text) if no phrase matches
it any more, and names every phrase that no longer matches any message: change the phrase in
the heading (or write a new entry), keep the anchor readers may have linked to if you like.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "troubleshooting.md"
HOLE = "\x00"  # stands for an f-string placeholder: no phrase can match across it
HEADING = re.compile(r"^### (.+)$", re.M)
CODE = re.compile(r"`([^`]+)`")
INTERNAL = {"AssertionError"}
MIN_FIXED = 12


@dataclass(frozen=True)
class Message:
    where: str
    exception: str
    text: str

    def shown(self) -> str:
        return self.text.replace(HOLE, "{…}")


def _fixed_text(node: ast.expr) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(
            str(part.value) if isinstance(part, ast.Constant) else HOLE for part in node.values
        )
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _fixed_text(node.left), _fixed_text(node.right)
        if left is None and right is None:
            return None
        return (left if left is not None else HOLE) + (right if right is not None else HOLE)
    return None


def _callee(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def error_messages() -> list[Message]:
    found = []
    for path in sorted(ROOT.glob("packages/*/src/**/*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id.endswith("_REASON")
                for target in node.targets
            ):
                name, text = "Unsupported", _fixed_text(node.value)
            elif not isinstance(node, ast.Call) or not node.args:
                continue
            else:
                name = _callee(node)
                if not re.fullmatch(r"[A-Z]\w*(Error|Exception)", name) or name in INTERNAL:
                    continue
                text = _fixed_text(node.args[0])
            if text is None or max(len(run) for run in text.split(HOLE)) < MIN_FIXED:
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            found.append(Message(where, name, text))
    return found


def phrases() -> list[str]:
    page = PAGE.read_text(encoding="utf-8")
    return [p for heading in HEADING.findall(page) for p in CODE.findall(heading)]


def _matches(phrase: str, message: Message) -> bool:
    return phrase in message.text


def test_the_source_has_messages_and_the_page_has_entries() -> None:
    # Guards the two scanners: an empty side would make the checks below pass vacuously.
    assert len(error_messages()) > 100
    assert len(phrases()) > 50


def test_every_error_message_has_an_entry() -> None:
    keys = phrases()
    uncovered = [m for m in error_messages() if not any(_matches(k, m) for k in keys)]
    assert not uncovered, (
        f"{len(uncovered)} error message(s) have no entry in docs/troubleshooting.md; add a "
        "'### `distinctive phrase`' entry for each:\n"
        + "\n".join(f"  {m.where} [{m.exception}] {m.shown()}" for m in uncovered)
    )


def test_every_entry_matches_a_message() -> None:
    messages = error_messages()
    stale = [k for k in phrases() if not any(_matches(k, m) for m in messages)]
    assert not stale, (
        "these troubleshooting phrases match no error message in packages/*/src (the message "
        f"changed or went away): {stale}"
    )
