"""The user-facing pages hold no placeholder and import nothing private.

README.md, every page under docs/ (English and Chinese) and every package's README are read
by users, who copy what they show: a ``git clone <this repository>``, a ``TODO`` or a
``python -m dmuon._demo`` is either a command that cannot run as written or a name that may
change without notice. Angle brackets stay allowed where they name a variable part of a key
or a message (``<name>/muon``, ``<file>: missing``); a shell block's command line must run as
written, so it may hold none.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(
    [
        ROOT / "README.md",
        *(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts),
        *(ROOT / "packages").glob("*/README.md"),
    ]
)

# Words that mark unfinished text, and angle-bracket stand-ins for something the reader must
# supply (this repository, your path, a URL, an ellipsis).
MARKER = re.compile(r"\b(?:TODO|FIXME|XXX|TBD)\b")
STAND_IN = re.compile(
    r"<\s*(?:this|your|insert|placeholder|repo|repository|url|link|path/to|\.\.\.|…)\b[^<>\n]*>"
    r"|<\s*(?:\.\.\.|…)\s*>",
    re.I,
)
# A private module of one of the packages, imported or run.
PRIVATE = re.compile(
    r"\bfrom\s+dmuon\w*(?:\.\w+)*\._\w*\s+import\b"
    r"|\bimport\s+dmuon\w*(?:\.\w+)*\._\w*"
    r"|-m\s+dmuon\w*(?:\.\w+)*\._\w*"
    r"|\bdmuon\._(?!_)\w+"  # dmuon.__all__ is public
)
# A pip install of one of the packages by name: none is on a package index, so pip would fetch
# another project's package of that name, or nothing.
INDEX_INSTALL = re.compile(
    r"pip install\s+(?:-\S+\s+)*[\"']?dmuon[\w-]*(?:\[[\w,]+\])?[\"']?(?![\w./-])"
)
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell|console)\n(.*?)^```", re.M | re.S)
SHELL_STAND_IN = re.compile(r"<[A-Za-z.…][^<>\n]*>")


def problems(text: str) -> list[str]:
    """Every placeholder or private import in ``text``, as ``line N: kind: the line``."""
    found = []
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        for kind, pattern in (
            ("marker", MARKER),
            ("stand-in", STAND_IN),
            ("private", PRIVATE),
            ("install from an index", INDEX_INSTALL),
        ):
            if pattern.search(line):
                found.append(f"line {number}: {kind}: {line.strip()}")
    for block in SHELL_BLOCK.finditer(text):
        first = text.count("\n", 0, block.start(1)) + 1
        for offset, line in enumerate(block.group(1).splitlines()):
            if SHELL_STAND_IN.search(line):
                found.append(f"line {first + offset}: stand-in in a command: {line.strip()}")
    return found


@pytest.mark.parametrize(
    "bad",
    [
        "```bash\ngit clone <this repository> dmuon && cd dmuon\n```\n",
        "Clone <your fork> first.",
        "TODO: say which torch.",
        "Run `torchrun --nproc-per-node 8 -m dmuon._demo --torchrun`.",
        "from dmuon_fsdp._api import get_dedicated_params",
        "import dmuon_ns._autotune as tune",
        "```bash\npython train.py --dir <checkpoint dir>\n```\n",
        'the Trainer module (`pip install "dmuon[hf]"`)',
        "pip install dmuon-ns",
    ],
)
def test_the_scanner_finds_placeholders_and_private_imports(bad: str) -> None:
    assert problems(bad), bad


@pytest.mark.parametrize(
    "good",
    [
        "dmuon names the subgroups `<name>/muon` and `<name>/adamw`.",
        "- `<file>: missing`: a data file the `.metadata` lists is gone.",
        "INFO:dmuon_fsdp.setup._dedicate:dedicate_params: 14 params assigned to 2 ranks",
        "`torchrun --nproc-per-node 8 --no-python dmuon-demo --torchrun`",
        "the names below are the whole public surface (`dmuon.__all__`)",
        "```bash\npython3 -m nox -s demo -- --steps 80\n```\n",
        'pip install "./packages/dmuon[hf]"',
        "pip install -e ./packages/dmuon-ns ./packages/dmuon",
    ],
)
def test_the_scanner_lets_notation_through(good: str) -> None:
    assert not problems(good), problems(good)


def test_the_user_facing_pages_hold_no_placeholder_or_private_import() -> None:
    assert len(PAGES) > 40 and ROOT / "docs" / "zh" / "quickstart.md" in PAGES
    found = [
        f"{page.relative_to(ROOT)} {problem}"
        for page in PAGES
        for problem in problems(page.read_text(encoding="utf-8"))
    ]
    assert not found, (
        "placeholders or private imports in user-facing pages: write the real command or name "
        "(a checkout's root instead of a clone URL, ./packages/dmuon[hf] instead of dmuon[hf], the dmuon-demo command instead of "
        "dmuon._demo, a public name from `import dmuon`):\n" + "\n".join(found)
    )
