"""Markdown pieces of the generated reference pages, and the error of an undocumented item."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

COMMAND = "python -m cache_service.tools.docs_reference"
BANNER = f"<!-- Generated from the code by `{COMMAND}`: edit the code, not this page. -->"


class MissingDescription(Exception):
    """Something the reference pages would show has no description or help text."""

    def __init__(self, what: Sequence[str]) -> None:
        super().__init__("no description or help text for: " + ", ".join(what))
        self.what = tuple(what)


def require_descriptions(missing: Sequence[str]) -> None:
    """Refuse to write a page with undocumented items, naming every one of them."""
    if missing:
        raise MissingDescription(missing)


def prose(text: str) -> str:
    """Text for a table cell or a list item: one line, no stray table bars, tags or emphasis."""
    # Descriptions are plain sentences written for --help; `*`, `<` and `|` in them
    # (CACHE_SERVICE_*, <FLAG>, a|b) would otherwise be read as Markdown or HTML.
    line = " ".join(text.split())
    return line.replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*")


def code(text: str) -> str:
    """Text as inline code (Python-Markdown's tables leave a bar inside code alone)."""
    fence = "``" if "`" in text else "`"
    return f"{fence}{text}{fence}"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table of already-formatted cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def page(title: str, *blocks: str) -> str:
    """A whole page: title, banner, then the blocks separated by blank lines."""
    return "\n\n".join((f"# {title}", BANNER, *blocks)) + "\n"
