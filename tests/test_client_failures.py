"""Failing open visibly, against httpx.MockTransport: base URLs checked when a client is made,
errors that name the URL, fail-open misses counted by reason (and exported on a registry
passed in), and a warning log limited to one line per URL per interval. Both twins."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import prometheus_client
import pytest
from prometheus_client import CollectorRegistry

from cache_service.client import AsyncCacheClient, CacheClient, FailOpenCounts
from cache_service.client.failures import LOG_INTERVAL_SECONDS
from cache_service.core.errors import ServiceError, ServiceUnavailable
from tests.test_client import (
    KEY_A,
    LOOKUP_ANSWER,
    MISS,
    TOKENS,
    Clock,
    Handler,
    Service,
    answer_json,
    answer_problem,
    twin_opener,
    unreachable,
)

LOGGER = "cache_service.client"
METRIC = "prompt_cache_client_fail_open_total"


def fresh_url() -> str:
    """A base URL no other test uses: the log's interval is kept per URL, across clients."""
    return f"http://cache-{uuid.uuid4().hex[:12]}.test"


def failing(error: type[httpx.TransportError]) -> Handler:
    """A service whose every request fails with `error`."""

    def fail(request: httpx.Request) -> httpx.Response:
        raise error("boom", request=request)

    return fail


@pytest.fixture(params=["sync", "async"])
def connect(request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    """Open a CacheClient, or an AsyncCacheClient behind `Blocking`, on a fresh URL."""
    with twin_opener(request.param, fresh_url) as open_client:
        yield open_client


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The client logger's warning lines."""
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == LOGGER and record.levelno == logging.WARNING
    ]


# Base URLs --------------------------------------------------------------------------------


@pytest.mark.parametrize("twin", [CacheClient, AsyncCacheClient])
@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("127.0.0.1:8080", "did you mean 'http://127.0.0.1:8080'"),
        ("localhost:8080", "did you mean 'http://localhost:8080'"),
        ("cache.internal", "no scheme"),
        ("ftp://cache.test", "must be http or https, not 'ftp'"),
        ("ws://cache.test:8080", "must be http or https, not 'ws'"),
        ("http://", "names no host"),
        ("http://[::1", "is not a URL"),
    ],
)
def test_a_base_url_without_an_http_scheme_and_host_is_refused_at_creation(
    twin: type[CacheClient | AsyncCacheClient], url: str, says: str
) -> None:
    with pytest.raises(ValueError, match="base_url") as caught:
        twin(url, transport=None)
    assert says in str(caught.value)


@pytest.mark.parametrize("url", ["http://cache.test", "https://cache.test/prefix", "HTTP://X:1"])
def test_http_and_https_base_urls_are_accepted(url: str) -> None:
    with CacheClient(url, transport=httpx.MockTransport(answer_json({}))) as client:
        assert client.stats() == {}


# Errors name the URL ------------------------------------------------------------------------


def test_a_connection_error_names_the_url_it_tried(connect: Any) -> None:
    url = fresh_url()
    with pytest.raises(ServiceUnavailable) as caught:
        connect(Service(unreachable), base_url=url + "/cache").lookup("llama", TOKENS)
    assert caught.value.detail == (f"POST {url}/cache/v1/lookup: ConnectError: connection refused")


def test_errors_and_logs_never_show_the_urls_password(
    connect: Any, caplog: pytest.LogCaptureFixture
) -> None:
    host = fresh_url().removeprefix("http://")
    client = connect(Service(unreachable), base_url=f"http://worker:hunter2@{host}", fail_open=True)
    client.lookup("llama", TOKENS)
    with pytest.raises(ServiceUnavailable) as caught:
        client.info()
    assert f"GET http://{host}/v1/info" in caught.value.detail
    assert "hunter2" not in caught.value.detail
    assert warnings_of(caplog) and not any("hunter2" in line for line in warnings_of(caplog))


# Counted by reason --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (unreachable, "connect"),
        (failing(httpx.ConnectTimeout), "timeout"),
        (failing(httpx.ReadTimeout), "timeout"),
        (failing(httpx.RemoteProtocolError), "transport"),
        (answer_problem(503), "status"),
        (answer_json({"no": 1}), "invalid_answer"),
        (answer_problem(507), "store_full"),
    ],
)
def test_fail_open_counts_every_miss_by_reason(connect: Any, answer: Handler, reason: str) -> None:
    client = connect(Service(answer), fail_open=True, backoff_initial_seconds=0.0)
    assert client.failures == FailOpenCounts()
    client.lookup("llama", TOKENS)
    client.get_blocks("llama", [KEY_A])
    assert client.put_prefix("llama", TOKENS, [b"x"]) == 0
    assert client.failures == FailOpenCounts(**{reason: 3})
    assert client.failures.total == 3


def test_misses_skipped_while_backing_off_are_counted_as_backoff(
    connect: Any, clock: Clock
) -> None:
    service = Service(unreachable)
    client = connect(service, fail_open=True, backoff_initial_seconds=1.0, clock=clock)
    for _ in range(4):
        assert client.lookup("llama", TOKENS) == MISS
    assert len(service.requests) == 1
    assert client.failures == FailOpenCounts(connect=1, backoff=3)


def test_without_fail_open_errors_raise_and_nothing_is_counted(connect: Any) -> None:
    client = connect(Service(answer_problem(500)))
    with pytest.raises(ServiceError):
        client.lookup("llama", TOKENS)
    assert client.failures == FailOpenCounts()


def test_healthy_is_false_on_failure_but_not_a_fail_open_miss(connect: Any) -> None:
    client = connect(Service(unreachable), fail_open=True)
    assert client.healthy() is False
    assert client.failures.total == 0


def test_a_metrics_registry_exports_fail_open_misses_by_reason() -> None:
    registry = CollectorRegistry()
    down = httpx.MockTransport(unreachable)
    url = fresh_url()
    with CacheClient(url, fail_open=True, transport=down, metrics_registry=registry) as client:
        assert registry.get_sample_value(METRIC, {"reason": "connect"}) == 0.0
        client.lookup("llama", TOKENS)
    # A second client on the same registry (a worker re-creating its client) shares the counter.
    twin = AsyncCacheClient(url, fail_open=True, transport=down, metrics_registry=registry)

    async def one_lookup() -> None:
        async with twin:
            await twin.lookup("llama", TOKENS)

    asyncio.run(one_lookup())
    assert registry.get_sample_value(METRIC, {"reason": "connect"}) == 2.0
    assert registry.get_sample_value(METRIC, {"reason": "timeout"}) == 0.0


def test_without_a_registry_no_metric_is_registered_anywhere() -> None:
    with CacheClient(fresh_url(), fail_open=True, transport=httpx.MockTransport(unreachable)) as c:
        c.lookup("llama", TOKENS)
        assert c.failures.connect == 1
    assert prometheus_client.REGISTRY.get_sample_value(METRIC, {"reason": "connect"}) is None


# One log line per URL per interval ---------------------------------------------------------


def test_fail_open_logs_a_warning_naming_the_url_and_the_error(
    connect: Any, caplog: pytest.LogCaptureFixture
) -> None:
    url = fresh_url()
    connect(Service(answer_problem(503)), base_url=url, fail_open=True).lookup("llama", TOKENS)
    assert warnings_of(caplog) == [
        f"prompt cache {url} failing open, calls answer misses: "
        f"POST {url}/v1/lookup answered 503: no [status]"
    ]


def test_the_log_says_how_many_misses_it_left_out_once_the_interval_is_over(
    connect: Any, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    url = fresh_url()
    client = connect(
        Service(unreachable), base_url=url, fail_open=True, backoff_initial_seconds=1.0, clock=clock
    )
    client.lookup("llama", TOKENS)  # logged
    for _ in range(5):
        clock.advance(1.0)
        client.lookup("llama", TOKENS)  # a failure each: out of backoff, inside the interval
        client.lookup("llama", TOKENS)  # skipped by the backoff it started
    assert len(warnings_of(caplog)) == 1
    clock.advance(LOG_INTERVAL_SECONDS)
    client.lookup("llama", TOKENS)
    lines = warnings_of(caplog)
    assert len(lines) == 2
    assert lines[1].startswith(f"prompt cache {url} failing open, calls answer misses: POST {url}")
    assert lines[1].endswith("[connect] (10 more fail-open misses since the last line)")


def test_clients_of_one_url_share_its_log_interval(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    url = fresh_url()
    for _ in range(3):  # a worker that opens a client per request still logs one line
        transport = httpx.MockTransport(unreachable)
        with CacheClient(url, fail_open=True, transport=transport, clock=clock) as client:
            client.lookup("llama", TOKENS)
    assert len(warnings_of(caplog)) == 1
    with CacheClient(fresh_url(), fail_open=True, transport=transport, clock=clock) as other:
        other.lookup("llama", TOKENS)
    assert len(warnings_of(caplog)) == 2  # another URL has an interval of its own


def test_a_success_logs_nothing(connect: Any, caplog: pytest.LogCaptureFixture) -> None:
    client = connect(Service(answer_json(LOOKUP_ANSWER)), fail_open=True)
    assert client.lookup("llama", TOKENS).matched_blocks == 2
    assert warnings_of(caplog) == []
