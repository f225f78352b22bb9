"""The status page at / against a real server: what it shows is what /v1/stats reports, who may
see it, and that it needs nothing from anywhere else."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from html import unescape
from pathlib import Path

import httpx
import pytest

from cache_service.client import CacheClient
from cache_service.service.status_history import SAMPLE_SECONDS
from tests.integration.conftest import ServerProcess

pytestmark = pytest.mark.integration

MakeServer = Callable[..., ServerProcess]
MODEL = "llama-3-8b"
BLOCK = 16
PROMPT = list(range(4 * BLOCK))


def figures(html: str) -> dict[str, list[str]]:
    """Every `data-stat` of the page and the exact values shown for it."""
    found: dict[str, list[str]] = {}
    for name, value in re.findall(r'data-stat="([^"]+)" data-value="([^"]*)"', html):
        found.setdefault(unescape(name), []).append(unescape(value))
    return found


def shown(html: str, name: str) -> str:
    """The one exact value the page shows for `name` (however often it shows it)."""
    values = set(figures(html)[name])
    assert len(values) == 1, (name, values)
    return values.pop()


def traffic(url: str, api_key: str | None = None) -> None:
    """Store a prompt's four blocks, then look up that prompt (all hits) and one that shares
    half of it (half misses)."""
    with CacheClient(url, api_key=api_key) as client:
        client.put_prefix(MODEL, PROMPT, [b"kv" * 500] * 4, retention="agent")
        client.lookup(MODEL, PROMPT, retention="agent")
        client.lookup(MODEL, PROMPT[: 2 * BLOCK] + [7] * (2 * BLOCK))


def assert_page_shows_stats(html: str, stats: dict[str, object]) -> None:
    for name in ("blocks", "used_bytes", "payload_bytes", "capacity_bytes"):
        assert shown(html, name) == str(stats[name]), name
    retention = stats["retention"]
    assert isinstance(retention, dict)
    for name, counts in retention.items():
        for field in ("hit_tokens", "miss_tokens"):
            assert shown(html, f"retention.{name}.{field}") == str(counts[field]), (name, field)
    tenants = stats["tenants"]
    assert isinstance(tenants, dict)
    for tenant, counts in tenants.items():
        for field in ("hit_tokens", "miss_tokens", "estimated_bytes"):
            assert shown(html, f"tenant.{tenant}.{field}") == str(counts[field]), (tenant, field)


def test_page_shows_what_stats_report_without_auth(make_server: MakeServer) -> None:
    server = make_server(block_size=str(BLOCK), touch_flush_interval="0.05")
    traffic(server.url)
    page = httpx.get(server.url + "/?refresh=0")
    stats = httpx.get(server.url + "/v1/stats").json()
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert page.headers["cache-control"] == "no-store"
    assert_page_shows_stats(page.text, stats)
    hits = sum(c["hit_tokens"] for c in stats["retention"].values())
    misses = sum(c["miss_tokens"] for c in stats["retention"].values())
    assert (hits, misses) == (6 * BLOCK, 2 * BLOCK)
    assert float(shown(page.text, "hit_ratio")) == hits / (hits + misses)
    assert "75.0 %" in page.text
    info = httpx.get(server.url + "/v1/info").json()
    assert info["version"] in page.text
    assert info["hashing"]["seed_fingerprint"] in page.text
    assert "<h2>Tenants</h2>" not in page.text  # --auth none: no tenants by name


def test_page_reloads_unless_told_not_to(server: ServerProcess) -> None:
    assert '<meta http-equiv="refresh" content="15">' in httpx.get(server.url + "/").text
    assert 'http-equiv="refresh"' not in httpx.get(server.url + "/?refresh=0").text
    assert '<meta http-equiv="refresh" content="60">' in httpx.get(server.url + "/?refresh=60").text
    assert httpx.get(server.url + "/?refresh=-1").status_code == 422


def test_page_needs_nothing_from_elsewhere(server: ServerProcess) -> None:
    html = httpx.get(server.url + "/").text
    assert "http://" not in html and "https://" not in html
    assert "<script" not in html and "<img" not in html
    for reference in re.findall(r'(?:src|href)="([^"]*)"', html):
        assert reference.startswith("/") or reference.startswith("data:"), reference


def test_page_is_not_in_the_api_schema(server: ServerProcess) -> None:
    schema = httpx.get(server.url + "/openapi.json").json()
    assert "/" not in schema["paths"]


@pytest.fixture
def secured(make_server: MakeServer, keys: dict[str, str], tmp_path: Path) -> ServerProcess:
    """A server with --auth keys and the key file of two tenants and an operator."""
    del keys  # the fixture wrote the file
    return make_server(
        auth="keys", api_keys_file=str(tmp_path / "keys.toml"), block_size=str(BLOCK)
    )


def test_page_asks_a_browser_for_the_key(secured: ServerProcess) -> None:
    answer = httpx.get(secured.url + "/")
    assert answer.status_code == 401
    challenges = answer.headers.get_list("www-authenticate")
    assert challenges[0].startswith("Bearer")  # the API's answer, unchanged
    assert challenges[1].startswith('Basic realm="prompt-cache-service"')
    assert answer.headers["content-type"] == "application/problem+json"
    # The API's own routes still challenge for a bearer token only.
    assert httpx.get(secured.url + "/v1/stats").headers.get_list("www-authenticate") == [
        'Bearer realm="prompt-cache"'
    ]


def test_page_needs_an_admin_key_as_bearer_or_basic(
    secured: ServerProcess, keys: dict[str, str]
) -> None:
    reader, admin = keys["a-reader"], keys["ops"]
    bearer = {"Authorization": f"Bearer {reader}"}
    assert httpx.get(secured.url + "/", headers=bearer).status_code == 403
    assert httpx.get(secured.url + "/", auth=("anyone", reader)).status_code == 403
    assert httpx.get(secured.url + "/", auth=("anyone", "pck_wrong")).status_code == 401
    assert httpx.get(secured.url + "/", auth=(admin, "")).status_code == 401  # the password
    as_admin = {"Authorization": f"Bearer {admin}"}
    assert httpx.get(secured.url + "/", headers=as_admin).status_code == 200
    assert httpx.get(secured.url + "/", auth=("ops", admin)).status_code == 200
    # Basic credentials are a key like any other for reads: the API takes them too.
    assert httpx.get(secured.url + "/v1/stats", auth=("", admin)).status_code == 200


def test_basic_credentials_never_change_anything(
    secured: ServerProcess, keys: dict[str, str]
) -> None:
    """A browser resends remembered Basic credentials even on a request another site's page
    makes it send (a forged form): writes take a bearer key only, so nothing is stored or
    purged that way."""
    admin, writer = keys["ops"], keys["a-writer"]
    purge = httpx.post(secured.url + "/v1/purge", auth=("", admin), json={"tenant": "team-a"})
    assert purge.status_code == 401
    assert "GET and HEAD requests only" in purge.json()["detail"]
    lookup = {"model": MODEL, "tokens": PROMPT}
    assert httpx.post(secured.url + "/v1/lookup", auth=("", writer), json=lookup).status_code == 401


def test_page_shows_every_tenant_to_an_admin(secured: ServerProcess, keys: dict[str, str]) -> None:
    traffic(secured.url, keys["a-writer"])
    with CacheClient(secured.url, api_key=keys["b-writer"]) as team_b:
        team_b.lookup(MODEL, PROMPT)  # team b has nothing stored: all misses
    admin = ("", keys["ops"])
    page = httpx.get(secured.url + "/", auth=admin).text
    stats = httpx.get(secured.url + "/v1/stats", auth=admin).json()
    assert set(stats["tenants"]) == {"team-a", "team-b", "operators"}
    assert_page_shows_stats(page, stats)
    assert shown(page, "tenant.team-b.miss_tokens") == str(len(PROMPT))
    assert int(shown(page, "tenant.team-a.estimated_bytes")) > 0


def answers_by_worker(url: str, name: str) -> dict[str, str]:
    """The value each worker's page shows for `name`, asking until both workers answered."""
    found: dict[str, str] = {}
    deadline = time.monotonic() + 20
    while len(found) < 2 and time.monotonic() < deadline:
        with httpx.Client() as client:  # a new connection: either worker may answer
            html = client.get(url + "/").text
        found[shown(html, "process")] = shown(html, name)
    assert len(found) == 2, f"one worker answered every request: {found}"
    return found


def test_every_worker_charts_the_whole_fleets_traffic(make_server: MakeServer) -> None:
    server = make_server(workers="2", block_size=str(BLOCK), touch_flush_interval="0.05")
    # Both workers serve (each took its first sample before serving) before the traffic,
    # so that each one's history holds all of it.
    answers_by_worker(server.url, "hit_ratio")
    traffic(server.url)  # the requests fall on either worker
    time.sleep(SAMPLE_SECONDS + 1.5)  # every worker has sampled since
    ratios = answers_by_worker(server.url, "hit_ratio.last_5_min")
    assert set(ratios.values()) == {str(6 / 8)}, ratios  # the fleet's 6 hit blocks of 8
