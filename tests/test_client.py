"""CacheClient and AsyncCacheClient against httpx.MockTransport: requests, answers, errors,
fail-open and backoff. Every test runs against both twins (the `connect` fixture)."""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import pickle
from array import array
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import httpx
import pytest

from cache_service.client import AsyncCacheClient, CacheClient, Match, StoreResult, Usage
from cache_service.core.blocks import BlockKey
from cache_service.core.errors import InvalidAnswer, InvalidField, ServiceError, ServiceUnavailable
from cache_service.core.framing import MEDIA_TYPE, decode_frames, encode_frames, join_frames
from tests.wire_samples import info_body, sample_info

BASE_URL = "http://cache.test"
KEY_A = "0123456789abcdef0123456789abcdef"
KEY_B = "fedcba9876543210fedcba9876543210"
TOKENS = list(range(10))
LOOKUP_ANSWER: dict[str, Any] = {
    "model": "llama",
    "block_size": 4,
    "prompt_tokens": 10,
    "matched_blocks": 2,
    "cached_tokens": 8,
    "keys": [KEY_A, KEY_B],
    "retention": "chat",
    "usage": {"prompt_cache_hit_tokens": 8, "prompt_cache_miss_tokens": 2},
}
STORE_ANSWER: dict[str, Any] = {
    "model": "llama",
    "block_size": 4,
    "start_block": 1,
    "requested_blocks": 1,
    "stored_blocks": 1,
    "refreshed_blocks": 0,
    "conflicts": 0,
    "truncated_blocks": 0,
    "collisions": 0,
    "keys": [KEY_B],
}
MISS = Match(  # a fail-open miss of lookup("llama", TOKENS): no retention class named
    model="llama",
    retention="",
    matched_blocks=0,
    cached_tokens=0,
    block_size=0,
    prompt_tokens=10,
    keys=[],
    usage=Usage(prompt_cache_hit_tokens=0, prompt_cache_miss_tokens=10),
    payloads=None,
)

Handler = Callable[[httpx.Request], httpx.Response]


class Clock(Protocol):
    """The shared `clock` fixture (conftest.VirtualClock)."""

    def __call__(self) -> float: ...

    def advance(self, seconds: float) -> float: ...


class Service:
    """A scripted service: records every request and answers with `answer(request)`."""

    def __init__(self, answer: Handler) -> None:
        self.answer = answer
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.answer(request)

    @property
    def last_json(self) -> Any:
        """The JSON body of the last request."""
        return json.loads(self.requests[-1].content)

    @property
    def last_frames(self) -> tuple[dict[str, Any], list[bytes | None]]:
        """The frame header and frames of the last request."""
        header, frames = decode_frames(self.requests[-1].content)
        return header, [bytes(frame) if frame is not None else None for frame in frames]


class Blocking:
    """Calls an AsyncCacheClient's coroutine methods from a plain test, one loop per call;
    its other attributes (`failures`) are read as they are."""

    def __init__(self, client: AsyncCacheClient) -> None:
        self.client = client

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.client, name)
        if not inspect.iscoroutinefunction(method):
            return method

        def call(*args: Any, **kwargs: Any) -> Any:
            return asyncio.run(method(*args, **kwargs))

        return call


def answer_json(body: Any, status: int = 200) -> Handler:
    """Always answer `body` as JSON."""
    return lambda request: httpx.Response(status, json=body)


def answer_frames(header: dict[str, Any], payloads: list[bytes | None]) -> Handler:
    """Always answer a frame body."""
    content = join_frames(encode_frames(header, payloads))
    return lambda request: httpx.Response(
        200, content=content, headers={"Content-Type": MEDIA_TYPE}
    )


def answer_problem(status: int, **fields: Any) -> Handler:
    """Always answer an RFC 9457 problem."""
    body = {"type": "about:blank", "title": "Problem", "status": status, "detail": "no", **fields}
    return lambda request: httpx.Response(
        status,
        content=json.dumps(body).encode(),
        headers={"Content-Type": "application/problem+json"},
    )


def unreachable(request: httpx.Request) -> httpx.Response:
    """A service that cannot be connected to."""
    raise httpx.ConnectError("connection refused", request=request)


@contextmanager
def twin_opener(twin: str, default_url: Callable[[], str]) -> Iterator[Callable[..., Any]]:
    """Opens a CacheClient, or an AsyncCacheClient behind `Blocking`, over a MockTransport;
    closes every one it opened on exit."""
    closers: list[Callable[[], None]] = []

    def open_client(service: Handler, base_url: str | None = None, **options: Any) -> Any:
        transport = httpx.MockTransport(service)
        url = base_url or default_url()
        if twin == "sync":
            client = CacheClient(url, transport=transport, **options)
            closers.append(client.close)
            return client
        aio = AsyncCacheClient(url, transport=transport, **options)
        closers.append(lambda: asyncio.run(aio.aclose()))
        return Blocking(aio)

    try:
        yield open_client
    finally:
        for close in closers:
            close()


@pytest.fixture(params=["sync", "async"])
def connect(request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    """Open a CacheClient, or an AsyncCacheClient behind `Blocking`, on BASE_URL."""
    with twin_opener(request.param, lambda: BASE_URL) as open_client:
        yield open_client


# Requests and answers ---------------------------------------------------------------------


def test_lookup_posts_the_tokens_as_a_binary_frame_and_parses_the_match(connect: Any) -> None:
    service = Service(answer_json(LOOKUP_ANSWER))
    client = connect(service, api_key="s3cret")
    match = client.lookup(
        "llama", TOKENS, kv_layout="fp16", salt="pepper", retention="chat", block_size=4
    )
    request = service.requests[-1]
    assert (request.method, request.url.path) == ("POST", "/v1/lookup")
    assert request.headers["Authorization"] == "Bearer s3cret"
    assert request.headers["Content-Type"] == MEDIA_TYPE
    assert service.last_frames == (
        {
            "model": "llama",
            "kv_layout": "fp16",
            "salt": "pepper",
            "retention": "chat",
            "block_size": 4,
            "fetch": False,
        },
        [array("I", TOKENS).tobytes()],
    )
    assert match == Match(
        model="llama",
        retention="chat",
        matched_blocks=2,
        cached_tokens=8,
        block_size=4,
        prompt_tokens=10,
        keys=[KEY_A, KEY_B],
        usage=Usage(prompt_cache_hit_tokens=8, prompt_cache_miss_tokens=2),
        payloads=None,
    )


def test_lookup_defaults_send_empty_salt_null_options_and_no_authorization(connect: Any) -> None:
    service = Service(answer_json(LOOKUP_ANSWER))
    connect(service).lookup("llama", array("I", TOKENS))
    assert "Authorization" not in service.requests[-1].headers
    assert service.last_frames == (
        {
            "model": "llama",
            "kv_layout": "",
            "salt": "",
            "retention": None,
            "block_size": None,
            "fetch": False,
        },
        [array("I", TOKENS).tobytes()],
    )


def test_lookup_sends_already_encoded_tokens_as_they_are(connect: Any) -> None:
    service = Service(answer_json(LOOKUP_ANSWER))
    encoded = array("I", TOKENS).tobytes()
    connect(service).lookup("llama", encoded)
    assert service.last_frames[1] == [encoded]


def test_lookup_with_fetch_returns_the_payload_frames(connect: Any) -> None:
    service = Service(answer_frames(LOOKUP_ANSWER, [b"kv-0", b""]))
    match = connect(service).lookup("llama", TOKENS, fetch=True)
    assert service.last_frames[0]["fetch"] is True
    assert match.payloads == [b"kv-0", b""]
    assert all(type(payload) is bytes for payload in match.payloads)
    assert (match.matched_blocks, match.keys) == (2, [KEY_A, KEY_B])


@pytest.mark.parametrize(
    "frames",
    [[b"kv-0", None], [b"kv-0"]],
    ids=["absent-frame", "too-few-frames"],
)
def test_lookup_frames_that_do_not_cover_the_match_are_an_invalid_answer(
    connect: Any, frames: list[bytes | None]
) -> None:
    client = connect(Service(answer_frames(LOOKUP_ANSWER, frames)))
    with pytest.raises(ServiceError) as caught:
        client.lookup("llama", TOKENS, fetch=True)
    assert caught.value.status == 502


@pytest.mark.parametrize(
    ("answer", "fetch"),
    [
        (lambda request: httpx.Response(200, content=b"<html>"), False),
        (answer_json([1, 2]), False),
        (answer_json({**LOOKUP_ANSWER, "matched_blocks": "2"}), False),
        (answer_json({**LOOKUP_ANSWER, "cached_tokens": True}), False),
        (answer_json({**LOOKUP_ANSWER, "usage": None}), False),
        (answer_json({**LOOKUP_ANSWER, "keys": [1, 2]}), False),
        (answer_json(LOOKUP_ANSWER), True),
        (
            lambda request: httpx.Response(
                200, content=b"PCF1", headers={"Content-Type": MEDIA_TYPE}
            ),
            True,
        ),
    ],
    ids=[
        "not-json",
        "not-an-object",
        "wrong-type",
        "bool-for-int",
        "no-usage",
        "keys-not-strings",
        "json-for-fetch",
        "truncated-frames",
    ],
)
def test_an_unparseable_2xx_answer_raises_a_502_service_error(
    connect: Any, answer: Handler, fetch: bool
) -> None:
    client = connect(Service(answer))
    with pytest.raises(ServiceError) as caught:
        client.lookup("llama", TOKENS, fetch=fetch)
    assert caught.value.status == 502
    assert not isinstance(caught.value, ServiceUnavailable)


@pytest.mark.parametrize(
    "tokens", [[1, -1], [2**32], [1.5], b"abc"], ids=["negative", "big", "float", "ragged-bytes"]
)
def test_lookup_refuses_bad_token_ids_before_sending(connect: Any, tokens: list[Any]) -> None:
    service = Service(answer_json(LOOKUP_ANSWER))
    with pytest.raises(InvalidField) as refused:
        connect(service, fail_open=True).lookup("llama", tokens)
    assert service.requests == []
    assert refused.value.field == "tokens"
    assert str(refused.value).count("0..4294967295") <= 1  # the rule, said once


@pytest.mark.parametrize(
    ("payloads", "said"),
    [
        (["kv"], "payloads[0]: a payload is bytes, a bytearray or a memoryview, not str"),
        (
            [b"kv", None],
            "payloads[1]: a payload is bytes, a bytearray or a memoryview, not NoneType",
        ),
        (b"kv", "payloads is a list of payloads, one per block, not one bytes"),
        ([memoryview(b"kvkv")[::2]], "payloads[0]: a payload is contiguous memory: pass bytes(x)"),
        (
            [memoryview(bytes(8)).cast("f")],
            "payloads[0]: a payload is counted in bytes, not in items of 4 bytes in 1 dimensions",
        ),
    ],
    ids=["str", "none", "one-bytes", "strided", "floats"],
)
def test_store_refuses_payloads_that_are_not_bytes_before_sending(
    connect: Any, payloads: Any, said: str
) -> None:
    service = Service(answer_json(STORE_ANSWER))
    with pytest.raises(TypeError) as refused:
        connect(service, fail_open=True).store("llama", TOKENS, payloads)
    assert service.requests == []
    assert str(refused.value).startswith(said)


def test_store_sends_a_frame_body_with_the_header_and_one_frame_per_block(connect: Any) -> None:
    service = Service(answer_json(STORE_ANSWER))
    client = connect(service, api_key="k")
    result = client.store(
        "llama",
        TOKENS,
        [b"kv-1", memoryview(b"kv-2")],
        kv_layout="fp16",
        start_block=1,
        salt="pepper",
        retention="agent",
        block_size=4,
    )
    request = service.requests[-1]
    assert (request.method, request.url.path) == ("POST", "/v1/blocks")
    assert request.headers["Content-Type"] == MEDIA_TYPE
    assert request.headers["Authorization"] == "Bearer k"
    assert service.last_frames == (
        {
            "model": "llama",
            "kv_layout": "fp16",
            "salt": "pepper",
            "retention": "agent",
            "block_size": 4,
            "start_block": 1,
        },
        [array("I", TOKENS).tobytes(), b"kv-1", b"kv-2"],
    )
    assert result == StoreResult(**STORE_ANSWER)


def test_put_prefix_returns_the_newly_stored_block_count(connect: Any) -> None:
    service = Service(answer_json({**STORE_ANSWER, "stored_blocks": 0, "refreshed_blocks": 1}))
    assert connect(service).put_prefix("llama", TOKENS, [b"kv-0"]) == 0
    header, frames = service.last_frames
    assert (header["start_block"], header["salt"], header["retention"]) == (0, "", None)
    assert frames == [array("I", TOKENS).tobytes(), b"kv-0"]


def test_put_prefix_says_which_blocks_were_already_stored_with_other_bytes(connect: Any) -> None:
    answer = {**STORE_ANSWER, "requested_blocks": 4, "stored_blocks": 1, "refreshed_blocks": 3}
    service = Service(answer_json({**answer, "conflicts": 2}))
    stored = connect(service).put_prefix("llama", TOKENS, [b"kv-0"])
    assert stored == 1  # still the count newly stored, as an int
    assert isinstance(stored, int)
    assert (stored.stored_blocks, stored.identical_blocks, stored.conflicts) == (1, 1, 2)
    assert stored.as_sent is False
    assert stored.result == StoreResult(**{**answer, "conflicts": 2})
    assert repr(stored) == "StoredBlocks(1, identical_blocks=1, conflicts=2, requested_blocks=4)"


def test_put_prefix_is_as_sent_only_when_every_block_is_held_with_its_bytes(
    connect: Any,
) -> None:
    held = {**STORE_ANSWER, "requested_blocks": 3, "stored_blocks": 1, "refreshed_blocks": 2}
    assert connect(Service(answer_json(held))).put_prefix("llama", TOKENS, [b"x"]).as_sent
    truncated = {**held, "stored_blocks": 0, "truncated_blocks": 1}
    assert not connect(Service(answer_json(truncated))).put_prefix("llama", TOKENS, [b"x"]).as_sent
    down = connect(Service(unreachable), fail_open=True).put_prefix("llama", TOKENS, [b"x", b"y"])
    assert (down, down.as_sent, down.result.requested_blocks) == (0, False, 2)


def test_put_prefix_answer_survives_copy_and_pickle(connect: Any) -> None:
    answer = {**STORE_ANSWER, "refreshed_blocks": 1, "conflicts": 1}
    stored = connect(Service(answer_json(answer))).put_prefix("llama", TOKENS, [b"x"])
    for again in (copy.copy(stored), pickle.loads(pickle.dumps(stored))):
        assert (again, again.conflicts, again.result) == (1, 1, stored.result)


def test_get_blocks_posts_hex_keys_and_maps_absent_frames_to_none(connect: Any) -> None:
    header = {"model": "llama", "requested": 3, "found": 2}
    service = Service(answer_frames(header, [b"kv-a", None, b""]))
    keys = [KEY_A, BlockKey(bytes.fromhex(KEY_B)), KEY_A.upper()]
    blocks = connect(service).get_blocks("llama", keys, kv_layout="fp16", salt="pepper")
    request = service.requests[-1]
    assert (request.method, request.url.path) == ("POST", "/v1/blocks/fetch")
    assert service.last_json == {
        "model": "llama",
        "kv_layout": "fp16",
        "salt": "pepper",
        "keys": [KEY_A, KEY_B, KEY_A],
    }
    assert blocks == [b"kv-a", None, b""]


def test_get_blocks_without_keys_sends_nothing(connect: Any) -> None:
    service = Service(unreachable)
    assert connect(service).get_blocks("llama", []) == []
    assert service.requests == []


@pytest.mark.parametrize("key", ["abc", "zz" * 16, BlockKey(b"short")], ids=repr)
def test_get_blocks_refuses_a_malformed_key_before_sending(connect: Any, key: Any) -> None:
    service = Service(unreachable)
    with pytest.raises(InvalidField):
        connect(service, fail_open=True).get_blocks("llama", [KEY_A, key])
    assert service.requests == []


def test_get_blocks_answer_with_a_frame_per_key_missing_is_invalid(connect: Any) -> None:
    service = Service(answer_frames({"model": "llama", "requested": 2, "found": 1}, [b"x"]))
    with pytest.raises(ServiceError) as caught:
        connect(service).get_blocks("llama", [KEY_A, KEY_B])
    assert caught.value.status == 502


def test_info_reads_the_typed_answer_and_stats_returns_the_json_object(connect: Any) -> None:
    bodies = {"/v1/info": info_body(models={"llama": 16}), "/v1/stats": {"path": "/v1/stats"}}
    service = Service(lambda request: httpx.Response(200, json=bodies[request.url.path]))
    client = connect(service)
    info = client.info()
    assert info == sample_info(models={"llama": 16})
    assert (info.block_size_for("llama"), info.block_size_for("other")) == (16, 64)
    assert client.stats() == {"path": "/v1/stats"}
    assert [request.method for request in service.requests] == ["GET", "GET"]


def test_an_info_without_its_declared_shape_is_an_invalid_answer_naming_the_field(
    connect: Any,
) -> None:
    body = info_body()
    del body["limits"]["max_body_size"]
    with pytest.raises(InvalidAnswer) as caught:
        connect(Service(answer_json(body))).info()
    assert caught.value.status == 502
    assert "'limits.max_body_size'" in caught.value.detail


def test_healthy_asks_healthz_or_readyz(connect: Any) -> None:
    statuses = {"/healthz": 200, "/readyz": 503}
    service = Service(lambda request: httpx.Response(statuses[request.url.path], json={}))
    client = connect(service, fail_open=True)
    assert client.healthy() is True
    assert client.healthy(ready=True) is False
    assert client.healthy() is True  # a failed probe does not start a backoff


def test_healthy_is_false_when_the_service_is_unreachable(connect: Any) -> None:
    assert connect(Service(unreachable)).healthy() is False


def test_the_timeout_applies_to_every_phase(connect: Any) -> None:
    service = Service(answer_json({}))
    connect(service, timeout=1.5).stats()
    assert service.requests[-1].extensions["timeout"] == dict.fromkeys(
        ("connect", "read", "write", "pool"), 1.5
    )


def test_a_base_url_path_prefix_is_kept() -> None:
    service = Service(answer_json({}))
    with CacheClient(f"{BASE_URL}/cache", transport=httpx.MockTransport(service)) as client:
        client.stats()
    assert service.requests[-1].url == httpx.URL(f"{BASE_URL}/cache/v1/stats")


# Errors -----------------------------------------------------------------------------------


def test_a_problem_answer_raises_service_error_with_status_and_body(connect: Any) -> None:
    errors = [{"field": "tokens[1]", "message": "must be >= 0"}]
    service = Service(answer_problem(422, type="https://x/invalid-field", errors=errors))
    with pytest.raises(ServiceError) as caught:
        connect(service).lookup("llama", TOKENS)
    error = caught.value
    assert error.status == 422
    assert error.problem_body["errors"] == errors
    assert error.problem_type == "https://x/invalid-field"
    assert error.detail == "no"


def test_a_non_json_error_body_becomes_the_detail(connect: Any) -> None:
    service = Service(lambda request: httpx.Response(502, text="<h1>Bad Gateway</h1>"))
    with pytest.raises(ServiceError) as caught:
        connect(service).stats()
    assert caught.value.status == 502
    assert caught.value.detail == "<h1>Bad Gateway</h1>"
    assert caught.value.problem_body["title"] == "Bad Gateway"


@pytest.mark.parametrize(
    "error", [httpx.ConnectError, httpx.ReadTimeout, httpx.RemoteProtocolError]
)
def test_transport_errors_and_timeouts_raise_service_unavailable(
    connect: Any, error: type[httpx.TransportError]
) -> None:
    def fail(request: httpx.Request) -> httpx.Response:
        raise error("boom", request=request)

    with pytest.raises(ServiceUnavailable) as caught:
        connect(Service(fail)).lookup("llama", TOKENS)
    assert caught.value.status == 503
    assert isinstance(caught.value.__cause__, error)
    assert "/v1/lookup" in caught.value.detail


def test_a_5xx_answer_raises_without_fail_open(connect: Any) -> None:
    with pytest.raises(ServiceError) as caught:
        connect(Service(answer_problem(503))).put_prefix("llama", TOKENS, [b"x"])
    assert caught.value.status == 503


# Fail-open and backoff --------------------------------------------------------------------


@pytest.mark.parametrize("answer", [unreachable, answer_problem(500), answer_json({"no": 1})])
def test_fail_open_turns_failures_into_misses(connect: Any, answer: Handler) -> None:
    service = Service(answer)
    client = connect(service, fail_open=True, backoff_initial_seconds=0.0)
    assert client.lookup("llama", TOKENS) == MISS
    fetched = client.lookup("llama", TOKENS, fetch=True, block_size=4)
    assert fetched.payloads == []
    assert (fetched.block_size, fetched.usage.prompt_cache_miss_tokens) == (4, 10)
    assert client.get_blocks("llama", [KEY_A, KEY_B]) == [None, None]
    assert client.put_prefix("llama", TOKENS, [b"x", b"y"]) == 0
    assert client.store("llama", TOKENS, [b"x"], start_block=2).requested_blocks == 1
    assert len(service.requests) == 5  # a zero backoff never skips the network


def test_fail_open_backs_off_doubling_up_to_the_max(connect: Any, clock: Clock) -> None:
    service = Service(unreachable)
    client = connect(
        service,
        fail_open=True,
        backoff_initial_seconds=0.5,
        backoff_max_seconds=2.0,
        clock=clock,
    )
    assert client.lookup("llama", TOKENS) == MISS
    assert len(service.requests) == 1
    sent = 1
    for window in (0.5, 1.0, 2.0, 2.0):
        clock.advance(window - 0.25)
        assert client.lookup("llama", TOKENS) == MISS
        assert client.get_blocks("llama", [KEY_A]) == [None]
        assert client.put_prefix("llama", TOKENS, [b"x"]) == 0
        assert len(service.requests) == sent  # inside the window: no network at all
        clock.advance(0.25)
        assert client.lookup("llama", TOKENS) == MISS
        sent += 1
        assert len(service.requests) == sent  # the window is over: one probe, which fails


def test_fail_open_backoff_resets_after_a_success(connect: Any, clock: Clock) -> None:
    up = False

    def flaky(request: httpx.Request) -> httpx.Response:
        return answer_json(LOOKUP_ANSWER)(request) if up else unreachable(request)

    service = Service(flaky)
    client = connect(service, fail_open=True, backoff_initial_seconds=0.5, clock=clock)
    client.lookup("llama", TOKENS)
    clock.advance(0.5)
    client.lookup("llama", TOKENS)  # second failure: the window is now 1.0 s
    clock.advance(1.0)
    up = True
    assert client.lookup("llama", TOKENS).matched_blocks == 2
    up = False
    client.lookup("llama", TOKENS)  # first failure again: 0.5 s, not 2.0 s
    clock.advance(0.5)
    client.lookup("llama", TOKENS)
    assert len(service.requests) == 5


@pytest.mark.parametrize("status", [400, 404, 409, 413, 415, 422])
def test_fail_open_still_raises_4xx_and_does_not_back_off(
    connect: Any, clock: Clock, status: int
) -> None:
    service = Service(answer_problem(status))
    client = connect(service, fail_open=True, clock=clock)
    for _ in range(2):
        with pytest.raises(ServiceError) as caught:
            client.put_prefix("llama", TOKENS, [b"x"], start_block=1)
        assert caught.value.status == status
    assert len(service.requests) == 2


def test_fail_open_store_full_is_a_miss_but_not_a_backoff(connect: Any, clock: Clock) -> None:
    service = Service(answer_problem(507))
    client = connect(service, fail_open=True, clock=clock)
    assert client.put_prefix("llama", TOKENS, [b"x"]) == 0
    assert client.put_prefix("llama", TOKENS, [b"x"]) == 0
    assert len(service.requests) == 2


def test_fail_open_does_not_cover_info_stats_or_their_backoff(connect: Any, clock: Clock) -> None:
    service = Service(unreachable)
    client = connect(service, fail_open=True, clock=clock)
    with pytest.raises(ServiceUnavailable):
        client.info()
    with pytest.raises(ServiceUnavailable):
        client.stats()
    client.lookup("llama", TOKENS)  # info and stats failures started no backoff
    assert len(service.requests) == 3


def test_concurrent_failures_count_as_one(clock: Clock) -> None:
    in_flight = 0

    async def slow_failure(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight
        in_flight += 1
        while in_flight < 3:  # every call is on the wire before the first one fails
            await asyncio.sleep(0)
        raise httpx.ConnectError("refused", request=request)

    async def scenario() -> int:
        transport = httpx.MockTransport(slow_failure)
        async with AsyncCacheClient(
            BASE_URL, fail_open=True, transport=transport, clock=clock
        ) as client:
            misses = await asyncio.gather(*(client.lookup("llama", TOKENS) for _ in range(3)))
            assert misses == [MISS] * 3
            clock.advance(0.5)  # one failure: the initial window, not 0.5 * 2 * 2
            await client.lookup("llama", TOKENS)
        return in_flight

    assert asyncio.run(scenario()) == 4


# Lifecycle --------------------------------------------------------------------------------


def test_the_sync_client_closes_its_pool_on_exit() -> None:
    with CacheClient(BASE_URL, transport=httpx.MockTransport(unreachable)) as client:
        pass
    with pytest.raises(RuntimeError):
        client.info()


def test_the_async_client_closes_its_pool_on_exit() -> None:
    async def scenario() -> None:
        async with AsyncCacheClient(BASE_URL, transport=httpx.MockTransport(unreachable)) as client:
            pass
        with pytest.raises(RuntimeError):
            await client.info()

    asyncio.run(scenario())


def test_backoff_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        CacheClient(BASE_URL, backoff_initial_seconds=5.0, backoff_max_seconds=1.0)
