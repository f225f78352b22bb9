"""A damaged namespace record (the namespaces table has no checksum) once locked its
namespace out: every lookup missed and every store answered 200 with nothing stored, each
block counted a hash collision. The cache tells damage from a real collision by hashing the
stored copy: a namespace's root is the hash of its encoded bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

from cache_service.core.blocks import BlockKey, Namespace
from cache_service.core.cache import PrefixCache
from cache_service.core.cache_observer import CacheObserver
from cache_service.core.config import CacheConfig
from cache_service.core.hashing import BlockHasher
from cache_service.core.retention import DEFAULT_LIFETIMES
from cache_service.core.store.lmdb.store import LmdbStore

NS = Namespace("m")
TOKENS = list(range(8))


class Counts(CacheObserver):
    """Counts corrupt records and collisions."""

    def __init__(self) -> None:
        self.corrupt_records = 0
        self.collisions = 0

    def on_corrupt_records(self, count: int) -> None:
        self.corrupt_records += count

    def on_collision(self, count: int) -> None:
        self.collisions += count


def open_cache(folder: Path, events: Counts, hasher: BlockHasher | None = None) -> PrefixCache:
    store = LmdbStore(folder, map_size_bytes=1 << 26, lifetimes=DEFAULT_LIFETIMES)
    return PrefixCache(
        store, config=CacheConfig(default_block_size=4), events=events, hasher=hasher
    )


def damage_namespace(cache: PrefixCache, replacement: bytes) -> None:
    scope = cache.hasher.namespace_id(NS).scope
    store = cache.store
    assert isinstance(store, LmdbStore)
    with store.env.begin(write=True) as txn:
        txn.put(scope, replacement, db=store.backend.dbs["namespaces"])


@pytest.mark.parametrize("damage", [b"\x00garbage", b"", b"short"])
def test_a_damaged_namespace_record_is_mended_and_counted(tmp_path: Path, damage: bytes) -> None:
    events = Counts()
    cache = open_cache(tmp_path, events)
    cache.insert(NS, TOKENS, [b"a", b"b"])
    damage_namespace(cache, damage)
    assert cache.match_prefix(NS, TOKENS).matched_blocks == 2  # mended, then found
    assert events.corrupt_records == 1 and events.collisions == 0
    assert cache.insert(NS, [*TOKENS, 8, 9, 10, 11], [b"a", b"b", b"c"]).stored == 1
    cache.store.close()


def test_a_damaged_namespace_record_is_mended_by_a_store_too(tmp_path: Path) -> None:
    events = Counts()
    cache = open_cache(tmp_path, events)
    cache.insert(NS, TOKENS, [b"a", b"b"])
    damage_namespace(cache, b"junk")
    assert cache.insert(NS, [*TOKENS, 8, 9, 10, 11], [b"a", b"b", b"c"]).stored == 1
    assert events.corrupt_records == 1
    assert cache.match_prefix(NS, [*TOKENS, 8, 9, 10, 11]).matched_blocks == 3
    cache.store.close()


def test_a_real_root_collision_keeps_the_first_namespace(tmp_path: Path) -> None:
    """With every namespace hashing to one root, another namespace's copy hashes back to the
    root: it is genuine, and the second namespace stays refused (never a wrong hit)."""
    events = Counts()
    constant = BlockHasher(hash_fn=lambda data: bytes(16))
    cache = open_cache(tmp_path, events, constant)
    one_block = TOKENS[:4]  # every key is the same too: one block per chain
    cache.insert(Namespace("first"), one_block, [b"a"])
    other = Namespace("second")
    assert cache.match_prefix(other, one_block).matched_blocks == 0
    assert cache.insert(other, one_block, [b"x"]).stored == 0
    assert events.corrupt_records == 0 and events.collisions > 0
    found = cache.match_prefix(Namespace("first"), one_block, with_payloads=True)
    assert found.payloads == (b"a",)
    assert BlockKey(bytes(16)) == cache.hasher.root(other)
    cache.store.close()
