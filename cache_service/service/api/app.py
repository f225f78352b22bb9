"""The application factory: routes, middleware and a lifespan that starts and stops the
ServiceLifecycle (the store, the cache and the background workers)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, disable_created_metrics
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cache_service import __version__
from cache_service.core.cache import Clock
from cache_service.core.store.protocols import BlockStore
from cache_service.service.allocator import keep_freed_memory
from cache_service.service.api.auth import Authenticator
from cache_service.service.api.cancels import AnswerCancelled
from cache_service.service.api.docs import install_docs
from cache_service.service.api.lifecycle import ServiceLifecycle
from cache_service.service.api.limits import QuotaGate
from cache_service.service.api.local_reads import router as local_reads_router
from cache_service.service.api.openapi import install_openapi
from cache_service.service.api.operator_routes import router as operator_router
from cache_service.service.api.problems import install_problem_handlers
from cache_service.service.api.routes import router
from cache_service.service.api.routing_routes import router as route_router
from cache_service.service.api.status_page import router as status_router
from cache_service.service.metrics import CacheMetrics
from cache_service.service.settings import Settings

DESCRIPTION = """A prefix-aware prompt cache of KV blocks. Prefill workers look up the longest
cached prefix of a prompt, fetch its KV payloads, and store the blocks they computed."""


class RequestTimer:
    """ASGI middleware: request latency and answers by route template and status code
    (unmatched paths count as route 'other')."""

    def __init__(self, app: ASGIApp, *, metrics: CacheMetrics) -> None:
        self.app = app
        self.metrics = metrics
        self._children: dict[tuple[str, int], tuple[Any, Any]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Time one request."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        # An exception before any answer started is a 500 to the client (uvicorn sends it).
        status = 500

        async def send_noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            # The router leaves the matched route in the scope: its template is a bounded label.
            route = getattr(scope.get("route"), "path", None) or "other"
            duration, count = self._children.get((route, status)) or self._labelled(route, status)
            duration.observe(time.perf_counter() - started)
            count.inc()

    def _labelled(self, route: str, status: int) -> tuple[Any, Any]:
        """A route's and status's children, looked up once: labels() is a dict walk under a
        lock, twice a request otherwise. Both are bounded: route templates, HTTP codes."""
        pair = (
            self.metrics.request_duration.labels(route=route),
            self.metrics.requests.labels(route=route, code=str(status)),
        )
        self._children[route, status] = pair
        return pair


def app_from_environment() -> FastAPI:
    """The app of one worker process, configured from CACHE_SERVICE_* variables."""
    settings = Settings()
    keep_freed_memory(settings.groups.server.keep_freed_memory)
    return create_app(settings)


def create_app(
    settings: Settings | None = None,
    *,
    store: BlockStore | None = None,
    clock: Clock = time.time,
    registry: CollectorRegistry | None = None,
) -> FastAPI:
    """Build the service. The store is opened in the lifespan (after any fork), unless given."""
    config = (settings or Settings()).groups
    # `*_created` timestamp series double every counter on a scrape and no dashboard uses them.
    disable_created_metrics()  # type: ignore[no-untyped-call]
    registry = registry or CollectorRegistry()
    metrics = CacheMetrics(registry)
    metrics.declare_retention(config.cache.retention.classes)
    keys = config.auth.keys
    metrics.declare_tenants(sorted(keys.tenants) if keys is not None else [])
    service = ServiceLifecycle(config, metrics=metrics, store=store, clock=clock)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.service = await service.start()
        try:
            yield
        finally:
            app.state.service = None  # new requests get 503 while in-flight writes finish
            await service.stop()

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
    app.include_router(route_router)
    app.include_router(local_reads_router)
    app.include_router(status_router)
    install_problem_handlers(app)
    install_openapi(app, bearer_auth=keys is not None)
    install_docs(app)
    app.add_middleware(QuotaGate)  # inside: it needs the key the Authenticator found
    app.add_middleware(Authenticator, keys=keys)
    app.add_middleware(AnswerCancelled)  # a stopping server's cancel is a 503 ...
    app.add_middleware(RequestTimer, metrics=metrics)  # ... which the timer counts as such
    return app
