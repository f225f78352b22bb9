"""The proxy's own endpoints: /healthz, /readyz following the decode engines' health,
/v1/models from a decode engine, and /metrics in Prometheus's text format."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.pd_proxy.conftest import Proxy, dead_url
from tests.pd_proxy.fake_engine import MODEL, FakeEngine

pytestmark = pytest.mark.integration

MakeEngine = Callable[[str], FakeEngine]
MakeProxy = Callable[..., Proxy]


def wait_for_status(url: str, status: int, *, seconds: float = 5.0) -> httpx.Response:
    deadline = time.monotonic() + seconds
    while True:
        answer = httpx.get(url, timeout=5.0)
        if answer.status_code == status or time.monotonic() > deadline:
            return answer
        time.sleep(0.05)


def test_readyz_follows_the_decode_engines_health_checks(
    make_engine: MakeEngine, make_proxy: MakeProxy
) -> None:
    decode = make_engine("d0")
    proxy = make_proxy([("p-gone", dead_url())], [decode])
    assert httpx.get(proxy.url + "/healthz", timeout=5).json() == {"status": "ok"}
    ready = httpx.get(proxy.url + "/readyz", timeout=5)
    assert ready.status_code == 200
    assert ready.json()["engines"]["decode"] == {"d0": "healthy"}
    assert ready.json()["engines"]["prefill"]["p-gone"].startswith("down: GET /health failed")

    decode.health_status = 503
    down = wait_for_status(proxy.url + "/readyz", 503)
    assert down.status_code == 503
    assert down.headers["content-type"] == "application/problem+json"
    assert down.json()["type"].endswith("/no-decode-engine")
    assert down.json()["engines"]["decode"] == {"d0": "down: GET /health answered 503"}
    assert proxy.sample("prompt_cache_pd_proxy_engine_up", engine="d0", role="decode") == 0

    decode.health_status = 200
    assert wait_for_status(proxy.url + "/readyz", 200).status_code == 200
    assert httpx.get(proxy.url + "/healthz", timeout=5).status_code == 200


def test_models_come_from_a_healthy_decode_engine(
    make_engine: MakeEngine, make_proxy: MakeProxy
) -> None:
    prefill, decode = make_engine("p0"), make_engine("d0")
    proxy = make_proxy([prefill], [decode])
    answer = httpx.get(proxy.url + "/v1/models", headers={"Authorization": "Bearer k"}, timeout=5)
    assert answer.status_code == 200
    assert answer.json()["data"] == [{"id": MODEL, "owned_by": "d0"}]
    [asked] = [r for r in decode.received if r.path == "/v1/models"]
    assert asked.headers["authorization"] == "Bearer k"


def test_metrics_are_exposed_with_one_prefix_and_counted(
    make_engine: MakeEngine, make_proxy: MakeProxy
) -> None:
    proxy = make_proxy([("p-gone", dead_url())], [make_engine("d0")])
    body = {"model": MODEL, "prompt": "hi"}
    assert httpx.post(proxy.url + "/v1/completions", json=body, timeout=10).status_code == 200
    text = httpx.get(proxy.url + "/metrics", timeout=5).text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert set(families) == {
        "prompt_cache_pd_proxy_" + name
        for name in (
            "requests", "prefill_seconds", "decode_seconds", "decode_first_byte_seconds",
            "fallbacks", "failovers", "route_failures", "engine_up", "engine_in_flight",
            "prompt_tokens", "completion_tokens",
        )
    }  # fmt: skip
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in families.values()
        for sample in family.samples
    }
    requests = "prompt_cache_pd_proxy_requests_total"
    assert samples[(requests, (("endpoint", "completions"), ("outcome", "ok")))] == 1
    fallbacks = "prompt_cache_pd_proxy_fallbacks_total"
    assert samples[(fallbacks, (("reason", "no_prefill"),))] == 1
    assert samples[(fallbacks, (("reason", "prefill_timeout"),))] == 0
    up = "prompt_cache_pd_proxy_engine_up"
    assert samples[(up, (("engine", "p-gone"), ("role", "prefill")))] == 0
    assert samples[(up, (("engine", "d0"), ("role", "decode")))] == 1
    assert samples[("prompt_cache_pd_proxy_prompt_tokens_total", ())] == 7
