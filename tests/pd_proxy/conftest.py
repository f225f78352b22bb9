"""Fixtures of the proxy's tests: fake engines and the proxy itself, each served by uvicorn in
a thread on 127.0.0.1 and stopped by the fixture that started it."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from cache_service.tools.pd_proxy.app import create_app
from cache_service.tools.pd_proxy.metrics import ProxyMetrics
from cache_service.tools.pd_proxy.options import EngineAddress, ProxyOptions
from tests.integration.conftest import free_port
from tests.pd_proxy.fake_engine import FakeEngine
from tests.pd_proxy.servers import ThreadedServer

# Short enough for a quick suite, long enough for a loaded 2-core machine.
TEST_OPTIONS: dict[str, Any] = {
    "prefill_timeout_seconds": 5.0,
    "decode_timeout_seconds": 5.0,
    "connect_timeout_seconds": 1.0,
    "health_interval_seconds": 0.2,
    "route_timeout_seconds": 1.0,
}


@dataclass
class Proxy:
    """A running proxy: its URL and its metrics (read in-process)."""

    url: str
    metrics: ProxyMetrics
    options: ProxyOptions

    def sample(self, name: str, **labels: str) -> float:
        """A metric's sample value (0 when it has none yet)."""
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


Target = FakeEngine | tuple[str, str]  # a fake engine, or (name, url) of anything


def dead_url() -> str:
    """A URL where nothing listens (connections are refused)."""
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture
def make_engine() -> Iterator[Callable[[str], FakeEngine]]:
    """A factory of started fake engines, all stopped at teardown."""
    started: list[FakeEngine] = []

    def factory(name: str) -> FakeEngine:
        engine = FakeEngine(name)
        started.append(engine)
        return engine.start()

    yield factory
    for engine in started:
        engine.stop()


@pytest.fixture
def make_proxy() -> Iterator[Callable[..., Proxy]]:
    """A factory of started proxies over the engines given; all stopped at teardown."""
    servers: list[ThreadedServer] = []

    def factory(prefill: Sequence[Target], decode: Sequence[Target], **options: Any) -> Proxy:
        proxy_options = ProxyOptions(
            prefill=tuple(_address(t) for t in prefill),
            decode=tuple(_address(t) for t in decode),
            **{**TEST_OPTIONS, **options},
        )
        metrics = ProxyMetrics()
        server = ThreadedServer(create_app(proxy_options, metrics=metrics), name="pd-proxy")
        servers.append(server)
        server.start()
        return Proxy(server.url, metrics, proxy_options)

    yield factory
    for server in servers:
        server.stop()


def _address(target: Target) -> EngineAddress:
    if isinstance(target, FakeEngine):
        return EngineAddress(target.name, target.url)
    return EngineAddress(*target)
