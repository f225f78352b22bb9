"""Engines chosen by the prefix they hold: the proxy asks a fake engine's /tokenize and a real
`cache-service serve` that follows the engines' KV events (test publishers over real ZMQ) for
POST /v1/route. Any failure of either call falls back to the choice by requests in flight."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import zmq

from tests.integration.conftest import ServerProcess
from tests.kv_events.prompts import prompt_events
from tests.kv_events.publisher import WIRES, TestPublisher
from tests.pd_proxy.conftest import Proxy, dead_url
from tests.pd_proxy.fake_engine import MODEL, FakeEngine, tokenize

pytestmark = pytest.mark.integration

MakeEngine = Callable[[str], FakeEngine]
MakeProxy = Callable[..., Proxy]
SCHEME = "vllm-sha256-cbor"
HELD_PROMPT = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ!?"  # 4 blocks of 16
OTHER_PROMPT = "a prompt that no engine holds any block of, long enough for blocks"


@pytest.fixture
def context() -> Iterator[zmq.Context[Any]]:
    """A ZMQ context for the test's publishers, destroyed after it."""
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def complete(proxy: Proxy, prompt: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
    return httpx.post(proxy.url + "/v1/completions", json=body, timeout=20.0)


def served_by(engines: list[FakeEngine], prompt: str) -> list[str]:
    return [e.name for e in engines for r in e.completions() if r.body["prompt"] == prompt]


def test_the_engines_holding_the_longest_prefix_are_chosen(
    make_server: Callable[..., ServerProcess],
    make_engine: MakeEngine,
    make_proxy: MakeProxy,
    context: zmq.Context[Any],
) -> None:
    publishers = [TestPublisher(context, wire=WIRES["vllm-map-batch"]) for _ in range(4)]
    try:
        service = make_server(
            kv_events=",".join(p.endpoint for p in publishers),
            kv_events_hash_scheme=SCHEME,
            kv_events_block_size="16",
            kv_events_seed="0",
        )
        for publisher in publishers:
            publisher.wait_for_subscriber()
        # Engines are named as the service names them: HOST:PORT of their publisher.
        names = [p.endpoint.removeprefix("tcp://") for p in publishers]
        p0, p1, d0, d1 = (make_engine(name) for name in names)
        tokens = tokenize(HELD_PROMPT)
        for holder in (publishers[1], publishers[3]):  # p1 and d1 hold the whole prompt
            holder.publish(prompt_events(SCHEME, tokens, seed="0"))
        wait_for_blocks(service, [names[1], names[3]], 4)
        # An engine of the proxy's that publishes no KV events: the service refuses a question
        # naming it (422 unknown-instance), and the proxy asks about every engine instead.
        unknown = make_engine("d-unknown")
        proxy = make_proxy([p0, p1], [d0, d1, unknown], cache_url=service.url)

        for _ in range(3):
            assert complete(proxy, HELD_PROMPT).status_code == 200
        assert served_by([p0, p1, d0, d1, unknown], HELD_PROMPT) == [names[1]] * 3 + [names[3]] * 3
        for _ in range(2):  # held nowhere: in turn
            assert complete(proxy, OTHER_PROMPT).status_code == 200
        assert sorted(served_by([p0, p1], OTHER_PROMPT)) == sorted(names[:2])
        assert len(set(served_by([d0, d1, unknown], OTHER_PROMPT))) == 2
        route_failures = "prompt_cache_pd_proxy_route_failures_total"
        assert proxy.sample(route_failures, reason="route") == 0
        assert proxy.sample(route_failures, reason="tokenize") == 0
        asked = [r.body for e in (p0, p1) for r in e.received if r.path == "/tokenize"]
        assert {"model": MODEL, "prompt": HELD_PROMPT} in asked
    finally:
        for publisher in publishers:
            publisher.close()


def wait_for_blocks(service: ServerProcess, names: list[str], blocks: int) -> None:
    deadline = time.monotonic() + 10.0
    while True:
        report = httpx.get(service.url + "/v1/stats", timeout=5.0).json()["kv_events"]
        if all(report[name]["blocks"] == blocks for name in names):
            return
        assert time.monotonic() < deadline, f"the service never saw the blocks: {report}"
        time.sleep(0.02)


def test_an_unreachable_cache_service_falls_back_to_requests_in_flight(
    make_engine: MakeEngine, make_proxy: MakeProxy
) -> None:
    prefill, decode = make_engine("p0"), make_engine("d0")
    proxy = make_proxy([prefill], [decode], cache_url=dead_url())
    started = time.monotonic()
    assert complete(proxy, HELD_PROMPT).status_code == 200
    assert time.monotonic() - started < 4.0
    assert [r.path for r in prefill.received] == ["/tokenize", "/v1/completions"]
    assert proxy.sample("prompt_cache_pd_proxy_route_failures_total", reason="route") == 1
    assert decode.completions()[0].body["kv_transfer_params"]["do_remote_prefill"] is True


def test_a_failed_tokenize_falls_back_to_requests_in_flight(
    make_engine: MakeEngine, make_proxy: MakeProxy
) -> None:
    prefill, decode = make_engine("p0"), make_engine("d0")
    prefill.tokenize_status = 500
    proxy = make_proxy([prefill], [decode], cache_url=dead_url())
    assert complete(proxy, HELD_PROMPT).status_code == 200
    assert proxy.sample("prompt_cache_pd_proxy_route_failures_total", reason="tokenize") == 1
    assert proxy.sample("prompt_cache_pd_proxy_route_failures_total", reason="route") == 0
