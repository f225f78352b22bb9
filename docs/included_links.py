"""A MkDocs hook (docs/mkdocs.yml: `hooks`): a page that includes a Markdown file from outside
the site (`--8<-- "deploy/README.md"`, pymdownx.snippets' syntax) gets that file with its
relative links rebased onto the page, so that one text reads right in both places.

deploy/README.md links the site's pages as GitHub shows them beside it
(`../docs/content/operations/security.md`); included into guides/deploy.md the same link must
be `../operations/security.md`. A link to anything but a page of the site is left as written,
so MkDocs' link validation (strict) names it; in-page anchors (`#the-image`) are left alone.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

INCLUDE = re.compile(r'^--8<-- "([^"]+)"[ \t]*$', re.MULTILINE)
# [text](target#anchor "title"): the target is rebased, the rest kept.
LINK = re.compile(r"(\]\()([^)\s#]+)([^)]*\))")
SCHEME_OR_ROOT = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|/)", re.IGNORECASE)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """The page's Markdown with each file from outside the site included, links rebased."""
    docs = Path(config["docs_dir"]).resolve()
    repository = Path(config["config_file_path"]).resolve().parent.parent
    page_folder = (docs / page.file.src_uri).parent

    def include(found: re.Match[str]) -> str:
        source = (repository / found[1]).resolve()
        if source.is_relative_to(docs):
            return found[0]  # a page of the site: pymdownx.snippets includes it as it is

        def rebase(link: re.Match[str]) -> str:
            target = (source.parent / link[2]).resolve()
            if SCHEME_OR_ROOT.match(link[2]) or not target.is_relative_to(docs):
                return link[0]
            return link[1] + posixpath.relpath(target, page_folder) + link[3]

        return LINK.sub(rebase, source.read_text(encoding="utf-8"))

    return INCLUDE.sub(include, markdown)
