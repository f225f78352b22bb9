"""Ingestion feeds /v1/route's memo, against a real server and real ZMQ publishers on
127.0.0.1: once engines have stored a prompt, its segments are in the hub's memo before any
route asked for it, and the first route of it answers as hashing the prompt would."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from cache_service.core.engines.routing import EngineSpec, RouteScorer
from cache_service.service.kv_events.config import EngineConfig
from cache_service.service.kv_events.hub import KvEventsHub
from tests.integration.conftest import ServerProcess
from tests.kv_events.following import BLOCK, SCHEME, SEED
from tests.kv_events.prompts import prompt_events
from tests.kv_events.publisher import TestPublisher

pytestmark = pytest.mark.integration

PROMPT = [(11 + i * 7919) % 50_000 for i in range(40 * BLOCK + 5)]  # 40 blocks and 5 tokens


def kv_stats(server: ServerProcess) -> dict[str, Any]:
    stats: dict[str, Any] = httpx.get(server.url + "/v1/stats", timeout=5.0).json()["kv_events"]
    return stats


def wait_for_stats(server: ServerProcess, check: Callable[[dict[str, Any]], bool]) -> None:
    deadline = time.monotonic() + 10
    while not check(kv_stats(server)):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; /v1/stats kv_events: {kv_stats(server)}")
        time.sleep(0.05)


def test_a_prompt_the_engines_stored_is_in_the_route_memo_before_its_first_route(
    following: ServerProcess, publishers: dict[str, TestPublisher]
) -> None:
    # Engine a stores the whole prompt's 40 full blocks over three events, b the first 20.
    for event in prompt_events(SCHEME, PROMPT[: 40 * BLOCK], seed=SEED, splits=[5, 20, 15]):
        publishers["a"].publish([event])
    publishers["b"].publish(prompt_events(SCHEME, PROMPT[: 20 * BLOCK], seed=SEED))
    wait_for_stats(
        following,
        lambda s: (s["engine-a"]["blocks"], s["engine-b"]["blocks"]) == (40, 20),
    )
    stats = kv_stats(following)
    # Segments of 16 blocks from the prompt's start: a's events close 0-15 and 16-31 (the
    # last 8 blocks close none), b's close 0-15 (the same key: one memo entry, recorded twice).
    assert stats["engine-a"]["route_memo_segments"] == 2
    assert stats["engine-b"]["route_memo_segments"] == 1
    assert stats["engine-a"]["verified"] == 3

    response = httpx.post(
        following.url + "/v1/route", json={"model": "m", "tokens": PROMPT}, timeout=10
    )
    assert response.status_code == 200, response.text
    answer = response.json()
    n = len(PROMPT)
    assert [
        (r["instance"], r["medium"], r["matched_blocks"], r["tokens_to_prefill"])
        for r in answer["instances"]
    ] == [
        ("engine-a", "GPU", 40, n - 40 * BLOCK),
        ("engine-b", "GPU", 20, n - 20 * BLOCK),
    ]
    assert answer["best"]["instance"] == "engine-a"


def test_the_hubs_first_route_of_a_stored_prompt_only_hits_its_memo(
    publishers: dict[str, TestPublisher],
) -> None:
    publisher = publishers["a"]
    hub = KvEventsHub(
        [
            EngineConfig(
                "engine-a", publisher.endpoint, hash_scheme=SCHEME, seed=SEED, block_size=BLOCK
            )
        ]
    )
    hub.start()
    try:
        publisher.wait_for_subscriber(timeout_seconds=10)
        for event in prompt_events(SCHEME, PROMPT[: 32 * BLOCK], seed=SEED, splits=[7, 25]):
            publisher.publish([event])
        deadline = time.monotonic() + 10
        while hub.views.block_count("engine-a") < 32 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert hub.chain_memo.stats() == {"segments": 2, "blocks": 32, "hits": 0, "misses": 0}
        spec = EngineSpec("engine-a", SCHEME, SEED, BLOCK)
        prompt = PROMPT[: 32 * BLOCK + 5]  # two whole segments and a partial block
        scores = RouteScorer(hub.views, memo=hub.chain_memo).score(prompt, [spec])
        reference = RouteScorer(hub.views, full_hash=True).score(prompt, [spec])
        assert scores == reference
        assert scores.best is not None and scores.best.matched_blocks == 32
        # Both segments came from the memo: nothing of the prompt was hashed, nothing missed.
        assert hub.chain_memo.stats()["hits"] == 2
        assert hub.chain_memo.stats()["misses"] == 0
    finally:
        assert hub.stop()
