"""Against a real server: header and body limits, slow clients, the write queue, quotas."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from cache_service.client import CacheClient
from cache_service.core.framing import MEDIA_TYPE, encode_frames, join_frames
from cache_service.core.tokens import tokens_to_bytes
from cache_service.service.api_keys import Role, key_file_entry, new_key
from tests.integration.conftest import ServerProcess

pytestmark = pytest.mark.integration

MakeServer = Callable[..., ServerProcess]
PROBLEM = "application/problem+json"
LOOKUP = {"model": "m", "tokens": list(range(64))}


def raw_request(server: ServerProcess, head: bytes) -> socket.socket:
    """A connection that has sent `head` (request line and headers) and nothing more."""
    conn = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    conn.sendall(head)
    return conn


def read_answer(conn: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    chunks = []
    try:
        while chunk := conn.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass  # closed with our unread bytes pending: what came before the reset counts
    return b"".join(chunks)


def store_head(length: int) -> bytes:
    return (
        f"POST /v1/blocks HTTP/1.1\r\nHost: x\r\nContent-Type: {MEDIA_TYPE}\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def test_oversized_headers_get_431_naming_the_limit(make_server: MakeServer) -> None:
    server = make_server(max_header_bytes="4096")
    answer = httpx.post(server.url + "/v1/lookup", json=LOOKUP, headers={"X-Big": "a" * 5000})
    assert answer.status_code == 431
    assert answer.headers["content-type"] == PROBLEM
    assert answer.json()["limit"] == "max_header_bytes"
    # A head that never ends is cut off too (the server answers 431 and closes; the client,
    # still sending, may see the close as a reset instead), and the server goes on serving.
    conn = raw_request(server, b"GET /healthz HTTP/1.1\r\nX-Endless: ")
    try:
        for _ in range(64):  # 1 MiB of one header
            conn.sendall(b"a" * 16384)
        answer = read_answer(conn)
    except TimeoutError:
        answer = b"no answer: the head was not cut off"
    except OSError:
        answer = b"reset"
    conn.close()
    assert answer.startswith(b"HTTP/1.1 431") or answer in (b"reset", b"")
    assert httpx.post(server.url + "/v1/lookup", json=LOOKUP).status_code == 200


def test_a_body_trickling_in_times_out_with_408_and_frees_the_worker(
    make_server: MakeServer,
) -> None:
    server = make_server(body_timeout="1")
    conn = raw_request(server, store_head(10_000))
    started = time.monotonic()
    answer = b""
    for _ in range(200):  # one byte every 50 ms: 10,000 bytes would take 8 minutes
        try:
            conn.sendall(b"P")
        except OSError:
            break
        # Meanwhile the service answers others at once.
        assert httpx.post(server.url + "/v1/lookup", json=LOOKUP).status_code == 200
        if select.select([conn], [], [], 0.05)[0]:
            answer = read_answer(conn)
            break
    conn.close()
    assert answer.startswith(b"HTTP/1.1 408")
    assert b"connection: close" in answer.lower()
    assert b'"limit":"body_timeout"' in answer
    assert time.monotonic() - started < 10


def test_writes_backed_up_get_503_with_retry_after_while_reads_are_served(
    make_server: MakeServer,
) -> None:
    server = make_server(max_pending_writes="1", lmdb_sync="full")
    big = b"x" * (8 * 2**20)
    answers: list[httpx.Response] = []

    def store(label: int) -> None:
        tokens = tokens_to_bytes([label] * 64)
        body = join_frames(encode_frames({"model": "m"}, [tokens, big]))
        answers.append(httpx.post(server.url + "/v1/blocks", content=body, timeout=60,
                                  headers={"Content-Type": MEDIA_TYPE}))  # fmt: skip

    for attempt in range(5):  # concurrent 8 MiB stores into a queue of one
        threads = [threading.Thread(target=store, args=(attempt * 100 + i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        lookups = [httpx.post(server.url + "/v1/lookup", json=LOOKUP).status_code
                   for _ in range(5)]  # fmt: skip
        for thread in threads:
            thread.join()
        assert lookups == [200] * 5  # reads are served throughout
        if any(a.status_code == 503 for a in answers):
            break
    refused = next(a for a in answers if a.status_code == 503)
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["limit"] == "max_pending_writes"
    assert {a.status_code for a in answers} <= {200, 503}
    assert any(a.status_code == 200 for a in answers)


def quota_server(make_server: MakeServer, tmp_path: Path, quota: str, **flags: str) -> tuple[
    ServerProcess, str
]:  # fmt: skip
    secret = new_key()
    path = tmp_path / "quota-keys.toml"
    path.write_text(key_file_entry("limited", "t", Role.WRITER, secret) + quota + "\n")
    return make_server(auth="keys", api_keys_file=str(path), **flags), secret


def test_a_request_rate_quota_answers_429_with_retry_after(
    make_server: MakeServer, tmp_path: Path
) -> None:
    server, secret = quota_server(make_server, tmp_path, "requests_per_second = 2")
    headers = {"Authorization": "Bearer " + secret}
    answers = [httpx.post(server.url + "/v1/lookup", json=LOOKUP, headers=headers)
               for _ in range(4)]  # fmt: skip
    statuses = [a.status_code for a in answers]
    assert statuses[:2] == [200, 200]
    assert 429 in statuses[2:]
    refused = next(a for a in answers if a.status_code == 429)
    assert refused.headers["content-type"] == PROBLEM
    assert refused.json()["limit"] == "requests_per_second"
    assert int(refused.headers["retry-after"]) >= 1
    time.sleep(1.1)
    assert httpx.post(server.url + "/v1/lookup", json=LOOKUP, headers=headers).status_code == 200


def test_a_byte_rate_quota_charges_bodies_in_and_out(
    make_server: MakeServer, tmp_path: Path
) -> None:
    server, secret = quota_server(make_server, tmp_path, "bytes_per_second = 2000")
    headers = {"Authorization": "Bearer " + secret, "Content-Type": MEDIA_TYPE}
    body = join_frames(encode_frames({"model": "m"}, [tokens_to_bytes(range(64)), b"x" * 8000]))
    assert httpx.post(server.url + "/v1/blocks", content=body, headers=headers).status_code == 200
    refused = httpx.post(server.url + "/v1/lookup", json=LOOKUP, headers=headers)
    assert refused.status_code == 429
    assert refused.json()["limit"] == "bytes_per_second"
    assert int(refused.headers["retry-after"]) >= 3  # 8 KB at 2 KB/s, less the first second


def test_a_quota_holds_across_worker_processes(make_server: MakeServer, tmp_path: Path) -> None:
    server, secret = quota_server(make_server, tmp_path, "requests_per_second = 5", workers="2")
    headers = {"Authorization": "Bearer " + secret}
    statuses: list[int] = []

    def hammer() -> None:
        for _ in range(10):  # a fresh connection each time: both workers get some
            with httpx.Client() as client:
                answer = client.post(server.url + "/v1/lookup", json=LOOKUP, headers=headers)
                statuses.append(answer.status_code)

    started = time.monotonic()
    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    admitted = statuses.count(200)
    assert statuses.count(200) + statuses.count(429) == 40
    # One bucket for the machine: 5 at once plus 5 a second, however the workers split them.
    assert admitted <= 5 + 5 * elapsed + 1, (admitted, elapsed)


def test_a_tenant_over_its_capacity_quota_evicts_only_its_own_blocks(
    make_server: MakeServer, keys: dict[str, str], tmp_path: Path
) -> None:
    key_file = tmp_path / "keys.toml"
    key_file.write_text(key_file.read_text() + '\n[tenants.team-a]\ncapacity = "1MiB"\n')
    server = make_server(auth="keys", api_keys_file=str(key_file))
    payload = b"x" * 64 * 1024
    with (
        CacheClient(server.url, api_key=keys["a-writer"]) as a,
        CacheClient(server.url, api_key=keys["b-writer"]) as b,
    ):
        for label in range(8):
            b.put_prefix("m", [label] * 64, [payload])
        for label in range(40):  # 40 x 64 KiB through a 1 MiB quota
            a.put_prefix("m", [1000 + label] * 64, [payload])
        assert all(b.lookup("m", [label] * 64).matched_blocks == 1 for label in range(8))
        assert a.lookup("m", [1039] * 64).matched_blocks == 1
        assert a.lookup("m", [1000] * 64).matched_blocks == 0
    why = httpx.post(server.url + "/v1/explain", json={"model": "m", "tokens": [1000] * 64},
                     headers={"Authorization": "Bearer " + keys["a-reader"]}).json()  # fmt: skip
    assert (why["reason"], why["facts"]["cause"]) == ("evicted", "tenant_quota")
    text = httpx.get(server.url + "/metrics",
                     headers={"Authorization": "Bearer " + keys["ops"]}).text  # fmt: skip
    assert 'prompt_cache_evicted_blocks_total{reason="tenant_quota"}' in text
