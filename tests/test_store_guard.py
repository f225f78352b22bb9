"""StoreGuard and the ServiceLifecycle's stop: no store call, read or write, is in progress when the
store closes, and a stop that finds one still running at its deadline leaves the store open."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from cache_service.core.blocks import Namespace
from cache_service.core.store.memory import MemoryStore
from cache_service.service.api.guard import StoreGuard
from cache_service.service.api.lifecycle import ServiceLifecycle
from cache_service.service.api.state import NotReady, ServiceState
from cache_service.service.metrics import CacheMetrics
from cache_service.service.settings import Settings

NAMESPACE = Namespace("m")
TOKENS = list(range(64 * 3))
PAYLOADS = [bytes([n]) * 4096 for n in range(3)]


def test_a_closed_guard_refuses_new_work_and_counts_that_in_progress() -> None:
    guard = StoreGuard()
    usage = guard.counted(MemoryStore().usage)
    with guard.call():
        guard.close()
        assert guard.active == 1
        with pytest.raises(NotReady) as refused:
            usage()
        assert refused.value.status == 503
    assert guard.active == 0
    assert guard.admitted(usage)().blocks == 0  # the stop's own last calls pass


def test_counted_work_is_held_in_its_own_thread_only() -> None:
    guard = StoreGuard()
    seen: list[tuple[bool, int]] = []

    def work() -> None:
        seen.append((guard.held_here, guard.active))
        other = threading.Thread(target=lambda: seen.append((guard.held_here, guard.active)))
        other.start()
        other.join()

    asyncio.run(guard.in_thread(work))
    assert seen == [(True, 1), (False, 1)]
    assert not guard.held_here and guard.active == 0


def test_wait_idle_returns_at_the_deadline_while_a_call_runs() -> None:
    guard = StoreGuard()
    release = threading.Event()

    def inside() -> None:
        with guard.call():
            release.wait(5)

    thread = threading.Thread(target=inside)
    thread.start()
    time.sleep(0.05)
    started = time.monotonic()
    idle = asyncio.run(guard.wait_idle(time.monotonic() + 0.2))
    took = time.monotonic() - started
    release.set()
    thread.join()
    assert not idle and 0.15 <= took < 2.0
    assert asyncio.run(guard.wait_idle(time.monotonic() + 1.0))


def _slow_reader(state: ServiceState, inside: threading.Event, release: threading.Event) -> list:
    """A lookup that fetches payloads and lingers inside its read transaction (the sink runs
    within it) until `release`; what it copied, or the error it met."""
    copied: list[object] = []

    def sink(_index: int, payload: bytes | memoryview | None) -> None:
        inside.set()
        release.wait(10)
        copied.append(bytes(payload) if payload is not None else None)  # reads the mapped page

    def run() -> None:  # as a route hands its store work to a thread
        try:
            state.guard.counted(state.cache.match_prefix)(
                NAMESPACE, TOKENS, with_payloads=True, sink=sink
            )
        except Exception as exc:
            copied.append(exc)

    threading.Thread(target=run, daemon=True).start()
    return copied


def _service(tmp_path: Path, timeout: float) -> ServiceLifecycle:
    settings = Settings(store=str(tmp_path / "data"), shutdown_timeout=timeout)
    return ServiceLifecycle(settings.groups, metrics=CacheMetrics(CollectorRegistry()))


def test_stop_waits_for_a_read_inside_its_transaction_before_closing(tmp_path: Path) -> None:
    """Closing LMDB under a reader unmaps the pages its payload views point into (a copy
    after that is a segmentation fault): the stop waits for the read to end."""
    inside, release = threading.Event(), threading.Event()

    async def run() -> tuple[list, float, bool]:
        running = _service(tmp_path, timeout=5.0)
        state = await running.start()
        state.cache.insert(NAMESPACE, TOKENS, PAYLOADS)
        copied = _slow_reader(state, inside, release)
        assert await asyncio.to_thread(inside.wait, 5)
        asyncio.get_running_loop().call_later(0.3, release.set)
        started = time.monotonic()
        await running.stop()
        took = time.monotonic() - started
        with pytest.raises(NotReady):  # a read after the stop is refused, not a crash
            await state.in_thread(state.cache.match_prefix, NAMESPACE, TOKENS, with_payloads=True)
        return copied, took, release.is_set()

    copied, took, released = asyncio.run(run())
    assert released and took >= 0.25
    assert copied == PAYLOADS


def test_stop_leaves_the_store_open_under_a_read_that_outlasts_the_timeout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="cache_service")
    inside, release = threading.Event(), threading.Event()

    async def run() -> tuple[list, float]:
        running = _service(tmp_path, timeout=0.3)
        state = await running.start()
        state.cache.insert(NAMESPACE, TOKENS, PAYLOADS)
        copied = _slow_reader(state, inside, release)
        assert await asyncio.to_thread(inside.wait, 5)
        started = time.monotonic()
        await running.stop()
        took = time.monotonic() - started
        release.set()
        deadline = time.monotonic() + 5
        while len(copied) < len(PAYLOADS) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return copied, took

    copied, took = asyncio.run(run())
    assert 0.25 <= took < 2.0
    assert copied == PAYLOADS  # the store was left open: the reader finished unharmed
    assert any("1 store calls still running after 0.3s" in m for m in caplog.messages)
