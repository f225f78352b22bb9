"""Pins over every backend: a pinned prefix is never evicted nor expired, overlapping pins
are released independently, and only as high a rank may release one."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from cache_service.core.blocks import PinLimits
from cache_service.core.errors import Forbidden, NotStored, QuotaExceeded
from cache_service.core.store.protocols import BlockStore
from tests.store.chains import NSID, T0, TTL, assert_prefix_closed, chain, matched, put

if TYPE_CHECKING:
    from conftest import RawAccess

FOREVER = T0 + 10**9

pytestmark = pytest.mark.needs("pins")


@pytest.mark.needs("store_eviction")
def test_a_pinned_prefix_is_never_evicted_nor_expired(store: BlockStore, raw: RawAccess) -> None:
    system = chain([1, 2])
    put(store, chain([1, 2, 3]))
    put(store, chain([7, 8]))
    record, new = store.pin(NSID, system, now=T0, by="ops")
    assert (new, record.blocks, record.key, record.by) == (True, 2, system[-1].key, "ops")
    evicted = store.evict(now=FOREVER, max_blocks=100, target_blocks=0)
    assert {e.key for e in evicted} == {
        chain([1, 2, 3])[2].key,
        *(link.key for link in chain([7, 8])),
    }
    assert matched(store, system, now=FOREVER) == 2
    assert store.pin(NSID, system, now=T0, by="ops") == (record, False)
    assert_prefix_closed(raw)


@pytest.mark.needs("clock_expiry", "store_eviction")
def test_overlapping_pins_are_released_independently(store: BlockStore) -> None:
    longer = chain([1, 2, 3])
    put(store, longer)
    store.pin(NSID, longer[:1], now=T0, by="ops")
    store.pin(NSID, longer, now=T0, by="ops")
    assert store.unpin(NSID, longer[-1].key, now=T0, ttl_seconds=TTL) == 3
    assert store.unpin(NSID, longer[-1].key, now=T0, ttl_seconds=TTL) == 0
    assert matched(store, longer, now=T0 + TTL) == 1  # block 0 is still pinned
    store.evict(now=T0 + TTL, max_blocks=10, expired_only=True)
    assert store.usage().blocks == 1
    assert [record.blocks for record in store.pins(b"")] == [1]


def test_only_as_high_a_rank_may_release_a_pin_and_a_higher_one_takes_it_over(
    store: BlockStore,
) -> None:
    links = chain([1])
    put(store, links)
    store.pin(NSID, links, now=T0, by="admin", rank=2)
    with pytest.raises(Forbidden):
        store.unpin(NSID, links[0].key, now=T0, ttl_seconds=TTL, rank=1)
    record, new = store.pin(NSID, links, now=T0, by="root", rank=3)
    assert (new, record.by, record.rank) == (False, "root", 3)
    assert store.unpin(NSID, links[0].key, now=T0, ttl_seconds=TTL, rank=3) == 1


def test_a_pin_needs_its_whole_prefix_stored_and_keeps_to_its_limits(store: BlockStore) -> None:
    links = chain([1, 2])
    put(store, links[:1])
    with pytest.raises(NotStored):
        store.pin(NSID, links, now=T0, by="ops")
    with pytest.raises(ValueError, match="block 0"):
        store.pin(NSID, links[1:], now=T0, by="ops")
    with pytest.raises(QuotaExceeded):
        store.pin(NSID, links[:1], now=T0, by="ops", limits=PinLimits(blocks=0))
    with pytest.raises(QuotaExceeded):
        store.pin(NSID, links[:1], now=T0, by="ops", limits=PinLimits(tenant_bytes=1))
    assert store.pins(b"") == []
