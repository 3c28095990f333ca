"""The Chinese pages (``docs/zh``) stand beside the English ones they translate.

The English pages with a Chinese translation are listed in ``TRANSLATED``, the guides still
waiting for one in ``UNTRANSLATED``; every guide is in exactly one of the two, so a new English
guide fails here until it is translated or listed as waiting. A translated page keeps the
English page's code: its ```` ```python ```` and ```` ```bash ```` blocks equal the English
ones, in order, and its ``literalinclude`` directives include the same file with the same
options. Each page of a pair links to the other (the language switch), and to the same pages
besides. The Chinese
troubleshooting page has every entry of the English one, in the same sections and order, each
under the English heading verbatim: users search the page for the text of the message they got
(``test_troubleshooting.py`` ties the headings' phrases to the messages in the source), and the
heading gives the entry the same anchor on both pages.
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
    "guides/pipeline.md",
    "guides/grad-accumulation.md",
    "guides/clipping.md",
    "guides/checkpoints.md",
    "guides/mixed-precision.md",
    "guides/moe.md",
    "guides/ema.md",
    "guides/qk-clip.md",
    "guides/routing.md",
    "guides/newton-schulz.md",
    "guides/tuning.md",
    "guides/compile.md",
    "guides/scale.md",
    "guides/integrations/index.md",
    "guides/integrations/lightning.md",
    "guides/integrations/huggingface.md",
    "guides/integrations/torchtitan.md",
]
UNTRANSLATED: list[str] = []

CODE = re.compile(r"^```(python|bash)\n(.*?)^```", re.M | re.S)
INCLUDE = re.compile(r"^```\{literalinclude\} (\S+)\n((?::.*\n)*)", re.M)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
SECTION = re.compile(r"^## (.+)$", re.M)
ENTRY = re.compile(r"^### (.+)$", re.M)
CJK = re.compile(r"[\u4e00-\u9fff]")


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
    guides = {p.relative_to(DOCS).as_posix() for p in (DOCS / "guides").rglob("*.md")}
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


@pytest.mark.parametrize("page", TRANSLATED)
def test_the_pages_link_to_the_same_pages(page: str) -> None:
    # A paragraph, a bullet or a "see ..." kept in one language only shows as a link the other
    # lacks. The Chinese index names the pages with no translation (concepts, API) in prose,
    # where the English one lists them in its table of contents.
    english, chinese = DOCS / page, ZH / page

    def as_english(target: Path) -> Path:
        return DOCS / target.relative_to(ZH) if target.is_relative_to(ZH) else target

    en = {t for t in links(english) if t != chinese}
    zh = {as_english(t) for t in links(chinese)} - {english}
    if page == "index.md":
        zh -= {DOCS / "concepts.md", DOCS / "api.md"}
    rel = sorted(str(t.relative_to(DOCS)) for t in en - zh)
    assert not rel, (
        f"docs/{page} links to {rel}, docs/zh/{page} does not: translate what links there"
    )
    rel = sorted(str(t.relative_to(DOCS)) for t in zh - en)
    assert not rel, f"docs/zh/{page} links to {rel}, docs/{page} does not: say it in English too"


@pytest.mark.parametrize("page", TRANSLATED)
def test_the_chinese_page_has_the_english_sections(page: str) -> None:
    # A section dropped in translation (its heading lost, its text run into the section above)
    # leaves the Chinese page with fewer headings of that level.
    def levels(path: Path) -> list[int]:
        text = re.sub(r"^```.*?^```", "", read(path), flags=re.M | re.S)
        return [len(hashes) for hashes in re.findall(r"^(#{1,6}) ", text, re.M)]

    assert levels(ZH / page) == levels(DOCS / page), (
        f"docs/zh/{page}: its headings (levels, in order) differ from docs/{page}'s: one section per"
        " English section"
    )


def _entries(text: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """The ``##`` sections of a page, each with its ``###`` entries as (heading, body) pairs."""
    parts = SECTION.split(text)[1:]
    sections = []
    for title, body in zip(parts[::2], parts[1::2], strict=True):
        pieces = ENTRY.split(body)[1:]
        sections.append((title, list(zip(pieces[::2], pieces[1::2], strict=True))))
    return sections


def test_the_chinese_troubleshooting_page_has_every_english_entry() -> None:
    english = _entries(read(DOCS / "troubleshooting.md"))
    chinese = _entries(read(ZH / "troubleshooting.md"))
    assert len(chinese) == len(english), "one Chinese section per English section, in order"
    for (title, zh_entries), (en_title, en_entries) in zip(chinese, english, strict=True):
        en_headings = [heading for heading, _ in en_entries]
        zh_headings = [heading for heading, _ in zh_entries]
        missing = [h for h in en_headings if h not in zh_headings]
        extra = [h for h in zh_headings if h not in en_headings]
        assert not missing and not extra, (
            f"Chinese troubleshooting section {title!r} (English {en_title!r}): "
            f"untranslated entries {missing}, entries with no English one {extra}; each Chinese "
            "entry keeps its English heading verbatim (the message phrases users search for, "
            "and the anchor links point at)"
        )
        assert zh_headings == en_headings, f"section {title!r}: entries not in the English order"
        untranslated = [h for h, body in zh_entries if not CJK.search(body)]
        assert not untranslated, f"section {title!r}: entries with no Chinese text {untranslated}"
    assert sum(len(entries) for _, entries in chinese) > 200
