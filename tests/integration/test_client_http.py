"""The client over real sockets: a closed port fails open visibly (a warning naming the URL,
limited to one line, and counted misses), healthy() as the start-up check of a real server,
and two writers of different bytes for the same tokens, the second told of its conflicts."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from cache_service.client import AsyncCacheClient, CacheClient, FailOpenCounts
from cache_service.core.errors import ServiceUnavailable
from tests.integration.conftest import ServerProcess, free_port

pytestmark = pytest.mark.integration

LOGGER = "cache_service.client"
PROMPT = list(range(5000, 5256))  # 4 blocks of 64


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The client logger's warning lines."""
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == LOGGER and record.levelno == logging.WARNING
    ]


def closed_url() -> str:
    """The URL of a port on 127.0.0.1 that nobody listens on."""
    return f"http://127.0.0.1:{free_port()}"


def test_a_closed_port_fails_open_with_a_warning_naming_the_url_and_a_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = closed_url()
    registry = CollectorRegistry()
    with CacheClient(url, fail_open=True, metrics_registry=registry) as client:
        miss = client.lookup("llama-3-8b", PROMPT, fetch=True)
        assert (miss.matched_blocks, miss.cached_tokens, miss.payloads) == (0, 0, [])
        assert miss.usage.prompt_cache_miss_tokens == len(PROMPT)
        assert client.failures == FailOpenCounts(connect=1)
        assert client.healthy() is False  # the start-up check would have said so
        with pytest.raises(ServiceUnavailable) as caught:
            client.info()  # not a data-path call: raised, naming the URL
    assert caught.value.detail.startswith(f"GET {url}/v1/info: ConnectError:")
    counted = registry.get_sample_value(
        "prompt_cache_client_fail_open_total", {"reason": "connect"}
    )
    assert counted == 1.0
    [line] = warnings_of(caplog)
    assert line.startswith(f"prompt cache {url} failing open, calls answer misses: ")
    assert f"POST {url}/v1/lookup: ConnectError:" in line
    assert "Connection refused" in line
    assert line.endswith("[connect]")


@pytest.mark.parametrize("twin", ["sync", "async"])
def test_many_failures_on_a_closed_port_log_one_line(
    caplog: pytest.LogCaptureFixture, twin: str
) -> None:
    url = closed_url()
    options: dict[str, Any] = {"fail_open": True, "backoff_initial_seconds": 0.0}
    if twin == "sync":
        with CacheClient(url, **options) as client:
            for _ in range(50):
                assert client.put_prefix("m", PROMPT, [b"kv"] * 4) == 0
            failures = client.failures
    else:

        async def run() -> FailOpenCounts:
            async with AsyncCacheClient(url, **options) as client:
                for _ in range(50):
                    assert (await client.lookup("m", PROMPT)).matched_blocks == 0
                return client.failures

        failures = asyncio.run(run())
    assert failures == FailOpenCounts(connect=50)  # a zero backoff: every call tried and failed
    assert len(warnings_of(caplog)) == 1


def test_healthy_is_the_start_up_check_of_a_real_server(server: ServerProcess) -> None:
    with CacheClient(server.url, fail_open=True) as client:
        assert client.healthy() is True
        assert client.healthy(ready=True) is True

    async def run() -> tuple[bool, bool]:
        async with AsyncCacheClient(server.url) as client:
            return await client.healthy(), await client.healthy(ready=True)

    assert asyncio.run(run()) == (True, True)


def test_a_second_writer_of_other_bytes_is_told_of_its_conflicts(server: ServerProcess) -> None:
    mine = [f"a{i}".encode() * 100 for i in range(4)]
    theirs = [f"b{i}".encode() * 100 for i in range(4)]
    with CacheClient(server.url) as first, CacheClient(server.url) as second:
        stored = first.put_prefix("m", PROMPT, mine)
        assert (stored, stored.conflicts, stored.as_sent) == (4, 0, True)

        other = second.put_prefix("m", PROMPT, theirs)
        assert (other, other.identical_blocks, other.conflicts, other.as_sent) == (0, 0, 4, False)

        mixed = second.put_prefix("m", PROMPT, mine[:2] + theirs[2:])
        assert (mixed, mixed.identical_blocks, mixed.conflicts) == (0, 2, 2)

        same = second.put_prefix("m", PROMPT, mine)
        assert (same, same.identical_blocks, same.conflicts, same.as_sent) == (0, 4, 0, True)

        assert second.lookup("m", PROMPT, fetch=True).payloads == mine  # the first writer's

    async def longer() -> Any:
        async with AsyncCacheClient(server.url) as client:
            return await client.put_prefix("m", [*PROMPT, *range(64)], [*theirs, b"new"])

    grown = asyncio.run(longer())
    assert (grown, grown.conflicts, grown.identical_blocks, grown.as_sent) == (1, 4, 0, False)
