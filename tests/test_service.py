"""The ServiceLifecycle: started and stopped as one, and a stop that never waits forever."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from pathlib import Path

import pytest
from conftest import memory_store_for
from prometheus_client import CollectorRegistry

from cache_service.core.blocks import Namespace
from cache_service.core.errors import Overloaded
from cache_service.core.store.lmdb.store import LmdbStore
from cache_service.core.store.memory import MemoryStore
from cache_service.service.api.background import ElectionLock, sweeper
from cache_service.service.api.lifecycle import ServiceLifecycle, given_store
from cache_service.service.api.state import ServiceState, WriteGate
from cache_service.service.metrics import CacheMetrics
from cache_service.service.settings import Settings


def service(settings: Settings, store: MemoryStore | None = None) -> ServiceLifecycle:
    """A service on `settings` with a fresh metrics registry."""
    return ServiceLifecycle(settings.groups, metrics=CacheMetrics(CollectorRegistry()), store=store)


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
    settings = Settings(touch_flush_interval=3600)
    store = memory_store_for(settings)

    async def run() -> int:
        running = service(settings, store)
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
    stuck = threading.Event()

    async def run() -> float:
        settings = Settings(shutdown_timeout=0.3)
        running = service(settings, memory_store_for(settings))
        state = await running.start()
        request = asyncio.ensure_future(state.writes.run(lambda: stuck.wait(10)))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        await running.stop()
        took = time.monotonic() - started
        stuck.set()  # let the thread go once the stop is measured
        await request
        return took

    took = asyncio.run(run())
    assert 0.3 <= took < 2.0
    assert any("1 writes still running after 0.3s" in m for m in caplog.messages)


def test_a_cancelled_store_request_keeps_its_place_until_its_write_ends(tmp_path: Path) -> None:
    """uvicorn cancels the requests still open when it shuts down, before the lifespan's
    stop: the write a cancelled request started still runs in its thread, so the stop must
    wait for it and close the store only after it committed."""
    release = threading.Event()
    outcome: list[object] = []

    def slow_write(state: ServiceState) -> None:
        release.wait(5)
        try:
            outcome.append(state.cache.insert(Namespace("m"), list(range(64)), [b"kv"]).stored)
        except Exception as exc:  # a store closed under the write would land here
            outcome.append(exc)

    async def run() -> tuple[int, int, float]:
        running = service(Settings(store=str(tmp_path / "data"), shutdown_timeout=5.0))
        state = await running.start()
        request = asyncio.ensure_future(state.writes.run(lambda: slow_write(state)))
        await asyncio.sleep(0.05)  # the write's thread has started
        request.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await request
        pending_after_cancel = state.writes.pending
        asyncio.get_running_loop().call_later(0.3, release.set)
        started = time.monotonic()
        await running.stop()
        return pending_after_cancel, state.writes.pending, time.monotonic() - started

    pending_after_cancel, pending_after_stop, took = asyncio.run(run())
    assert (pending_after_cancel, pending_after_stop) == (1, 0)
    assert took >= 0.25  # the stop waited for the write
    assert outcome == [1]  # which committed its block before the store was closed
    reopened = LmdbStore(tmp_path / "data", map_size_bytes=1 << 30)
    try:
        assert reopened.usage().blocks == 1
    finally:
        reopened.close()


def test_stop_waits_for_a_write_that_finishes_in_time() -> None:
    async def run() -> tuple[float, int]:
        settings = Settings(shutdown_timeout=5.0)
        running = service(settings, memory_store_for(settings))
        state = await running.start()
        request = asyncio.ensure_future(state.writes.run(lambda: time.sleep(0.2)))
        await asyncio.sleep(0.01)
        started = time.monotonic()
        await running.stop()
        await request
        return time.monotonic() - started, state.writes.pending

    took, pending = asyncio.run(run())
    assert 0.15 <= took < 2.0
    assert pending == 0


def test_a_full_gate_refuses_a_store_at_once() -> None:
    async def run() -> None:
        gate = WriteGate(1)
        release = threading.Event()
        first = asyncio.ensure_future(gate.run(lambda: release.wait(5)))
        await asyncio.sleep(0.01)
        with pytest.raises(Overloaded, match="max_pending_writes"):
            await gate.run(lambda: None)
        release.set()
        await first
        assert gate.pending == 0

    asyncio.run(run())


def test_a_store_given_to_the_service_is_held_to_its_settings() -> None:
    settings = Settings(removal_log_entries=1000)
    store = memory_store_for(settings)

    async def run() -> tuple[int, str]:
        running = service(settings, store)
        state = await running.start()
        await running.stop()
        return store.removal_log_entries, state.store_kind

    assert asyncio.run(run()) == (1000, "memory")
    with pytest.raises(ValueError, match=r"orders eviction by 'adaptive'.*'fifo'"):
        given_store(store, Settings.model_construct(eviction_policy="fifo").groups.store)
    # Nothing is changed on a store given: one opened otherwise is refused, naming both.
    with pytest.raises(ValueError, match=r"keeps 1000 recent removals, the settings 262144"):
        given_store(store, Settings().groups.store)
    shorter = Settings(removal_log_entries=1000, retention="agent=3d,chat=1d")
    with pytest.raises(
        ValueError, match=r"by agent=3d, chat=7d, handoff=10m, the settings by agent=3d, chat=1d"
    ):
        given_store(store, shorter.groups.store)
    with pytest.raises(ValueError, match=r"bounds lifetimes by none .*\(--retention\)"):
        given_store(MemoryStore(removal_log_entries=1000), settings.groups.store)


def test_a_cancelled_sweep_keeps_its_place_until_its_batch_ends(tmp_path: Path) -> None:
    """The sweeper's batches go through the write gate too: a stop cancels the job, and the
    batch already running in its thread is waited for before the store closes."""
    release = threading.Event()

    def slow_batch() -> int:
        release.wait(5)
        return 0

    async def run() -> tuple[int, int]:
        gate = WriteGate(1)
        lock = ElectionLock(tmp_path, "sweeper.lock")
        job = sweeper(slow_batch, lock, lambda work: gate.run(work, refusable=False))
        task = asyncio.ensure_future(job())
        await asyncio.sleep(0.05)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        during = gate.pending
        release.set()
        await gate.wait_idle(5)
        lock.release()
        return during, gate.pending

    assert asyncio.run(run()) == (1, 0)
