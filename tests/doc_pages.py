"""The README and the documentation site's pages as the tests read them: sections, code blocks.

Every example a page shows in ``sh`` or ``python`` that a test runs is found here by the page
and the heading it sits under; a heading or a block that moves fails the test that runs it,
never silently runs nothing.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def read(page: str) -> str:
    """``README.md`` at the root, or a page of the site by its path under ``docs/``."""
    return (ROOT / page if page == "README.md" else DOCS / page).read_text()


def headed(text: str) -> list[tuple[str, str]]:
    """``(heading, text under it)`` of every Markdown heading outside code blocks, in order."""
    found: list[tuple[str, list[str]]] = [("", [])]
    fenced = False
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"#+ (.*)$", line)):
            found.append((match.group(1), []))
            continue
        found[-1][1].append(line)
    return [(heading, "".join(lines)) for heading, lines in found]


def section(page: str, title: str) -> str:
    """The text under a heading of a page, up to the next heading of any level."""
    matching = [text for heading, text in headed(read(page)) if heading == title]
    assert len(matching) == 1, f"{page} has {len(matching)} sections {title!r}"
    return matching[0]


def blocks(text: str, language: str) -> list[str]:
    """The fenced code blocks of one language in a text, in order (possibly none); a block
    indented under a list item comes without its indentation."""
    found = re.findall(rf"^( *)```{language}\n(.*?)^\1```$", text, re.M | re.S)
    return [textwrap.dedent(body) for _, body in found]


def snippets(page: str, title: str, language: str) -> list[str]:
    """The blocks of one language under a heading of a page; finding none is a failure."""
    found = blocks(section(page, title), language)
    assert found, f"{page}, {title!r}: no {language} block to run"
    return found


def pages() -> list[str]:
    """Every page of the site, as a path under ``docs/``."""
    return sorted(str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md"))
