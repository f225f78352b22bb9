"""The data path over every backend: match, insert, collisions, payload reads, corruption, usage."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from cache_service.core.blocks import BlockKey, ChainLink, NamespaceId, NewBlock
from cache_service.core.errors import MissingParent
from cache_service.core.store.protocols import BlockStore
from cache_service.core.tokens import tokens_to_bytes
from tests.store.capabilities import capable
from tests.store.chains import (
    BLOCK,
    NSID,
    OTHER_NS,
    OTHER_NSID,
    T0,
    TTL,
    assert_holds,
    assert_prefix_closed,
    chain,
    matched,
    payload_of,
    put,
)

if TYPE_CHECKING:
    from conftest import RawAccess


# -- match -----------------------------------------------------------------------------------


def test_match_counts_the_stored_verified_prefix(store: BlockStore, raw: RawAccess) -> None:
    stored = chain([1, 2, 3])
    put(store, stored)
    assert matched(store, chain([1, 2, 3, 4, 5])) == 3
    assert matched(store, chain([1, 2, 9, 3])) == 2
    assert matched(store, chain([1, 2])) == 2
    assert matched(store, chain([7, 1, 2, 3])) == 0
    assert matched(store, chain([1, 2, 3], OTHER_NS)) == 0
    assert matched(store, []) == 0
    assert_prefix_closed(raw)


def test_match_without_payloads_returns_none_for_payloads(store: BlockStore) -> None:
    put(store, chain([1, 2]))
    result = store.match(NSID, chain([1, 2]), now=T0)
    assert result.payloads is None
    assert (result.collisions, result.corrupt) == (0, 0)


def test_match_with_payloads_returns_the_stored_bytes(store: BlockStore) -> None:
    links = chain([1, 2, 3, 4])
    payloads = [b"", b"\x00\xff" * 3, bytes(range(256)) * 800, b"last"]  # 200 KiB: LMDB overflow
    put(store, links, payloads=payloads)
    result = store.match(NSID, chain([1, 2, 3, 4, 5]), now=T0, with_payloads=True)
    assert result.matched == 4
    assert result.payloads == tuple(payloads)
    assert all(type(p) is bytes for p in result.payloads)


def test_insert_accepts_memoryview_payloads(store: BlockStore) -> None:
    links = chain([1, 2])
    data = bytearray(b"abcdefgh")
    put(store, links, payloads=[memoryview(data)[:4], memoryview(data)[4:]])
    assert store.match(NSID, links, now=T0, with_payloads=True).payloads == (b"abcd", b"efgh")


# -- insert ----------------------------------------------------------------------------------


def test_insert_reports_stored_keys_in_order(store: BlockStore) -> None:
    links = chain([1, 2, 3])
    result = put(store, links)
    assert result.stored == tuple(link.key for link in links)
    assert (result.refreshed, result.conflicts, result.collisions) == (0, 0, 0)


def test_insert_of_nothing_is_a_no_op(store: BlockStore) -> None:
    result = store.insert(NSID, [], parent=None, now=T0, retention="chat", ttl_seconds=TTL)
    assert result.stored == ()
    assert store.usage().blocks == 0


def test_insert_continues_a_stored_parent(store: BlockStore, raw: RawAccess) -> None:
    links = chain([1, 2, 3, 4])
    put(store, links[:2])
    put(store, links, start=2)
    assert matched(store, links) == 4
    assert_prefix_closed(raw)


def test_insert_with_missing_parent_raises_and_changes_nothing(
    store: BlockStore, raw: RawAccess
) -> None:
    put(store, chain([1]))
    before_usage, before_blocks = store.usage(), raw.blocks()
    links = chain([1, 2, 3, 4])
    with pytest.raises(MissingParent) as caught:
        put(store, links, start=2)
    assert caught.value.extensions["parent_block"] == 1
    if capable(store, "exact_usage"):  # Redis's memory figures move on their own
        assert store.usage() == before_usage
    assert raw.blocks() == before_blocks
    assert matched(store, links) == 1
    assert store.match(NSID, links[2:], now=T0).matched == 0


def test_insert_with_missing_parent_in_a_new_namespace_records_no_namespace(
    store: BlockStore,
) -> None:
    links = chain([1, 2, 3], OTHER_NS)
    with pytest.raises(MissingParent):
        store.insert(
            OTHER_NSID,
            [NewBlock(links[2], payload_of(links[2]))],
            parent=links[1],
            now=T0,
            retention="chat",
            ttl_seconds=TTL,
        )
    # The memory backend changes records in place: a refusal must come before any write.
    assert store.encoded_namespace(OTHER_NSID.scope) is None


@pytest.mark.needs("clock_expiry")
def test_insert_under_an_expired_parent_raises_missing_parent(
    store: BlockStore, raw: RawAccess
) -> None:
    links = chain([1, 2])
    put(store, links[:1], ttl_seconds=10)
    with pytest.raises(MissingParent):
        put(store, links, start=1, now=T0 + 10)
    assert_holds(store, raw, blocks=1)


def test_insert_under_a_parent_whose_key_holds_other_tokens_raises_missing_parent(
    store: BlockStore, raw: RawAccess
) -> None:
    real = chain([1])[0]
    put(store, [real])
    impostor = ChainLink(key=real.key, parent=real.parent, tokens=tokens_to_bytes([9] * 4), depth=0)
    child = ChainLink(
        key=BlockKey(b"c" * 16), parent=real.key, tokens=tokens_to_bytes([2] * 4), depth=1
    )
    with pytest.raises(MissingParent):
        store.insert(
            NSID,
            [NewBlock(child, b"x")],
            parent=impostor,
            now=T0,
            retention="chat",
            ttl_seconds=TTL,
        )
    assert_holds(store, raw, blocks=1)


def test_storing_an_existing_block_is_a_refresh(store: BlockStore, raw: RawAccess) -> None:
    links = chain([1, 2, 3])
    put(store, links)
    result = put(store, links, now=T0 + 5)
    assert result.stored == ()
    assert (result.refreshed, result.conflicts) == (3, 0)
    assert_holds(store, raw, blocks=3, payload_bytes=3 * len(payload_of(links[0])))
    assert {raw.blocks()[link.key].created_at for link in links} == {T0}


@pytest.mark.needs("record_upkeep", "clock_expiry")
def test_a_refresh_records_the_use_and_slides_the_expiry(store: BlockStore, raw: RawAccess) -> None:
    links = chain([1, 2, 3])
    put(store, links)
    put(store, links, now=T0 + 5)
    metas = raw.blocks()
    assert {metas[link.key].last_used_at for link in links} == {T0 + 5}
    assert {metas[link.key].expires_at for link in links} == {T0 + 5 + TTL}


def test_first_writer_wins_and_conflicts_are_counted(store: BlockStore, raw: RawAccess) -> None:
    links = chain([1, 2, 3])
    first = [b"first-0", b"first-1", b"first-2"]
    put(store, links, payloads=first)
    result = put(store, links, payloads=[b"first-0", b"second-1", b"second-2-longer"])
    assert (result.refreshed, result.conflicts) == (3, 2)
    assert store.match(NSID, links, now=T0, with_payloads=True).payloads == tuple(first)
    assert_holds(store, raw, blocks=3, payload_bytes=sum(map(len, first)))


def test_a_refresh_lengthens_a_blocks_life_and_never_shortens_it(
    store: BlockStore, raw: RawAccess
) -> None:
    link = chain([1])[0]
    put(store, [link], ttl_seconds=TTL)
    assert raw.seconds_left(link.key, T0) == pytest.approx(TTL, abs=1)
    put(store, [link], ttl_seconds=7 * TTL)
    assert raw.seconds_left(link.key, T0) == pytest.approx(7 * TTL, abs=1)
    put(store, [link], ttl_seconds=TTL)
    assert raw.seconds_left(link.key, T0) == pytest.approx(7 * TTL, abs=1)


@pytest.mark.needs("record_upkeep", "clock_expiry")
def test_refresh_keeps_the_later_expiry(store: BlockStore, raw: RawAccess) -> None:
    links = chain([1])
    put(store, links, ttl_seconds=7 * TTL, retention="long")
    put(store, links, now=T0 + 1, ttl_seconds=TTL, retention="short")
    meta = raw.blocks()[links[0].key]
    assert (meta.expires_at, meta.retention) == (T0 + 7 * TTL, "long")
    put(store, links, now=T0 + 7 * TTL - 1, ttl_seconds=TTL, retention="short")
    meta = raw.blocks()[links[0].key]
    assert (meta.expires_at, meta.retention) == (T0 + 8 * TTL - 1, "short")


def test_insert_lifts_its_parents_life_to_the_new_blocks(store: BlockStore, raw: RawAccess) -> None:
    links = chain([1, 2, 3])
    put(store, links[:2], ttl_seconds=TTL)
    put(store, links, start=2, ttl_seconds=10 * TTL)
    assert raw.seconds_left(links[1].key, T0) == pytest.approx(10 * TTL, abs=1)


@pytest.mark.needs("store_eviction", "record_upkeep", "clock_expiry")
def test_insert_lifts_ancestors_expiry_to_the_new_blocks(store: BlockStore, raw: RawAccess) -> None:
    links = chain([1, 2, 3])
    put(store, links[:2], ttl_seconds=TTL, retention="short")
    put(store, links, start=2, now=T0 + 1, ttl_seconds=10 * TTL, retention="long")
    metas = raw.blocks()
    assert [metas[link.key].expires_at for link in links] == [T0 + 1 + 10 * TTL] * 3
    assert [metas[link.key].retention for link in links] == ["long"] * 3
    assert_prefix_closed(raw)


# -- collisions ------------------------------------------------------------------------------


def _impostor(
    link: ChainLink,
    *,
    parent: BlockKey | None = None,
    tokens: bytes | None = None,
    depth: int | None = None,
) -> ChainLink:
    return ChainLink(
        key=link.key,
        parent=link.parent if parent is None else parent,
        tokens=link.tokens if tokens is None else tokens,
        depth=link.depth if depth is None else depth,
    )


@pytest.mark.parametrize("differs", ["tokens", "parent", "depth"])
def test_collision_is_refused_and_never_matched(
    store: BlockStore, raw: RawAccess, differs: str
) -> None:
    links = chain([1, 2])
    put(store, links, payloads=[b"real-0", b"real-1"])
    real = links[1]
    if differs == "tokens":
        fake = _impostor(real, tokens=tokens_to_bytes([5] * BLOCK))
    elif differs == "parent":
        fake = _impostor(real, parent=BlockKey(b"\x01" * 16))
    else:
        fake = _impostor(real, depth=real.depth + 1)
    before = raw.blocks()
    result = store.insert(
        NSID,
        [NewBlock(fake, b"fake")],
        parent=links[0],
        now=T0,
        retention="chat",
        ttl_seconds=TTL,
    )
    assert (result.stored, result.collisions) == ((), 1)
    assert raw.blocks()[real.key] == before[real.key]
    answer = store.match(NSID, [links[0], fake], now=T0, with_payloads=True)
    assert (answer.matched, answer.collisions) == (1, 1)
    assert answer.payloads == (b"real-0",)
    assert store.match(NSID, links, now=T0, with_payloads=True).payloads == (b"real-0", b"real-1")


def test_collision_mid_request_stores_the_blocks_before_it(
    store: BlockStore, raw: RawAccess
) -> None:
    taken = chain([8])[0]
    put(store, [taken])
    links = chain([1, 2, 3])
    # Block 1 of the new prompt hashes (in this fiction) to the key `taken` already holds.
    clash = ChainLink(key=taken.key, parent=links[0].key, tokens=links[1].tokens, depth=1)
    result = store.insert(
        NSID,
        [NewBlock(links[0], b"a"), NewBlock(clash, b"b")],
        parent=None,
        now=T0,
        retention="chat",
        ttl_seconds=TTL,
    )
    assert (result.stored, result.collisions) == ((links[0].key,), 1)
    assert matched(store, [links[0], clash]) == 1
    assert_prefix_closed(raw)


def test_namespace_whose_root_collides_shares_nothing(store: BlockStore, raw: RawAccess) -> None:
    links = chain([1, 2])
    put(store, links, payloads=[b"mine-0", b"mine-1"])
    # Another namespace whose root key (in this fiction) equals ours: different encoded bytes.
    intruder = NamespaceId(root=NSID.root, encoded=NSID.encoded + b"-other")
    answer = store.match(intruder, links, now=T0, with_payloads=True)
    assert (answer.matched, answer.collisions) == (0, 1)
    assert store.get_payloads(intruder, [link.key for link in links], now=T0)[0] == [None, None]
    before = raw.blocks()
    blocks = [NewBlock(link, b"theirs") for link in chain([3, 4])]
    result = store.insert(intruder, blocks, parent=None, now=T0, retention="chat", ttl_seconds=TTL)
    assert (result.stored, result.collisions) == ((), 2)
    assert raw.blocks() == before
    assert store.match(NSID, links, now=T0, with_payloads=True).payloads == (b"mine-0", b"mine-1")


# -- get_payloads ----------------------------------------------------------------------------


def test_get_payloads_returns_stored_blocks_of_the_namespace_only(store: BlockStore) -> None:
    links = chain([2, 3])
    foreign = chain([2, 3], OTHER_NS)
    put(store, links, payloads=[b"p0", b"p1"])
    put(store, foreign, payloads=[b"f0", b"f1"], namespace=OTHER_NS)
    unknown = BlockKey(b"\x07" * 16)
    keys = [links[1].key, foreign[0].key, unknown, links[0].key]
    payloads, corrupt = store.get_payloads(NSID, keys, now=T0 + 5)
    assert (payloads, corrupt) == ([b"p1", None, None, b"p0"], 0)
    payloads, _ = store.get_payloads(OTHER_NSID, [foreign[0].key, links[0].key], now=T0)
    assert payloads == [b"f0", None]
    assert store.get_payloads(NSID, [], now=T0) == ([], 0)


@pytest.mark.needs("clock_expiry")
def test_get_payloads_reads_an_expired_block_as_none(store: BlockStore) -> None:
    short, links = chain([1]), chain([2])
    put(store, short, ttl_seconds=10, payloads=[b"short-lived"])
    put(store, links, payloads=[b"p0"])
    keys = [short[0].key, links[0].key]
    assert store.get_payloads(NSID, keys, now=T0 + 9.9) == ([b"short-lived", b"p0"], 0)
    assert store.get_payloads(NSID, keys, now=T0 + 10) == ([None, b"p0"], 0)


# -- corruption ------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", [b"same-length-but-no", b"short", b""])
def test_corrupt_payload_is_never_returned_and_is_counted(
    store: BlockStore, raw: RawAccess, damage: bytes
) -> None:
    links = chain([1, 2, 3])
    put(
        store, links, payloads=[b"payload-zero-zero!", b"payload-one-one-1!", b"payload-two-two-2!"]
    )
    raw.overwrite_payload(links[1].key, damage)
    answer = store.match(NSID, links, now=T0, with_payloads=True)
    assert (answer.matched, answer.corrupt) == (1, 1)
    assert answer.payloads == (b"payload-zero-zero!",)
    payloads, corrupt = store.get_payloads(NSID, [link.key for link in links], now=T0)
    assert payloads == [b"payload-zero-zero!", None, b"payload-two-two-2!"]
    assert corrupt == 1


# -- usage -----------------------------------------------------------------------------------


@pytest.mark.needs("exact_usage")
def test_usage_counts_the_blocks_stored(store: BlockStore) -> None:
    put(store, chain([1, 2, 3]))
    put(store, chain([1, 2], OTHER_NS), namespace=OTHER_NS)
    assert store.usage().blocks == 5


@pytest.mark.needs("exact_usage", "store_eviction")
def test_usage_counts_blocks_and_payload_bytes(store: BlockStore) -> None:
    empty = store.usage()
    assert (empty.blocks, empty.payload_bytes) == (0, 0)
    links = chain([1, 2, 3])
    put(store, links, payloads=[b"a" * 10, b"b" * 20, b"c" * 30])
    usage = store.usage()
    assert (usage.blocks, usage.payload_bytes) == (3, 60)
    assert usage.used_bytes > empty.used_bytes
    store.evict(now=T0, max_blocks=1)
    usage = store.usage()
    assert (usage.blocks, usage.payload_bytes) == (2, 30)


def test_estimate_bytes_grows_with_the_payload(store: BlockStore) -> None:
    small = store.space.estimate_bytes(100, 4 * 64)
    large = store.space.estimate_bytes(1 << 20, 4 * 64)
    assert 100 < small < large
    assert large >= 1 << 20


def test_reserved_bytes_are_reported_by_the_space_report(store: BlockStore) -> None:
    assert store.space.reserved_bytes() >= 0
