"""uvicorn's httptools protocol with a limit on the request line and headers (431), and its
own refusals (a request it cannot parse) as problem+json naming the cause, like the app's.

uvicorn sets no such limit for httptools, and the ASGI application only sees a request once
its headers are complete, so the limit lives here. The request line and headers are counted
as the parser reports them; a head that never ends is cut off by the bytes received before
it ended (the limit plus one read's worth, since a read may also hold the start of a body).
"""

from __future__ import annotations

import os
import sys
from http import HTTPStatus
from typing import Any

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from cache_service.core.errors import HeadersTooLarge, RequestError

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
        """The head is over: what follows is body."""
        self._in_head = False
        super().on_headers_complete()

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
