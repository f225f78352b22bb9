"""Against a real server with a key file of two tenants: authentication, roles, isolation."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cache_service.client import CacheClient
from cache_service.core.errors import ServiceError
from cache_service.service.api import create_app
from cache_service.service.api.auth import PUBLIC_PATHS, ROUTE_ROLES
from cache_service.service.api_keys import new_key
from cache_service.service.settings import Settings
from tests.integration.conftest import ServerProcess, free_port

pytestmark = pytest.mark.integration

MakeServer = Callable[..., ServerProcess]
MODEL = "llama-3-8b"


def application_routes(routes: Iterable[Any]) -> Iterator[tuple[str, str]]:
    """(path, method) of every route, walking into included routers."""
    for route in routes:
        if getattr(route, "methods", None):
            yield from ((route.path, method) for method in route.methods)
        elif hasattr(route, "original_router"):
            yield from application_routes(route.original_router.routes)
        elif hasattr(route, "routes"):
            yield from application_routes(route.routes)


@pytest.fixture
def secured(make_server: MakeServer, keys: dict[str, str], tmp_path: Path) -> ServerProcess:
    """A server with --auth keys and the key file of two tenants and an operator."""
    del keys  # the fixture wrote the file
    return make_server(auth="keys", api_keys_file=str(tmp_path / "keys.toml"))


def test_every_route_but_health_answers_401_without_a_key(secured: ServerProcess) -> None:
    # Walk the application's own routes, not the OpenAPI schema: thin routes count too.
    routes = sorted(application_routes(create_app(Settings()).routes))
    assert ("/v1/lookup", "POST") in routes
    for path, _ in routes:  # every route has its role written down (the default is admin)
        assert path in ROUTE_ROLES or path in PUBLIC_PATHS, path
    for path, method in routes:
        if method == "HEAD":
            continue
        answer = httpx.request(method, secured.url + path, timeout=5.0)
        if path in PUBLIC_PATHS:
            assert answer.status_code == 200, path
            continue
        assert answer.status_code == 401, (method, path)
        assert answer.headers["www-authenticate"].startswith("Bearer")
        assert answer.headers["content-type"] == "application/problem+json"
    # A path that does not exist is not revealed either.
    assert httpx.get(secured.url + "/v1/nothing-here").status_code == 401


def test_a_wrong_key_is_401_and_a_weak_role_is_403(
    secured: ServerProcess, keys: dict[str, str]
) -> None:
    bad = {"Authorization": "Bearer " + new_key()}
    assert httpx.post(secured.url + "/v1/lookup", headers=bad, json={}).status_code == 401
    basic = {"Authorization": "Basic " + keys["a-writer"]}
    assert httpx.post(secured.url + "/v1/lookup", headers=basic, json={}).status_code == 401
    with CacheClient(secured.url, api_key=keys["a-reader"]) as reader:
        with pytest.raises(ServiceError) as refused:
            reader.put_prefix(MODEL, list(range(64)), [b"kv"])
        assert refused.value.status == 403
        assert "needs writer" in str(refused.value)
        assert reader.lookup(MODEL, list(range(64))).matched_blocks == 0
    reader_headers = {"Authorization": "Bearer " + keys["a-reader"]}
    assert httpx.get(secured.url + "/v1/stats", headers=reader_headers).status_code == 403
    assert httpx.get(secured.url + "/metrics", headers=reader_headers).status_code == 403
    admin = {"Authorization": "Bearer " + keys["ops"]}
    assert httpx.get(secured.url + "/v1/stats", headers=admin).status_code == 200
    assert httpx.get(secured.url + "/metrics", headers=admin).status_code == 200


def test_tenant_b_cannot_observe_anything_tenant_a_stored(
    secured: ServerProcess, keys: dict[str, str]
) -> None:
    prompt = list(range(5000, 5256))  # 4 blocks
    payloads = [f"a's kv {i}".encode() for i in range(4)]
    with (
        CacheClient(secured.url, api_key=keys["a-writer"]) as a,
        CacheClient(secured.url, api_key=keys["a-reader"]) as a_reader,
        CacheClient(secured.url, api_key=keys["b-writer"]) as b,
    ):
        assert a.put_prefix(MODEL, prompt, payloads) == 4
        seen_by_a = a_reader.lookup(MODEL, prompt, fetch=True)
        assert seen_by_a.matched_blocks == 4  # the same tenant shares, across its keys
        assert list(seen_by_a.payloads or ()) == payloads

        # Tenant b: the same tokens match nothing, a's keys fetch nothing (as if absent).
        seen_by_b = b.lookup(MODEL, prompt, fetch=True)
        assert (seen_by_b.matched_blocks, seen_by_b.cached_tokens) == (0, 0)
        assert seen_by_b.usage.prompt_cache_miss_tokens == 256
        assert b.get_blocks(MODEL, seen_by_a.keys) == [None] * 4
        # b stores the same tokens: its own new blocks under its own keys, not a's.
        assert b.put_prefix(MODEL, prompt, [b"b's kv"] * 4) == 4
        own = b.lookup(MODEL, prompt, fetch=True)
        assert list(own.payloads or ()) == [b"b's kv"] * 4
        assert set(own.keys).isdisjoint(seen_by_a.keys)
        assert b.get_blocks(MODEL, seen_by_a.keys) == [None] * 4
        assert a.get_blocks(MODEL, seen_by_a.keys) == payloads
        assert a.get_blocks(MODEL, own.keys) == [None] * 4


def test_the_metrics_port_serves_metrics_without_a_key(
    make_server: MakeServer, keys: dict[str, str], tmp_path: Path
) -> None:
    port = free_port()
    server = make_server(
        auth="keys", api_keys_file=str(tmp_path / "keys.toml"), metrics_port=str(port)
    )
    with CacheClient(server.url, api_key=keys["a-writer"]) as client:
        client.put_prefix(MODEL, list(range(64)), [b"kv"])
    scraped = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5.0)
    assert scraped.status_code == 200
    assert "prompt_cache_stored_blocks_total 1.0" in scraped.text
    assert httpx.get(server.url + "/metrics").status_code == 401  # the main port still asks


def test_lookups_are_billed_per_tenant_in_the_usage_log_and_metrics(
    make_server: MakeServer, keys: dict[str, str], tmp_path: Path
) -> None:
    usage = tmp_path / "usage" / "usage.jsonl"
    server = make_server(
        auth="keys",
        api_keys_file=str(tmp_path / "keys.toml"),
        usage_log=str(usage),
        touch_flush_interval="0.05",
    )
    prompt = list(range(64 * 3 + 10))
    with (
        CacheClient(server.url, api_key=keys["a-writer"]) as a,
        CacheClient(server.url, api_key=keys["b-writer"]) as b,
    ):
        a.put_prefix(MODEL, prompt, [b"kv"] * 3)
        assert a.lookup(MODEL, prompt).usage.prompt_cache_hit_tokens == 192
        assert b.lookup(MODEL, prompt).usage.prompt_cache_miss_tokens == 202
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(_lines(usage)) < 2:
        time.sleep(0.05)
    records = [(r["tenant"], r["key"], r["model"], r["prompt_cache_hit_tokens"],
                r["prompt_cache_miss_tokens"]) for r in _lines(usage)]  # fmt: skip
    assert records == [
        ("team-a", "a-writer", MODEL, 192, 10),
        ("team-b", "b-writer", MODEL, 0, 202),
    ]
    admin = {"Authorization": "Bearer " + keys["ops"]}
    text = httpx.get(server.url + "/metrics", headers=admin).text
    assert 'prompt_cache_tenant_hit_tokens_total{tenant="team-a"} 192.0' in text
    assert 'prompt_cache_tenant_miss_tokens_total{tenant="team-b"} 202.0' in text
    assert 'prompt_cache_tenant_hit_tokens_total{tenant="operators"} 0.0' in text
    stats = httpx.get(server.url + "/v1/stats", headers=admin).json()["tenants"]
    assert (stats["team-a"]["hit_tokens"], stats["team-b"]["miss_tokens"]) == (192, 202)
    assert stats["team-a"]["estimated_bytes"] > 0
    assert stats["team-b"]["estimated_bytes"] == 0


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_two_workers_append_one_usage_log_without_losing_or_tearing_a_line(
    make_server: MakeServer, keys: dict[str, str], tmp_path: Path
) -> None:
    usage = tmp_path / "usage.jsonl"
    server = make_server(auth="keys", api_keys_file=str(tmp_path / "keys.toml"),
                         usage_log=str(usage), usage_log_max_bytes="4KiB",
                         workers="2", touch_flush_interval="0.05")  # fmt: skip
    headers = {"Authorization": "Bearer " + keys["a-reader"]}
    for index in range(60):  # fresh connections: both workers answer some
        with httpx.Client() as fresh:
            fresh.post(server.url + "/v1/lookup", json={"model": "m", "tokens": [index] * 64},
                       headers=headers).raise_for_status()  # fmt: skip
    files = sorted(tmp_path.glob("usage.jsonl*"))

    def records() -> list[dict[str, Any]]:
        lines: list[str] = []
        for _ in range(100):  # a worker may rotate a file between the glob and the read
            try:
                lines = [line for path in tmp_path.glob("usage.jsonl*")
                         if not path.name.endswith(".lock")
                         for line in path.read_text().splitlines()]  # fmt: skip
                break
            except FileNotFoundError:
                continue
        return [json.loads(line) for line in lines]  # a torn line would not parse

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(records()) < 60:
        time.sleep(0.05)
    assert len(records()) == 60  # rotated at 4 KiB, five old files kept: all still here
    assert files
    assert {r["key"] for r in records()} == {"a-reader"}
