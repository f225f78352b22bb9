"""Purges over every backend: a tenant's blocks, a namespace's, or what is under one block;
a pin that loses its blocks lets go of those that stay."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from cache_service.core.blocks import store_key
from cache_service.core.store.protocols import BlockStore
from tests.store.capabilities import capable
from tests.store.chains import (
    NSID,
    OTHER_NS,
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


@pytest.mark.needs("purge_under")
def test_purge_under_a_block_takes_its_subtree_only(store: BlockStore, raw: RawAccess) -> None:
    trunk = chain([1, 2, 3])
    put(store, trunk, payloads=[b"a", b"bb", b"ccc"])
    put(store, chain([1, 5]), start=1)
    result = store.purge(b"", under=store_key(b"", trunk[1].key), now=T0)
    assert (result.blocks, result.payload_bytes, result.pins) == (2, 5, 0)
    assert matched(store, trunk) == 1
    assert matched(store, chain([1, 5])) == 2
    assert_prefix_closed(raw)


def test_purge_a_namespace_leaves_the_others(store: BlockStore, raw: RawAccess) -> None:
    put(store, chain([1, 2]), payloads=[b"a", b"bb"])
    put(store, chain([1, 2], OTHER_NS), namespace=OTHER_NS, payloads=[b"ccc", b"dddd"])
    mine = store.purge(b"", root=NSID.root, now=T0)
    assert (mine.blocks, mine.payload_bytes, mine.pins) == (2, 3, 0)
    assert matched(store, chain([1, 2])) == 0
    assert store.match(OTHER_NSID, chain([1, 2], OTHER_NS), now=T0).matched == 2
    everything = store.purge(OTHER_NSID.partition, now=T0)
    assert (everything.blocks, everything.payload_bytes) == (2, 7)
    assert_holds(store, raw, blocks=0)


def test_a_purge_under_a_pin_releases_the_blocks_above_it(store: BlockStore) -> None:
    links = chain([1, 2, 3])
    put(store, links)
    store.pin(NSID, links, now=T0, by="ops")
    result = store.purge(b"", under=store_key(b"", links[2].key), now=T0, ttl_seconds=10)
    assert (result.blocks, result.pins) == (1, 1)
    assert store.pins(b"") == []
    assert matched(store, links, now=T0 + 9) == 2
    if capable(store, "clock_expiry"):
        assert matched(store, links, now=T0 + 10) == 0  # let go of: they expire like the rest
