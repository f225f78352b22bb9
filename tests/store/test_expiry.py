"""Expiry over every backend: blocks live until their expiry, are replaced after it, and a
touch slides it along the prefix."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from cache_service.core.blocks import Touch
from cache_service.core.store.protocols import BlockStore
from tests.store.chains import (
    NSID,
    T0,
    TTL,
    assert_prefix_closed,
    chain,
    matched,
    put,
)

if TYPE_CHECKING:
    from conftest import RawAccess


# -- expiry ----------------------------------------------------------------------------------


@pytest.mark.needs("clock_expiry")
def test_block_is_alive_until_just_before_its_expiry(store: BlockStore) -> None:
    links = chain([1, 2])
    put(store, links, ttl_seconds=100)
    assert matched(store, links, now=T0 + 99.999) == 2
    assert matched(store, links, now=T0 + 100) == 0
    assert matched(store, links, now=T0 + 1e6) == 0


@pytest.mark.needs("clock_expiry")
def test_expired_block_is_replaced_by_a_new_insert(store: BlockStore, raw: RawAccess) -> None:
    links = chain([1, 2])
    put(store, links, ttl_seconds=100, payloads=[b"old-0", b"old-1"])
    later = T0 + 100
    result = put(store, links, now=later, payloads=[b"new-zero", b"new-one"])
    assert result.stored == (links[0].key, links[1].key)
    assert (result.refreshed, result.conflicts) == (0, 0)
    assert store.match(NSID, links, now=later, with_payloads=True).payloads == (
        b"new-zero",
        b"new-one",
    )
    usage = store.usage()
    assert (usage.blocks, usage.payload_bytes) == (2, len(b"new-zero") + len(b"new-one"))
    metas = raw.blocks()
    assert metas[links[0].key].created_at == later
    assert metas[links[0].key].expires_at == later + TTL
    assert_prefix_closed(raw)


@pytest.mark.needs("clock_expiry", "store_eviction")
def test_expired_parent_replaced_keeps_its_expired_child_counted(
    store: BlockStore, raw: RawAccess
) -> None:
    links = chain([1, 2])
    put(store, links, ttl_seconds=100)
    put(store, links[:1], now=T0 + 200)
    assert matched(store, links, now=T0 + 200) == 1
    assert_prefix_closed(raw)
    evicted = store.evict(now=T0 + 200, max_blocks=10, expired_only=True)
    assert [e.key for e in evicted] == [links[1].key]
    assert_prefix_closed(raw)


# -- touch -----------------------------------------------------------------------------------


def test_touch_lifts_the_whole_prefix_to_a_longer_ttl_and_never_shortens_it(
    store: BlockStore, raw: RawAccess
) -> None:
    links = chain([1, 2, 3])
    keys = tuple(link.key for link in links)
    put(store, links, ttl_seconds=100)
    store.touch([Touch(keys=keys, at=T0, retention="agent", ttl_seconds=1000)])
    assert [raw.seconds_left(k, T0) for k in keys] == pytest.approx([1000] * 3, abs=1)
    store.touch([Touch(keys=keys, at=T0, retention="chat", ttl_seconds=10)])
    assert [raw.seconds_left(k, T0) for k in keys] == pytest.approx([1000] * 3, abs=1)
    assert matched(store, links) == 3


@pytest.mark.needs("record_upkeep", "clock_expiry")
def test_touch_slides_expiry_to_the_later_of_two_and_counts_hits(
    store: BlockStore, raw: RawAccess
) -> None:
    links = chain([1, 2])
    keys = tuple(link.key for link in links)
    put(store, links, ttl_seconds=100, retention="chat")
    store.touch([Touch(keys=keys, at=T0 + 10, retention="agent", ttl_seconds=20)])
    metas = raw.blocks()
    assert [metas[k].expires_at for k in keys] == [T0 + 100, T0 + 100]
    assert [metas[k].retention for k in keys] == ["chat", "chat"]
    store.touch([Touch(keys=keys, at=T0 + 90, retention="agent", ttl_seconds=20)])
    metas = raw.blocks()
    assert [metas[k].expires_at for k in keys] == [T0 + 110, T0 + 110]
    assert [metas[k].retention for k in keys] == ["agent", "agent"]
    # A use is recorded on the deepest block; the expiry slides on the whole prefix.
    assert metas[keys[-1]].hits == 2
    assert metas[keys[-1]].last_used_at == T0 + 90
    assert_prefix_closed(raw)


@pytest.mark.needs("record_upkeep", "clock_expiry")
def test_touch_stops_at_a_block_that_is_gone(store: BlockStore, raw: RawAccess) -> None:
    links = chain([1, 2, 3])
    put(store, links[:1], ttl_seconds=100)
    keys = tuple(link.key for link in links)
    store.touch([Touch(keys=keys, at=T0 + 50, retention="chat", ttl_seconds=100)])
    # The deepest block still stored records the use: here the first.
    assert raw.blocks()[links[0].key].expires_at == T0 + 150
    assert raw.blocks()[links[0].key].hits == 1
    assert store.usage().blocks == 1
    store.touch([])
