"""Headless Chromium for the tests that open pages: Debian's browser, driven by Playwright's
Python package (never `playwright install`: these machines fetch no browser builds)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def chromium_executable() -> str | None:
    """Debian's chromium, else one on PATH, else None."""
    return str(CHROMIUM) if CHROMIUM.exists() else shutil.which("chromium")


@contextmanager
def launched(executable: str) -> Iterator[Any]:
    """A headless Chromium browser (Playwright's Browser), closed on leaving."""
    from playwright.sync_api import sync_playwright  # noqa: PLC0415 - optional, for browser tests

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()
