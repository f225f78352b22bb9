"""Every refused request is a problem+json 4xx/5xx naming what is wrong, and changes nothing."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from cache_service.core.framing import MEDIA_TYPE, encode_frames, join_frames
from tests.integration.conftest import ServerProcess

pytestmark = pytest.mark.integration

PROBLEM = "application/problem+json"
PROMPT = list(range(128))


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server with small limits, shared by this module's tests (none of them store)."""
    root = tmp_path_factory.mktemp("errors")
    server = ServerProcess(
        root / "data",
        root / "server.log",
        max_body_size="64KiB",
        max_blocks_per_request="4",
        max_tokens_per_request="1024",
    )
    server.start()
    frames = join_frames(encode_frames({"model": "m", "tokens": PROMPT}, [b"a", b"b"]))
    stored = httpx.post(
        server.url + "/v1/blocks", content=frames, headers={"content-type": MEDIA_TYPE}
    )
    assert stored.json()["stored_blocks"] == 2
    yield server
    server.stop()


def frames(header: dict[str, Any], payloads: list[bytes | None]) -> bytes:
    """A frame body."""
    return join_frames(encode_frames(header, payloads))


def snapshot(server: ServerProcess) -> tuple[int, int]:
    """What the store holds, to show that a refused request changed nothing."""
    stats = httpx.get(server.url + "/v1/stats").json()
    return stats["blocks"], stats["payload_bytes"]


JSON_HEADERS = {"content-type": "application/json"}
FRAME_HEADERS = {"content-type": MEDIA_TYPE}

CASES: list[tuple[str, str, bytes, dict[str, str], int, str | None]] = [
    # (name, path, body, headers, status, field named)
    ("malformed json", "/v1/lookup", b'{"model": "m", "tokens": [1,', JSON_HEADERS, 400, None),
    ("json array body", "/v1/lookup", b"[1, 2]", JSON_HEADERS, 400, None),
    (
        "string token",
        "/v1/lookup",
        json.dumps({"model": "m", "tokens": [1, "2", 3]}).encode(),
        JSON_HEADERS,
        422,
        "tokens[1]",
    ),
    (
        "negative token",
        "/v1/lookup",
        json.dumps({"model": "m", "tokens": [1, -2]}).encode(),
        JSON_HEADERS,
        422,
        "tokens[1]",
    ),
    (
        "token over 2^32-1",
        "/v1/lookup",
        json.dumps({"model": "m", "tokens": [2**32]}).encode(),
        JSON_HEADERS,
        422,
        "tokens[0]",
    ),
    (
        "float token",
        "/v1/lookup",
        json.dumps({"model": "m", "tokens": [1.5]}).encode(),
        JSON_HEADERS,
        422,
        "tokens[0]",
    ),
    (
        "missing model",
        "/v1/lookup",
        json.dumps({"tokens": [1]}).encode(),
        JSON_HEADERS,
        422,
        "model",
    ),
    (
        "unknown field",
        "/v1/lookup",
        json.dumps({"model": "m", "tokens": [1], "retension": "chat"}).encode(),
        JSON_HEADERS,
        422,
        "retension",
    ),
    (
        "unknown retention",
        "/v1/lookup",
        json.dumps({"model": "m", "tokens": [1], "retention": "forever"}).encode(),
        JSON_HEADERS,
        422,
        "retention",
    ),
    (
        "block size mismatch",
        "/v1/lookup",
        json.dumps({"model": "m", "tokens": [1], "block_size": 16}).encode(),
        JSON_HEADERS,
        422,
        "block_size",
    ),
    (
        "too many tokens",
        "/v1/lookup",
        json.dumps({"model": "m", "tokens": list(range(1025))}).encode(),
        JSON_HEADERS,
        413,
        None,
    ),
    (
        "lookup as text",
        "/v1/lookup",
        b'{"model":"m","tokens":[]}',
        {"content-type": "text/plain"},
        415,
        None,
    ),
    ("lookup without type", "/v1/lookup", b'{"model":"m","tokens":[]}', {}, 415, None),
    ("store as json", "/v1/blocks", b'{"model":"m","tokens":[]}', JSON_HEADERS, 415, None),
    ("store garbage frames", "/v1/blocks", b"PCF1garbage", FRAME_HEADERS, 400, None),
    ("store wrong magic", "/v1/blocks", b"XXXX\x00\x00\x00\x00", FRAME_HEADERS, 400, None),
    (
        "store string token",
        "/v1/blocks",
        frames({"model": "m", "tokens": ["x"] * 64}, [b"p"]),
        FRAME_HEADERS,
        422,
        "tokens[0]",
    ),
    (
        "store absent frame",
        "/v1/blocks",
        frames({"model": "m", "tokens": PROMPT}, [b"p", None]),
        FRAME_HEADERS,
        422,
        "frames[1]",
    ),
    (
        "store more payloads than blocks",
        "/v1/blocks",
        frames({"model": "m", "tokens": list(range(64))}, [b"p", b"q"]),
        FRAME_HEADERS,
        422,
        "payloads",
    ),
    (
        "store too many blocks",
        "/v1/blocks",
        frames({"model": "m", "tokens": list(range(64 * 5))}, [b"p"] * 5),
        FRAME_HEADERS,
        413,
        None,
    ),
    (
        "store with missing parent",
        "/v1/blocks",
        frames({"model": "m", "tokens": list(range(500, 756)), "start_block": 2}, [b"p", b"q"]),
        FRAME_HEADERS,
        409,
        None,
    ),
    (
        "store negative start",
        "/v1/blocks",
        frames({"model": "m", "tokens": PROMPT, "start_block": -1}, [b"p"]),
        FRAME_HEADERS,
        422,
        "start_block",
    ),
    (
        "fetch bad key",
        "/v1/blocks/fetch",
        json.dumps({"model": "m", "keys": ["zz"]}).encode(),
        JSON_HEADERS,
        422,
        "keys[0]",
    ),
    (
        "fetch too many keys",
        "/v1/blocks/fetch",
        json.dumps({"model": "m", "keys": ["0" * 32] * 5}).encode(),
        JSON_HEADERS,
        413,
        None,
    ),
    ("body too large", "/v1/lookup", b" " * (65 * 1024), JSON_HEADERS, 413, None),
    (
        "binary lookup with two frames",
        "/v1/lookup",
        frames({"model": "m"}, [bytes(8), bytes(8)]),
        FRAME_HEADERS,
        422,
        "frames",
    ),
    (
        "binary lookup with ragged tokens",
        "/v1/lookup",
        frames({"model": "m"}, [bytes(7)]),
        FRAME_HEADERS,
        422,
        "frames[0]",
    ),
    (
        "binary lookup with tokens in the header too",
        "/v1/lookup",
        frames({"model": "m", "tokens": [1]}, [bytes(4)]),
        FRAME_HEADERS,
        422,
        "tokens",
    ),
    (
        "binary store without any frame",
        "/v1/blocks",
        frames({"model": "m"}, []),
        FRAME_HEADERS,
        422,
        "frames[0]",
    ),
    (
        "lookup 5000-digit token",
        "/v1/lookup",
        b'{"model": "m", "tokens": [' + b"9" * 5000 + b"]}",
        JSON_HEADERS,
        400,
        None,
    ),
    (
        "store 5000-digit token",
        "/v1/blocks",
        b"PCF1"
        + len(b'{"model":"m","tokens":[' + b"9" * 5000 + b"]}").to_bytes(4, "little")
        + b'{"model":"m","tokens":['
        + b"9" * 5000
        + b"]}"
        + bytes(4),
        FRAME_HEADERS,
        400,
        None,
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "field"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_bad_request_gets_problem_json_and_changes_nothing(  # noqa: PLR0917 - parametrized
    limited: ServerProcess,
    path: str,
    body: bytes,
    headers: dict[str, str],
    status: int,
    field: str | None,
) -> None:
    before = snapshot(limited)
    response = httpx.post(limited.url + path, content=body, headers=headers)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    problem = response.json()
    assert problem["status"] == status
    assert problem["type"].startswith("https://")
    assert problem["title"] and problem["detail"]
    if field is not None:
        assert field in [error["field"] for error in problem["errors"]], problem
        assert field in problem["detail"]
    assert snapshot(limited) == before


def test_body_over_limit_without_content_length_is_413(limited: ServerProcess) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(100):
            yield b" " * 1024

    response = httpx.post(limited.url + "/v1/lookup", content=chunks(), headers=JSON_HEADERS)
    assert response.status_code == 413
    assert response.json()["limit"] == "max_body_size"


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/nowhere", 404), ("GET", "/v1/lookup", 405), ("DELETE", "/v1/blocks", 405)],
)
def test_unknown_routes_and_methods_are_problem_json(
    limited: ServerProcess, method: str, path: str, status: int
) -> None:
    response = httpx.request(method, limited.url + path)
    assert response.status_code == status
    assert response.headers["content-type"] == PROBLEM


def test_stored_data_is_intact_after_all_refusals(limited: ServerProcess) -> None:
    for _, path, body, headers, _, _ in CASES:
        httpx.post(limited.url + path, content=body, headers=headers)
    response = httpx.post(
        limited.url + "/v1/lookup", json={"model": "m", "tokens": PROMPT, "fetch": True}
    )
    assert response.status_code == 200
    assert response.content.endswith(b"\x01\x00\x00\x00\x00\x00\x00\x00b")


# Requests uvicorn's HTTP parser refuses before the app sees them, and the cause it names.
UNPARSABLE = [
    (
        "bad chunk size",
        b"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
        "chunk size",
    ),
    (
        "content-length with transfer-encoding",
        b"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n",
        "Content-Length",
    ),
    ("invalid method", b"G@T /healthz HTTP/1.1\r\nHost: x\r\n\r\n", "method"),
    ("invalid request target", b"GET /\x01 HTTP/1.1\r\nHost: x\r\n\r\n", "url"),
    ("invalid version", b"GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n", "version"),
    ("invalid header line", b"GET /healthz HTTP/1.1\r\nHost x\r\n\r\n", "header"),
]


@pytest.mark.parametrize(
    ("request_bytes", "cause"),
    [case[1:] for case in UNPARSABLE],
    ids=[case[0] for case in UNPARSABLE],
)
def test_unparsable_http_gets_problem_json_naming_the_cause(
    limited: ServerProcess, request_bytes: bytes, cause: str
) -> None:
    with socket.create_connection(("127.0.0.1", limited.port), timeout=10) as conn:
        conn.sendall(request_bytes)
        answer = b""
        while chunk := conn.recv(65536):  # the server closes the connection after answering
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    assert lines[0] == "HTTP/1.1 400 Bad Request"
    assert headers["content-type"] == PROBLEM
    assert headers["connection"] == "close"
    assert int(headers["content-length"]) == len(body)
    problem = json.loads(body)
    assert problem["status"] == 400
    assert problem["type"].startswith("https://")
    assert cause.lower() in problem["cause"].lower()
    assert problem["cause"] in problem["detail"]
    assert httpx.get(limited.url + "/healthz").status_code == 200  # and it goes on serving
