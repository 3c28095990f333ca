"""The Chinese pages (``docs/zh``) stand beside the English ones they translate.

The English pages with a Chinese translation are listed in ``TRANSLATED``, the guides still
waiting for one in ``UNTRANSLATED``; every guide is in exactly one of the two, so a new English
guide fails here until it is translated or listed as waiting. A translated page keeps the
English page's code: its ```` ```python ```` and ```` ```bash ```` blocks equal the English
ones, in order, and its ``literalinclude`` directives include the same file with the same
options. Each page of a pair links to the other (the language switch). The Chinese
troubleshooting page keeps the English section order, and each of its entries keeps English
inline-code phrases of an entry of the same section, verbatim: users search the page for the
text of the message they got, and ``test_troubleshooting.py`` ties those phrases to the
messages in the source.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent
ZH = DOCS / "zh"

TRANSLATED = [
    "index.md",
    "quickstart.md",
    "faq.md",
    "troubleshooting.md",
    "guides/index.md",
    "guides/zero.md",
    "guides/hsdp.md",
    "guides/ddp.md",
    "guides/tp.md",
    "guides/grad-accumulation.md",
    "guides/clipping.md",
    "guides/checkpoints.md",
    "guides/mixed-precision.md",
    "guides/moe.md",
    "guides/qk-clip.md",
    "guides/routing.md",
    "guides/newton-schulz.md",
    "guides/tuning.md",
    "guides/compile.md",
    "guides/scale.md",
]
UNTRANSLATED: list[str] = []

CODE = re.compile(r"^```(python|bash)\n(.*?)^```", re.M | re.S)
INCLUDE = re.compile(r"^```\{literalinclude\} (\S+)\n((?::.*\n)*)", re.M)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
SECTION = re.compile(r"^## (.+)$", re.M)
ENTRY = re.compile(r"^### (.+)$", re.M)
PHRASE = re.compile(r"`([^`]+)`")


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def code_blocks(path: Path) -> list[tuple[str, str]]:
    return CODE.findall(read(path))


def includes(path: Path) -> list[tuple[Path, str]]:
    return [
        ((path.parent / target).resolve(), opts) for target, opts in INCLUDE.findall(read(path))
    ]


def links(path: Path) -> set[Path]:
    return {
        Path(posixpath.normpath((path.parent / target).as_posix()))
        for target in LINK.findall(read(path))
        if "://" not in target
    }


def test_every_guide_is_translated_or_listed_as_waiting() -> None:
    guides = {f"guides/{p.name}" for p in (DOCS / "guides").glob("*.md")}
    listed = {p for p in TRANSLATED + UNTRANSLATED if p.startswith("guides/")}
    assert guides == listed, (
        f"guides neither translated nor listed as waiting: {sorted(guides - listed)}; "
        f"listed but gone: {sorted(listed - guides)}"
    )
    assert not set(TRANSLATED) & set(UNTRANSLATED)
    waiting_but_there = [p for p in UNTRANSLATED if (ZH / p).exists()]
    assert not waiting_but_there, f"move these to TRANSLATED: {waiting_but_there}"


def test_the_chinese_tree_has_no_page_without_an_english_one() -> None:
    pages = {p.relative_to(ZH).as_posix() for p in ZH.rglob("*.md")}
    assert pages == set(TRANSLATED), sorted(pages ^ set(TRANSLATED))


@pytest.mark.parametrize("page", TRANSLATED)
def test_the_chinese_page_keeps_the_english_code(page: str) -> None:
    english, chinese = DOCS / page, ZH / page
    assert chinese.exists(), f"{page} has no Chinese page docs/zh/{page}"
    assert code_blocks(chinese) == code_blocks(english), (
        f"docs/zh/{page}: the python/bash blocks differ from docs/{page} (same blocks, same order)"
    )
    assert includes(chinese) == includes(english), f"docs/zh/{page}: literalinclude differs"


def test_the_scanners_see_code() -> None:
    # Guards the comparisons above: pages with no blocks would compare equal vacuously.
    assert sum(len(code_blocks(ZH / p)) for p in TRANSLATED) > 10
    assert len(includes(ZH / "quickstart.md")) == 3


@pytest.mark.parametrize("page", TRANSLATED)
def test_the_pages_link_to_each_other(page: str) -> None:
    english, chinese = DOCS / page, ZH / page
    assert english in links(chinese), f"docs/zh/{page} has no link to docs/{page} ([English](...))"
    if page in ("index.md", "quickstart.md", "faq.md", "troubleshooting.md", "guides/index.md"):
        assert chinese in links(english), f"docs/{page} has no link to docs/zh/{page} ([中文](...))"


def _entries(text: str) -> list[tuple[str, list[list[str]]]]:
    """The ``##`` sections of a page, each with the phrases of its ``###`` entries."""
    parts = SECTION.split(text)[1:]
    return [
        (title, [PHRASE.findall(entry) for entry in ENTRY.findall(body)])
        for title, body in zip(parts[::2], parts[1::2], strict=True)
    ]


def test_the_chinese_troubleshooting_entries_keep_the_message_phrases() -> None:
    english = _entries(read(DOCS / "troubleshooting.md"))
    chinese = _entries(read(ZH / "troubleshooting.md"))
    assert len(chinese) == len(english), "one Chinese section per English section, in order"
    translated = 0
    for (title, zh_entries), (_, en_entries) in zip(chinese, english, strict=True):
        en_phrases = [set(phrases) for phrases in en_entries]
        for phrases in zh_entries:
            if not phrases:
                continue  # a message torch or a warning prints, quoted in prose as in English
            translated += 1
            assert any(set(phrases) <= en for en in en_phrases), (
                f"Chinese troubleshooting section {title!r}: the entry {phrases} has no English "
                "entry in the same section with these phrases; copy the English heading's "
                "backticked phrases verbatim"
            )
    assert translated >= 30, translated
