"""The client's transports against a tiny HTTP server: keep-alive, chunked answers, no body."""

from __future__ import annotations

import asyncio

import httpx

from cache_service.client.aio_transport import AsyncStreamTransport

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
