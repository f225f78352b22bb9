"""uvicorn's httptools protocol with a limit on the request line and headers (431), and its
own refusals (a request it cannot parse) as problem+json naming the cause, like the app's.

uvicorn sets no such limit for httptools, and the ASGI application only sees a request once
its headers are complete, so the limit lives here. The request line and headers are counted
as the parser reports them; a head that never ends is cut off by the bytes received before
it ended (the limit plus one read's worth, since a read may also hold the start of a body).

It also offers a large body to be read straight into one buffer (direct_body.py): the
connection is handed to a buffered protocol for the body's bytes, then back.
"""

from __future__ import annotations

import asyncio
import os
import sys
from http import HTTPStatus
from typing import Any

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from cache_service.core.errors import HeadersTooLarge, RequestError
from cache_service.service.api.direct_body import DIRECT_MIN_BYTES, SCOPE_KEY, DirectBody

ENV_NAME = "CACHE_SERVICE_MAX_HEADER_BYTES"  # set by `serve` for every worker process
DEFAULT_MAX_HEADER_BYTES = 16384
READ_ALLOWANCE_BYTES = 256 * 1024  # the most one read may bring beyond the head


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol that answers 431 (problem+json) to an oversized head and closes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_header_bytes = int(os.environ.get(ENV_NAME, DEFAULT_MAX_HEADER_BYTES))
        self._head_bytes = 0
        self._in_head = True  # until the current message's headers are complete
        self._unread_head = 0  # bytes received while in the head
        self._refused = False
        self._direct: DirectBody | None = None  # the current request's large body

    def data_received(self, data: bytes) -> None:
        """Feed the parser, unless the head has gone on far too long."""
        if self._in_head:
            self._unread_head += len(data)
            if self._unread_head > self.max_header_bytes + READ_ALLOWANCE_BYTES:
                self._refused = True
                self.send_400_response("")
                return
        super().data_received(data)

    def on_message_begin(self) -> None:
        """A new request: its head is counted afresh."""
        super().on_message_begin()
        self._head_bytes = 0
        self._in_head = True
        self._unread_head = 0

    def on_url(self, url: bytes) -> None:
        """Count the request target."""
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        """Count one header line."""
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        """The head is over: what follows is body, offered to the application to read
        straight into one buffer when it is large."""
        self._in_head = False
        super().on_headers_complete()
        length = self._declared_length()
        # Not for a pipelined request (its cycle waits in line) nor an upgrade.
        if length >= DIRECT_MIN_BYTES and not self.pipeline and not self.parser.should_upgrade():
            self._direct = DirectBody(length, self._read_direct)
            self.scope[SCOPE_KEY] = self._direct  # type: ignore[literal-required]

    def on_message_complete(self) -> None:
        """The parser saw the whole body: nothing is left to read straight."""
        self._direct = None
        super().on_message_complete()

    def _declared_length(self) -> int:
        """The Content-Length of a request that is not chunked, else 0."""
        length = 0
        for name, value in self.headers:
            if name == b"transfer-encoding":
                return 0
            if name == b"content-length" and value.isdigit():
                length = int(value)
        return length

    def _read_direct(self) -> None:
        """The application took the body over: read the rest of it straight into its buffer."""
        assert self._direct is not None
        self.transport.set_protocol(_BodyReader(self, self._direct))
        self.flow.resume_reading()

    def end_direct(self) -> None:
        """The whole body is in: the parser, left inside the body, is replaced by a fresh one
        for the next request on the connection."""
        self._direct = None
        self.parser = httptools.HttpRequestParser(self)
        super().on_message_complete()

    def _count(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > self.max_header_bytes:
            self._refused = True
            # Raised inside a parser callback: the parser stops, and uvicorn calls
            # send_400_response, which answers 431 for a refused head.
            raise HeadersTooLarge("over the limit")

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request it cannot parse, as problem+json naming the cause
        (431 when the head was too long), and the connection closed."""
        if self._refused:
            error: RequestError = HeadersTooLarge(
                f"the request line and headers are over the limit of {self.max_header_bytes} "
                "bytes (max_header_bytes)",
                limit="max_header_bytes",
                limit_bytes=self.max_header_bytes,
            )
        else:
            cause = parse_error_cause(sys.exc_info()[1], msg)
            error = RequestError(
                f"the request is not valid HTTP/1.1: {cause}; the connection is closed",
                cause=cause,
            )
        self.transport.write(problem_message(error, self.server_state.default_headers))
        self.transport.close()


class _BodyReader(asyncio.BufferedProtocol):
    """Reads a DirectBody's remaining bytes into its buffer (the kernel's copy the only one),
    then hands the connection back to the HTTP protocol; it never reads past the body."""

    def __init__(self, http: LimitedHttpToolsProtocol, direct: DirectBody) -> None:
        self.http = http
        self.direct = direct

    def get_buffer(self, sizehint: int) -> memoryview:
        """The unfilled rest of the body."""
        return self.direct.space()

    def buffer_updated(self, nbytes: int) -> None:
        """Count what came; at the end, give the connection back."""
        direct = self.direct
        direct.grew(nbytes)
        if direct.complete:
            self.http.transport.set_protocol(self.http)
            self.http.end_direct()
        elif direct.progressed():
            self.http.cycle.message_event.set()  # the reader extends its body timeout

    def eof_received(self) -> None:
        """The client ended its side mid-body: as the HTTP protocol would (the transport
        closes)."""
        self.http.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        """The client went away mid-body: the application sees a disconnect."""
        self.http.connection_lost(exc)

    def pause_writing(self) -> None:
        """Passed on: the answer is written by the HTTP protocol."""
        self.http.pause_writing()

    def resume_writing(self) -> None:
        """Passed on: the answer is written by the HTTP protocol."""
        self.http.resume_writing()


def parse_error_cause(exc: BaseException | None, fallback: str) -> str:
    """What the HTTP parser objected to ('Invalid character in chunk size'), or `fallback`."""
    # uvicorn calls send_400_response inside its `except HttpParserError`, so the parser's
    # own message, which names the cause, is the exception being handled.
    if isinstance(exc, httptools.HttpParserError) and str(exc):
        return str(exc)
    return fallback.rstrip(".") or "invalid HTTP request"


def problem_message(error: RequestError, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A whole HTTP/1.1 response carrying `error` as problem+json, for a connection closing."""
    body = orjson.dumps(error.to_problem())
    status = HTTPStatus(error.status)
    head = [f"HTTP/1.1 {status.value} {status.phrase}\r\n".encode()]
    head += [name + b": " + value + b"\r\n" for name, value in default_headers]  # server, date
    head += [
        b"content-type: application/problem+json\r\n",
        b"content-length: " + str(len(body)).encode() + b"\r\n",
        b"connection: close\r\n\r\n",
    ]
    return b"".join(head) + body
