"""The BlockStore contract, run against every backend through the `store` fixture."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from cache_service.blocks import (
    BlockKey,
    ChainLink,
    InsertResult,
    Namespace,
    NamespaceId,
    NewBlock,
    Touch,
)
from cache_service.errors import MissingParent
from cache_service.hashing import BlockHasher, tokens_to_bytes
from cache_service.store.base import BlockStore
from cache_service.store.lmdb import LmdbStore

if TYPE_CHECKING:
    from conftest import RawAccess

LMDB_MAP_SIZE_BYTES = 1 << 30
BLOCK = 4
T0 = 1_000_000.0
TTL = 3600.0
NS = Namespace(model="contract-model")
OTHER_NS = Namespace(model="contract-model", tenant="someone-else")
HASHER = BlockHasher()
NSID = HASHER.namespace_id(NS)
OTHER_NSID = HASHER.namespace_id(OTHER_NS)


def chain(labels: Sequence[int], namespace: Namespace = NS) -> list[ChainLink]:
    """A prompt of one block per label, each block four copies of its label."""
    tokens = [label for label in labels for _ in range(BLOCK)]
    return HASHER.chain(namespace, tokens_to_bytes(tokens), block_size=BLOCK)


def payload_of(link: ChainLink, size: int = 24) -> bytes:
    """A payload unique to the block."""
    return (link.key * (size // 16 + 1))[:size]


def put(
    store: BlockStore,
    links: Sequence[ChainLink],
    *,
    now: float = T0,
    start: int = 0,
    ttl_seconds: float = TTL,
    retention: str = "chat",
    payloads: Sequence[bytes | memoryview] | None = None,
    namespace: Namespace = NS,
) -> InsertResult:
    """Insert links[start:] (their parent is links[start - 1])."""
    todo = links[start:]
    blocks = [
        NewBlock(link, payloads[i] if payloads is not None else payload_of(link))
        for i, link in enumerate(todo)
    ]
    return store.insert(
        HASHER.namespace_id(namespace),
        blocks,
        parent=links[start - 1] if start else None,
        now=now,
        retention=retention,
        ttl_seconds=ttl_seconds,
    )


def matched(store: BlockStore, links: Sequence[ChainLink], now: float = T0) -> int:
    return store.match(NSID, links, now=now).matched


def assert_prefix_closed(raw: RawAccess) -> None:
    """Every stored block's parent is stored, counts it as a child and outlives it."""
    blocks = raw.blocks()
    for meta in blocks.values():
        if meta.depth > 0:
            assert meta.parent in blocks, "a stored block lost its parent"
            assert blocks[meta.parent].expires_at >= meta.expires_at
        children = sum(
            1 for other in blocks.values() if other.depth > 0 and other.parent == meta.key
        )
        assert meta.children == children


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
    assert store.usage() == before_usage
    assert raw.blocks() == before_blocks
    assert matched(store, links) == 1
    assert store.match(NSID, links[2:], now=T0).matched == 0


def test_insert_under_an_expired_parent_raises_missing_parent(store: BlockStore) -> None:
    links = chain([1, 2])
    put(store, links[:1], ttl_seconds=10)
    with pytest.raises(MissingParent):
        put(store, links, start=1, now=T0 + 10)
    assert store.usage().blocks == 1


def test_insert_under_a_parent_whose_key_holds_other_tokens_raises_missing_parent(
    store: BlockStore,
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
    assert store.usage().blocks == 1


def test_storing_an_existing_block_is_a_refresh(store: BlockStore, raw: RawAccess) -> None:
    links = chain([1, 2, 3])
    put(store, links)
    usage = store.usage()
    result = put(store, links, now=T0 + 5)
    assert result.stored == ()
    assert (result.refreshed, result.conflicts) == (3, 0)
    assert store.usage().blocks == usage.blocks
    assert store.usage().payload_bytes == usage.payload_bytes
    metas = raw.blocks()
    assert {metas[link.key].created_at for link in links} == {T0}
    assert {metas[link.key].last_used_at for link in links} == {T0 + 5}
    assert {metas[link.key].expires_at for link in links} == {T0 + 5 + TTL}


def test_first_writer_wins_and_conflicts_are_counted(store: BlockStore) -> None:
    links = chain([1, 2, 3])
    first = [b"first-0", b"first-1", b"first-2"]
    put(store, links, payloads=first)
    result = put(store, links, payloads=[b"first-0", b"second-1", b"second-2-longer"])
    assert (result.refreshed, result.conflicts) == (3, 2)
    assert store.match(NSID, links, now=T0, with_payloads=True).payloads == tuple(first)
    assert store.usage().payload_bytes == sum(map(len, first))


def test_refresh_keeps_the_later_expiry(store: BlockStore, raw: RawAccess) -> None:
    links = chain([1])
    put(store, links, ttl_seconds=7 * TTL, retention="long")
    put(store, links, now=T0 + 1, ttl_seconds=TTL, retention="short")
    meta = raw.blocks()[links[0].key]
    assert (meta.expires_at, meta.retention) == (T0 + 7 * TTL, "long")
    put(store, links, now=T0 + 7 * TTL - 1, ttl_seconds=TTL, retention="short")
    meta = raw.blocks()[links[0].key]
    assert (meta.expires_at, meta.retention) == (T0 + 8 * TTL - 1, "short")


def test_insert_lifts_ancestors_expiry_to_the_new_blocks(store: BlockStore, raw: RawAccess) -> None:
    links = chain([1, 2, 3])
    put(store, links[:2], ttl_seconds=TTL, retention="short")
    put(store, links, start=2, now=T0 + 1, ttl_seconds=10 * TTL, retention="long")
    metas = raw.blocks()
    assert [metas[link.key].expires_at for link in links] == [T0 + 1 + 10 * TTL] * 3
    assert [metas[link.key].retention for link in links] == ["long"] * 3
    assert_prefix_closed(raw)


# -- expiry ----------------------------------------------------------------------------------


def test_block_is_alive_until_just_before_its_expiry(store: BlockStore) -> None:
    links = chain([1, 2])
    put(store, links, ttl_seconds=100)
    assert matched(store, links, now=T0 + 99.999) == 2
    assert matched(store, links, now=T0 + 100) == 0
    assert matched(store, links, now=T0 + 1e6) == 0


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


def test_get_payloads_returns_alive_blocks_of_the_namespace_only(store: BlockStore) -> None:
    short = chain([1])
    links = chain([2, 3])
    foreign = chain([2, 3], OTHER_NS)
    put(store, short, ttl_seconds=10, payloads=[b"short-lived"])
    put(store, links, payloads=[b"p0", b"p1"])
    put(store, foreign, payloads=[b"f0", b"f1"], namespace=OTHER_NS)
    unknown = BlockKey(b"\x07" * 16)
    keys = [links[1].key, foreign[0].key, unknown, links[0].key, short[0].key]
    payloads, corrupt = store.get_payloads(NSID, keys, now=T0 + 5)
    assert (payloads, corrupt) == ([b"p1", None, None, b"p0", b"short-lived"], 0)
    payloads, corrupt = store.get_payloads(NSID, keys, now=T0 + 10)
    assert (payloads, corrupt) == ([b"p1", None, None, b"p0", None], 0)
    payloads, _ = store.get_payloads(OTHER_NSID, [foreign[0].key, links[0].key], now=T0)
    assert payloads == [b"f0", None]
    assert store.get_payloads(NSID, [], now=T0) == ([], 0)


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


def test_evicted_records_say_why_and_what(store: BlockStore) -> None:
    links = chain([1])
    put(store, links, ttl_seconds=10, retention="agent", payloads=[b"12345"])
    (evicted,) = store.evict(now=T0 + 10, max_blocks=5)
    assert (evicted.key, evicted.reason, evicted.retention) == (links[0].key, "expired", "agent")
    assert (evicted.expires_at, evicted.payload_size) == (T0 + 10, 5)


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


def test_evict_never_removes_a_block_with_a_stored_child(store: BlockStore, raw: RawAccess) -> None:
    trunk = chain([1, 2, 3])
    put(store, trunk)
    for label in range(10, 16):
        put(store, chain([1, 2, 3, label]), start=3, now=T0 + label)
    order = evict_one_at_a_time(store, raw, now=T0 + 100, count=12)
    assert [key for key, _ in order[-3:]] == [trunk[2].key, trunk[1].key, trunk[0].key]
    assert store.usage().blocks == 0


@pytest.mark.parametrize("target", [0, 1, 4, 6])
def test_evict_with_target_blocks_stops_exactly_there(store: BlockStore, target: int) -> None:
    put(store, chain([1, 2, 3]))
    put(store, chain([4, 5, 6]), now=T0 + 1)
    evicted = store.evict(now=T0 + 2, max_blocks=100, target_blocks=target)
    assert len(evicted) == 6 - target
    assert store.usage().blocks == target


def test_evict_with_target_used_bytes_stops_once_below_it(store: BlockStore) -> None:
    for label in range(20):
        put(store, chain([label, 1000 + label]), payloads=[b"x" * 2000, b"y" * 2000])
    full = store.usage().used_bytes
    target = full // 2
    evicted = store.evict(now=T0, max_blocks=1000, target_used_bytes=target)
    assert evicted
    assert store.usage().used_bytes <= target
    assert 0 < store.usage().blocks < 40


def test_evict_stops_at_max_blocks(store: BlockStore) -> None:
    put(store, chain([1, 2, 3, 4, 5]))
    assert len(store.evict(now=T0, max_blocks=2)) == 2
    assert store.usage().blocks == 3


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


def test_evict_scans_past_a_full_batch_of_non_leaves(store: BlockStore, raw: RawAccess) -> None:
    # 40 expired blocks in one chain: the expiry index starts with many blocks that have a child.
    links = chain(list(range(40)))
    put(store, links, ttl_seconds=10)
    evicted = store.evict(now=T0 + 10, max_blocks=1000, expired_only=True)
    assert [e.key for e in evicted] == [link.key for link in reversed(links)]
    assert_prefix_closed(raw)


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


# -- touch -----------------------------------------------------------------------------------


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
    assert parent.lru_seq == deepest.lru_seq
    assert parent.last_used_at == T0 + 20
    assert parent.hits == 2


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


# -- usage -----------------------------------------------------------------------------------


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
    small = store.estimate_bytes(100, 4 * 64)
    large = store.estimate_bytes(1 << 20, 4 * 64)
    assert 100 < small < large
    assert large >= 1 << 20


# -- LMDB only -------------------------------------------------------------------------------


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
        assert metas[newer[0].key].lru_seq > max(metas[link.key].lru_seq for link in links)
        assert [e.key for e in again.evict(now=T0 + 1, max_blocks=1)] == [links[2].key]
    finally:
        again.close()
