"""Eviction over every backend: expired first, then leaves in policy order, and the
policy's record of use."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from cache_service.core.blocks import BlockKey, BlockMeta, Touch
from cache_service.core.eviction import LruPolicy
from cache_service.core.store.lmdb.store import LmdbStore
from cache_service.core.store.memory import MemoryStore
from cache_service.core.store.protocols import BlockStore
from tests.store.chains import (
    LMDB_MAP_SIZE_BYTES,
    T0,
    TTL,
    assert_prefix_closed,
    chain,
    matched,
    put,
)

if TYPE_CHECKING:
    from conftest import RawAccess


# -- eviction --------------------------------------------------------------------------------


def evict_one_at_a_time(
    store: BlockStore, raw: RawAccess, *, now: float, count: int
) -> list[tuple[BlockKey, str]]:
    order = []
    for _ in range(count):
        evicted = store.evict(now=now, max_blocks=1)
        assert len(evicted) <= 1
        order += [(e.key, e.reason) for e in evicted]
        assert_prefix_closed(raw)
    return order


@pytest.mark.needs("store_eviction")
def test_evict_removes_expired_first_then_lru_leaves_only(
    store: BlockStore, raw: RawAccess
) -> None:
    old = chain([1, 2, 3, 4])  # stored first: least recently used
    branch = chain([1, 2, 5])  # shares blocks 0 and 1 with `old`, stored later
    brief = chain([9, 9])  # stored last, but expires soon
    put(store, old, now=T0)
    put(store, branch, now=T0 + 1, start=0)
    put(store, brief, now=T0 + 2, ttl_seconds=10)
    now = T0 + 20
    order = evict_one_at_a_time(store, raw, now=now, count=9)
    assert order == [
        (brief[1].key, "expired"),
        (brief[0].key, "expired"),
        (old[3].key, "capacity"),
        (old[2].key, "capacity"),
        (branch[2].key, "capacity"),
        (branch[1].key, "capacity"),
        (branch[0].key, "capacity"),
    ]
    assert store.usage().blocks == 0


@pytest.mark.needs("store_eviction")
def test_evicted_records_say_why_and_what(store: BlockStore) -> None:
    links = chain([1])
    put(store, links, ttl_seconds=10, retention="agent", payloads=[b"12345"])
    (evicted,) = store.evict(now=T0 + 10, max_blocks=5)
    assert (evicted.key, evicted.reason, evicted.retention) == (links[0].key, "expired", "agent")
    assert (evicted.expires_at, evicted.payload_size) == (T0 + 10, 5)


@pytest.mark.needs("store_eviction")
def test_evict_expired_only_leaves_alive_blocks(store: BlockStore, raw: RawAccess) -> None:
    keep = chain([1, 2])
    drop = chain([3, 4])
    put(store, keep, ttl_seconds=100)
    put(store, drop, ttl_seconds=10)
    evicted = store.evict(now=T0 + 50, max_blocks=100, expired_only=True)
    assert [e.key for e in evicted] == [drop[1].key, drop[0].key]
    assert {e.reason for e in evicted} == {"expired"}
    assert matched(store, keep, now=T0 + 50) == 2
    assert_prefix_closed(raw)


@pytest.mark.needs("store_eviction")
def test_evict_never_removes_a_block_with_a_stored_child(store: BlockStore, raw: RawAccess) -> None:
    trunk = chain([1, 2, 3])
    put(store, trunk)
    for label in range(10, 16):
        put(store, chain([1, 2, 3, label]), start=3, now=T0 + label)
    order = evict_one_at_a_time(store, raw, now=T0 + 100, count=12)
    assert [key for key, _ in order[-3:]] == [trunk[2].key, trunk[1].key, trunk[0].key]
    assert store.usage().blocks == 0


@pytest.mark.needs("store_eviction")
@pytest.mark.parametrize("target", [0, 1, 4, 6])
def test_evict_with_target_blocks_stops_exactly_there(store: BlockStore, target: int) -> None:
    put(store, chain([1, 2, 3]))
    put(store, chain([4, 5, 6]), now=T0 + 1)
    evicted = store.evict(now=T0 + 2, max_blocks=100, target_blocks=target)
    assert len(evicted) == 6 - target
    assert store.usage().blocks == target


@pytest.mark.needs("store_eviction")
def test_evict_with_target_used_bytes_stops_once_below_it(store: BlockStore) -> None:
    for label in range(20):
        put(store, chain([label, 1000 + label]), payloads=[b"x" * 2000, b"y" * 2000])
    full = store.usage().used_bytes
    target = full // 2
    evicted = store.evict(now=T0, max_blocks=1000, target_used_bytes=target)
    assert evicted
    assert store.usage().used_bytes <= target
    assert 0 < store.usage().blocks < 40


@pytest.mark.needs("store_eviction")
def test_evict_stops_at_max_blocks(store: BlockStore) -> None:
    put(store, chain([1, 2, 3, 4, 5]))
    assert len(store.evict(now=T0, max_blocks=2)) == 2
    assert store.usage().blocks == 3


@pytest.mark.needs("store_eviction")
def test_evict_spares_protected_blocks(store: BlockStore, raw: RawAccess) -> None:
    old = chain([1, 2])
    new = chain([3, 4])
    put(store, old)
    put(store, new, now=T0 + 1)
    protected = frozenset(link.key for link in old)
    evicted = store.evict(now=T0 + 2, max_blocks=100, target_blocks=0, protected=protected)
    assert [e.key for e in evicted] == [new[1].key, new[0].key]
    assert matched(store, old, now=T0 + 2) == 2
    assert_prefix_closed(raw)


def test_evict_of_an_empty_store_evicts_nothing(store: BlockStore) -> None:
    assert store.evict(now=T0, max_blocks=10) == []
    assert store.evict(now=T0, max_blocks=10, target_blocks=0) == []


@pytest.mark.needs("store_eviction")
def test_evict_scans_past_a_full_batch_of_non_leaves(store: BlockStore, raw: RawAccess) -> None:
    # 40 expired blocks in one chain: the expiry index starts with many blocks that have a child.
    links = chain(list(range(40)))
    put(store, links, ttl_seconds=10)
    evicted = store.evict(now=T0 + 10, max_blocks=1000, expired_only=True)
    assert [e.key for e in evicted] == [link.key for link in reversed(links)]
    assert_prefix_closed(raw)


@pytest.mark.needs("store_eviction")
def test_touched_older_prompt_survives_eviction_over_a_newer_one(store: BlockStore) -> None:
    older = chain([1, 2, 3])
    newer = chain([4, 5, 6])
    put(store, older, now=T0)
    put(store, newer, now=T0 + 1)
    store.touch(
        [
            Touch(
                keys=tuple(link.key for link in older), at=T0 + 2, retention="chat", ttl_seconds=TTL
            )
        ]
    )
    store.evict(now=T0 + 3, max_blocks=100, target_blocks=3)
    assert matched(store, older, now=T0 + 3) == 3
    assert matched(store, newer, now=T0 + 3) == 0


# -- the LRU policy's record of use --------------------------------------------------------


@pytest.mark.needs("store_eviction")
def test_a_removed_blocks_record_of_use_passes_to_its_parent(
    store: BlockStore, raw: RawAccess
) -> None:
    links = chain([1, 2, 3])
    keys = tuple(link.key for link in links)
    put(store, links, ttl_seconds=100)
    store.touch([Touch(keys=keys, at=T0 + 10, retention="chat", ttl_seconds=100)])
    store.touch([Touch(keys=keys, at=T0 + 20, retention="chat", ttl_seconds=100)])
    deepest = raw.blocks()[keys[-1]]
    assert store.evict(now=T0 + 30, max_blocks=1)[0].key == keys[-1]
    parent = raw.blocks()[keys[1]]
    assert parent.eviction_rank == deepest.eviction_rank
    assert parent.last_used_at == T0 + 20
    assert parent.hits == 2


@pytest.mark.needs("store_eviction")
def test_leaf_lru_ranks_a_prefix_by_the_last_use_of_any_block_under_it(
    store: BlockStore,
) -> None:
    # P is stored, then Q, then P's child C with a short TTL: storing C used P after Q,
    # though only C recorded it. Once C expires and is swept, P must still outrank Q.
    p = chain([1, 2])
    q = chain([9])
    put(store, p[:1], ttl_seconds=1000)
    put(store, q, ttl_seconds=1000)
    put(store, p, start=1, ttl_seconds=100, retention="agent")
    swept = store.evict(now=T0 + 150, max_blocks=10, expired_only=True)
    assert [e.key for e in swept] == [p[1].key]
    order = [e.key for e in store.evict(now=T0 + 150, max_blocks=2)]
    assert order == [q[0].key, p[0].key]


class _Forgetful(LruPolicy):
    """LRU whose parents take nothing over from a removed child."""

    name = "forgetful"

    def child_removed(self, parent: BlockMeta, child: BlockMeta) -> None:
        """Nothing passes."""


@pytest.mark.parametrize("backend", ["memory", "lmdb"])
def test_what_a_parent_takes_over_from_a_removed_child_is_the_policys(
    backend: str, tmp_path: Path, raw_of: Callable[[BlockStore], RawAccess]
) -> None:
    policy = _Forgetful()
    store: BlockStore = (
        MemoryStore(policy=policy)
        if backend == "memory"
        else LmdbStore(tmp_path, map_size_bytes=LMDB_MAP_SIZE_BYTES, policy=policy)
    )
    try:
        assert (store.policy.name, LruPolicy().name) == ("forgetful", "lru")
        links = chain([1, 2])
        put(store, links)
        store.touch([Touch(keys=(links[1].key,), at=T0 + 10, retention="chat", ttl_seconds=TTL)])
        before = raw_of(store).blocks()[links[0].key]
        store.evict(now=T0 + 20, max_blocks=1)
        after = raw_of(store).blocks()[links[0].key]
        assert (after.eviction_rank, after.hits, after.children) == (before.eviction_rank, 0, 0)
    finally:
        store.close()
