"""D's streamed answer, passed to the client byte for byte as it arrives.

When D's stream breaks off (its connection closed, or nothing for the decode timeout) the
proxy ends the client's stream too, never leaving it waiting: for an event stream it first
sends an OpenAI error event (`data: {"error": {...}}`, as vLLM itself does on a failure mid
stream, so OpenAI clients raise) and no `data: [DONE]`. Whatever ends the stream (its end, a
break, the client going away) closes D's answer, counts the request done on D and records
the request's outcome and time.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass

import anyio
import httpx
import orjson
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from cache_service.tools.pd_proxy.bodies import Endpoint
from cache_service.tools.pd_proxy.engines import Engine, EnginePool
from cache_service.tools.pd_proxy.metrics import ProxyMetrics
from cache_service.tools.pd_proxy.reporting import ThrottledLog, describe_error
from cache_service.tools.pd_proxy.usage import StreamUsage

EVENT_STREAM = "text/event-stream"


@dataclass(frozen=True, slots=True)
class StreamContext:
    """What a relay needs to know of its request: where it went and what it asked."""

    endpoint: Endpoint
    engine: Engine
    started: float  # time.monotonic() when D was sent the request
    count_usage: bool  # the request asked for a final usage chunk


class Relay:
    """One streamed answer of D's: its chunks, then (once, however it ends) its bookkeeping."""

    def __init__(
        self,
        response: httpx.Response,
        context: StreamContext,
        *,
        pool: EnginePool,
        metrics: ProxyMetrics,
        log: ThrottledLog,
    ) -> None:
        self._response = response
        self._context = context
        self._pool = pool
        self._metrics = metrics
        self._log = log
        success = response.is_success
        self._usage = StreamUsage() if context.count_usage and success else None
        self._outcome = "client_gone"  # unless the stream ends or breaks off first
        self._closed = False

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """D's bytes as they arrive; an error event if they break off."""
        response, engine = self._response, self._context.engine
        event_stream = response.headers.get("content-type", "").startswith(EVENT_STREAM)
        tail = b"\n\n"
        try:
            async for chunk in response.aiter_raw():
                if self._usage is not None:
                    self._usage.feed(chunk)
                if chunk:
                    tail = (tail + chunk)[-2:]
                yield chunk
            self._outcome = "ok" if response.is_success else "engine_status"
        except httpx.HTTPError as exc:
            timed_out = isinstance(exc, httpx.TimeoutException)
            self._outcome = "decode_timeout" if timed_out else "decode_cut"
            what = "sent nothing in time" if timed_out else "broke off"
            message = f"the decode engine {engine.name}'s stream {what}: {describe_error(exc)}"
            self._log.warning(f"cut:{engine.name}", "%s (%s)", message, engine.url)
            if event_stream:
                yield _error_event(message, tail)
        finally:
            await self.close()

    async def close(self) -> None:
        """Close D's answer, count the request done on D, record its time and outcome; once."""
        if self._closed:
            return
        self._closed = True
        context = self._context
        with anyio.CancelScope(shield=True):
            await self._response.aclose()
        self._pool.end(context.engine)
        self._metrics.decode_seconds.observe(time.monotonic() - context.started)
        self._metrics.requests.labels(context.endpoint.name, self._outcome).inc()
        if self._usage is not None and self._outcome == "ok":
            self._metrics.count_usage(self._usage.finish())


class RelayResponse(StreamingResponse):
    """A StreamingResponse of a Relay that closes it whatever happens (the client gone before
    the first byte included) and takes a client's leaving as an end, not an error."""

    def __init__(self, relay: Relay, *, status_code: int, media_type: str,
                 headers: Mapping[str, str]) -> None:  # fmt: skip
        self._relay = relay
        self._chunks = relay.chunks()
        super().__init__(
            self._chunks, status_code=status_code, media_type=media_type, headers=headers
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream the answer; a client that went away is no error of the proxy's."""
        try:
            await super().__call__(scope, receive, send)
        except (ClientDisconnect, OSError):
            pass
        finally:
            with anyio.CancelScope(shield=True):
                await self._chunks.aclose()
                await self._relay.close()


def relay(
    response: httpx.Response,
    context: StreamContext,
    *,
    pool: EnginePool,
    metrics: ProxyMetrics,
    log: ThrottledLog,
    headers: Mapping[str, str],
) -> RelayResponse:
    """The client's response: D's status, content type and bytes."""
    media_type = response.headers.get("content-type", EVENT_STREAM)
    stream = Relay(response, context, pool=pool, metrics=metrics, log=log)
    return RelayResponse(
        stream, status_code=response.status_code, media_type=media_type, headers=headers
    )


def _error_event(message: str, tail: bytes) -> bytes:
    # An event cut mid-line is ended first, so the error arrives as an event of its own.
    error = {"error": {"message": message, "type": "decode_failed", "param": None, "code": 502}}
    return (b"" if tail == b"\n\n" else b"\n\n") + b"data: " + orjson.dumps(error) + b"\n\n"
