"""A blocking httpx transport over the standard library's http.client.

httpx's default transport parses a response in 64 KiB steps in Python; a 28 MiB payload
fetch then spends about as long in the client as in the service. http.client reads a body
of known length in one call, so this transport moves MiB-sized payloads at close to the
loopback's speed. It keeps idle keep-alive connections per host, and maps failures to
httpx's exceptions, so everything above it (errors, fail-open) is unchanged.
"""

from __future__ import annotations

import http.client
import threading
from collections import defaultdict
from collections.abc import Callable
from functools import partial

import httpx

from cache_service.core.errors import MalformedBody
from cache_service.core.framing import is_frames_type, read_frames

_Origin = tuple[str, int]
Body = bytes | list[bytes | memoryview]  # a request body, or its chunks to send in turn
_IOV_MAX = 1024  # buffers one sendmsg takes on Linux
_RETRYABLE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


class StdlibTransport(httpx.BaseTransport):
    """HTTP/1.1 with keep-alive over http.client; plain http only (use httpx's for https)."""

    def __init__(self, *, timeout_seconds: float | None, max_idle_per_host: int = 8) -> None:
        self._timeout = timeout_seconds
        self._max_idle = max_idle_per_host
        self._idle: dict[_Origin, list[http.client.HTTPConnection]] = defaultdict(list)
        self._lock = threading.Lock()

    def _acquire(self, origin: _Origin) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            idle = self._idle[origin]
            if idle:
                return idle.pop(), True
        return http.client.HTTPConnection(*origin, timeout=self._timeout), False

    def _release(self, origin: _Origin, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            idle = self._idle[origin]
            if len(idle) < self._max_idle:
                idle.append(conn)
                return
        conn.close()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        """Send one request and read its whole answer."""
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"StdlibTransport speaks http only, not {url.scheme}")
        headers = [
            (name.decode("latin-1"), value.decode("latin-1")) for name, value in request.headers.raw
        ]
        return self.exchange(
            (url.host, url.port or 80),
            request.method,
            url.raw_path.decode("ascii"),
            headers,
            request.read(),
            request=request,
        )

    def exchange(
        self,
        origin: tuple[str, int],
        method: str,
        target: str,
        headers: list[tuple[str, str]],
        body: Body,
        *,
        request: httpx.Request | None = None,
        frames_apart: bool = False,
        while_waiting: Callable[[], object] | None = None,
    ) -> httpx.Response:
        """One request as plain parts (the client's fast path skips building httpx objects);
        `headers` must include Host. A body in chunks goes out with scatter-gather writes; with
        `frames_apart` a frame answer is read frame by frame (extensions["frames"]);
        `while_waiting` runs once, after the request is sent and before the answer is read."""
        failed = request or httpx.Request(method, f"http://{origin[0]}:{origin[1]}{target}")
        for attempt in range(2):
            conn, reused = self._acquire(origin)
            if not reused:
                self._connect(conn, failed)
            try:
                conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
                for name, value in headers:
                    conn.putheader(name, value)
                if isinstance(body, list):
                    conn.endheaders()
                    _send_chunks(conn, body)
                else:
                    conn.endheaders(body or None)
                if while_waiting is not None:  # the service works meanwhile, on its own core
                    work, while_waiting = while_waiting, None
                    try:
                        work()
                    except BaseException:  # the answer is never read: the connection is spent
                        conn.close()
                        raise
                answer = conn.getresponse()
                content, extensions = _read_answer(answer, frames_apart)
            except _RETRYABLE as exc:
                conn.close()
                if reused and attempt == 0:
                    continue  # the server closed an idle connection: try a fresh one
                raise httpx.ReadError(str(exc) or type(exc).__name__, request=failed) from exc
            except TimeoutError as exc:
                conn.close()
                raise httpx.ReadTimeout(str(exc) or "timed out", request=failed) from exc
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                error = httpx.ConnectError if isinstance(exc, ConnectionError) else httpx.ReadError
                raise error(str(exc) or type(exc).__name__, request=failed) from exc
            if answer.will_close:
                conn.close()
            else:
                self._release(origin, conn)
            return httpx.Response(
                status_code=answer.status,
                headers=answer.getheaders(),
                content=content,
                extensions=extensions,
            )
        raise AssertionError("unreachable")

    @staticmethod
    def _connect(conn: http.client.HTTPConnection, failed: httpx.Request) -> None:
        # Connected here rather than lazily in endheaders, so that a wrong host or port (refused,
        # unknown name, no route) is a ConnectError or ConnectTimeout, not a ReadError.
        try:
            conn.connect()
        except TimeoutError as exc:
            conn.close()
            raise httpx.ConnectTimeout(str(exc) or "timed out", request=failed) from exc
        except OSError as exc:
            conn.close()
            raise httpx.ConnectError(str(exc) or type(exc).__name__, request=failed) from exc

    def close(self) -> None:
        """Close every idle connection."""
        with self._lock:
            for idle in self._idle.values():
                for conn in idle:
                    conn.close()
            self._idle.clear()


def _read_answer(
    answer: http.client.HTTPResponse, frames_apart: bool
) -> tuple[bytes, dict[str, object]]:
    """The body; with `frames_apart`, a frame answer's frames under extensions["frames"], each
    payload in bytes of its own (no body-sized buffer, no second copy)."""
    if (
        not frames_apart
        or answer.status != 200
        or not is_frames_type(answer.getheader("content-type"))
    ):
        return answer.read(), {}
    frames: object
    try:
        frames = read_frames(partial(_read_declared, answer))
    except MalformedBody as exc:
        frames = exc
        answer.read()  # the rest, so that the connection can carry the next request
    return b"", {"frames": frames}


def _read_declared(answer: http.client.HTTPResponse, wanted: int) -> bytes:
    """Up to `wanted` bytes of the body; IncompleteRead when the connection ends before the
    declared length (http.client's read(n) returns short there, and a cut answer must be a
    transport error, not a malformed body)."""
    declared = answer.length  # None when chunked (which raises IncompleteRead itself)
    data = answer.read(wanted)
    if declared is not None and len(data) < min(wanted, declared):
        raise http.client.IncompleteRead(data, min(wanted, declared) - len(data))
    return data


def body_length(body: Body) -> int:
    """The bytes a body sends."""
    if isinstance(body, bytes):
        return len(body)
    return sum(chunk.nbytes if isinstance(chunk, memoryview) else len(chunk) for chunk in body)


def _send_chunks(conn: http.client.HTTPConnection, chunks: list[bytes | memoryview]) -> None:
    """Send chunks in order with sendmsg, up to _IOV_MAX at a time, without joining them."""
    sock = conn.sock
    views = [memoryview(chunk).cast("B") for chunk in chunks if len(chunk)]
    first = 0  # views before it are sent
    while first < len(views):
        sent = sock.sendmsg(views[first : first + _IOV_MAX])
        while sent and sent >= len(views[first]):
            sent -= len(views[first])
            first += 1
        if sent:
            views[first] = views[first][sent:]
