"""The application factory: its lifespan opens the store and runs the background workers."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, disable_created_metrics
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from cache_service import __version__
from cache_service.api.auth import Authenticator
from cache_service.api.background import (
    METRICS_RETRY_SECONDS,
    ElectionLock,
    MetricsPort,
    repeat,
    sweeper,
)
from cache_service.api.docs import install_docs
from cache_service.api.limits import QuotaGate
from cache_service.api.openapi import install_openapi
from cache_service.api.operator_routes import router as operator_router
from cache_service.api.problems import install_problem_handlers
from cache_service.api.routes import router
from cache_service.api.startup import open_store, serving_line
from cache_service.api.state import ServiceState, WriteGate
from cache_service.cache import Clock, PrefixCache
from cache_service.hashing import BlockHasher
from cache_service.metrics import CacheMetrics, StoreCollector
from cache_service.quotas import QuotaBook
from cache_service.settings import Settings
from cache_service.store.base import BlockStore
from cache_service.store.lmdb import LmdbStore
from cache_service.usage import UsageLog

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
    keys = settings.key_ring() if settings.auth == "keys" else None
    metrics.declare_tenants(sorted(keys.tenants) if keys is not None else [])

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = store is None
        # Refused if the folder's data was made with other settings (`cache-service serve`
        # checks first, so that it exits with the message rather than a worker's traceback).
        the_store: BlockStore = store or open_store(settings)
        the_store.removal_log_entries = settings.removal_log_entries
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
            tenant_capacity_bytes=keys.tenant_capacity if keys is not None else None,
            events=metrics,
        )
        collector = StoreCollector(cache.capacity.usage, settings.capacity)
        metrics.scrape_registry.register(collector)
        folder = settings.data_dir if owned else None
        sweeper_lock = ElectionLock(folder, "sweeper.lock")
        metrics_port = MetricsPort(
            settings.metrics_host,
            settings.metrics_port,
            metrics.scrape_registry,
            ElectionLock(folder, "metrics.lock"),
        )
        metrics_port.ensure()
        # The capacity may have been lowered since the data was written.
        await run_in_threadpool(cache.capacity.enforce)
        kind = "lmdb" if isinstance(the_store, LmdbStore) else type(the_store).__name__
        usage_log = (
            UsageLog(settings.usage_log, max_bytes=settings.usage_log_max_bytes, clock=clock)
            if settings.usage_log is not None
            else None
        )
        writes = WriteGate(settings.max_pending_writes)
        quotas = QuotaBook(list(keys), folder) if keys is not None else None
        app.state.service = ServiceState(cache, metrics, settings, kind, writes, usage_log, quotas)

        async def flush() -> None:
            if cache.touches.pending:
                await run_in_threadpool(cache.touches.flush)
            if usage_log is not None:
                await run_in_threadpool(usage_log.flush)

        workers = [
            asyncio.create_task(repeat(settings.touch_flush_interval, flush, "touch flush")),
            asyncio.create_task(
                repeat(settings.sweep_interval, sweeper(cache, sweeper_lock), "sweeper")
            ),
        ]
        if settings.metrics_port is not None:  # a worker that did not get the port retries
            workers.append(
                asyncio.create_task(
                    repeat(METRICS_RETRY_SECONDS, metrics_port.ensure_async, "metrics port")
                )
            )
        log.info("%s", serving_line(settings, the_store))
        try:
            yield
        finally:
            app.state.service = None
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            cache.touches.flush()
            if usage_log is not None:
                usage_log.flush()
            sweeper_lock.release()
            metrics_port.close()
            if quotas is not None:
                quotas.close()
            metrics.scrape_registry.unregister(collector)
            metrics.close()
            if owned:
                the_store.close()

    app = FastAPI(
        title="Prompt cache service",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url=None,  # install_docs: the same pages, with scripts served from the package
        redoc_url=None,
    )
    app.state.service = None
    app.include_router(router)
    app.include_router(operator_router)
    install_problem_handlers(app)
    install_openapi(app, bearer_auth=keys is not None)
    install_docs(app)
    app.add_middleware(QuotaGate)  # inside: it needs the key the Authenticator found
    app.add_middleware(Authenticator, keys=keys)
    app.add_middleware(RequestTimer, metrics=metrics)
    return app
