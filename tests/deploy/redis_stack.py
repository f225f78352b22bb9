"""The Redis stack of tests/deploy: the service on a real redis-server, a real Prometheus with
our rules, and a real outage.

The LMDB live stack cannot show the backend's series: only a remote store exports them. Here
the service stores on one redis-server (a single node serves the Redis store as a cluster of
one would); Prometheus scrapes the backend counters at zero first, then the traffic lands,
then the node is killed (SIGKILL, by its PID) and the service answers lookups as misses and
refuses stores with 503 until its write breaker opens. The stack waits until Prometheus holds
the final counts and has evaluated its rules on them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from cache_service.client import CacheClient
from cache_service.core.errors import ServiceError
from cache_service.service.backend_metrics import SYNC_SECONDS
from tests.deploy.live_stack import BLOCK, MODEL, RULES, SCRAPE_WAIT_SECONDS, tokens
from tests.deploy.prometheus_process import PrometheusProcess, Series, wait_for_rules_after_scrape
from tests.integration.conftest import ServerProcess, free_port
from tests.redis_cluster.nodes import MEMORY, single_node

FAILED_LOOKUPS = 60  # with Redis gone: enough for a 5-minute rate above the alert's guard
REFUSED_STORES = 3  # the breaker opens after three refusals in a row (store/redis/breaker.py)
STORE_SECONDS = 60.0  # a refused store waits out its retries (5 s at least) first


@dataclass
class RedisStack:
    """What the tests read: both processes and the service's final backend counters."""

    service: ServerProcess
    prometheus: PrometheusProcess
    metrics_url: str
    counts: dict[str, float]  # the service's own /metrics samples once the outage was done

    def query(self, expr: str) -> Series:
        """An instant query against the stack's Prometheus."""
        return self.prometheus.query(expr)


def samples(text: str) -> dict[str, float]:
    """Every sample of a text exposition, by its name with labels as written."""
    found = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found


def final_counts(metrics_url: str) -> dict[str, float]:
    """The lookups answered and the backend counters, summed, from the service's /metrics."""
    exposed = samples(httpx.get(metrics_url, timeout=10.0).text)
    lookups = [v for k, v in exposed.items() if k.startswith("prompt_cache_lookups_total{")]
    counts = {"lookups": sum(lookups)}
    for field in ("lookup_errors", "write_retries", "write_failures", "breaker_opened"):
        counts[field] = exposed[f"prompt_cache_backend_{field}_total"]
    return counts


def drive_outage(service: ServerProcess, kill_redis: Callable[[], None]) -> None:
    """Stores and hits while Redis answers; then Redis killed: lookups (misses) and stores
    refused with 503, concurrently, so that their retries overlap."""
    with CacheClient(service.url) as client:
        prompt = tokens(0, 4 * BLOCK)
        client.store(MODEL, prompt, [b"r" * 256] * 4)
        for _ in range(5):
            assert client.lookup(MODEL, prompt).matched_blocks == 4
        kill_redis()
        for _ in range(FAILED_LOOKUPS):
            assert client.lookup(MODEL, prompt).matched_blocks == 0  # a miss, never a 5xx

    def refused(first: int) -> int:
        with CacheClient(service.url, timeout=STORE_SECONDS) as client:
            try:
                client.store(MODEL, tokens(first, 2 * BLOCK), [b"s" * 64] * 2)
            except ServiceError as exc:
                return exc.status
        return 200

    with ThreadPoolExecutor(REFUSED_STORES) as pool:
        answers = list(pool.map(refused, [1000 * (i + 1) for i in range(REFUSED_STORES)]))
    assert answers == [503] * REFUSED_STORES


def wait_until_scraped_and_evaluated(stack: RedisStack) -> None:
    """Wait until Prometheus holds the service's final backend counts, then until the rules
    have been evaluated a full interval after that scrape."""
    prometheus = stack.prometheus

    def total(field: str) -> None:
        expected = stack.counts[field]
        prometheus.wait_for(
            f"sum(prompt_cache_backend_{field}_total)",
            lambda result: bool(result) and float(result[0]["value"][1]) == expected,
            what=f"a scrape with prompt_cache_backend_{field}_total == {expected}",
            timeout_seconds=SCRAPE_WAIT_SECONDS,
        )

    for field in ("lookup_errors", "write_failures", "breaker_opened"):
        total(field)
    wait_for_rules_after_scrape(
        prometheus,
        "prompt_cache_backend_write_failures_total",
        "instance:prompt_cache_backend_lookup_errors_per_lookup:ratio_rate5m",
        timeout_seconds=SCRAPE_WAIT_SECONDS,
    )


@contextlib.contextmanager
def start_redis_stack(prometheus_binary: Path, workdir: Path) -> Iterator[RedisStack]:
    """Start redis-server, the service on it and Prometheus; drive the traffic and the
    outage; wait for the scrape and the rules; stop every process (by PID) on exit."""
    metrics_port = free_port()
    with single_node(workdir, *MEMORY) as (redis_process, redis_port):
        service = ServerProcess(
            workdir / "data",
            workdir / "service.log",
            store=f"redis://127.0.0.1:{redis_port}",
            metrics_port=str(metrics_port),
            block_size=str(BLOCK),
            touch_flush_interval="0.05",
        )
        prometheus = PrometheusProcess(
            prometheus_binary,
            workdir / "prometheus",
            targets=[f"127.0.0.1:{metrics_port}"],
            rule_files=sorted(RULES.glob("*.yml")),
        )
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        try:
            service.start()
            prometheus.start()
            # The backend counters at zero first: a rate needs a sample before the outage.
            prometheus.wait_for(
                "prompt_cache_backend_write_failures_total",
                lambda result: len(result) == 1,
                what="a scrape of the backend counters",
                timeout_seconds=SCRAPE_WAIT_SECONDS,
            )

            def kill_redis() -> None:
                redis_process.kill()
                redis_process.wait()

            drive_outage(service, kill_redis)
            stack = RedisStack(service, prometheus, metrics_url, counts={})
            # The service copies its store's counts into the counters once a second.
            prometheus.wait_for(
                "sum(prompt_cache_backend_breaker_opened_total)",
                lambda result: bool(result) and float(result[0]["value"][1]) >= 1,
                what="a scrape with the write breaker opened",
                timeout_seconds=SCRAPE_WAIT_SECONDS,
            )
            time.sleep(2 * SYNC_SECONDS)  # any count of the same moment is copied by then
            stack.counts = final_counts(metrics_url)
            wait_until_scraped_and_evaluated(stack)
            yield stack
        finally:
            prometheus.stop()
            service.stop()
