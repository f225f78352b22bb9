"""One request's way through the engines: which hold its prefix, P, then D.

1. the engines are chosen (`placement.py`, then `EnginePool.choose`);
2. P gets a one-token copy (`bodies.prefill_body`); its answer's `kv_transfer_params` are
   kept. A P that fails (no connection, a non-2xx answer, past the prefill timeout) or no
   healthy P is a fallback, counted by reason: D then computes the whole prompt;
3. D gets the request as sent, with P's params. A D that cannot be reached (no connection, or
   closed before its answer began) is marked down and the next healthy D is tried; none left
   is a 503. Once D's answer has begun it is D's: passed through, status and all.

Every call has a connect timeout and a read timeout, so nothing waits forever.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import httpx
import orjson
from starlette.responses import Response

from cache_service.core.errors import PromptCacheError, RequestError
from cache_service.tools.pd_proxy import bodies
from cache_service.tools.pd_proxy.bodies import Endpoint
from cache_service.tools.pd_proxy.engines import Engine, EnginePool
from cache_service.tools.pd_proxy.errors import DecodeFailed, DecodeTimeout, NoDecodeEngine
from cache_service.tools.pd_proxy.metrics import ProxyMetrics
from cache_service.tools.pd_proxy.options import ProxyOptions
from cache_service.tools.pd_proxy.placement import PrefixPlacement
from cache_service.tools.pd_proxy.relay import StreamContext, relay
from cache_service.tools.pd_proxy.reporting import ThrottledLog, describe_error
from cache_service.tools.pd_proxy.usage import answer_usage, asks_for_usage

# Failures before any byte of D's answer: nothing was answered, another D may take it.
UNREACHABLE = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.RemoteProtocolError,  # closed without an answer
    httpx.ReadError,
    httpx.WriteError,
)
OUTCOMES: dict[type[PromptCacheError], str] = {
    RequestError: "bad_request",  # not JSON, too large (413), too slow to arrive (408)
    NoDecodeEngine: "no_decode_engine",
    DecodeFailed: "decode_error",
    DecodeTimeout: "decode_timeout",
}


class PDFlow:
    """Sends each request to a P, then a D, and answers with D's answer."""

    def __init__(
        self,
        options: ProxyOptions,
        *,
        pool: EnginePool,
        client: httpx.AsyncClient,
        placement: PrefixPlacement,
        metrics: ProxyMetrics,
    ) -> None:
        self._pool = pool
        self._client = client
        self._placement = placement
        self._metrics = metrics
        self._log = ThrottledLog()
        connect = options.connect_timeout_seconds
        self._prefill_timeout_seconds = options.prefill_timeout_seconds
        self._prefill_timeout = httpx.Timeout(options.prefill_timeout_seconds, connect=connect)
        self._decode_timeout_seconds = options.decode_timeout_seconds
        self._decode_timeout = httpx.Timeout(options.decode_timeout_seconds, connect=connect)

    async def handle(
        self,
        endpoint: Endpoint,
        body: Callable[[], Awaitable[bytes | bytearray]],
        headers: Mapping[str, str],
    ) -> Response:
        """Answer one request (`body` reads it as sent); a PromptCacheError for the proxy's
        own refusals, counted here as every outcome is."""
        try:
            raw = await body()
            return await self._handle(endpoint, bytes(raw), headers)
        except PromptCacheError as exc:
            outcome = next((OUTCOMES[c] for c in type(exc).__mro__ if c in OUTCOMES), "error")
            self._metrics.requests.labels(endpoint.name, outcome).inc()
            raise

    async def _handle(
        self, endpoint: Endpoint, raw: bytes, client_headers: Mapping[str, str]
    ) -> Response:
        body = bodies.read_request(raw)
        headers = bodies.engine_headers(client_headers)
        held = await self._placement.held_tokens(body, chat=endpoint.chat, headers=headers)
        params = await self._prefill(endpoint, body, headers, held)
        content = bodies.decode_content(raw, body, params)
        engine, response, started = await self._open_decode(endpoint, content, headers, held)
        answer_headers = {bodies.REQUEST_ID_HEADER: headers[bodies.REQUEST_ID_HEADER]}
        if bodies.wants_stream(body):
            context = StreamContext(endpoint, engine, started, asks_for_usage(body))
            return relay(
                response,
                context,
                pool=self._pool,
                metrics=self._metrics,
                log=self._log,
                headers=answer_headers,
            )
        content = await self._read_decode(engine, response, started)
        outcome = "ok" if response.is_success else "engine_status"
        self._metrics.requests.labels(endpoint.name, outcome).inc()
        if response.is_success:
            self._metrics.count_usage(answer_usage(content))
        return Response(
            content,
            status_code=response.status_code,
            media_type=response.headers.get("content-type", "application/json"),
            headers=answer_headers,
        )

    async def _prefill(
        self,
        endpoint: Endpoint,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        held: Mapping[str, int],
    ) -> dict[str, Any] | None:
        """P's kv_transfer_params; None (the fallback counted) when P failed or none is up."""
        engine = self._pool.choose("prefill", held_tokens=held)
        if engine is None:
            self._metrics.fallbacks.labels("no_prefill").inc()
            return None
        started = time.monotonic()
        try:
            with self._pool.busy(engine):
                async with asyncio.timeout(self._prefill_timeout_seconds):
                    response = await self._client.post(
                        engine.url + endpoint.path,
                        content=orjson.dumps(bodies.prefill_body(body, chat=endpoint.chat)),
                        headers=dict(headers),
                        timeout=self._prefill_timeout,
                    )
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            self._pool.mark_down(engine, f"{endpoint.path}: {describe_error(exc)}")
            self._fallback("prefill_error", engine, describe_error(exc))
            return None
        except (httpx.TimeoutException, TimeoutError):
            seconds = self._prefill_timeout_seconds
            self._fallback("prefill_timeout", engine, f"no answer in {seconds:g} s")
            return None
        except httpx.HTTPError as exc:
            self._fallback("prefill_error", engine, describe_error(exc))
            return None
        finally:
            self._metrics.prefill_seconds.observe(time.monotonic() - started)
        if not response.is_success:
            self._fallback("prefill_error", engine, f"answered {response.status_code}")
            return None
        return bodies.returned_params(response.content)

    def _fallback(self, reason: str, engine: Engine, why: str) -> None:
        self._metrics.fallbacks.labels(reason).inc()
        self._log.warning(
            f"prefill:{engine.name}",
            "prefill engine %s failed (%s): decode engines compute its prompts alone",
            engine.describe(),
            why,
        )

    async def _open_decode(
        self,
        endpoint: Endpoint,
        content: bytes,
        headers: Mapping[str, str],
        held: Mapping[str, int],
    ) -> tuple[Engine, httpx.Response, float]:
        """A D's answer begun (status and headers read), counted in flight on it, and when it
        was sent; the next healthy D when one cannot be reached."""
        tried: list[Engine] = []
        failures: list[str] = []
        while True:
            engine = self._pool.choose("decode", held_tokens=held, exclude=tried)
            if engine is None:
                raise NoDecodeEngine(self._no_decode(tried, failures), tried=failures)
            if tried:
                self._metrics.failovers.inc()
            self._pool.begin(engine)
            started = time.monotonic()
            request = self._client.build_request(
                "POST",
                engine.url + endpoint.path,
                content=content,
                headers=dict(headers),
                timeout=self._decode_timeout,
            )
            try:
                response = await self._client.send(request, stream=True)
            except UNREACHABLE as exc:
                self._pool.end(engine)
                self._pool.mark_down(engine, f"{endpoint.path}: {describe_error(exc)}")
                tried.append(engine)
                failures.append(f"{engine.name}: {describe_error(exc)}")
                continue
            except httpx.TimeoutException as exc:
                self._pool.end(engine)
                seconds = self._decode_timeout_seconds
                raise DecodeTimeout(
                    f"the decode engine {engine.name} did not answer in {seconds:g} s"
                ) from exc
            except BaseException:
                self._pool.end(engine)
                raise
            self._metrics.decode_first_byte_seconds.observe(time.monotonic() - started)
            return engine, response, started

    async def _read_decode(self, engine: Engine, response: httpx.Response, started: float) -> bytes:
        """D's whole answer; DecodeTimeout or DecodeFailed when it stops before its end."""
        try:
            return await response.aread()
        except httpx.TimeoutException as exc:
            seconds = self._decode_timeout_seconds
            raise DecodeTimeout(
                f"the decode engine {engine.name} sent nothing for {seconds:g} s"
            ) from exc
        except httpx.HTTPError as exc:
            raise DecodeFailed(
                f"the decode engine {engine.name}'s answer broke off: {describe_error(exc)}"
            ) from exc
        finally:
            await response.aclose()
            self._pool.end(engine)
            self._metrics.decode_seconds.observe(time.monotonic() - started)

    def _no_decode(self, tried: list[Engine], failures: list[str]) -> str:
        detail = "no decode engine could take the request"
        if failures:
            detail += "; tried " + "; ".join(failures)
        tried_names = {engine.name for engine in tried}
        down = [
            f"{name}: {state}"
            for name, state in self._pool.states("decode").items()
            if state != "healthy" and name not in tried_names
        ]
        if down:
            detail += "; not tried (" + "; ".join(down) + ")"
        return detail
