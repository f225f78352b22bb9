"""The client's transports against a tiny HTTP server: keep-alive, chunked answers, no body,
frame answers read frame by frame, bodies sent in chunks; and failures to connect, which must
read as such (the client counts them as `connect`)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
from collections.abc import Callable
from functools import partial

import httpx
import pytest

from cache_service.client import CacheClient
from cache_service.client.aio_transport import AsyncStreamTransport
from cache_service.client.transport import StdlibTransport, body_length
from cache_service.core.errors import ServiceError
from cache_service.core.framing import MEDIA_TYPE, encode_frames, join_frames

CHUNKED = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: 1\r\nX-Other: 2\r\n\r\n"
)
NO_CONTENT = b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n"


async def _serve(answers: list[bytes]) -> tuple[asyncio.Server, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for answer in answers:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                (int(line.split(b":")[1]) for line in head.split(b"\r\n")
                 if line.lower().startswith(b"content-length")), 0)  # fmt: skip
            await reader.readexactly(length)
            writer.write(answer)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def _exchange_twice(answers: list[bytes], body: bytes) -> list[httpx.Response]:
    """Two requests over one keep-alive connection to a server that sends `answers`."""

    async def run() -> list[httpx.Response]:
        server, port = await _serve(answers)
        transport = AsyncStreamTransport(timeout_seconds=5)
        async with httpx.AsyncClient(transport=transport, base_url=f"http://127.0.0.1:{port}") as c:
            responses = [await c.post("/x", content=body) for _ in range(2)]
        server.close()
        await server.wait_closed()
        return responses

    return asyncio.run(run())


def test_chunked_answers_with_trailers_keep_the_connection_usable() -> None:
    responses = _exchange_twice([CHUNKED, CHUNKED], b"abc")
    assert [r.content for r in responses] == [b"hello world", b"hello world"]


def test_an_answer_without_a_body_does_not_wait_for_one() -> None:
    responses = _exchange_twice([NO_CONTENT, CHUNKED], b"")
    assert [r.status_code for r in responses] == [204, 200]


def _closed_port() -> int:
    """A port that was free a moment ago: nobody listens on it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stdlib_get(port: int) -> None:
    with httpx.Client(transport=StdlibTransport(timeout_seconds=5)) as client:
        client.get(f"http://127.0.0.1:{port}/healthz")


def _stream_get(port: int) -> None:
    async def run() -> None:
        async with httpx.AsyncClient(transport=AsyncStreamTransport(timeout_seconds=5)) as c:
            await c.get(f"http://127.0.0.1:{port}/healthz")

    asyncio.run(run())


KEY_A, KEY_B = "aa" * 16, "bb" * 16

GETS = {"stdlib": _stdlib_get, "stream": _stream_get}


@pytest.mark.parametrize("get", GETS.values(), ids=GETS.keys())
def test_a_closed_port_is_a_connect_error(get: Callable[[int], None]) -> None:
    with pytest.raises(httpx.ConnectError):
        get(_closed_port())


@pytest.mark.parametrize("get", GETS.values(), ids=GETS.keys())
@pytest.mark.parametrize(
    ("failure", "expected"),
    [
        (socket.gaierror(-2, "Name or service not known"), httpx.ConnectError),
        (OSError(113, "No route to host"), httpx.ConnectError),
        (TimeoutError("timed out"), httpx.ConnectTimeout),
    ],
    ids=["unknown-host", "no-route", "timeout"],
)
def test_a_failure_to_connect_is_a_connect_error_or_timeout(
    monkeypatch: pytest.MonkeyPatch,
    get: Callable[[int], None],
    failure: OSError,
    expected: type[httpx.TransportError],
) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise failure

    monkeypatch.setattr(socket, "create_connection", fail)  # http.client connects through it
    monkeypatch.setattr(asyncio, "open_connection", fail)
    with pytest.raises(expected) as caught:
        get(_closed_port())
    assert type(caught.value) is expected


def _frames_answer(body: bytes) -> bytes:
    head = f"HTTP/1.1 200 OK\r\nContent-Type: {MEDIA_TYPE}\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def _fetch_in_turn(answers: list[bytes]) -> list[object]:
    """One get_blocks per answer over one connection to a server that sends `answers`: what
    each returned, or its error's (status, detail)."""

    async def serve_and_fetch() -> list[object]:
        server, port = await _serve(answers)

        def fetch_each() -> list[object]:
            outcomes: list[object] = []
            with CacheClient(f"http://127.0.0.1:{port}", timeout=5) as client:
                for _ in answers:
                    try:
                        outcomes.append(client.get_blocks("m", [KEY_A, KEY_B]))
                    except ServiceError as exc:
                        outcomes.append((exc.status, exc.detail))
            return outcomes

        outcomes = await asyncio.to_thread(fetch_each)
        server.close()
        await server.wait_closed()
        return outcomes

    return asyncio.run(serve_and_fetch())


GOOD_FRAMES = join_frames(encode_frames({"model": "m", "requested": 2, "found": 1}, [b"kv", None]))


def test_a_frame_answer_is_read_frame_by_frame_and_a_malformed_one_is_invalid() -> None:
    # One connection: a malformed body must not spoil it.
    malformed, read = _fetch_in_turn(
        [_frames_answer(GOOD_FRAMES + b"junk"), _frames_answer(GOOD_FRAMES)]
    )
    assert malformed == (502, "unexpected bytes after the last frame")
    assert read == [b"kv", None]
    assert type(read[0]) is bytes  # its own bytes, not a view into a body-sized buffer


@pytest.mark.parametrize("kept", [0, 6, 30])
def test_a_frame_answer_cut_short_is_a_transport_error_not_a_malformed_body(kept: int) -> None:
    # A server killed mid-answer: the head promised more than arrived. That is the connection
    # failing (503, a miss the client backs off from), not a server that sent junk (502).
    cut = _frames_answer(GOOD_FRAMES)[: -len(GOOD_FRAMES) + kept]
    [outcome] = _fetch_in_turn([cut])
    assert isinstance(outcome, tuple) and outcome[0] == 503, outcome
    assert "IncompleteRead" in outcome[1]


def test_a_body_in_chunks_arrives_whole_and_in_order() -> None:
    # More chunks than one sendmsg takes, and more bytes than a socket buffer holds, so that
    # partial sends happen.
    chunks: list[bytes | memoryview] = [os.urandom(size) for size in range(1, 3000)]
    chunks[5] = memoryview(bytearray(b"a view" * 100_000))
    whole = b"".join(chunks)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))  # fmt: skip
        digest = hashlib.sha256(await reader.readexactly(length)).hexdigest().encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 64\r\n\r\n" + digest)
        await writer.drain()
        writer.close()

    async def run() -> httpx.Response:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        transport = StdlibTransport(timeout_seconds=10)
        headers = [("Host", "x"), ("Content-Length", str(body_length(chunks)))]
        exchange = partial(transport.exchange, ("127.0.0.1", port), "POST", "/", headers, chunks)
        response = await asyncio.to_thread(exchange)
        transport.close()
        server.close()
        await server.wait_closed()
        return response

    assert body_length(chunks) == len(whole)
    assert asyncio.run(run()).content == hashlib.sha256(whole).hexdigest().encode()
