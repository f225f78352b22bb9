"""Every problem type the service sends, provoked from a real one and read by the client: the
exception's class, the field it names and the reason. Through the client's own calls where one
can provoke the problem; otherwise the real answer (to a route the client has no call for, or
to bytes no client sends) goes through the client's `response_error`. The servers are
`cache-service serve` processes, or the app served by uvicorn in a thread where a test needs
what no flag sets (a store not open yet, a backend that keeps no pins). A remote store's failed
write is provoked on Redis (tests/redis_cluster/test_client_problems.py)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import lmdb
import pytest
import uvicorn

from cache_service.client import (
    BlockSizeMismatchProblem,
    CacheClient,
    DiskFullProblem,
    ForbiddenProblem,
    HeadersTooLargeProblem,
    InsufficientStorageProblem,
    InvalidField,
    InvalidFieldProblem,
    MalformedBodyProblem,
    MissingParentProblem,
    NotEnabledProblem,
    NotReadyProblem,
    NotStoredProblem,
    NotSupportedByStoreProblem,
    OverloadedProblem,
    PayloadTooLargeProblem,
    QuotaExceededProblem,
    RequestProblem,
    RequestTimeoutProblem,
    ServiceError,
    ServiceUnavailable,
    ThrottledProblem,
    UnauthorizedProblem,
    UnknownInstanceProblem,
    UnknownRetentionProblem,
    UnsupportedMediaTypeProblem,
)
from cache_service.client.problems import PROBLEM_CLASSES, response_error
from cache_service.core.errors import RequestError
from cache_service.core.store.memory import MemoryStore
from cache_service.core.store.protocols import Capabilities
from cache_service.service.api import create_app
from cache_service.service.api_keys import Role, key_file_entry, new_key
from cache_service.service.settings import Settings
from tests.conftest import memory_store_for
from tests.integration.conftest import ServerProcess, free_port
from tests.reliability.small_disk import fill, tmpfs
from tests.reliability.thread_server import ThreadServer

pytestmark = pytest.mark.integration

MODEL = "m"
BLOCK = 64  # the service's default block size
Provoke = Callable[[ServerProcess], object]

# Sent when a remote store fails a write: tests/redis_cluster/test_client_problems.py.
ON_REDIS = {"storage-failure"}
# A StorageError of no narrower type: raised by a store only while it opens (start-up) or by
# the client's own same-host reads, never in a request's answer; tests/test_client_problems.py
# reads it as the service would render it.
NEVER_ANSWERED = {"storage"}


def prompt(first: int, blocks: int = 1) -> list[int]:
    """Token ids of `blocks` full blocks, starting at `first` (a prompt of its own)."""
    return list(range(first, first + blocks * BLOCK))


def refusal(call: Callable[[], object]) -> ServiceError:
    """The ServiceError a call raises."""
    with pytest.raises(ServiceError) as raised:
        call()
    return raised.value


def raw_answer(port: int, request: bytes, *, then: float = 0.0) -> httpx.Response:
    """The service's answer to bytes no client sends (after waiting `then` seconds with the
    connection open), read until the service closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(request)
        time.sleep(then)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = [tuple(line.split(": ", 1)) for line in lines]
    return httpx.Response(int(status_line.split()[1]), headers=headers, content=body)


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One service with small limits, shared by the module's tests without keys."""
    root = tmp_path_factory.mktemp("client-problems")
    server = ServerProcess(
        root / "data",
        root / "server.log",
        capacity="1MiB",
        max_tokens_per_request="512",
        body_timeout="0.5",
        max_header_bytes="4096",
    )
    server.start()
    yield server
    server.stop()


def client_call(
    call: Callable[[CacheClient], object], *, path: str = "", **options: Any
) -> Provoke:
    """Provoke with one of the client's calls (on a base URL with `path` added)."""

    def provoke(server: ServerProcess) -> object:
        with CacheClient(server.url + path, **options) as client:
            return call(client)

    return provoke


def answer_to(request: Callable[[str], httpx.Response]) -> Provoke:
    """Provoke with a request the client has no call for; raise what the client reads."""

    def provoke(server: ServerProcess) -> object:
        raise response_error(request(server.url))

    return provoke


def raw(request: bytes, *, then: float = 0.0) -> Provoke:
    """Provoke with bytes no client sends; raise what the client reads of the answer."""

    def provoke(server: ServerProcess) -> object:
        raise response_error(raw_answer(server.port, request, then=then))

    return provoke


TEXT = {"content-type": "text/plain"}
PIN = prompt(2000)  # never stored
JSON = {"content-type": "application/json"}

# (problem type, how to provoke it, class, status, field, what the reason says)
CASES: list[tuple[str, Provoke, type[ServiceError], int, str | None, str]] = [
    (
        "invalid-field",
        client_call(lambda c: c.lookup(MODEL, prompt(0), block_size=0)),
        InvalidFieldProblem, 422, "block_size", "greater than or equal to 1",
    ),
    (
        "block-size-mismatch",
        client_call(lambda c: c.lookup(MODEL, prompt(0), block_size=32)),
        BlockSizeMismatchProblem, 422, "block_size", "blocks of 64 tokens, not 32",
    ),
    (
        "unknown-retention",
        client_call(lambda c: c.lookup(MODEL, prompt(0), retention="forever")),
        UnknownRetentionProblem, 422, "retention", "unknown retention class 'forever'",
    ),
    (
        "unknown-instance",
        client_call(lambda c: c.route(MODEL, prompt(0), instances=["nowhere"])),
        UnknownInstanceProblem, 422, "instances[0]", "unknown instance 'nowhere'",
    ),
    (
        "malformed-body",
        answer_to(lambda url: httpx.post(url + "/v1/blocks/fetch", content=b"{", headers=JSON)),
        MalformedBodyProblem, 400, None, "not valid JSON",
    ),
    (
        "bad-request",
        raw(b"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"),
        RequestProblem, 400, None, "not valid HTTP/1.1",
    ),
    (
        "payload-too-large",
        client_call(lambda c: c.lookup(MODEL, prompt(0, blocks=9))),
        PayloadTooLargeProblem, 413, "tokens", "576 is over the limit of 512",
    ),
    (
        "request-timeout",
        raw(
            b"POST /v1/blocks/fetch HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{",
            then=1.0,  # twice body_timeout, and the rest of the body never comes
        ),
        RequestTimeoutProblem, 408, None, "did not arrive within 0.5 s",
    ),
    (
        "headers-too-large",
        client_call(lambda c: c.info(), api_key="k" * 8192),
        HeadersTooLargeProblem, 431, None, "over the limit of 4096 bytes (max_header_bytes)",
    ),
    (
        "unsupported-media-type",
        answer_to(lambda url: httpx.post(url + "/v1/lookup", content=b"tokens", headers=TEXT)),
        UnsupportedMediaTypeProblem, 415, None, "'text/plain' is not accepted here",
    ),
    (
        "missing-parent",
        client_call(lambda c: c.store(MODEL, prompt(1000, blocks=2), [b"kv"], start_block=1)),
        MissingParentProblem, 409, "start_block", "block 0 (the parent of block 1) is not stored",
    ),
    (
        "not-stored",
        answer_to(lambda url: httpx.post(url + "/v1/pin", json={"model": MODEL, "tokens": PIN})),
        NotStoredProblem, 409, None, "not stored",
    ),
    (
        "not-enabled",
        answer_to(lambda url: httpx.get(url + "/v1/local-reads")),
        NotEnabledProblem, 404, None, "--local-reads",
    ),
    (
        "insufficient-storage",
        client_call(lambda c: c.store(MODEL, prompt(3000), [bytes(2 * 2**20)])),
        InsufficientStorageProblem, 507, None, "larger than the cache's capacity",
    ),
    (
        "about:blank",  # a route the service does not have: the base URL has a path too many
        client_call(lambda c: c.info(), path="/nowhere"),
        RequestProblem, 404, None, "Not Found",
    ),
]  # fmt: skip


def assert_refusal(
    error: ServiceError, raised: type[ServiceError], status: int, field: str | None, reason: str
) -> None:
    """The error is of class `raised`, names `field`, and its reason says `reason`."""
    assert type(error) is raised
    assert (error.status, error.field) == (status, field)
    assert reason in error.reason, error.reason
    assert error.problem != "internal"
    assert error.problem_type == error.problem_body.get("type", "about:blank")
    if isinstance(error, RequestError):  # the service's own class of the type, too
        assert 400 <= status < 500 or isinstance(error, OverloadedProblem)
        assert error.to_problem()["detail"] == error.problem_body["detail"]
    if isinstance(error, ThrottledProblem):  # its Retry-After, in the body
        assert error.retry_after_seconds >= 1


@pytest.mark.parametrize("huge", [10**300, 1e300], ids=["integer", "integral float"])
def test_a_number_of_any_size_is_refused_without_being_repeated(
    limited: ServerProcess, huge: Any
) -> None:
    with CacheClient(limited.url) as client:
        error = refusal(lambda: client.lookup(MODEL, prompt(0), block_size=huge))
    assert type(error) is InvalidFieldProblem
    assert (error.field, error.reason) == (
        "block_size",
        "Input should be less than or equal to 4294967295",
    )
    assert "0" * 20 not in str(error.problem_body)


def test_a_field_refused_on_either_side_is_an_invalid_field(limited: ServerProcess) -> None:
    with CacheClient(limited.url) as client:
        with pytest.raises(InvalidField) as before_sending:
            client.lookup(MODEL, [1, -2])
        assert not isinstance(before_sending.value, ServiceError)  # nothing was sent
        assert (before_sending.value.field, before_sending.value.reason) == (
            "tokens",
            "token ids are integers in 0..4294967295",  # said once
        )
        with pytest.raises(InvalidField) as answered:
            client.lookup(MODEL, prompt(0), retention="forever")
        assert isinstance(answered.value, UnknownRetentionProblem)


# -- with API keys: who may do what -------------------------------------------------------------


# A writer whose tenant may pin one block, a reader, and a writer with a rate quota of one
# request every 100 s.
SECRETS = {name: new_key() for name in ("writer", "reader", "slow")}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A service with a key file of SECRETS' keys, and a pin quota of one block."""
    root = tmp_path_factory.mktemp("client-problems-keys")
    entries = [
        key_file_entry("writer", "team", Role.WRITER, SECRETS["writer"]),
        key_file_entry("reader", "team", Role.READER, SECRETS["reader"]),
        key_file_entry("slow", "slow-team", Role.WRITER, SECRETS["slow"])
        + "requests_per_second = 0.01\n",
    ]
    (root / "keys.toml").write_text("\n".join(entries))
    server = ServerProcess(
        root / "data",
        root / "server.log",
        auth="keys",
        api_keys_file=str(root / "keys.toml"),
        pin_quota_blocks="1",
    )
    server.start()
    yield server
    server.stop()


def pin_past_the_quota(server: ServerProcess) -> object:
    """Store two blocks, then pin them (the client has no call for pins)."""
    tokens = prompt(4000, blocks=2)
    with CacheClient(server.url, api_key=SECRETS["writer"]) as writer:
        writer.store(MODEL, tokens, [b"a", b"b"])
    key = {"Authorization": "Bearer " + SECRETS["writer"]}
    pinned = httpx.post(
        server.url + "/v1/pin", json={"model": MODEL, "tokens": tokens}, headers=key
    )
    raise response_error(pinned)


KEYED_CASES: list[tuple[str, Provoke, type[ServiceError], int, str | None, str]] = [
    ("unauthorized", client_call(lambda c: c.info()), UnauthorizedProblem, 401, None, "API key"),
    (
        "forbidden",
        client_call(lambda c: c.store(MODEL, prompt(0), [b"kv"]), api_key=SECRETS["reader"]),
        ForbiddenProblem, 403, None, "needs writer",
    ),
    ("quota-exceeded", pin_past_the_quota, QuotaExceededProblem, 403, None, "quota"),
    (
        "rate-limited",  # the quota holds one request: the second waits about 100 s
        client_call(lambda c: (c.info(), c.info()), api_key=SECRETS["slow"]),
        ThrottledProblem, 429, None, "requests_per_second",
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    ("server", "provoke", "raised", "status", "field", "reason"),
    [("limited", *case[1:]) for case in CASES] + [("keyed", *case[1:]) for case in KEYED_CASES],
    ids=[case[0] for case in CASES + KEYED_CASES],
)
def test_each_problem_type_raises_its_class_naming_the_field_and_the_reason(  # noqa: PLR0917
    request: pytest.FixtureRequest,
    server: str,
    provoke: Provoke,
    raised: type[ServiceError],
    status: int,
    field: str | None,
    reason: str,
) -> None:
    serving = request.getfixturevalue(server)  # the module's server without keys, or with
    assert_refusal(refusal(lambda: provoke(serving)), raised, status, field, reason)


# -- the service's own state: starting, writes backed up, a full disk ---------------------------


@pytest.fixture
def starting(tmp_path: Path) -> Iterator[str]:
    """The app served before its lifespan opened the store (as a request finds a service that
    is starting): uvicorn on 127.0.0.1 in a thread, the lifespan not run."""
    app = create_app(Settings(data_dir=tmp_path / "data"))
    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="starting-service")
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "uvicorn did not start"
    yield f"http://127.0.0.1:{config.port}"
    server.should_exit = True
    thread.join(timeout=30)


def test_a_service_whose_store_is_not_open_is_not_ready(starting: str) -> None:
    with CacheClient(starting) as client:
        error = refusal(lambda: client.lookup(MODEL, prompt(0)))
    assert_refusal(error, NotReadyProblem, 503, None, "the store is not open yet")


def test_a_store_past_max_pending_writes_is_refused_at_once(
    make_server: Callable[..., ServerProcess],
) -> None:
    server = make_server(max_pending_writes="1")
    # Holding LMDB's one write lock from this process keeps the service's writes waiting for
    # it, so the one place for a pending write stays taken (by a store or the service's own).
    env = lmdb.open(str(server.data_dir), map_size=2**30, max_dbs=16)
    held = env.begin(write=True)
    refused: list[OverloadedProblem] = []
    with (
        CacheClient(server.url, timeout=30) as waiting,
        CacheClient(server.url, timeout=1) as quick,
        ThreadPoolExecutor(max_workers=1) as pool,
    ):
        try:
            first = pool.submit(waiting.store, MODEL, prompt(5000), [b"first"])
            for attempt in range(1, 10):
                try:
                    quick.store(MODEL, prompt(5000 + attempt * BLOCK), [b"later"])
                except ServiceUnavailable:
                    continue  # it took the place before `first` did, and waits there instead
                except OverloadedProblem as error:
                    refused.append(error)
                    break
        finally:
            held.abort()
            env.close()
        with contextlib.suppress(OverloadedProblem):  # refused too if a write of the service's
            first.result(timeout=30)  # own held the place; else stored once the lock was free
    assert refused, "no store was refused"
    assert_refusal(refused[0], OverloadedProblem, 503, None, "(max_pending_writes); retry")
    assert isinstance(refused[0], ThrottledProblem) and refused[0].retry_after_seconds == 1.0


class PinlessStore(MemoryStore):
    """A backend that declares it keeps no pins (none shipped lacks them; a new one may)."""

    capabilities = Capabilities(
        "pinless", lacks={**MemoryStore.capabilities.lacks, "pins": "it keeps no pins"}
    )


def test_a_pin_on_a_store_that_keeps_none_is_not_supported() -> None:
    settings = Settings(store="memory://")
    server = ThreadServer(
        create_app(settings, store=memory_store_for(settings, PinlessStore)), "pinless"
    )
    server.start()
    try:
        pinned = httpx.post(server.url + "/v1/pin", json={"model": MODEL, "tokens": PIN})
    finally:
        server.stop()
    error = response_error(pinned)  # the client has no call for pins
    reason = "pinning is not supported by the pinless store: it keeps no pins"
    assert_refusal(error, NotSupportedByStoreProblem, 501, None, reason)


def test_a_store_on_a_full_disk_is_disk_full(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "disk", 32 * 2**20) as disk:
        server = ServerProcess(disk / "data", tmp_path / "server.log", capacity="1GiB")
        server.start()
        try:
            fill(disk / "filler")  # another program takes the rest of the disk
            with CacheClient(server.url) as client:
                error = refusal(lambda: client.store(MODEL, prompt(0), [bytes(65536)]))
        finally:
            server.stop()
    assert_refusal(error, DiskFullProblem, 507, None, "has 0 B free")


# -- every type: provoked here, on Redis, or never in an answer ---------------------------------


def test_every_problem_type_the_client_knows_is_provoked() -> None:
    here = {case[0] for case in CASES + KEYED_CASES} | {
        "not-ready",
        "not-supported-by-store",
        "writes-backed-up",
        "disk-full",
    }
    assert set(PROBLEM_CLASSES) | {"about:blank"} == here | ON_REDIS | NEVER_ANSWERED
    assert all(PROBLEM_CLASSES[name].problem == name for name in PROBLEM_CLASSES)
