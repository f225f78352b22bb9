"""The Service: started and stopped as one, and a stop that never waits forever."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from cache_service.core.blocks import Namespace
from cache_service.core.store.memory import MemoryStore
from cache_service.service.api.service import Service
from cache_service.service.metrics import CacheMetrics
from cache_service.service.settings import Settings


def service(settings: Settings, store: MemoryStore | None = None) -> Service:
    """A service on `settings` with a fresh metrics registry."""
    return Service(settings, metrics=CacheMetrics(CollectorRegistry()), store=store)


def test_a_memory_url_serves_with_no_files_beside_any_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)

    async def run() -> None:
        running = service(Settings(store="memory://"))
        state = await running.start()
        assert state.store_kind == "memory"
        await running.stop()
        assert running.state is None

    asyncio.run(run())
    assert list(tmp_path.iterdir()) == []  # no data folder, no lock or quota files


def test_store_wins_over_data_dir(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "unused", store=f"lmdb://{tmp_path}/used")

    async def run() -> None:
        running = service(settings)
        await running.start()
        await running.stop()

    asyncio.run(run())
    assert (tmp_path / "used" / "data.mdb").exists()
    assert not (tmp_path / "unused").exists()


def test_stop_flushes_deferred_touches_once_no_write_is_running() -> None:
    store = MemoryStore()

    async def run() -> int:
        running = service(Settings(touch_flush_interval=3600), store)
        state = await running.start()
        namespace, tokens = Namespace("m"), list(range(64))
        state.cache.insert(namespace, tokens, [b"x"])
        state.cache.match_prefix(namespace, tokens)
        assert state.cache.touches.pending == 1
        await running.stop()
        return state.cache.touches.pending

    assert asyncio.run(run()) == 0


def test_stop_with_a_write_that_never_finishes_returns_within_the_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="cache_service")
    store = MemoryStore()

    async def run() -> float:
        running = service(Settings(shutdown_timeout=0.3), store)
        state = await running.start()
        stuck = state.writes.admit()
        stuck.__enter__()  # a store request that holds its place and never returns
        started = time.monotonic()
        await running.stop()
        return time.monotonic() - started

    took = asyncio.run(run())
    assert 0.3 <= took < 2.0
    assert any("1 store requests still running after 0.3s" in m for m in caplog.messages)


def test_stop_waits_for_a_write_that_finishes_in_time() -> None:
    async def run() -> tuple[float, int]:
        running = service(Settings(shutdown_timeout=5.0), MemoryStore())
        state = await running.start()
        place = state.writes.admit()
        place.__enter__()
        asyncio.get_running_loop().call_later(0.2, place.__exit__, None, None, None)
        started = time.monotonic()
        await running.stop()
        return time.monotonic() - started, state.writes.pending

    took, pending = asyncio.run(run())
    assert 0.2 <= took < 2.0
    assert pending == 0
