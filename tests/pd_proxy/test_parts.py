"""The proxy's parts that start nothing: the choice of an engine, the bodies sent to P and D,
the /tokenize question, the route answer read, and the usage found in a stream."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest

from cache_service.client import InstanceHold, RouteAnswer, StoreHold
from cache_service.tools.pd_proxy import bodies
from cache_service.tools.pd_proxy.app import create_app
from cache_service.tools.pd_proxy.engines import EnginePool
from cache_service.tools.pd_proxy.metrics import ProxyMetrics
from cache_service.tools.pd_proxy.options import EngineAddress, ProxyOptions
from cache_service.tools.pd_proxy.placement import held_by_engine, tokenize_body
from cache_service.tools.pd_proxy.usage import StreamUsage, answer_usage


def pool_of(*decode: str) -> EnginePool:
    addresses = [EngineAddress(name, f"http://127.0.0.1:{i + 2}") for i, name in enumerate(decode)]
    options = ProxyOptions(
        prefill=(EngineAddress("p0", "http://127.0.0.1:1"),), decode=tuple(addresses)
    )
    pool = EnginePool(options, ProxyMetrics())
    for engine in pool.all():
        pool.mark_up(engine)
    return pool


def test_the_engine_holding_the_most_tokens_wins_whatever_its_load() -> None:
    pool = pool_of("d0", "d1", "d2")
    d1 = pool.engines("decode")[1]
    pool.begin(d1)
    pool.begin(d1)
    assert pool.choose("decode", held_tokens={"d1": 32, "d2": 16}) is d1


def test_ties_go_to_the_fewest_in_flight_then_in_turn() -> None:
    pool = pool_of("d0", "d1", "d2")
    d0, d1, d2 = pool.engines("decode")
    pool.begin(d0)
    assert [pool.choose("decode") for _ in range(4)] == [d1, d2, d1, d2]
    pool.mark_down(d2, "gone")
    assert pool.choose("decode", held_tokens={"d2": 64}) is d1
    assert pool.choose("decode", exclude=[d1]) is d0
    pool.mark_down(d1, "gone")
    pool.mark_down(d0, "gone")
    assert pool.choose("decode") is None


def test_prefill_gets_one_token_unstreamed_and_asked_to_keep_its_kv() -> None:
    request = {
        "model": "m",
        "prompt": "x",
        "max_tokens": 50,
        "min_tokens": 5,
        "n": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "kv_transfer_params": {"prompt_cache": {"retention": "chat"}, "do_remote_decode": False},
    }
    assert bodies.prefill_body(request, chat=False) == {
        "model": "m",
        "prompt": "x",
        "max_tokens": 1,
        "n": 1,
        "stream": False,
        "kv_transfer_params": {
            "prompt_cache": {"retention": "chat"},
            "do_remote_decode": True,
            "do_remote_prefill": False,
        },
    }
    assert bodies.prefill_body({"messages": []}, chat=True)["max_completion_tokens"] == 1


def test_decode_gets_the_bytes_as_sent_unless_prefill_returned_params() -> None:
    raw = b'{"model": "m",  "prompt": "x"}'
    body = orjson.loads(raw)
    assert bodies.decode_content(raw, body, None) is raw
    params = {"do_remote_prefill": True}
    assert orjson.loads(bodies.decode_content(raw, body, params)) == {
        **body,
        "kv_transfer_params": params,
    }
    own = {**body, "kv_transfer_params": {"prompt_cache": {"retention": "chat"}, "x": 1}}
    report = {"do_remote_prefill": True, "prompt_cache": {"stored_tokens": 42}}
    assert orjson.loads(bodies.decode_content(raw, own, report))["kv_transfer_params"] == {
        "x": 1,
        "do_remote_prefill": True,
        "prompt_cache": {"retention": "chat", "stored_tokens": 42},
    }


@pytest.mark.parametrize(
    ("answer", "params"),
    [
        (b'{"kv_transfer_params": {"a": 1}}', {"a": 1}),
        (b'{"kv_transfer_params": null}', None),
        (b'{"choices": []}', None),
        (b'{"kv_transfer_params": [1]}', None),
        (b"not json", None),
    ],
)
def test_the_params_prefill_returned_are_an_object_or_none(
    answer: bytes, params: dict[str, int] | None
) -> None:
    assert bodies.returned_params(answer) == params


def test_engines_get_the_clients_key_and_one_request_id() -> None:
    headers = bodies.engine_headers({"authorization": "Bearer k", "cookie": "no"})
    assert headers["authorization"] == "Bearer k"
    assert "cookie" not in headers
    assert headers["x-request-id"].startswith("pd-")
    assert bodies.engine_headers({"x-request-id": "r1"})["x-request-id"] == "r1"


def test_the_tokenize_question_follows_the_endpoint() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": []}
    assert tokenize_body(chat, chat=True) == {
        "model": "m",
        "messages": chat["messages"],
        "tools": [],
    }
    assert tokenize_body({"model": "m", "prompt": ["one"]}, chat=False) == {
        "model": "m",
        "prompt": "one",
    }
    assert tokenize_body({"model": "m", "prompt": [1, 2, 3]}, chat=False) is None  # ids already
    assert tokenize_body({"model": "m", "prompt": ["a", "b"]}, chat=False) is None  # a batch


def hold(instance: str | None, tokens: int, *, live: bool = True) -> InstanceHold:
    return InstanceHold(
        instance=instance,
        medium="GPU",
        matched_blocks=tokens // 16,
        cached_tokens=tokens,
        tokens_to_prefill=64 - tokens,
        block_size=16,
        data_parallel_rank=None,
        stale=False,
        live=live,
    )


def test_an_engine_holds_its_best_medium_and_a_gone_engine_nothing() -> None:
    answer = RouteAnswer(
        model="m",
        prompt_tokens=64,
        instances=[hold("a", 48), hold("b", 32, live=False), hold("a", 16)],
        store=StoreHold(matched_blocks=0, cached_tokens=0, tokens_to_prefill=64, block_size=16),
        best=None,
        unscored={},
    )
    assert held_by_engine(answer) == {"a": 48}


def test_the_streams_final_usage_is_found_across_chunk_boundaries() -> None:
    usage = {"prompt_tokens": 5, "completion_tokens": 2}
    events = (
        b'data: {"choices": [{"text": "usage"}], "usage": null}\n\n'
        + b"data: "
        + orjson.dumps({"choices": [], "usage": usage})
        + b"\n\ndata: [DONE]\n\n"
    )
    scanner = StreamUsage()
    for start in range(0, len(events), 7):
        scanner.feed(events[start : start + 7])
    assert scanner.finish() == usage
    assert answer_usage(b'{"usage": {"prompt_tokens": 1}}') == {"prompt_tokens": 1}
    assert answer_usage(b'{"choices": []}') is None


def test_a_prefill_answer_without_params_leaves_decode_the_request_as_sent() -> None:
    """In process, the engines an httpx.MockTransport: P answers 200 with no JSON at all."""
    sent: dict[str, bytes] = {}

    def engines(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        sent[request.url.host] = request.content
        if request.url.host == "prefill":
            return httpx.Response(200, content=b"not json")
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})

    options = ProxyOptions(
        prefill=(EngineAddress("p0", "http://prefill"),),
        decode=(EngineAddress("d0", "http://decode"),),
    )
    metrics = ProxyMetrics()
    app = create_app(options, metrics=metrics, transport=httpx.MockTransport(engines))
    raw = b'{"model": "m",   "prompt": "x", "max_tokens": 9}'

    async def exchange() -> httpx.Response:
        # httpx's ASGI transport, not starlette's TestClient: the lowest starlette the
        # bounds allow imports a name newer anyio warns about (and warnings are errors)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p") as c,
        ):
            return await c.post("/v1/completions", content=raw)

    answer = asyncio.run(exchange())
    assert answer.json() == {"choices": [{"text": "ok"}]}
    assert orjson.loads(sent["prefill"])["max_tokens"] == 1
    assert sent["decode"] == raw  # byte for byte
    name = "prompt_cache_pd_proxy_fallbacks_total"
    reasons = ("prefill_error", "prefill_timeout", "no_prefill")
    fallbacks = [metrics.registry.get_sample_value(name, {"reason": r}) for r in reasons]
    assert fallbacks == [0, 0, 0]  # P answered: no fallback, only no params to pass on
