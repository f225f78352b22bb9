"""Every store call made off the event loop is inside work the store guard counts.

The guard sits where work is handed to a thread (routes, operators, the write gate, jobs,
the collectors a scrape runs), not in front of the store: a hand-off that forgot it would let
a stop close LMDB under a thread's transaction. This test serves a real app in a thread over
a real LMDB store wrapped in a checker, drives every route, the metrics port and the
background jobs, and asserts that the checker saw no store call from a thread outside
counted work.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from cache_service.client import CacheClient
from cache_service.core.store.lmdb.store import LmdbStore
from cache_service.core.store.protocols import BlockStore
from cache_service.service.api import lifecycle
from cache_service.service.api.app import create_app
from cache_service.service.api.guard import StoreGuard
from cache_service.service.settings import Settings
from tests.integration.conftest import free_port
from tests.reliability.thread_server import ThreadServer

MODEL = "m"
PROMPT = list(range(64 * 4))
PAYLOADS = [bytes([n]) * 1024 for n in range(4)]


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class HandOffCheck:
    """A store that notes every method call made in a thread without an event loop while
    the service's guard does not hold that thread (test-only: a proxy is fine here)."""

    def __init__(self, store: BlockStore) -> None:
        object.__setattr__(self, "_store", store)
        object.__setattr__(self, "guard", None)
        object.__setattr__(self, "unguarded", [])
        object.__setattr__(self, "checked", set())

    def _note(self, name: str) -> None:
        if _on_event_loop():
            return
        guard = cast(StoreGuard | None, self.guard)
        self.checked.add(name)
        if guard is None or not guard.held_here:
            self.unguarded.append((name, threading.current_thread().name))

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._store, name)
        if not callable(value):
            return value
        if name == "batch":
            return self._batch

        def noted(*args: Any, **kwargs: Any) -> Any:
            self._note(name)
            return value(*args, **kwargs)

        return noted

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._store, name, value)

    @contextmanager
    def _batch(self) -> Iterator[None]:
        self._note("batch")
        with self._store.batch():
            yield


@pytest.fixture
def checked_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A served app over a checked LMDB store, the checker, and the metrics port's URL."""
    opening = Settings().groups.store  # opened as the service would open it
    check = HandOffCheck(
        LmdbStore(
            tmp_path / "data",
            map_size_bytes=1 << 30,
            lifetimes=opening.lifetimes,
            removal_log_entries=opening.removal_log_entries,
        )
    )

    def guard_noted() -> StoreGuard:
        guard = StoreGuard()
        object.__setattr__(check, "guard", guard)
        return guard

    monkeypatch.setattr(lifecycle, "StoreGuard", guard_noted)
    metrics_port = free_port()
    settings = Settings(
        store=str(tmp_path / "data"),
        metrics_port=metrics_port,
        touch_flush_interval=0.05,
        sweep_interval=0.05,
    )
    server = ThreadServer(create_app(settings, store=cast(BlockStore, check)), "handoffs")
    server.start()
    try:
        yield server, check, f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        server.stop()
        check._store.close()


def _each_route(url: str, metrics_url: str) -> dict[str, int]:
    """Drive every route that reaches the store; each one's status."""
    statuses: dict[str, int] = {}
    client = CacheClient(url)
    try:
        client.put_prefix(MODEL, PROMPT, PAYLOADS)
        match = client.lookup(MODEL, PROMPT)
        statuses["lookup"] = 200 if match.matched_blocks == 4 else 0
        statuses["lookup fetch"] = 200 if client.lookup(MODEL, PROMPT, fetch=True).payloads else 0
        statuses["blocks"] = 200 if len(client.get_blocks(MODEL, match.keys)) == 4 else 0
    finally:
        client.close()
    requests: list[tuple[str, str, dict[str, Any] | None]] = [
        ("GET", "/v1/info", None),
        ("GET", "/v1/stats", None),
        ("GET", "/readyz", None),
        ("GET", "/metrics", None),
        ("GET", "/", None),
        ("POST", "/v1/explain", {"model": MODEL, "tokens": PROMPT + [7] * 64}),
        ("POST", "/v1/pin", {"model": MODEL, "tokens": PROMPT}),
        ("GET", "/v1/pins", None),
        ("POST", "/v1/unpin", {"model": MODEL, "tokens": PROMPT}),
        ("POST", "/v1/route", {"model": MODEL, "tokens": PROMPT}),
        ("POST", "/v1/purge", {"model": MODEL, "tokens": PROMPT[:128]}),
    ]
    with httpx.Client(base_url=url, timeout=10) as http:
        for method, path, body in requests:
            statuses[f"{method} {path}"] = http.request(method, path, json=body).status_code
    statuses["metrics port"] = httpx.get(metrics_url, timeout=10).status_code
    return statuses


def test_every_store_call_off_the_loop_is_counted_by_the_guard(checked_server: Any) -> None:
    server, check, metrics_url = checked_server
    statuses = _each_route(server.url, metrics_url)
    assert {k: v for k, v in statuses.items() if v != 200} == {}
    time.sleep(0.5)  # touch flushes, sweeps, disk checks and status samples run meanwhile
    server.stop()  # the stop's final flush too
    assert check.unguarded == []
    # The check saw the data path, the operator controls and the background jobs.
    seen: Callable[[str], bool] = check.checked.__contains__
    assert all(map(seen, ("match", "insert", "read_payloads", "usage", "pin", "unpin")))
    assert all(map(seen, ("pins", "purge", "inspect", "touch")))
