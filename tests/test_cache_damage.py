"""The cache over a damaged store: a damaged block is a miss (lookups, fetches, stores), each
damaged record is counted once, and the block goes with its subtree when the damage is
dropped: at the touch flush on a server (deferred), at once in a replay."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from cache_service.core.blocks import Evicted, Namespace, store_key
from cache_service.core.cache import PrefixCache
from cache_service.core.cache_observer import CacheObserver
from cache_service.core.config import CacheConfig
from cache_service.core.errors import MissingParent
from cache_service.core.operators import EXPLANATIONS, Operators
from cache_service.core.retention import DEFAULT_LIFETIMES
from cache_service.core.store.lmdb.store import LmdbStore
from cache_service.core.store.parts.codec import RECORD_FIELDS
from cache_service.core.touches import TouchOptions
from tests.conftest import LmdbRawAccess, VirtualClock

NS = Namespace(model="m", tenant="team-a")
BLOCK = 4
PROMPT = [label for label in range(1, 7) for _ in range(BLOCK)]  # six blocks
PAYLOADS = [b"kv-%d" % i * 8 for i in range(6)]


class Counting(CacheObserver):
    """Counts what the cache reports about damage."""

    def __init__(self) -> None:
        self.corrupt_records = 0
        self.corrupt_payloads = 0
        self.evicted: list[Evicted] = []

    def on_corrupt_records(self, count: int) -> None:
        self.corrupt_records += count

    def on_corrupt(self, count: int) -> None:
        self.corrupt_payloads += count

    def on_evicted(self, evicted: Sequence[Evicted], *, now: float) -> None:
        self.evicted += evicted


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LmdbStore]:
    opened = LmdbStore(
        tmp_path / "lmdb",
        map_size_bytes=1 << 28,
        removal_log_entries=100,
        lifetimes=DEFAULT_LIFETIMES,  # the caches' retention
    )
    yield opened
    opened.close()


def make(store: LmdbStore, *, defer: bool) -> tuple[PrefixCache, Counting]:
    """A cache over a store that holds PROMPT, stored by another cache (as a restarted
    server finds it: nothing of it in this cache's memo of recent matches)."""
    clock = VirtualClock()  # one clock for both (a real one is years after the virtual one)
    PrefixCache(store, config=CacheConfig(default_block_size=BLOCK), clock=clock).insert(
        NS, PROMPT, PAYLOADS
    )
    events = Counting()
    cache = PrefixCache(
        store,
        config=CacheConfig(default_block_size=BLOCK),
        touches=TouchOptions(defer=defer),
        clock=clock,
        events=events,
    )
    return cache, events


def damage(cache: PrefixCache, store: LmdbStore, block: int, field: str = "hits") -> None:
    partition = cache.hasher.namespace_id(NS).partition
    key = store_key(partition, cache.chain(NS, PROMPT)[block].key)
    LmdbRawAccess(store).flip(key, RECORD_FIELDS[field][0])


def test_deferred_damage_is_a_miss_until_the_flush_drops_it_and_counts_it_once(
    store: LmdbStore,
) -> None:
    cache, events = make(store, defer=True)
    damage(cache, store, 3)
    keys = cache.chain(NS, PROMPT).keys
    for _ in range(3):  # read often before the flush: one damaged record all the same
        found = cache.match_prefix(NS, PROMPT, with_payloads=True)
        assert (found.matched_blocks, found.payloads) == (3, tuple(PAYLOADS[:3]))
        assert cache.match_prefix(NS, PROMPT).matched_blocks == 3
        assert cache.get_payloads(NS, keys) == [*PAYLOADS[:3], None, *PAYLOADS[4:]]
    assert (cache.damage_pending, events.corrupt_records, events.evicted) == (1, 0, [])
    with pytest.raises(MissingParent):  # its parent is damaged: stored in full, it waits
        cache.insert(NS, PROMPT, PAYLOADS[4:], start_block=4)
    assert cache.insert(NS, PROMPT, PAYLOADS).stored == 0
    cache.touches.flush()

    assert cache.drop_damaged() == 3  # block 3 and the two under it
    assert events.corrupt_records == 1
    assert sorted(e.reason for e in events.evicted) == ["corrupt"] * 3
    assert cache.get_payloads(NS, keys)[3:] == [None, None, None]
    assert cache.insert(NS, PROMPT, PAYLOADS).stored == 3
    assert cache.match_prefix(NS, PROMPT, with_payloads=True).payloads == tuple(PAYLOADS)
    assert events.corrupt_records == 1 and cache.damage_pending == 0


def test_without_deferred_touches_damage_is_dropped_at_once(store: LmdbStore) -> None:
    cache, events = make(store, defer=False)
    damage(cache, store, 2, "tokens")
    assert cache.match_prefix(NS, PROMPT).matched_blocks == 2
    assert events.corrupt_records == 1 and len(events.evicted) == 4
    found, outcome = cache.lookup_and_fill(NS, PROMPT)
    assert (found.matched_blocks, outcome.stored) == (2, 4)


def test_a_damaged_payload_is_counted_and_dropped_with_its_subtree(store: LmdbStore) -> None:
    cache, events = make(store, defer=True)
    partition = cache.hasher.namespace_id(NS).partition
    key = store_key(partition, cache.chain(NS, PROMPT)[4].key)
    LmdbRawAccess(store).overwrite_payload(key, b"rot")
    assert cache.match_prefix(NS, PROMPT, with_payloads=True).matched_blocks == 4
    assert events.corrupt_payloads == 1
    assert cache.drop_damaged() == 2
    assert (events.corrupt_records, [e.reason for e in events.evicted]) == (0, ["corrupt"] * 2)


def test_explain_says_a_damaged_block_is_corrupt_before_and_after_the_drop(
    store: LmdbStore,
) -> None:
    cache, _ = make(store, defer=True)
    ops = Operators.for_cache(cache)
    damage(cache, store, 1, "retention")
    explained = ops.explain(NS, PROMPT)
    assert (explained.reason, explained.matched_blocks) == ("corrupt", 1)
    assert explained.detail == EXPLANATIONS["corrupt"]
    cache.drop_damaged()
    assert ops.explain(NS, PROMPT).reason == "corrupt"  # the removal log remembers why


def test_a_remembered_match_over_a_damaged_block_heals_once_a_fetch_finds_it(
    store: LmdbStore,
) -> None:
    cache, events = make(store, defer=True)
    assert cache.match_prefix(NS, PROMPT).matched_blocks == 6  # remembered: one read next time
    damage(cache, store, 3)
    # The memo skips blocks it verified before (the known limit: a lookup may count block 3
    # until a read meets it); a fetch reads every record, finds it, and the drop follows.
    assert cache.match_prefix(NS, PROMPT, with_payloads=True).matched_blocks == 3
    cache.drop_damaged()
    assert cache.match_prefix(NS, PROMPT).matched_blocks == 3
    assert events.corrupt_records == 1


def test_a_purge_that_meets_a_damaged_record_drops_it_and_leaves_nothing(
    store: LmdbStore,
) -> None:
    cache, events = make(store, defer=True)
    damage(cache, store, 2, "children")
    result = Operators.for_cache(cache).purge("team-a")
    assert result.blocks == 5  # the damaged block went as "corrupt", the rest purged
    assert events.corrupt_records == 1
    assert cache.capacity.usage().blocks == 0
    assert cache.capacity.usage().payload_bytes == 0
