"""Every fenced code block of the documentation, with the marker that says what a test does
with it (tests/docs_site/test_code_blocks.py holds the rules).

The documentation is README.md, deploy/README.md and every page under docs/content. A block
is a CommonMark fence (three or more backticks or tildes, indented or not, so inside list
items too); its language is the first word of the info string. Its marker is the nearest
non-blank line before the opening fence, when that line is one of these HTML comments
(invisible on GitHub and on the site):

    <!-- code: run -->                      a test runs the block
    <!-- code: illustrative: REASON -->     no test runs it; REASON says why (short)
    <!-- test-command -->                   README's test command: .ci/run runs it

Indented (four-space) code blocks are not read: the docs use fences only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONTENT = REPO / "docs" / "content"

FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
CODE_MARKER = re.compile(r"^\s*<!--\s*code:\s*(?P<body>.*?)\s*-->\s*$")
TEST_COMMAND = "<!-- test-command -->"
RUN = "run"
ILLUSTRATIVE = "illustrative"
TESTED_BY_CI = "test-command"  # the marker kind of README's test command and its copies


@dataclass(frozen=True)
class Marker:
    """What a block's marker comment says: `kind` is "run", "illustrative" or
    "test-command"; `reason` is the illustrative reason ("" for the others). A comment of the
    form `<!-- code: ... -->` that says anything else keeps what it said in `kind` and
    `reason`, for the tests to reject."""

    kind: str
    reason: str
    line: int


@dataclass(frozen=True)
class CodeBlock:
    """One fenced block: `line` is the opening fence's line (1-based) in `path` (relative to
    the repository); `text` is the body with the fence's indentation removed."""

    path: Path
    line: int
    language: str
    info: str
    text: str
    marker: Marker | None

    @property
    def where(self) -> str:
        """`path:line`, as a test names the block."""
        return f"{self.path}:{self.line}"

    @property
    def illustrative(self) -> bool:
        """Whether the block is marked illustrative (no test runs or parses it)."""
        return self.marker is not None and self.marker.kind == ILLUSTRATIVE

    @property
    def marked_run(self) -> bool:
        """Whether the block is marked `<!-- code: run -->`."""
        return self.marker is not None and self.marker.kind == RUN


def doc_files() -> list[Path]:
    """The documentation's Markdown files: README.md, deploy/README.md and docs/content/**."""
    pages = sorted(CONTENT.rglob("*.md"))
    return [REPO / "README.md", REPO / "deploy" / "README.md", *pages]


def parse_marker(line: str, number: int) -> Marker | None:
    """The marker `line` (line `number` of its file) holds, or None when it holds none."""
    if line.strip() == TEST_COMMAND:
        return Marker(TESTED_BY_CI, "", number)
    found = CODE_MARKER.match(line)
    if found is None:
        return None
    kind, _, reason = found["body"].partition(":")
    return Marker(kind.strip(), reason.strip(), number)


def strip_indent(line: str, indent: int) -> str:
    """`line` without up to `indent` leading spaces (CommonMark's rule for a fence's body)."""
    spaces = len(line) - len(line.lstrip(" "))
    return line[min(spaces, indent) :]


def find_blocks(text: str, path: Path) -> list[CodeBlock]:
    """Every fenced block of the Markdown `text` (of the file `path`), in order. A fence that
    never closes is a ValueError: CommonMark would run it to the end of the file, which is
    never what a page meant."""
    lines = text.splitlines()
    blocks: list[CodeBlock] = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None or (opening["fence"][0] == "`" and "`" in opening["info"]):
            index += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        closing = re.compile(rf"^ *{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        end = next((j for j in range(index + 1, len(lines)) if closing.match(lines[j])), None)
        if end is None:
            raise ValueError(f"{path}:{index + 1}: a code fence that never closes")
        previous = next((j for j in range(index - 1, -1, -1) if lines[j].strip()), None)
        marker = None if previous is None else parse_marker(lines[previous], previous + 1)
        info = opening["info"].strip()
        body = [strip_indent(line, indent) for line in lines[index + 1 : end]]
        blocks.append(
            CodeBlock(
                path=path,
                line=index + 1,
                language=info.split()[0] if info else "",
                info=info,
                text="".join(line + "\n" for line in body),
                marker=marker,
            )
        )
        index = end + 1
    return blocks


def all_blocks() -> list[CodeBlock]:
    """Every fenced block of the documentation, file by file in `doc_files()` order."""
    blocks: list[CodeBlock] = []
    for path in doc_files():
        blocks += find_blocks(path.read_text(encoding="utf-8"), path.relative_to(REPO))
    return blocks
