"""Blocks stored while the clock ran ahead, over every backend: once the clock comes back they
read as misses on every path, and the sweeper removes them (see core.lifetimes)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from cache_service.core.blocks import Namespace, Touch
from cache_service.core.cache import PrefixCache
from cache_service.core.config import CacheConfig
from cache_service.core.lifetimes import UNBOUNDED, Lifetimes
from cache_service.core.operators import Operators
from cache_service.core.retention import DEFAULT_LIFETIMES
from cache_service.core.store.lmdb.store import LmdbStore
from cache_service.core.store.protocols import BlockStore
from tests.conftest import VirtualClock
from tests.store.chains import (
    LMDB_MAP_SIZE_BYTES,
    NSID,
    T0,
    assert_prefix_closed,
    chain,
    matched,
    put,
)

if TYPE_CHECKING:
    from conftest import RawAccess

TTLS = {"agent": 100.0, "chat": 1000.0}
AHEAD = 50_000.0  # the clock ran this far ahead, then came back to T0
BOUNDED = Lifetimes(TTLS)

pytestmark = [
    # A block from the future exists only where expiry follows the `now` a store is given.
    pytest.mark.needs("clock_expiry"),
    # The stores are opened with the classes' TTLs (as a cache's store is), unless a test
    # opens them otherwise.
    pytest.mark.store_opened(lifetimes=BOUNDED),
]


# -- the rule -----------------------------------------------------------------------------------


def test_a_block_is_alive_only_within_its_class_ttl_from_now() -> None:
    lifetimes = Lifetimes(TTLS)
    assert lifetimes.alive(T0 + 100, "agent", T0)
    assert lifetimes.alive(T0 + 101, "agent", T0)  # within the 1 s slack
    assert not lifetimes.alive(T0 + 101.5, "agent", T0)
    assert lifetimes.alive(T0 + 900, "chat", T0)
    assert lifetimes.alive(T0 + 900, "removed-class", T0)  # bounded by the longest TTL
    assert not lifetimes.alive(T0 + 1002, "removed-class", T0)
    assert lifetimes.alive(math.inf, "agent", T0)  # pinned
    assert not lifetimes.alive(T0, "agent", T0)  # expired
    assert lifetimes.from_future(T0 + 500, "agent", T0)
    assert not lifetimes.from_future(math.inf, "agent", T0)
    assert UNBOUNDED.alive(T0 + 1e12, "agent", T0)


# -- reads ------------------------------------------------------------------------------------


def test_a_block_from_the_future_is_a_miss_on_every_read(store: BlockStore) -> None:
    agent, chat = chain([1, 2]), chain([3, 4])
    put(store, agent, now=T0 + AHEAD, ttl_seconds=TTLS["agent"], retention="agent")
    put(store, chat, now=T0 + AHEAD, ttl_seconds=TTLS["chat"], retention="chat")
    assert matched(store, agent, now=T0 + AHEAD) == 2  # at the time they were stored
    for links in (agent, chat):
        found = store.match(NSID, links, now=T0)
        assert (found.matched, found.incarnation) == (0, None)
        assert store.match(NSID, links, now=T0, with_payloads=True).payloads == ()
        payloads, corrupt = store.get_payloads(NSID, [link.key for link in links], now=T0)
        assert (payloads, corrupt) == ([None, None], 0)


def test_a_block_stored_a_second_ahead_is_served(store: BlockStore) -> None:
    links = chain([1, 2])
    put(store, links, now=T0 + 0.5, ttl_seconds=TTLS["agent"], retention="agent")
    assert matched(store, links, now=T0) == 2
    assert store.evict(now=T0, max_blocks=100, expired_only=True) == []


def test_an_insert_over_a_block_from_the_future_stores_it_anew(
    store: BlockStore, raw: RawAccess
) -> None:
    links = chain([1, 2])
    put(store, links, now=T0 + AHEAD, ttl_seconds=TTLS["agent"], retention="agent")
    result = put(store, links, now=T0, ttl_seconds=TTLS["agent"], retention="agent")
    assert (len(result.stored), result.refreshed) == (2, 0)
    assert matched(store, links, now=T0) == 2
    blocks = raw.blocks()
    assert blocks[links[1].key].expires_at == T0 + TTLS["agent"]
    # the head had a child (from the future too, but unknown when the head is written): it
    # takes the longest class, which outlives any child it may keep
    assert (blocks[links[0].key].expires_at, blocks[links[0].key].retention) == (
        T0 + TTLS["chat"],
        "chat",
    )
    assert_prefix_closed(raw)


def test_a_touch_does_not_bring_a_block_from_the_future_back(store: BlockStore) -> None:
    links = chain([1, 2])
    put(store, links, now=T0 + AHEAD, ttl_seconds=TTLS["agent"], retention="agent")
    keys = tuple(link.key for link in links)
    store.touch([Touch(keys, at=T0, retention="agent", ttl_seconds=TTLS["agent"])])
    assert matched(store, links, now=T0) == 0


@pytest.mark.store_opened(lifetimes=UNBOUNDED)
def test_without_the_table_a_store_judges_by_expiry_alone(store: BlockStore) -> None:
    links = chain([1, 2])
    put(store, links, now=T0 + AHEAD, ttl_seconds=TTLS["agent"], retention="agent")
    assert matched(store, links, now=T0) == 2
    assert store.evict(now=T0, max_blocks=100, expired_only=True) == []


# -- the sweeper ----------------------------------------------------------------------------------


def test_the_sweeper_removes_blocks_from_the_future_leaf_first(
    store: BlockStore, raw: RawAccess
) -> None:
    now_chain, ahead = chain([1, 2]), chain([5, 6, 7])
    put(store, now_chain, now=T0, ttl_seconds=TTLS["agent"], retention="agent")
    put(store, ahead, now=T0 + AHEAD, ttl_seconds=TTLS["chat"], retention="chat")
    swept = store.evict(now=T0, max_blocks=100, expired_only=True)
    assert [e.key for e in swept] == [link.key for link in reversed(ahead)]
    assert {e.reason for e in swept} == {"expired"}
    assert set(raw.blocks()) == {link.key for link in now_chain}
    assert_prefix_closed(raw)
    # done: the next sweep finds no write ahead of the clock and scans nothing
    assert store.evict(now=T0 + 1, max_blocks=100, expired_only=True) == []


def test_one_sweep_removes_every_block_from_the_future_whatever_its_batch(
    store: BlockStore, raw: RawAccess
) -> None:
    """The pass reads every block, so it is made once, not once per batch of the sweep (a
    pass cut short by the batch was made again, in full, by every later sweep)."""
    ahead = chain([5, 6, 7])
    put(store, ahead, now=T0 + AHEAD, ttl_seconds=TTLS["chat"], retention="chat")
    assert len(store.evict(now=T0, max_blocks=2, expired_only=True)) == 3
    assert raw.blocks() == {}
    assert store.evict(now=T0, max_blocks=2, expired_only=True) == []


def test_a_stores_eviction_leaves_blocks_from_the_future_to_the_sweeper(
    store: BlockStore, raw: RawAccess
) -> None:
    put(store, chain([5, 6]), now=T0 + AHEAD, ttl_seconds=TTLS["chat"], retention="chat")
    assert store.evict(now=T0, max_blocks=100, target_blocks=2) == []
    assert len(raw.blocks()) == 2  # misses until the sweep: no scan of the whole store here


def test_a_block_from_the_future_above_a_younger_child_takes_the_longest_class(
    store: BlockStore, raw: RawAccess
) -> None:
    links = chain([1, 2])
    put(store, links, now=T0, ttl_seconds=TTLS["chat"], retention="chat")
    put(store, links[:1], now=T0 + AHEAD, ttl_seconds=TTLS["chat"], retention="chat")
    assert matched(store, links, now=T0) == 0  # its first block is from the future
    assert store.evict(now=T0, max_blocks=100, expired_only=True) == []
    head = raw.blocks()[links[0].key]
    assert (head.expires_at, head.retention) == (T0 + TTLS["chat"], "chat")
    assert matched(store, links, now=T0) == 2
    assert_prefix_closed(raw)


def test_a_lookup_told_its_prefix_was_verified_reads_it_again_while_a_write_is_ahead(
    store: BlockStore,
) -> None:
    """A memo of a verified match (`known`) stands for the blocks under it only while no
    parent can be from the future: a younger child no longer proves its parent alive."""
    links = chain([1, 2])
    put(store, links, now=T0, ttl_seconds=TTLS["chat"], retention="chat")
    verified = store.match(NSID, links, now=T0)
    assert verified.matched == 2 and verified.incarnation is not None
    put(store, links[:1], now=T0 + AHEAD, ttl_seconds=TTLS["chat"], retention="chat")
    again = store.match(NSID, links, now=T0, known=(2, verified.incarnation))
    assert again.matched == 0  # its first block is from the future, as without the memo


def test_the_latest_write_survives_a_restart(tmp_path: Path) -> None:
    store = LmdbStore(tmp_path / "lmdb", map_size_bytes=LMDB_MAP_SIZE_BYTES, lifetimes=BOUNDED)
    links = chain([1, 2])
    put(store, links, now=T0 + AHEAD, ttl_seconds=TTLS["agent"], retention="agent")
    store.close()
    store = LmdbStore(tmp_path / "lmdb", map_size_bytes=LMDB_MAP_SIZE_BYTES, lifetimes=BOUNDED)
    try:
        assert len(store.evict(now=T0, max_blocks=100, expired_only=True)) == 2
        assert store.usage().blocks == 0
    finally:
        store.close()


# -- pins -----------------------------------------------------------------------------------------


@pytest.mark.needs("pins")
@pytest.mark.store_opened(lifetimes=DEFAULT_LIFETIMES)  # the cache's retention
def test_an_unpinned_block_gets_the_longest_class_and_stays_served(store: BlockStore) -> None:
    clock = VirtualClock()
    cache = PrefixCache(store, config=CacheConfig(default_block_size=2), clock=clock)
    namespace, tokens = Namespace(model="m"), [1, 2, 3, 4]
    cache.insert(namespace, tokens, [b"a", b"b"], retention="agent")
    operators = Operators.for_cache(cache)
    operators.pin(namespace, tokens, by="operator")
    clock.now += 3600
    operators.unpin(namespace, tokens)
    assert cache.capacity.sweep_expired() == 0
    found = cache.match_prefix(namespace, tokens, touch=False)
    assert (found.matched_blocks, found.retention) == (2, "chat")
