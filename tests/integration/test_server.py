"""Against a real `cache-service serve` process: the user's walkthrough, restart, capacity."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from cache_service.client import CacheClient
from cache_service.core.blocks import Namespace
from cache_service.core.framing import MEDIA_TYPE, decode_frames, encode_frames, join_frames
from cache_service.core.hashing import BlockHasher
from tests.integration.conftest import ServerProcess

pytestmark = pytest.mark.integration

MakeServer = Callable[..., ServerProcess]


def payloads_for(tokens: list[int], size: int, block: int = 64) -> list[bytes]:
    """Deterministic distinct payloads, one per full block."""
    return [
        (f"kv:{tokens[i * block]}:{i}:".encode() * (size // 8 + 1))[:size]
        for i in range(len(tokens) // block)
    ]


def metric(text: str, name: str, **labels: str) -> float:
    """One sample's value from a Prometheus text exposition (0 if absent)."""
    label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name + (f"{{{label_text}}}" if labels else "")) + r" ([0-9.e+-]+)"
    found = re.search(pattern, text)
    return float(found.group(1)) if found else 0.0


def test_readme_walkthrough_store_lookup_fetch_restart_metrics(server: ServerProcess) -> None:
    prompt = list(range(1000, 2024))  # 1,024 tokens: 16 blocks of 64
    payloads = payloads_for(prompt, 4096)
    with CacheClient(server.url) as client:
        assert client.put_prefix("llama-3-8b", prompt, payloads) == 16

        full = client.lookup("llama-3-8b", prompt)
        assert full.matched_blocks == 16
        assert full.cached_tokens == 1024
        assert full.usage.prompt_cache_hit_tokens == 1024
        assert full.usage.prompt_cache_miss_tokens == 0

        shared = prompt[:500] + [7] * 524
        partial = client.lookup("llama-3-8b", shared)
        assert (partial.matched_blocks, partial.cached_tokens) == (7, 448)
        assert partial.usage.prompt_cache_miss_tokens == 1024 - 448
        assert partial.keys == full.keys[:7]

        assert client.get_blocks("llama-3-8b", full.keys) == payloads
        fetched = client.lookup("llama-3-8b", prompt, fetch=True)
        assert fetched.payloads == payloads

        metrics_text = httpx.get(server.url + "/metrics").text
        assert metric(metrics_text, "prompt_cache_hit_tokens_total", retention="chat") >= 1024 + 448
        assert metric(metrics_text, "prompt_cache_miss_tokens_total", retention="chat") >= 576
        assert metric(metrics_text, "prompt_cache_stored_blocks_total") == 16
        assert metric(metrics_text, "prompt_cache_blocks") == 16

    server.restart()
    with CacheClient(server.url) as client:
        again = client.lookup("llama-3-8b", prompt, fetch=True)
        assert again.matched_blocks == 16
        assert again.payloads == payloads
        assert client.lookup("other-model", prompt).matched_blocks == 0
        assert client.lookup("llama-3-8b", prompt, salt="s").matched_blocks == 0
        assert client.lookup("llama-3-8b", prompt, kv_layout="tp=2,rank=1").matched_blocks == 0


def test_store_continues_a_cached_prefix_from_start_block(server: ServerProcess) -> None:
    prompt = list(range(64 * 8))
    payloads = payloads_for(prompt, 1000)
    with CacheClient(server.url) as client:
        assert client.put_prefix("m", prompt[: 64 * 3], payloads[:3]) == 3
        assert client.put_prefix("m", prompt, payloads[3:], start_block=3) == 5
        assert client.lookup("m", prompt).matched_blocks == 8
        # Sending stored blocks again is a refresh, not a new store.
        assert client.put_prefix("m", prompt, payloads) == 0


def test_large_payload_and_many_blocks_in_one_request(server: ServerProcess) -> None:
    with CacheClient(server.url, timeout=60.0) as client:
        big_prompt = list(range(64))
        big = os.urandom(8 * 2**20)
        assert client.put_prefix("m", big_prompt, [big]) == 1
        assert client.get_blocks("m", client.lookup("m", big_prompt).keys) == [big]

        long_prompt = list(range(500_000, 500_000 + 64 * 600))
        many = payloads_for(long_prompt, 256, block=64)
        assert client.put_prefix("m", long_prompt, many) == 600
        assert client.lookup("m", long_prompt, fetch=True).payloads == many


def test_index_only_blocks_have_empty_payloads(server: ServerProcess) -> None:
    prompt = list(range(256))
    with CacheClient(server.url) as client:
        assert client.put_prefix("m", prompt, [b""] * 4) == 4
        found = client.lookup("m", prompt, fetch=True)
        assert found.matched_blocks == 4
        assert found.payloads == [b""] * 4


def test_capacity_eviction_keeps_store_under_limit_and_prefix_closed(
    make_server: MakeServer,
) -> None:
    capacity = 8 * 2**20
    server = make_server(capacity=str(capacity), touch_flush_interval="0.05")
    prompts = [[p * 100_000 + t for t in range(64 * 16)] for p in range(40)]
    with CacheClient(server.url) as client:
        for prompt in prompts:  # 40 prompts x 16 blocks x 32 KiB = 20 MiB > 8 MiB
            client.put_prefix("m", prompt, payloads_for(prompt, 32 * 1024))
            stats = client.stats()
            assert stats["used_bytes"] <= capacity
        assert client.lookup("m", prompts[-1]).matched_blocks == 16
        assert client.lookup("m", prompts[0]).matched_blocks == 0
        for prompt in prompts:
            keys = [k for k in client.lookup("m", prompt).keys]
            held = client.get_blocks("m", _all_keys(prompt))
            # Prefix-closed: what is held is a prefix, and lookup matches exactly that prefix.
            count = sum(payload is not None for payload in held)
            assert all(payload is not None for payload in held[:count])
            assert len(keys) == count
        metrics_text = httpx.get(server.url + "/metrics").text
        assert metric(metrics_text, "prompt_cache_evicted_blocks_total", reason="capacity") > 0
        assert metric(metrics_text, "prompt_cache_evicted_before_ttl_total", retention="chat") > 0


def _all_keys(prompt: list[int]) -> list[str]:
    """The keys of every full block of a prompt under the default seed."""
    keys = BlockHasher().keys(Namespace("m"), prompt, block_size=64)
    return [key.hex() for key in keys]


def test_store_larger_than_cache_keeps_longest_prefix_and_507_when_nothing_fits(
    make_server: MakeServer,
) -> None:
    server = make_server(capacity="1MiB")
    prompt = list(range(64 * 40))
    with CacheClient(server.url) as client:
        result = client.store("m", prompt, payloads_for(prompt, 64 * 1024))
        assert 0 < result.stored_blocks < 40
        assert result.truncated_blocks > 0
        assert client.lookup("m", prompt).matched_blocks == result.stored_blocks
    response = _post_frames(server.url, {"model": "m", "tokens": list(range(64))}, [b"x" * 2**21])
    assert response.status_code == 507
    assert response.headers["content-type"] == "application/problem+json"


def test_concurrent_writers_of_the_same_prefix_first_writer_wins(server: ServerProcess) -> None:
    prompt = list(range(64 * 6))
    errors: list[Exception] = []

    def writer(index: int) -> None:
        try:
            with CacheClient(server.url) as client:
                client.put_prefix("m", prompt, [bytes([index]) * 512] * 6)
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    with CacheClient(server.url) as client:
        found = client.lookup("m", prompt, fetch=True)
        assert found.matched_blocks == 6
        assert found.payloads is not None
        # Every block holds one writer's bytes, whole.
        assert all(len(set(payload)) == 1 and len(payload) == 512 for payload in found.payloads)
    metrics_text = httpx.get(server.url + "/metrics").text
    assert metric(metrics_text, "prompt_cache_stored_blocks_total") == 6
    assert metric(metrics_text, "prompt_cache_payload_conflicts_total") > 0


def test_expired_blocks_miss_and_are_swept(make_server: MakeServer) -> None:
    server = make_server(retention="chat=1s,agent=1h", sweep_interval="0.2")
    prompt = list(range(128))
    with CacheClient(server.url) as client:
        client.put_prefix("m", prompt, [b"a", b"b"])
        client.put_prefix("m", list(range(1, 129)), [b"c", b"d"], retention="agent")
        assert client.lookup("m", prompt).matched_blocks == 2
        deadline = 10.0
        started = time.monotonic()
        while client.stats()["blocks"] > 2 and time.monotonic() - started < deadline:
            time.sleep(0.1)
        assert client.lookup("m", prompt).matched_blocks == 0
        assert client.lookup("m", list(range(1, 129)), retention="agent").matched_blocks == 2
        assert client.stats()["blocks"] == 2


def test_info_reports_hashing_scheme_and_block_sizes(make_server: MakeServer) -> None:
    server = make_server(model_block_size="llama-3-8b=16", seed="fleet-seed")
    info = httpx.get(server.url + "/v1/info").json()
    assert info["hashing"]["scheme"] == "xxh3-128-chained"
    assert info["hashing"]["version"] == 1
    assert info["block_size"] == {"default": 64, "models": {"llama-3-8b": 16}}
    other = make_server()
    other_info = httpx.get(other.url + "/v1/info").json()
    assert other_info["hashing"]["seed_fingerprint"] != info["hashing"]["seed_fingerprint"]
    with CacheClient(server.url) as client:
        assert client.lookup("llama-3-8b", list(range(64))).block_size == 16


def test_openapi_schema_documents_every_route(server: ServerProcess) -> None:
    schema = httpx.get(server.url + "/openapi.json").json()
    for path in ("/v1/lookup", "/v1/blocks", "/v1/blocks/fetch", "/v1/info", "/v1/stats",
                 "/v1/explain", "/v1/pin", "/v1/unpin", "/v1/pins", "/v1/purge"):  # fmt: skip
        assert path in schema["paths"]
    components = schema["components"]["schemas"]
    assert {"LookupRequest", "StoreHeader", "FetchRequest", "LookupResponse", "Problem"} <= set(
        components
    )
    assert {"ExplainRequest", "PinRequest", "PurgeRequest", "ExplainResponse"} <= set(components)
    # Every reference resolves.
    refs = re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(schema))
    assert refs
    assert set(refs) <= set(components)
    store_body = schema["paths"]["/v1/blocks"]["post"]["requestBody"]["content"]
    assert MEDIA_TYPE in store_body


def _post_frames(url: str, header: dict[str, object], payloads: list[bytes]) -> httpx.Response:
    body = join_frames(encode_frames(header, payloads))
    return httpx.post(url + "/v1/blocks", content=body, headers={"content-type": MEDIA_TYPE})


def test_lookup_with_fetch_answers_frames(server: ServerProcess) -> None:
    prompt = list(range(128))
    assert _post_frames(server.url, {"model": "m", "tokens": prompt}, [b"one", b"two"]).is_success
    response = httpx.post(
        server.url + "/v1/lookup", json={"model": "m", "tokens": prompt, "fetch": True}
    )
    assert response.headers["content-type"] == MEDIA_TYPE
    header, frames = decode_frames(response.content)
    assert header["matched_blocks"] == 2
    assert [bytes(f) for f in frames if f is not None] == [b"one", b"two"]


def test_request_durations_are_labelled_by_route_template(server: ServerProcess) -> None:
    httpx.post(server.url + "/v1/lookup", json={"model": "m", "tokens": [1, 2]})
    httpx.get(server.url + "/v1/info")
    httpx.get(server.url + "/no/such/path")
    text = httpx.get(server.url + "/metrics").text
    count = "prompt_cache_request_duration_seconds_count"
    assert metric(text, count, route="/v1/lookup") == 1
    assert metric(text, count, route="/v1/info") == 1
    assert metric(text, count, route="other") == 1


def test_block_that_cannot_fit_is_507_and_evicts_nothing(make_server: MakeServer) -> None:
    server = make_server(capacity="8MiB")
    small = list(range(256))
    with CacheClient(server.url) as client:
        assert client.put_prefix("m", small, [b"x" * 1000] * 4) == 4
    response = _post_frames(
        server.url, {"model": "big", "tokens": list(range(64))}, [b"z" * (8 * 2**20 - 20000)]
    )
    assert response.status_code == 507
    with CacheClient(server.url) as client:
        assert client.lookup("m", small).matched_blocks == 4


def test_token_heavy_body_is_refused_before_it_is_parsed(make_server: MakeServer) -> None:
    server = make_server(max_tokens_per_request="1000")
    body = b'{"model": "m", "tokens": [' + b"1," * 60_000 + b"1]}"
    response = httpx.post(
        server.url + "/v1/lookup", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 413
    assert response.json()["limit"] == "max_tokens_per_request"
    header = {"model": "m", "tokens": [1] * 60_000}
    response = _post_frames(server.url, header, [])
    assert response.status_code == 413
    assert response.json()["limit"] == "max_tokens_per_request"


def test_one_client_survives_a_server_restart_and_fails_open_while_it_is_down(
    server: ServerProcess,
) -> None:
    prompt = list(range(128))
    with CacheClient(server.url, fail_open=True, backoff_initial_seconds=0.0) as client:
        client.put_prefix("m", prompt, [b"a", b"b"])
        server.stop()
        down = client.lookup("m", prompt)  # refused: a miss, not an exception
        assert down.matched_blocks == 0
        server.start()
        assert client.lookup("m", prompt).matched_blocks == 2  # a fresh keep-alive connection


def test_payloads_without_copies_are_views_and_with_copies_bytes(server: ServerProcess) -> None:
    # copy=False reads the answer whole and hands out views of it; copy=True reads each frame
    # off the socket into bytes of its own (no body-sized buffer, no second copy).
    prompt = list(range(192))
    payloads = [os.urandom(70_000) for _ in range(3)]
    with CacheClient(server.url) as client:
        client.put_prefix("m", prompt, payloads)
        for copy, kind in ((False, memoryview), (True, bytes)):
            found = client.lookup("m", prompt, fetch=True, copy=copy)
            assert found.payloads is not None
            assert all(type(p) is kind for p in found.payloads)
            assert [bytes(p) for p in found.payloads] == payloads
            fetched = client.get_blocks("m", found.keys, copy=copy)
            assert all(type(p) is kind for p in fetched)
            assert [bytes(p) for p in fetched if p is not None] == payloads


def test_two_worker_processes_share_one_store_and_add_up_their_metrics(
    make_server: MakeServer,
) -> None:
    server = make_server(workers="2", sweep_interval="0.2", retention="chat=2s,agent=1h")
    prompt = list(range(1024))
    with CacheClient(server.url) as client:
        assert client.put_prefix("m", prompt, [b"kv"] * 16) == 16
    for _ in range(30):  # fresh connections, so both workers answer some
        with CacheClient(server.url) as client:
            assert client.lookup("m", prompt).matched_blocks == 16
    text = httpx.get(server.url + "/metrics").text
    assert metric(text, "prompt_cache_lookups_total", outcome="full") == 30
    assert metric(text, "prompt_cache_hit_tokens_total", retention="chat") == 30 * 1024
    assert metric(text, "prompt_cache_blocks") == 16
    with CacheClient(server.url) as client:
        assert client.stats()["retention"]["chat"]["hit_tokens"] == 30 * 1024
        deadline = time.monotonic() + 15
        while client.stats()["blocks"] and time.monotonic() < deadline:
            time.sleep(0.2)  # one worker sweeps the expired blocks
        assert client.stats()["blocks"] == 0
    assert (server.data_dir / "sweeper.lock").exists()
