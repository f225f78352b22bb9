"""Write the docs site's reference pages from the code, or check the committed ones.

    python -m cache_service.tools.docs_reference [--check] [--out docs/content/reference]

configuration.md (every subcommand's flags; `serve`'s from its settings), metrics.md (the
service's Prometheus registry), http-api.md and openapi.json (its OpenAPI document),
backends.md (each store backend's declared capabilities). A setting,
flag or metric without a description stops the generation, naming it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from cache_service.tools.reference_backends import backends_page
from cache_service.tools.reference_cli import configuration_page
from cache_service.tools.reference_markdown import COMMAND, MissingDescription
from cache_service.tools.reference_service import (
    http_api_page,
    metrics_page,
    openapi_document,
    openapi_json,
)

DEFAULT_OUT = Path("docs/content/reference")


def render_pages() -> dict[str, str]:
    """Every reference page by file name, as it should read."""
    document = openapi_document()
    return {
        "configuration.md": configuration_page(),
        "metrics.md": metrics_page(),
        "http-api.md": http_api_page(document),
        "openapi.json": openapi_json(document),
        "backends.md": backends_page(),
    }


def write_pages(out: Path) -> list[Path]:
    """Write the pages into `out` (made if missing); the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_pages().items():
        path = out / name
        path.write_bytes(text.encode("utf-8"))  # bytes: no newline translation on any OS
        written.append(path)
    return written


def stale_pages(out: Path) -> list[str]:
    """The pages in `out` that are missing or differ from what the code gives."""
    return [
        name
        for name, text in render_pages().items()
        if not (out / name).is_file() or (out / name).read_bytes() != text.encode("utf-8")
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Write (or with --check, compare) the pages; the exit status."""
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say which pages are stale")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder of the pages")
    args = parser.parse_args(argv)
    try:
        if args.check:
            stale = stale_pages(args.out)
            for name in stale:
                print(f"{args.out / name} is stale: run {COMMAND}", file=sys.stderr)
            return 1 if stale else 0
        for path in write_pages(args.out):
            print(path)
    except MissingDescription as exc:
        print(f"{COMMAND}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
