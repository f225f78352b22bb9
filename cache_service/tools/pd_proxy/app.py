"""The proxy's Starlette app. Its lifespan owns what lives as long as the app: the HTTP client
to the engines, the cache service's client, and the health-check task; one first round of
checks runs before the app takes requests, so /readyz and the first choices are informed.

Routes: POST /v1/completions and /v1/chat/completions (proxied), GET /v1/models (a healthy
D's), GET /healthz (up), GET /readyz (a decode engine is healthy), GET /metrics. Every
refusal of the proxy's own is RFC 9457 problem+json, mapped in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cache_service.client import AsyncCacheClient
from cache_service.core.errors import PROBLEM_JSON, PromptCacheError, internal_problem
from cache_service.service.api.bodies import read_body
from cache_service.tools.pd_proxy import bodies
from cache_service.tools.pd_proxy.bodies import CHAT_COMPLETIONS, COMPLETIONS, Endpoint
from cache_service.tools.pd_proxy.engines import EnginePool
from cache_service.tools.pd_proxy.errors import NoDecodeEngine
from cache_service.tools.pd_proxy.flow import PDFlow
from cache_service.tools.pd_proxy.health import check_all, watch_health
from cache_service.tools.pd_proxy.metrics import ProxyMetrics
from cache_service.tools.pd_proxy.options import ProxyOptions
from cache_service.tools.pd_proxy.placement import PrefixPlacement
from cache_service.tools.pd_proxy.reporting import describe_error

KEEPALIVE = 64  # idle connections kept, to all engines together
log = logging.getLogger("cache_service.tools.pd_proxy")


@dataclass(frozen=True, slots=True)
class ProxyState:
    """What the routes use, made by the lifespan."""

    pool: EnginePool
    flow: PDFlow
    client: httpx.AsyncClient
    metrics: ProxyMetrics
    models_timeout: httpx.Timeout  # GET /v1/models: the prefill timeout (a short answer)
    options: ProxyOptions


def create_app(
    options: ProxyOptions,
    *,
    metrics: ProxyMetrics | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> Starlette:
    """The proxy app for `options`; `transport` replaces the network to the engines (tests)."""
    metrics = metrics if metrics is not None else ProxyMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        """Open the clients, check every engine once, watch them until the app stops."""
        pool = EnginePool(options, metrics)
        connect = options.connect_timeout_seconds
        # Streams stay open for minutes: no cap on connections, so none waits for another.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=KEEPALIVE)
        client = httpx.AsyncClient(
            timeout=httpx.Timeout(options.decode_timeout_seconds, connect=connect),
            limits=limits,
            transport=transport,
        )
        cache = None
        if options.cache_url is not None:
            cache = AsyncCacheClient(
                options.cache_url,
                api_key=options.cache_api_key,
                timeout=options.route_timeout_seconds,
            )
        placement = PrefixPlacement(
            pool=pool,
            client=client,
            cache=cache,
            metrics=metrics,
            timeout_seconds=options.route_timeout_seconds,
        )
        flow = PDFlow(options, pool=pool, client=client, placement=placement, metrics=metrics)
        models_timeout = httpx.Timeout(options.prefill_timeout_seconds, connect=connect)
        app.state.proxy = ProxyState(
            pool,
            flow,
            client,
            metrics,
            models_timeout,
            options,
        )
        await check_all(pool, client, timeout_seconds=connect)
        checks = watch_health(
            pool, client, interval_seconds=options.health_interval_seconds, timeout_seconds=connect
        )
        watcher = asyncio.create_task(checks, name="pd-proxy health checks")
        try:
            yield
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            if cache is not None:
                await cache.aclose()
            await client.aclose()

    routes = [
        Route("/v1/completions", _proxied(COMPLETIONS), methods=["POST"]),
        Route("/v1/chat/completions", _proxied(CHAT_COMPLETIONS), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics_page, methods=["GET"]),
    ]
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={PromptCacheError: _on_error, Exception: _on_unexpected},
    )


def _state(request: Request) -> ProxyState:
    state: ProxyState = request.app.state.proxy
    return state


def _proxied(endpoint: Endpoint) -> Callable[[Request], Awaitable[Response]]:
    async def proxy(request: Request) -> Response:
        """Send the request to a prefill engine, then a decode engine; D's answer."""
        state = _state(request)
        body = partial(
            read_body,
            request,
            limit_bytes=state.options.max_body_size,
            timeout_seconds=state.options.body_timeout_seconds,
        )
        return await state.flow.handle(endpoint, body, request.headers)

    return proxy


async def models(request: Request) -> Response:
    """GET /v1/models of a healthy decode engine, as it answered."""
    state = _state(request)
    headers = bodies.engine_headers(request.headers)
    failures = []
    for engine in sorted(state.pool.healthy("decode"), key=lambda e: e.in_flight):
        try:
            answer = await state.client.get(
                engine.url + "/v1/models", headers=headers, timeout=state.models_timeout
            )
        except httpx.HTTPError as exc:
            failures.append(f"{engine.name}: {describe_error(exc)}")
            continue
        return Response(
            answer.content,
            status_code=answer.status_code,
            media_type=answer.headers.get("content-type", "application/json"),
        )
    detail = "no decode engine answered GET /v1/models"
    raise NoDecodeEngine(detail + ("; tried " + "; ".join(failures) if failures else ""))


async def healthz(request: Request) -> Response:
    """The proxy is up."""
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    """200 while a decode engine is healthy, else 503; each engine's state either way."""
    pool = _state(request).pool
    engines = {"prefill": pool.states("prefill"), "decode": pool.states("decode")}
    if not pool.healthy("decode"):
        raise NoDecodeEngine("no decode engine is healthy", engines=engines)
    return JSONResponse({"status": "ready", "engines": engines})


async def metrics_page(request: Request) -> Response:
    """Prometheus's text exposition of the proxy's registry."""
    registry = _state(request).metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


async def _on_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, PromptCacheError)
    return JSONResponse(
        exc.to_problem(instance=request.url.path), status_code=exc.status, media_type=PROBLEM_JSON
    )


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s", request.url.path)
    body = internal_problem(request.url.path, "the proxy failed unexpectedly")
    return JSONResponse(body, status_code=500, media_type=PROBLEM_JSON)
