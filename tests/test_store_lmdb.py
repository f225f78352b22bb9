"""LMDB specifics: a full map never fails a write while something is evictable."""

from __future__ import annotations

from pathlib import Path

import pytest

from cache_service.blocks import Namespace
from cache_service.cache import PrefixCache
from cache_service.errors import InsufficientStorage
from cache_service.store.lmdb import LmdbStore


class Clock:
    """A clock that stands still unless told."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_full_map_evicts_and_retries_instead_of_failing(tmp_path: Path) -> None:
    store = LmdbStore(tmp_path, map_size_bytes=4 * 2**20)
    cache = PrefixCache(store, clock=Clock())  # no capacity: only the map limits it
    namespace = Namespace("m")
    prompts = [[p * 10_000 + t for t in range(64 * 4)] for p in range(20)]
    for prompt in prompts:  # 20 x 4 blocks x 64 KiB = 5 MiB > the 4 MiB map
        outcome = cache.insert(namespace, prompt, [bytes(64 * 1024)] * 4)
        assert outcome.stored == 4
    assert cache.match_prefix(namespace, prompts[-1]).matched_blocks == 4
    assert cache.match_prefix(namespace, prompts[0]).matched_blocks == 0
    store.close()


def test_block_larger_than_the_map_is_insufficient_storage(tmp_path: Path) -> None:
    store = LmdbStore(tmp_path, map_size_bytes=2 * 2**20)
    cache = PrefixCache(store, clock=Clock())
    namespace = Namespace("m")
    cache.insert(namespace, list(range(64)), [b"small"])
    with pytest.raises(InsufficientStorage):
        cache.insert(namespace, list(range(100, 164)), [bytes(4 * 2**20)])
    # Making room may have evicted the small block (a cache may forget), but the refused
    # block was not stored and the store still works.
    assert cache.match_prefix(namespace, list(range(100, 164))).matched_blocks == 0
    cache.insert(namespace, list(range(64)), [b"small"])
    assert cache.match_prefix(namespace, list(range(64))).matched_blocks == 1
    store.close()


def test_used_bytes_counts_pages_and_shrinks_after_eviction(tmp_path: Path) -> None:
    store = LmdbStore(tmp_path, map_size_bytes=64 * 2**20)
    cache = PrefixCache(store, clock=Clock())
    empty = store.usage().used_bytes
    cache.insert(Namespace("m"), list(range(64 * 8)), [bytes(100_000)] * 8)
    full = store.usage()
    assert full.payload_bytes == 800_000
    assert full.used_bytes >= 800_000  # overflow pages hold every payload byte
    assert full.used_bytes % 4096 == 0
    assert len(store.evict(now=Clock().now, max_blocks=100, target_blocks=0)) == 8
    assert store.usage().used_bytes <= empty + 4096 * 4
    assert store.space.file_bytes() >= full.used_bytes
    store.close()


def test_reopen_with_a_stale_reader_slot_clears_it(tmp_path: Path) -> None:
    store = LmdbStore(tmp_path, map_size_bytes=8 * 2**20)
    store.close()
    again = LmdbStore(tmp_path, map_size_bytes=8 * 2**20)
    assert again.env.reader_check() == 0
    again.close()
