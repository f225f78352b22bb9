"""LMDB only: a full map, page accounting, reader slots, and data that outlives the process."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from cache_service.core.blocks import BlockMeta, Namespace, StoreKey
from cache_service.core.cache import PrefixCache
from cache_service.core.config import CacheConfig
from cache_service.core.errors import InsufficientStorage
from cache_service.core.retention import DEFAULT_LIFETIMES
from cache_service.core.store.lmdb.store import LmdbStore
from cache_service.core.store.parts.codec import decode_meta
from cache_service.core.store.protocols import BlockStore
from tests.store.chains import LMDB_MAP_SIZE_BYTES, NSID, T0, chain, put

if TYPE_CHECKING:
    from conftest import RawAccess


class Clock:
    """A clock that stands still unless told."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_full_map_evicts_and_retries_instead_of_failing(tmp_path: Path) -> None:
    store = LmdbStore(tmp_path, map_size_bytes=4 * 2**20, lifetimes=DEFAULT_LIFETIMES)
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
    store = LmdbStore(tmp_path, map_size_bytes=2 * 2**20, lifetimes=DEFAULT_LIFETIMES)
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
    store = LmdbStore(tmp_path, map_size_bytes=64 * 2**20, lifetimes=DEFAULT_LIFETIMES)
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


def test_lmdb_data_survives_close_and_reopen(
    tmp_path: Path, raw_of: Callable[[BlockStore], RawAccess]
) -> None:
    path = tmp_path / "reopen"
    links = chain([1, 2, 3])
    first = LmdbStore(path, map_size_bytes=LMDB_MAP_SIZE_BYTES)
    put(first, links, payloads=[b"zero", b"one", b"two"])
    usage = first.usage()
    first.close()

    again = LmdbStore(path, map_size_bytes=LMDB_MAP_SIZE_BYTES)
    try:
        answer = again.match(NSID, links, now=T0, with_payloads=True)
        assert (answer.matched, answer.payloads) == (3, (b"zero", b"one", b"two"))
        assert again.usage().blocks == usage.blocks
        assert again.usage().payload_bytes == usage.payload_bytes
        # The use sequence carries on: a block stored now is newer than every old one.
        newer = chain([7])
        put(again, newer, now=T0 + 1)
        metas = raw_of(again).blocks()
        ranks = [metas[link.key].eviction_rank for link in links]
        assert metas[newer[0].key].eviction_rank > max(ranks)
        assert [e.key for e in again.evict(now=T0 + 1, max_blocks=1)] == [links[2].key]
    finally:
        again.close()


@pytest.mark.parametrize("counter", [b"seq", b"payload_bytes", b"latest_write"])
def test_a_damaged_counter_is_worked_out_again_not_a_500(tmp_path: Path, counter: bytes) -> None:
    """A counter in the meta table that does not decode (it has no checksum of its own) made
    every store, lookup or start-up fail; it is recounted from the block records instead."""
    store = LmdbStore(tmp_path, map_size_bytes=LMDB_MAP_SIZE_BYTES, lifetimes=DEFAULT_LIFETIMES)
    cache = PrefixCache(store, config=CacheConfig(default_block_size=4), clock=Clock())
    namespace = Namespace("m")
    cache.insert(namespace, list(range(8)), [b"x" * 10, b"y" * 20])
    with store.env.begin(write=True) as txn:
        txn.put(counter, b"\x01\x02\x03", db=store.backend.dbs["meta"])
    store.close()

    store = LmdbStore(tmp_path, map_size_bytes=LMDB_MAP_SIZE_BYTES, lifetimes=DEFAULT_LIFETIMES)
    cache = PrefixCache(store, config=CacheConfig(default_block_size=4), clock=Clock())
    assert cache.capacity.usage().payload_bytes == 30
    assert cache.match_prefix(namespace, list(range(8))).matched_blocks == 2
    stored = cache.insert(namespace, list(range(12)), [b"x" * 10, b"y" * 20, b"z" * 5])
    assert stored.stored == 1
    assert cache.match_prefix(namespace, list(range(12)), with_payloads=True).payloads == (
        b"x" * 10, b"y" * 20, b"z" * 5)  # fmt: skip
    assert cache.capacity.usage().payload_bytes == 35
    seqs = {meta.stored_seq for meta in _records(store)}
    assert len(seqs) == 3, "a recounted sequence goes on past every stored one"
    store.close()


def _records(store: LmdbStore) -> list[BlockMeta]:
    with store.env.begin() as txn:
        blocks = txn.cursor(db=store.backend.dbs["blocks"])
        return [decode_meta(StoreKey(bytes(key)), record) for key, record in blocks]
