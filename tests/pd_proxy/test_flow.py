"""The proxy's request flow against fake engines served by real uvicorn: P then D with P's
params, streaming passed through, and every failure ending in an answer, never a hang."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import orjson
import pytest

from tests.pd_proxy.conftest import Proxy, dead_url
from tests.pd_proxy.fake_engine import (
    MODEL,
    PREFILL_ANSWER_PARAMS,
    USAGE,
    FakeEngine,
    answer_text,
    stream_events,
)

pytestmark = pytest.mark.integration

MakeEngine = Callable[[str], FakeEngine]
MakeProxy = Callable[..., Proxy]
COMPLETION = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 16}
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Say hello"}],
    "max_completion_tokens": 16,
    "stream_options": {"include_usage": True},
}
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}


def post(proxy: Proxy, path: str, body: object, **headers: str) -> httpx.Response:
    return httpx.post(proxy.url + path, json=body, headers=headers, timeout=20.0)


def test_completion_goes_to_prefill_then_decode_with_the_params_prefill_returned(
    make_engine: MakeEngine, make_proxy: MakeProxy
) -> None:
    prefill, decode = make_engine("p0"), make_engine("d0")
    proxy = make_proxy([prefill], [decode])
    answer = post(proxy, "/v1/completions", COMPLETION, authorization="Bearer engine-key")

    assert answer.status_code == 200
    assert answer.json()["choices"][0]["text"] == answer_text("d0")
    [sent_p] = prefill.completions()
    assert sent_p.body == {
        **COMPLETION,
        "max_tokens": 1,
        "n": 1,
        "stream": False,
        "kv_transfer_params": PREFILL_PARAMS,
    }
    [sent_d] = decode.completions()
    assert sent_d.body == {**COMPLETION, "kv_transfer_params": PREFILL_ANSWER_PARAMS}
    assert answer.json()["received_kv_transfer_params"] == PREFILL_ANSWER_PARAMS
    for sent in (sent_p, sent_d):  # the client's key, and one request id for both
        assert sent.headers["authorization"] == "Bearer engine-key"
    assert sent_p.headers["x-request-id"] == sent_d.headers["x-request-id"]
    assert (
        proxy.sample("prompt_cache_pd_proxy_requests_total", endpoint="completions", outcome="ok")
        == 1
    )
    assert proxy.sample("prompt_cache_pd_proxy_prompt_tokens_total") == USAGE["prompt_tokens"]
    assert proxy.sample("prompt_cache_pd_proxy_completion_tokens_total") == 3
    assert proxy.sample("prompt_cache_pd_proxy_prefill_seconds_count") == 1
    assert proxy.sample("prompt_cache_pd_proxy_decode_seconds_count") == 1


def test_chat_prefill_is_capped_by_both_token_limits_and_never_streams(
    make_engine: MakeEngine, make_proxy: MakeProxy
) -> None:
    prefill, decode = make_engine("p0"), make_engine("d0")
    proxy = make_proxy([prefill], [decode])
    body = {**CHAT, "stream": True, "n": 2, "kv_transfer_params": {"prompt_cache": {}}}
    answer = post(proxy, "/v1/chat/completions", body)

    assert answer.status_code == 200
    sent_p = prefill.completions()[0].body
    assert (sent_p["max_tokens"], sent_p["max_completion_tokens"]) == (1, 1)
    assert (sent_p["n"], sent_p["stream"]) == (1, False)
    assert "stream_options" not in sent_p
    assert sent_p["kv_transfer_params"] == {"prompt_cache": {}, **PREFILL_PARAMS}
    sent_d = decode.completions()[0].body
    assert sent_d == {**body, "kv_transfer_params": {"prompt_cache": {}, **PREFILL_ANSWER_PARAMS}}


def test_streaming_passes_the_decode_engines_bytes_through_and_counts_its_usage(
    make_engine: MakeEngine, make_proxy: MakeProxy
) -> None:
    proxy = make_proxy([make_engine("p0")], [make_engine("d0")])
    body = {**CHAT, "stream": True}
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body, timeout=20) as got:
        assert got.status_code == 200
        assert got.headers["content-type"].startswith("text/event-stream")
        received = b"".join(got.iter_raw())
    assert received == b"".join(stream_events("d0", body, chat=True))
    assert proxy.sample("prompt_cache_pd_proxy_prompt_tokens_total") == 7
    assert proxy.sample("prompt_cache_pd_proxy_decode_first_byte_seconds_count") == 1
    assert proxy.sample("prompt_cache_pd_proxy_engine_in_flight", engine="d0", role="decode") == 0


def test_a_prefill_engine_that_cannot_be_reached_leaves_decode_to_compute_alone(
    make_engine: MakeEngine, make_proxy: MakeProxy
) -> None:
    prefill, decode = make_engine("p0"), make_engine("d0")
    proxy = make_proxy([prefill], [decode], health_interval_seconds=60.0)
    prefill.stop()  # healthy at the proxy's start; gone now

    first = post(proxy, "/v1/completions", COMPLETION)
    second = post(proxy, "/v1/completions", COMPLETION)
    assert (first.status_code, second.status_code) == (200, 200)
    assert [sent.body for sent in decode.completions()] == [COMPLETION, COMPLETION]  # no params
    fallbacks = "prompt_cache_pd_proxy_fallbacks_total"
    assert proxy.sample(fallbacks, reason="prefill_error") == 1  # and marked down at once:
    assert proxy.sample(fallbacks, reason="no_prefill") == 1
    assert proxy.sample("prompt_cache_pd_proxy_engine_up", engine="p0", role="prefill") == 0


def test_a_prefill_engine_answering_500_is_a_fallback(
    make_engine: MakeEngine, make_proxy: MakeProxy
) -> None:
    prefill, decode = make_engine("p0"), make_engine("d0")
    prefill.behaviour = "500"
    proxy = make_proxy([prefill], [decode])
    answer = post(proxy, "/v1/completions", COMPLETION)
    assert answer.status_code == 200
    assert answer.json()["received_kv_transfer_params"] is None
    assert proxy.sample("prompt_cache_pd_proxy_fallbacks_total", reason="prefill_error") == 1


def test_a_prefill_engine_past_its_timeout_leaves_decode_to_compute_alone(
    make_engine: MakeEngine, make_proxy: MakeProxy
) -> None:
    prefill, decode = make_engine("p0"), make_engine("d0")
    prefill.behaviour = "hang"
    proxy = make_proxy([prefill], [decode], prefill_timeout_seconds=0.5)
    started = time.monotonic()
    answer = post(proxy, "/v1/completions", COMPLETION)
    assert answer.status_code == 200
    assert 0.5 <= time.monotonic() - started < 4.0
    assert decode.completions()[0].body == COMPLETION
    assert proxy.sample("prompt_cache_pd_proxy_fallbacks_total", reason="prefill_timeout") == 1
    assert proxy.sample("prompt_cache_pd_proxy_engine_in_flight", engine="p0", role="prefill") == 0


def test_a_decode_engine_that_cannot_be_reached_fails_over_to_the_next(
    make_engine: MakeEngine, make_proxy: MakeProxy
) -> None:
    first, second = make_engine("d0"), make_engine("d1")
    proxy = make_proxy([make_engine("p0")], [first, second], health_interval_seconds=60.0)
    first.stop()  # healthy at the start, so chosen first (in turn), and gone now

    answer = post(proxy, "/v1/completions", COMPLETION)
    assert answer.status_code == 200
    assert answer.json()["engine"] == "d1"
    assert answer.json()["received_kv_transfer_params"] == PREFILL_ANSWER_PARAMS
    assert proxy.sample("prompt_cache_pd_proxy_failovers_total") == 1
    assert proxy.sample("prompt_cache_pd_proxy_engine_up", engine="d0", role="decode") == 0
    assert proxy.sample("prompt_cache_pd_proxy_engine_in_flight", engine="d0", role="decode") == 0


def test_with_every_decode_engine_gone_the_answer_is_a_quick_503_naming_them(
    make_engine: MakeEngine, make_proxy: MakeProxy
) -> None:
    first, second = make_engine("d0"), make_engine("d1")
    proxy = make_proxy([make_engine("p0")], [first, second], health_interval_seconds=60.0)
    first.stop()
    second.stop()

    started = time.monotonic()
    answer = post(proxy, "/v1/completions", {**COMPLETION, "stream": True})
    assert time.monotonic() - started < 3.0
    assert answer.status_code == 503
    assert answer.headers["content-type"] == "application/problem+json"
    problem = answer.json()
    assert problem["type"].endswith("/no-decode-engine")
    assert "d0: ConnectError" in problem["detail"] and "d1: ConnectError" in problem["detail"]
    assert (
        proxy.sample(
            "prompt_cache_pd_proxy_requests_total",
            endpoint="completions",
            outcome="no_decode_engine",
        )
        == 1
    )
    # Both are down now: the next request is refused without trying either.
    again = post(proxy, "/v1/completions", COMPLETION)
    assert again.status_code == 503
    assert "not tried (d0: down:" in again.json()["detail"]


def test_a_decode_stream_cut_mid_way_ends_the_proxys_stream_with_an_error_event(
    make_engine: MakeEngine, make_proxy: MakeProxy
) -> None:
    decode = make_engine("d0")
    decode.behaviour = "cut"
    proxy = make_proxy([make_engine("p0")], [decode])
    body = {**COMPLETION, "stream": True}
    started = time.monotonic()
    with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=20) as got:
        assert got.status_code == 200
        received = b"".join(got.iter_raw())  # ends: the proxy closes its stream cleanly
    assert time.monotonic() - started < 4.0
    events = stream_events("d0", body, chat=False)
    assert received.startswith(events[0] + events[1] + events[2][:9] + b"\n\n")
    last = received.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    error = orjson.loads(last.removeprefix(b"data: "))["error"]
    assert "stream broke off" in error["message"] and error["code"] == 502
    assert b"[DONE]" not in received
    assert (
        proxy.sample(
            "prompt_cache_pd_proxy_requests_total", endpoint="completions", outcome="decode_cut"
        )
        == 1
    )
    assert proxy.sample("prompt_cache_pd_proxy_engine_in_flight", engine="d0", role="decode") == 0


def test_a_busy_decode_engine_is_passed_over_for_an_idle_one(
    make_engine: MakeEngine, make_proxy: MakeProxy
) -> None:
    busy, idle = make_engine("d0"), make_engine("d1")
    busy.behaviour = "stall"
    proxy = make_proxy([make_engine("p0")], [busy, idle])
    body = {**COMPLETION, "stream": True}
    with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=20) as held:
        chunks = held.iter_raw()  # kept: a dropped iterator closes the connection
        assert next(chunks).startswith(b"data: ")  # d0 (first in turn) streams on
        engines = [post(proxy, "/v1/completions", COMPLETION).json()["engine"] for _ in range(2)]
    assert engines == ["d1", "d1"]  # in turn, the second would have been d0


def test_a_client_leaving_mid_stream_frees_the_decode_engine(
    make_engine: MakeEngine, make_proxy: MakeProxy
) -> None:
    decode = make_engine("d0")
    decode.behaviour = "stall"
    proxy = make_proxy([make_engine("p0")], [decode])
    body = {**COMPLETION, "stream": True}
    with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=20) as got:
        chunks = got.iter_raw()
        assert next(chunks).startswith(b"data: ")
        assert proxy.sample("prompt_cache_pd_proxy_engine_in_flight", engine="d0", role="decode")
    # The client has closed its connection, D's stream still open.
    requests = "prompt_cache_pd_proxy_requests_total"
    deadline = time.monotonic() + 5.0
    while proxy.sample(requests, endpoint="completions", outcome="client_gone") == 0:
        assert time.monotonic() < deadline, "the proxy did not notice the client leave"
        time.sleep(0.02)
    assert proxy.sample("prompt_cache_pd_proxy_engine_in_flight", engine="d0", role="decode") == 0
    assert proxy.sample("prompt_cache_pd_proxy_decode_seconds_count") == 1


def test_a_decode_answer_cut_mid_way_is_a_502_and_one_past_its_timeout_a_504(
    make_engine: MakeEngine, make_proxy: MakeProxy
) -> None:
    decode = make_engine("d0")
    proxy = make_proxy([make_engine("p0")], [decode], decode_timeout_seconds=0.5)
    decode.behaviour = "cut"
    cut = post(proxy, "/v1/completions", COMPLETION)
    assert cut.status_code == 502
    assert cut.json()["type"].endswith("/decode-failed")

    decode.behaviour = "hang"
    started = time.monotonic()
    slow = post(proxy, "/v1/completions", COMPLETION)
    assert slow.status_code == 504
    assert slow.json()["type"].endswith("/decode-timeout")
    assert time.monotonic() - started < 4.0
    assert proxy.sample("prompt_cache_pd_proxy_engine_in_flight", engine="d0", role="decode") == 0


def test_a_decode_engines_own_error_passes_through(
    make_engine: MakeEngine, make_proxy: MakeProxy
) -> None:
    decode = make_engine("d0")
    decode.behaviour = "500"
    proxy = make_proxy([make_engine("p0")], [decode])
    answer = post(proxy, "/v1/completions", COMPLETION)
    assert answer.status_code == 500
    assert answer.json()["error"]["message"] == "engine failed"
    assert (
        proxy.sample(
            "prompt_cache_pd_proxy_requests_total", endpoint="completions", outcome="engine_status"
        )
        == 1
    )


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "not a JSON array"),
        (b"", "empty"),
    ],
)
def test_a_body_that_is_not_a_json_object_is_a_400_problem(
    make_engine: MakeEngine, make_proxy: MakeProxy, raw: bytes, says: str
) -> None:
    decode = make_engine("d0")
    proxy = make_proxy([dead_url_target()], [decode])
    answer = httpx.post(proxy.url + "/v1/chat/completions", content=raw, timeout=10)
    assert answer.status_code == 400
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.json()["type"].endswith("/malformed-body")
    assert says in answer.json()["detail"]
    assert decode.completions() == []
    assert (
        proxy.sample(
            "prompt_cache_pd_proxy_requests_total",
            endpoint="chat_completions",
            outcome="bad_request",
        )
        == 1
    )


def test_a_body_over_the_limit_is_a_413_problem_naming_it(
    make_engine: MakeEngine, make_proxy: MakeProxy
) -> None:
    decode = make_engine("d0")
    proxy = make_proxy([dead_url_target()], [decode], max_body_size=1000)
    body = {"model": "m", "prompt": "x" * 2000}
    answer = httpx.post(proxy.url + "/v1/completions", json=body, timeout=10)
    assert answer.status_code == 413
    assert answer.headers["content-type"] == "application/problem+json"
    assert "max_body_size" in answer.json()["detail"]
    assert decode.completions() == []
    assert (
        proxy.sample(
            "prompt_cache_pd_proxy_requests_total", endpoint="completions", outcome="bad_request"
        )
        == 1
    )


def dead_url_target() -> tuple[str, str]:
    return ("p-gone", dead_url())
