"""Removing one block and its subtree on request, over every backend: deepest first, each
step prefix-closed, every index and counter kept, pinned blocks (and their path) kept."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import pytest

from cache_service.core.blocks import BlockKey, Namespace, StoreUsage, store_key
from cache_service.core.hashing import tenant_partition
from cache_service.core.store.parts.backend import Txn
from cache_service.core.store.parts.removals import (
    ENTRY_BYTES,
    FLOOR_ENTRIES,
    LOG_SHARE,
    RemovalLog,
)
from cache_service.core.store.protocols import BlockStore
from tests.store.chains import (
    HASHER,
    NSID,
    OTHER_NSID,
    T0,
    assert_holds,
    assert_prefix_closed,
    chain,
    matched,
    put,
)

if TYPE_CHECKING:
    from conftest import RawAccess

TENANT = Namespace(model="contract-model", tenant="team-r")
TENANT_ID = HASHER.namespace_id(TENANT)


def test_removing_a_leaf_removes_it_alone(store: BlockStore, raw: RawAccess) -> None:
    links = chain([1, 2, 3])
    put(store, links, payloads=[b"a" * 10, b"b" * 20, b"c" * 30])
    removed = store.remove_subtree(NSID, links[2].key, now=T0 + 1)
    assert [(e.key, e.reason, e.payload_size) for e in removed] == [(links[2].key, "removed", 30)]
    assert_holds(store, raw, blocks=2, payload_bytes=30)
    assert matched(store, links) == 2
    assert_prefix_closed(raw)
    assert store.remove_subtree(NSID, links[2].key, now=T0 + 1) == []  # once only


@pytest.mark.needs("record_upkeep", "store_eviction")
def test_removing_a_leaf_makes_its_parent_a_leaf(store: BlockStore, raw: RawAccess) -> None:
    links = chain([1, 2, 3])
    put(store, links, payloads=[b"a" * 10, b"b" * 20, b"c" * 30])
    store.remove_subtree(NSID, links[2].key, now=T0 + 1)
    assert raw.blocks()[links[1].key].children == 0
    # The parent is a leaf again: capacity eviction finds it first.
    assert [e.key for e in store.evict(now=T0 + 1, max_blocks=1)] == [links[1].key]


def test_removing_an_inner_block_ends_every_match_there(store: BlockStore) -> None:
    trunk = chain([1, 2, 3, 4])
    branch = chain([1, 2, 5])
    put(store, trunk)
    put(store, branch, start=2, now=T0 + 1)
    removed = store.remove_subtree(NSID, trunk[1].key, now=T0 + 2)
    assert removed[-1].key == trunk[1].key
    assert (matched(store, trunk, now=T0 + 2), matched(store, branch, now=T0 + 2)) == (1, 1)
    put(store, trunk, now=T0 + 3)  # stored again, the whole prefix matches again
    assert matched(store, trunk, now=T0 + 3) == 4


@pytest.mark.needs("subtree_removal", "store_eviction")
def test_removing_an_inner_block_removes_its_subtree_deepest_first(
    store: BlockStore, raw: RawAccess
) -> None:
    trunk = chain([1, 2, 3, 4])
    branch = chain([1, 2, 5])
    put(store, trunk)
    put(store, branch, start=2, now=T0 + 1)
    removed = store.remove_subtree(NSID, trunk[1].key, now=T0 + 2)
    keys = [e.key for e in removed]
    assert set(keys) == {trunk[1].key, trunk[2].key, trunk[3].key, branch[2].key}
    assert keys.index(trunk[3].key) < keys.index(trunk[2].key) < keys.index(trunk[1].key)
    assert keys.index(branch[2].key) < keys.index(trunk[1].key)
    assert {e.reason for e in removed} == {"removed"}
    assert store.usage().blocks == 1
    assert store.usage().payload_bytes == 24  # block 0's payload
    assert raw.blocks()[trunk[0].key].children == 0
    assert_prefix_closed(raw)
    # No stale index entry is left behind: expiry and eviction see only block 0.
    swept = store.evict(now=T0 + 10**6, max_blocks=10, expired_only=True)
    assert [(e.key, e.reason) for e in swept] == [(trunk[0].key, "expired")]
    assert store.usage().blocks == 0


def test_an_unknown_key_or_another_namespaces_block_removes_nothing(
    store: BlockStore, raw: RawAccess
) -> None:
    links = chain([1, 2])
    put(store, links)
    assert store.remove_subtree(NSID, BlockKey(b"\x09" * 16), now=T0) == []
    assert store.remove_subtree(OTHER_NSID, links[0].key, now=T0) == []
    assert_holds(store, raw, blocks=2)
    assert matched(store, links) == 2


@pytest.mark.needs("pins", "subtree_removal")
def test_pinned_blocks_and_the_path_to_them_stay(store: BlockStore, raw: RawAccess) -> None:
    pinned = chain([1, 2, 3])
    branch = chain([1, 2, 5])
    put(store, pinned)
    put(store, branch, start=2)
    store.pin(NSID, pinned, now=T0, by="ops")
    removed = store.remove_subtree(NSID, pinned[0].key, now=T0 + 1)
    assert [e.key for e in removed] == [branch[2].key]
    assert matched(store, pinned, now=T0 + 10**9) == 3
    assert store.remove_subtree(NSID, pinned[2].key, now=T0 + 1) == []
    assert len(store.pins(b"")) == 1
    assert_prefix_closed(raw)


@pytest.mark.needs("tenant_bytes", "removal_log", "subtree_removal", "store_eviction")
@pytest.mark.store_opened(removal_log_entries=10)
def test_removal_keeps_tenant_bytes_and_the_removal_log(store: BlockStore, raw: RawAccess) -> None:
    links = chain([1, 2, 3], TENANT)
    put(store, links[:1], namespace=TENANT)
    alone = store.tenant_bytes(TENANT_ID.partition)
    put(store, links, start=1, namespace=TENANT)
    assert store.tenant_bytes(TENANT_ID.partition) > alone
    removed = store.remove_subtree(TENANT_ID, links[1].key, now=T0 + 1)
    partition = tenant_partition(TENANT.tenant)
    assert [e.key for e in removed] == [
        store_key(partition, links[2].key),
        store_key(partition, links[1].key),
    ]
    assert store.tenant_bytes(TENANT_ID.partition) == alone
    state = store.inspect(TENANT_ID, links[1], now=T0 + 2)
    assert state.status == "absent"
    assert state.removal is not None
    assert (state.removal.reason, state.removal.at) == ("removed", T0 + 1)
    # The tenant's leaves follow: its quota eviction finds block 0 and nothing stale.
    evicted = store.evict_tenant(partition, target_bytes=0, now=T0 + 2, max_blocks=10)
    assert [e.key for e in evicted] == [store_key(partition, links[0].key)]
    assert store.tenant_bytes(TENANT_ID.partition) == 0
    assert_prefix_closed(raw)


@pytest.mark.needs("removal_log", "store_eviction")
@pytest.mark.store_opened(removal_log_entries=1 << 20)
def test_the_removal_log_keeps_to_its_share_of_a_small_store(store: BlockStore) -> None:
    # A small store's share of bytes is below the floor: the log keeps the latest
    # FLOOR_ENTRIES removals, though its configured length is far more.
    links = [chain([label])[0] for label in range(3 * FLOOR_ENTRIES)]
    for link in links:
        put(store, [link])
    evicted = store.evict(now=T0 + 1, max_blocks=len(links), target_blocks=0)
    assert len(evicted) == len(links)
    by_key = {link.key: link for link in links}
    remembered = [
        store.inspect(NSID, by_key[BlockKey(entry.key)], now=T0 + 2).removal is not None
        for entry in evicted
    ]
    assert remembered == [False] * (len(links) - FLOOR_ENTRIES) + [True] * FLOOR_ENTRIES


class _Measured:
    """A transaction that only measures the store (what the log's limit reads)."""

    def __init__(self, used_bytes: int) -> None:
        self.used_bytes = used_bytes

    def usage(self) -> StoreUsage:
        return StoreUsage(blocks=0, payload_bytes=0, used_bytes=self.used_bytes)


def test_the_removal_log_limit_is_its_length_within_a_share_of_the_store() -> None:
    log = RemovalLog(entries=2**18)
    store_bytes = 256 * 2**20
    limit = log.limit(cast(Txn, _Measured(store_bytes)), held=2**18)
    assert limit == int(store_bytes * LOG_SHARE) // ENTRY_BYTES == 2**17
    assert RemovalLog(entries=2**18).limit(cast(Txn, _Measured(2**20)), held=2**18) == (
        FLOOR_ENTRIES
    )
    assert RemovalLog(entries=2**18).limit(cast(Txn, _Measured(2**40)), held=2**18) == 2**18
    assert RemovalLog(entries=100).limit(cast(Txn, _Measured(2**20)), held=200) == 100
