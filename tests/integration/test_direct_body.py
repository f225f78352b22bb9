"""Against a real server: large bodies read straight into one buffer (direct_body.py) arrive
whole in any pieces, leave the connection ready for the next request, and still time out,
disconnect and refuse as every other body does."""

from __future__ import annotations

import json
import os
import random
import socket
import time
from collections.abc import Callable

import httpx
import pytest

from cache_service.client import CacheClient
from cache_service.core.framing import MEDIA_TYPE, encode_frames, join_frames
from cache_service.core.tokens import tokens_to_bytes
from cache_service.service.api.direct_body import DIRECT_MIN_BYTES, PROGRESS_BYTES, DirectBody
from tests.integration.conftest import ServerProcess
from tests.integration.test_limits import read_answer, store_head
from tests.reliability.processes import logged_errors

pytestmark = pytest.mark.integration

MakeServer = Callable[..., ServerProcess]
PAYLOAD_BYTES = 3 * DIRECT_MIN_BYTES  # well past the threshold, over several reads


def store_body(label: int, payloads: list[bytes]) -> tuple[bytes, bytes]:
    """A prompt of len(payloads) blocks of 64 tokens, and the frame body storing them."""
    tokens = tokens_to_bytes(range(label * 10_000, label * 10_000 + 64 * len(payloads)))
    return tokens, join_frames(encode_frames({"model": "m"}, [tokens, *payloads]))


def lookup_request(tokens: bytes) -> bytes:
    """A whole HTTP request for a lookup of `tokens` (to follow a store on one connection)."""
    body = join_frames(encode_frames({"model": "m"}, [tokens]))
    head = (
        f"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Type: {MEDIA_TYPE}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


def read_answers(conn: socket.socket, count: int) -> list[tuple[int, dict[str, object]]]:
    """`count` answers with Content-Length bodies off one connection: status and JSON body."""
    answers: list[tuple[int, dict[str, object]]] = []
    buffered = b""
    while len(answers) < count:
        while b"\r\n\r\n" not in buffered:
            buffered += conn.recv(65536)
        head, _, buffered = buffered.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        length = next(int(line.split(":")[1]) for line in lines
                      if line.lower().startswith("content-length"))  # fmt: skip
        while len(buffered) < length:
            buffered += conn.recv(65536)
        answers.append((int(lines[0].split()[1]), json.loads(buffered[:length])))
        buffered = buffered[length:]
    return answers


@pytest.mark.parametrize("piece_bytes", [1, 4096, 65_536, 1_000_003])
def test_a_large_body_in_any_pieces_is_stored_whole_and_the_next_request_is_read(
    server: ServerProcess, piece_bytes: int
) -> None:
    payloads = [os.urandom(PAYLOAD_BYTES), os.urandom(100)]
    tokens, body = store_body(1, payloads)
    request = store_head(len(body)) + body + lookup_request(tokens)  # the lookup pipelined
    rng = random.Random(piece_bytes)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
        sent = 0
        while sent < len(request):
            # Uneven pieces, the first mostly within the head; a pause now and then lets the
            # service read a piece at a time.
            size = piece_bytes if piece_bytes > 1 else rng.choice([1, 7, 20_000, 300_000])
            conn.sendall(request[sent : sent + size])
            sent += size
            if rng.random() < 0.02:
                time.sleep(0.005)
        (stored_status, stored), (found_status, found) = read_answers(conn, 2)
    assert (stored_status, stored["stored_blocks"]) == (200, 2), stored
    assert (found_status, found["matched_blocks"]) == (200, 2), found
    with CacheClient(server.url) as client:
        assert client.get_blocks("m", client.lookup("m", tokens).keys) == payloads
    assert not logged_errors(server.log_path)


def test_a_large_body_that_stops_coming_times_out_with_408(make_server: MakeServer) -> None:
    server = make_server(body_timeout="1")
    _, body = store_body(2, [os.urandom(PAYLOAD_BYTES)])
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
        conn.sendall(store_head(len(body)) + body[: 2 * PROGRESS_BYTES])  # then nothing
        answer = read_answer(conn)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"connection: close" in answer.lower()
    assert f"({2 * PROGRESS_BYTES} bytes came; body_timeout)".encode() in answer
    assert httpx.get(server.url + "/readyz").status_code == 200


def test_a_client_gone_mid_body_stores_nothing_and_logs_no_error(server: ServerProcess) -> None:
    tokens, body = store_body(3, [os.urandom(PAYLOAD_BYTES)])
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
        conn.sendall(store_head(len(body)) + body[: len(body) // 2])
        time.sleep(0.2)  # the service has begun reading it straight
    time.sleep(0.2)
    with CacheClient(server.url) as client:
        assert client.lookup("m", tokens).matched_blocks == 0
        stored = client.put_prefix("m", tokens, [os.urandom(PAYLOAD_BYTES)])  # still serving
    assert stored.stored_blocks == 1
    assert not logged_errors(server.log_path)


def test_a_large_body_over_the_limit_is_refused_before_any_buffer(
    make_server: MakeServer,
) -> None:
    server = make_server(max_body_size="2MiB")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
        conn.sendall(store_head(3 * DIRECT_MIN_BYTES))  # declared, never sent
        answer = read_answer(conn)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b'"limit":"max_body_size"' in answer


def test_a_direct_body_takes_what_it_lacks_and_wakes_its_reader_per_step() -> None:
    begun: list[bool] = []
    direct = DirectBody(PROGRESS_BYTES * 2 + 10, lambda: begun.append(True))
    assert not direct.active
    direct.begin(b"a" * 10)
    assert begun == [True] and direct.active and direct.filled == 10
    assert direct.take(b"b" * (PROGRESS_BYTES - 1)) == PROGRESS_BYTES - 1
    assert not direct.progressed()
    direct.take(b"b")
    assert direct.progressed() and not direct.progressed()
    assert direct.take(b"c" * (PROGRESS_BYTES * 2)) == PROGRESS_BYTES  # the rest is not its
    assert direct.complete
    assert direct.body() == b"a" * 10 + b"b" * PROGRESS_BYTES + b"c" * PROGRESS_BYTES
