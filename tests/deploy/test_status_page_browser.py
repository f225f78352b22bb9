"""The status page in headless Chromium: it loads with no console error and no failed request,
asks for the key the way a browser can give it (HTTP Basic), shows the numbers /v1/stats
reports, and is saved as a screenshot (STATUS_SCREENSHOT: where to copy it, for the README).

Playwright's Python package drives Debian's /usr/bin/chromium (never `playwright install`);
without either, the test is skipped, unless CI is set: then it fails.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cache_service.client import CacheClient
from cache_service.core.units import show_size
from cache_service.service.api_keys import Role, key_file_entry, new_key
from cache_service.service.status_history import SAMPLE_SECONDS
from tests.browser import CHROMIUM, chromium_executable, launched
from tests.deploy.conftest import missing
from tests.integration.conftest import ServerProcess

MODEL = "llama-3-8b"
BLOCK = 16
KEYS = {
    "ops": ("operators", Role.ADMIN),
    "a": ("team-a", Role.WRITER),
    "b": ("team-b", Role.WRITER),
}


@pytest.fixture
def browser() -> Iterator[Any]:
    """Headless Chromium, Debian's, through Playwright."""
    if importlib.util.find_spec("playwright") is None:
        missing("playwright (the Python package) is missing")
    executable = chromium_executable()
    if executable is None:
        missing(f"chromium ({CHROMIUM}) is missing")
    with launched(executable) as chromium:
        yield chromium


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[ServerProcess, dict[str, str]]]:
    """A server with --auth keys (an operator and two tenants); the secrets by key id."""
    secrets = {key_id: new_key() for key_id in KEYS}
    entries = [
        key_file_entry(key_id, tenant, role, secrets[key_id])
        for key_id, (tenant, role) in KEYS.items()
    ]
    (tmp_path / "keys.toml").write_text("\n".join(entries))
    server = ServerProcess(
        tmp_path / "data",
        tmp_path / "server.log",
        auth="keys",
        api_keys_file=str(tmp_path / "keys.toml"),
        block_size=str(BLOCK),
        capacity="64MiB",
        touch_flush_interval="0.05",
    )
    try:
        server.start()
        yield server, secrets
    finally:
        server.stop()


def traffic(server: ServerProcess, secrets: dict[str, str], round_: int) -> None:
    """Team a stores prompts and looks them up, mostly hitting; team b looks up, missing."""
    with CacheClient(server.url, api_key=secrets["a"]) as team_a:
        for i in range(8):
            prompt = [round_, i, *range(8 * BLOCK - 2)]
            team_a.put_prefix(MODEL, prompt, [b"kv" * 4096] * 8, retention="agent")
            team_a.lookup(MODEL, prompt, retention="agent")
            team_a.lookup(MODEL, prompt[: 5 * BLOCK] + [1] * (3 * BLOCK))
    with CacheClient(server.url, api_key=secrets["b"]) as team_b:
        team_b.lookup(MODEL, list(range(4 * BLOCK)))


def shown_for_people(name: str, value: str) -> str | None:
    """The text the page should show for an exact figure of /v1/stats (None: not checked)."""
    if name.endswith("_bytes") and value:
        return show_size(int(value))
    if name.endswith(("_tokens", "blocks", "pending_touches")):
        return f"{int(value):,}"
    return None


def test_status_page_in_chromium_shows_the_stats(
    browser: Any, secured: tuple[ServerProcess, dict[str, str]], tmp_path: Path
) -> None:
    server, secrets = secured
    # Two rounds of traffic a sample apart: the hour chart gets a line, not a dot.
    traffic(server, secrets, 1)
    time.sleep(SAMPLE_SECONDS + 0.5)
    traffic(server, secrets, 2)
    time.sleep(SAMPLE_SECONDS + 0.5)

    context = browser.new_context(
        http_credentials={"username": "ops", "password": secrets["ops"]},
        viewport={"width": 1200, "height": 900},
    )
    page = context.new_page()
    problems: list[str] = []

    def on_console(message: Any) -> None:
        if message.type in ("error", "warning"):
            problems.append(f"console {message.type}: {message.text}")

    page.on("console", on_console)
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on("requestfailed", lambda r: problems.append(f"failed: {r.url} {r.failure}"))
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    answer = page.goto(server.url + "/")
    assert answer is not None and answer.status == 200
    page.wait_for_load_state("networkidle")

    stats = httpx.get(server.url + "/v1/stats", auth=("", secrets["ops"])).json()
    shown = page.eval_on_selector_all(
        "[data-stat]",
        "els => els.map(e => [e.dataset.stat, e.dataset.value, e.innerText])",
    )
    assert problems == []
    assert requests == [server.url + "/"], requests  # no script, style, font, image, icon
    expected = {
        "blocks": stats["blocks"],
        "used_bytes": stats["used_bytes"],
        "payload_bytes": stats["payload_bytes"],
        "capacity_bytes": stats["capacity_bytes"],
        "pending_touches": stats["pending_touches"],
    }
    for name, counts in stats["retention"].items():
        expected |= {f"retention.{name}.{field}": value for field, value in counts.items()}
    for tenant, figures in stats["tenants"].items():
        expected |= {f"tenant.{tenant}.{field}": value for field, value in figures.items()}
    seen = {}
    for name, value, text in shown:
        if name in expected:
            exact = "" if expected[name] is None else str(expected[name])
            assert value == exact, (name, value, exact)
            people = shown_for_people(name, value)
            assert people is None or text == people, (name, text, people)
            seen[name] = text
    assert set(seen) == set(expected), set(expected) - set(seen)
    assert stats["tenants"]["team-a"]["hit_tokens"] > 0
    assert stats["tenants"]["team-b"]["miss_tokens"] == 2 * 4 * BLOCK  # a lookup a round
    assert page.locator("svg.chart polyline").count() >= 1  # the last hour, per 10 s
    assert page.get_by_text("team-b", exact=True).is_visible()

    screenshot = tmp_path / "status-page.png"
    page.screenshot(path=str(screenshot), full_page=True)
    context.close()
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    wanted = os.environ.get("STATUS_SCREENSHOT")
    if wanted:
        Path(wanted).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(screenshot, wanted)
    print(f"status page screenshot: {wanted or screenshot}", file=sys.stderr)


def test_status_page_refuses_a_browser_without_the_key(
    browser: Any, secured: tuple[ServerProcess, dict[str, str]]
) -> None:
    server, _ = secured
    context = browser.new_context(http_credentials={"username": "x", "password": new_key()})
    page = context.new_page()
    answer = page.goto(server.url + "/")
    assert answer is not None and answer.status == 401
    context.close()
