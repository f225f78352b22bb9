"""The application factory: its lifespan opens the store and runs the background workers."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import IO, Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, disable_created_metrics
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from cache_service import __version__
from cache_service.api.openapi import install_openapi
from cache_service.api.problems import install_problem_handlers
from cache_service.api.routes import router
from cache_service.api.state import ServiceState
from cache_service.cache import Clock, PrefixCache
from cache_service.capacity import EVICT_BATCH_BLOCKS
from cache_service.hashing import BlockHasher
from cache_service.metrics import CacheMetrics, StoreCollector
from cache_service.settings import Settings
from cache_service.store.base import BlockStore
from cache_service.store.lmdb import LmdbStore

log = logging.getLogger("cache_service")

DESCRIPTION = """A prefix-aware prompt cache of KV blocks. Prefill workers look up the longest
cached prefix of a prompt, fetch its KV payloads, and store the blocks they computed."""


class RequestTimer:
    """ASGI middleware: request latency by route template (unmatched paths count as 'other')."""

    def __init__(self, app: ASGIApp, *, metrics: CacheMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Time one request."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        try:
            await self.app(scope, receive, send)
        finally:
            # The router leaves the matched route in the scope: its template is a bounded label.
            route = getattr(scope.get("route"), "path", None) or "other"
            self.metrics.request_duration.labels(route=route).observe(time.perf_counter() - started)


async def _repeat(interval_seconds: float, job: Callable[[], Awaitable[Any]], name: str) -> None:
    """Run `job` every `interval_seconds` until cancelled; a failure is logged, not fatal."""
    while True:
        await asyncio.sleep(interval_seconds)
        try:
            await job()
        except Exception:
            log.exception("background job %s failed; retrying in %.1fs", name, interval_seconds)


class SweeperLock:
    """Elects one worker process to run the expiry sweeper (an advisory lock file beside the
    data); if it exits, the lock is free and another worker takes the job at its next turn."""

    def __init__(self, folder: Path | None) -> None:
        self._path = folder / "sweeper.lock" if folder is not None else None
        self._file: IO[bytes] | None = None

    def held(self) -> bool:
        """Whether this process runs the sweeper (trying to become it if nobody does)."""
        if self._path is None or self._file is not None:
            return True
        handle = self._path.open("ab")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            return False
        self._file = handle
        return True

    def release(self) -> None:
        """Give the job up (closing the file drops the lock)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def _sweeper(cache: PrefixCache, lock: SweeperLock) -> Callable[[], Awaitable[None]]:
    async def sweep() -> None:
        if not lock.held():
            return  # another worker sweeps: deleting the same blocks twice would only contend
        # Short batches, each its own transaction, so writers never wait long for the lock.
        while await run_in_threadpool(cache.sweep_expired) >= EVICT_BATCH_BLOCKS:
            await asyncio.sleep(0)

    return sweep


def app_from_environment() -> FastAPI:
    """The app of one worker process, configured from CACHE_SERVICE_* variables."""
    return create_app(Settings())


def create_app(
    settings: Settings | None = None,
    *,
    store: BlockStore | None = None,
    clock: Clock = time.time,
    registry: CollectorRegistry | None = None,
) -> FastAPI:
    """Build the service. The store is opened in the lifespan (after any fork), unless given."""
    settings = settings or Settings()
    # `*_created` timestamp series double every counter on a scrape and no dashboard uses them.
    disable_created_metrics()  # type: ignore[no-untyped-call]
    registry = registry or CollectorRegistry()
    metrics = CacheMetrics(registry)
    retention = settings.retention_policy()
    metrics.declare_retention(retention.classes)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = store is None
        the_store: BlockStore = store or LmdbStore(
            settings.data_dir,
            map_size_bytes=settings.map_size_bytes(),
            sync_mode=settings.lmdb_sync,
        )
        cache = PrefixCache(
            the_store,
            hasher=BlockHasher(seed=settings.seed),
            retention=retention,
            clock=clock,
            default_block_size=settings.block_size,
            model_block_sizes=settings.model_block_sizes(),
            capacity_bytes=settings.capacity,
            high_water=settings.high_water,
            low_water=settings.low_water,
            defer_touches=True,
            ttl_slide_fraction=settings.ttl_slide_fraction,
            events=metrics,
        )
        collector = StoreCollector(cache.usage, settings.capacity)
        metrics.scrape_registry.register(collector)
        sweeper_lock = SweeperLock(settings.data_dir if owned else None)
        # The capacity may have been lowered since the data was written.
        await run_in_threadpool(cache.enforce_capacity)
        kind = "lmdb" if isinstance(the_store, LmdbStore) else type(the_store).__name__
        app.state.service = ServiceState(cache, metrics, settings, kind)

        async def flush() -> None:
            if cache.pending_touches:
                await run_in_threadpool(cache.flush_touches)

        workers = [
            asyncio.create_task(_repeat(settings.touch_flush_interval, flush, "touch flush")),
            asyncio.create_task(
                _repeat(settings.sweep_interval, _sweeper(cache, sweeper_lock), "sweeper")
            ),
        ]
        try:
            yield
        finally:
            app.state.service = None
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            cache.flush_touches()
            sweeper_lock.release()
            metrics.scrape_registry.unregister(collector)
            metrics.close()
            if owned:
                the_store.close()

    app = FastAPI(
        title="Prompt cache service",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
    )
    app.state.service = None
    app.include_router(router)
    install_problem_handlers(app)
    install_openapi(app)
    app.add_middleware(RequestTimer, metrics=metrics)
    return app
