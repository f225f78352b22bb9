"""Lookups on the Redis store against a real Redis Cluster: the batched reads (fanout.py) and
the one-loop record walk (record_walk.py) give what the codec's checks give, a prompt looked
up again is read in one round trip yet verified block by block every time, and a Redis error
reply or a dead node is a miss.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

from cache_service.core.blocks import NewBlock, store_key
from cache_service.core.cache import PrefixCache
from cache_service.core.config import CacheConfig
from cache_service.core.store.redis.fanout import Command, command, get_command
from cache_service.core.store.redis.store import RedisStore
from cache_service.core.store.redis.values import block_key
from cache_service.core.tokens import tokens_to_bytes
from tests.redis_cluster.test_redis_store import BLOCK, NS, NSID, TTL, chain, put


def count_round_trips(store: RedisStore, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The commands of each round trip the store's reads make from now on (the real ones)."""
    calls: list[int] = []
    real = store.reads.run

    def run(commands: Sequence[Command]) -> list[object]:
        calls.append(len(commands))
        return real(commands)

    monkeypatch.setattr(store.reads, "run", run)
    return calls


def test_a_prefix_whose_records_run_past_the_read_ahead_matches_whole(store: RedisStore) -> None:
    links = chain(list(range(40)))
    long_class = "a-retention-class-name-longer-than-the-read-ahead-of-32-bytes"
    blocks = [NewBlock(link, b"p" * 100) for link in links]
    store.insert(NSID, blocks, parent=None, now=time.time(), retention=long_class,
                 ttl_seconds=TTL)  # fmt: skip
    assert store.match(NSID, links, now=time.time()).matched == 40
    store.client.setrange(block_key(store_key(b"", links[30].key)), 40, b"\xff")  # in the record
    assert store.match(NSID, links, now=time.time()).matched == 30
    assert store.damage_pending() == 1


def test_a_known_depth_is_read_at_once_and_still_verified(
    store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    links = chain(list(range(100)))
    put(store, links)
    calls = count_round_trips(store, monkeypatch)
    assert store.match(NSID, links, now=time.time()).matched == 100
    assert calls == [1 + 16, 84]  # a probe, then the rest
    calls.clear()
    first = store.match(NSID, links, now=time.time(), known=(100, b""))
    assert first.matched == 100 and first.incarnation == b""
    assert calls == [1 + 100]  # one round trip
    store.client.unlink(block_key(store_key(b"", links[60].key)))  # as if Redis evicted it
    assert store.match(NSID, links, now=time.time(), known=(100, b"")).matched == 60


def test_a_prompt_looked_up_again_is_verified_again(store: RedisStore) -> None:
    config = CacheConfig(default_block_size=BLOCK)
    store.lifetimes = config.retention.lifetimes()
    cache = PrefixCache(store, config=config)
    tokens = tokens_to_bytes([token for label in range(50) for token in [label] * BLOCK])
    links = cache.chain(NS, tokens)
    put(store, links)
    assert cache.match_prefix(NS, tokens).matched_blocks == 50
    assert cache.match_prefix(NS, tokens).matched_blocks == 50  # from the memo's chain
    store.client.unlink(block_key(store_key(b"", links[20].key)))
    assert cache.match_prefix(NS, tokens).matched_blocks == 20
    store.client.setrange(block_key(store_key(b"", links[10].key)), 50, b"\x00\x01")
    assert cache.match_prefix(NS, tokens).matched_blocks == 10


def test_an_error_reply_fails_the_whole_read_and_leaves_no_reply_behind(
    store: RedisStore,
) -> None:
    links = chain([1, 2, 3])
    put(store, links)
    keys = [block_key(store_key(b"", link.key)) for link in links]
    # INCR on a value that is no number: an error reply between good ones.
    commands = [get_command(keys[0]), command(b"INCR", keys[1]), get_command(keys[2])]
    with pytest.raises(Exception, match="not an integer"):
        store.reads.run(commands)
    # The connections that held the other replies were dropped, not handed out again.
    for _ in range(5):
        values = store.reads.run([get_command(key) for key in keys])
        assert values == [store.client.get(key) for key in keys]
    assert store.match(NSID, links, now=time.time()).matched == 3
