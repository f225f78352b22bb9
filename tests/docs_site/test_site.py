"""The documentation site: it builds with warnings as errors (broken links and anchors fail the
build: docs/mkdocs.yml's `validation`), it loads nothing from another host, in headless
Chromium every page renders from 127.0.0.1 alone and search works offline; and README.md is
short, its links resolve, and it reaches the two commonest tasks in one click."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.browser import chromium_executable, launched
from tests.docs_site.code_blocks import TESTED_BY_CI, find_blocks
from tests.docs_site.conftest import CONFIG, CONTENT, REPO, needs

README = REPO / "README.md"
# The Markdown files read on GitHub beside the code, with links relative to their folders.
REPOSITORY_PAGES = (README, REPO / "deploy" / "README.md")
LINK = re.compile(r"\]\(([^)\s]+)\)")
# A path from the repository's root, two folders deep at least (`tests/*.yml` in a sentence
# about deploy/prometheus is relative to that folder, not the root).
REPOSITORY_PATH = re.compile(
    r"(?<![\w/.-])(?:bench|cache_service|deploy|docs|tests)/[\w.-]+/[\w.*-]*[\w*]"
)
README_MAX_LINES = 250
# What a page loads (not what it links to): scripts, styles, images, frames, media.
LOADS = re.compile(
    r"""<(?:script|img|iframe|source|audio|video|embed)\b[^>]*\bsrc="([^"]*)"|"""
    r"""<link\b[^>]*\bhref="([^"]*)"[^>]*>"""
)
CSS_URL = re.compile(r"""url\(\s*['"]?([^'")]+)|@import\s+['"]([^'"]+)""")
OUTSIDE = re.compile(r"^(?:[a-z][a-z0-9+.-]*:)?//", re.IGNORECASE)
# A few pages of every kind: home, a guide, a generated reference, a design note.
BROWSED = ("index.html", "guides/vllm.html", "reference/metrics.html", "architecture.html")
# A laptop's screen: the theme's content column is then as narrow as on any wider one (80
# characters of code, measured from 1280 to 1920 px).
LAPTOP = {"width": 1280, "height": 800}


def nav_pages() -> list[str]:
    """Every page the site's navigation lists, as paths under docs/content."""
    config = yaml.load(CONFIG.read_text(encoding="utf-8"), Loader=yaml.BaseLoader)

    def walk(items: Any) -> Iterator[str]:
        for item in items:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            if isinstance(value, list):
                yield from walk(value)
            else:
                yield str(value)

    return list(walk(config["nav"]))


def test_every_page_in_the_folder_is_built_and_in_the_navigation(built_site: Path) -> None:
    pages = sorted(str(path.relative_to(CONTENT)) for path in CONTENT.rglob("*.md"))
    assert sorted(nav_pages()) == pages
    for page in pages:
        assert (built_site / page.replace(".md", ".html")).is_file(), page


def test_no_built_file_loads_anything_from_another_host(built_site: Path) -> None:
    outside = []
    for path in built_site.rglob("*.html"):
        for match in LOADS.finditer(path.read_text(encoding="utf-8")):
            url = match.group(1) or match.group(2)
            if OUTSIDE.match(url):
                outside.append(f"{path.relative_to(built_site)}: {url}")
    for path in built_site.rglob("*.css"):
        for match in CSS_URL.finditer(path.read_text(encoding="utf-8")):
            url = match.group(1) or match.group(2)
            if OUTSIDE.match(url) and not url.startswith("data:"):
                outside.append(f"{path.relative_to(built_site)}: {url}")
    assert outside == []


class _Quiet(SimpleHTTPRequestHandler):
    """Serves files without a log line per request."""

    def log_message(self, format: str, *args: Any) -> None:
        """Nothing."""


@pytest.fixture
def served(built_site: Path) -> Iterator[str]:
    """The built site over HTTP on 127.0.0.1 (a free port): its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Quiet, directory=str(built_site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
def browser() -> Iterator[Any]:
    """Headless Chromium (Debian's) through Playwright, as tests/deploy drive it."""
    needs("playwright")
    executable = chromium_executable()
    if executable is None:
        pytest.skip("chromium is missing (Debian: apt-get install -y chromium)")
    with launched(executable) as chromium:
        yield chromium


def test_pages_render_from_loopback_alone_and_search_works_offline(
    served: str, browser: Any
) -> None:
    page = browser.new_page()
    requests: list[str] = []
    failed: list[str] = []
    errors: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    page.on("requestfailed", lambda request: failed.append(request.url))
    page.on("console", lambda note: errors.append(note.text) if note.type == "error" else None)
    for path in BROWSED:
        answer = page.goto(served + path, wait_until="networkidle")
        assert answer is not None and answer.status == 200, path
        assert page.locator("article h1").count() == 1, path
    page.keyboard.press("/")  # the theme's shortcut to the search box
    page.keyboard.type("eviction")
    page.wait_for_selector(".md-search-result__item", timeout=15_000)
    assert page.locator(".md-search-result__item").count() > 0
    assert [url for url in requests if not url.startswith(served)] == []
    assert failed == [] and errors == []


def test_readme_is_short() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES
    assert "<!-- test-command -->" in text  # what .ci/run reads


def github_anchors(path: Path) -> set[str]:
    """The ids GitHub gives the headings of a Markdown file (lower case, punctuation but `-`
    and `_` dropped, spaces to dashes); lines inside code blocks are not headings."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    for block in find_blocks(text, path):  # blank out each block, fences included
        end = block.line + len(block.text.splitlines()) + 1
        lines[block.line - 1 : end] = [""] * (end - block.line + 1)
    headings = [line.lstrip("#").strip() for line in lines if re.match(r"#{1,6} ", line)]
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", REPOSITORY_PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_link_and_path_of_a_repository_page_resolves_beside_it(page: Path) -> None:
    """README.md and deploy/README.md as GitHub shows them (the site checks its own copies
    when it builds: docs/mkdocs.yml's `validation`): each relative link reaches a file from
    the page's folder, each #anchor a heading of its target, and each repository path the
    page names in its text (`deploy/docker/Dockerfile`, `tests/deploy/test_rules.py`) exists."""
    text = page.read_text(encoding="utf-8")
    links = [link for link in LINK.findall(text) if not OUTSIDE.match(link)]
    assert links, f"{page.name} links to nothing"
    broken = []
    for link in links:
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        heading_missing = bool(anchor) and path.suffix == ".md"
        if not path.exists() or (heading_missing and anchor not in github_anchors(path)):
            broken.append(link)
    assert broken == []
    named = set(REPOSITORY_PATH.findall(text))
    assert [path for path in sorted(named) if not list(REPO.glob(path))] == []


def test_readme_reaches_the_vllm_and_replay_guides_in_one_click() -> None:
    text = README.read_text(encoding="utf-8")
    for guide in ("docs/content/guides/vllm.md", "docs/content/guides/replay.md"):
        assert f"]({guide})" in text, guide


def test_the_site_s_home_page_is_readme_with_its_links_made_relative() -> None:
    """docs/content/index.md is README.md with `docs/content/` dropped from its links: one
    text, so the two cannot drift (edit README.md, then copy it)."""
    expected = README.read_text(encoding="utf-8").replace("](docs/content/", "](")
    assert (CONTENT / "index.md").read_text(encoding="utf-8") == expected


def one_line_commands() -> set[str]:
    """README's blocks that are one command line by design, which may run wider than the page:
    the test command (.ci/run executes that line verbatim) and the block under a heading that
    promises one line ("vLLM in one line")."""
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    kept = set()
    for block in find_blocks(text, README):
        heading = next((line for line in reversed(lines[: block.line]) if line.startswith("#")), "")
        by_ci = block.marker is not None and block.marker.kind == TESTED_BY_CI
        if by_ci or heading.endswith("in one line"):
            kept.add(block.text.strip())
    return kept


def test_the_home_page_s_diagram_and_commands_fit_without_scrolling(
    served: str, browser: Any
) -> None:
    page = browser.new_page(viewport=LAPTOP)
    page.goto(served + "index.html", wait_until="networkidle")
    shown = page.evaluate(
        """() => [...document.querySelectorAll('article pre > code')].map(
            code => [code.innerText.trim(), code.scrollWidth > code.clientWidth])"""
    )
    exempt = one_line_commands()
    assert len(exempt) == 2 and exempt <= {text for text, _ in shown}
    assert len(shown) >= 5  # the diagram, the commands and the worked example
    scrolling = [text.splitlines()[0] for text, scrolls in shown if scrolls and text not in exempt]
    assert scrolling == []
