"""Damaged blocks: a record or payload that fails verification is a miss, never an error,
and `drop_damaged` removes it with its subtree, mending the store around it.

Records are damaged on LMDB (the memory backend keeps objects, which cannot rot); payloads
on every backend.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, cast

import pytest

from cache_service.core.blocks import ChainLink, StoreKey, store_key
from cache_service.core.errors import NotStored
from cache_service.core.store.lmdb.store import LmdbStore
from cache_service.core.store.parts.backend import EXPIRY, VICTIMS
from cache_service.core.store.parts.codec import (
    DAMAGED,
    RECORD_FIELDS,
    CorruptRecord,
    check_record,
    decode_meta,
)
from cache_service.core.store.protocols import BlockStore
from tests.store.chains import (
    HASHER,
    LMDB_MAP_SIZE_BYTES,
    NSID,
    T0,
    TTL,
    Namespace,
    assert_holds,
    assert_prefix_closed,
    chain,
    matched,
    payload_of,
    put,
)

if TYPE_CHECKING:
    from conftest import LmdbRawAccess, RawAccess

LINKS = chain([1, 2, 3, 4, 5])
DAMAGED_AT = 2  # blocks 0 and 1 stay; 2 is damaged; 3 and 4 are its subtree


@pytest.fixture
def lmdb_store(tmp_path: Path) -> LmdbStore:
    opened = LmdbStore(tmp_path / "lmdb", map_size_bytes=LMDB_MAP_SIZE_BYTES)
    yield opened  # type: ignore[misc]
    opened.close()


@pytest.fixture
def lmdb_raw(lmdb_store: LmdbStore) -> LmdbRawAccess:
    from conftest import LmdbRawAccess  # noqa: PLC0415

    return LmdbRawAccess(lmdb_store)


def field_offset(name: str, record: bytes) -> int:
    """An offset inside the field `name` of `record` (its middle byte)."""
    offset, size = RECORD_FIELDS[name]
    if name == "retention":
        size = record[RECORD_FIELDS["retention_length"][0]]
    elif name == "tokens":
        offset += record[RECORD_FIELDS["retention_length"][0]]
        size = len(record) - offset
    assert size
    return offset + size // 2


def key_of(index: int) -> StoreKey:
    return store_key(b"", LINKS[index].key)


# -- the codec -------------------------------------------------------------------------------


def test_every_single_byte_flip_of_a_record_reads_as_damaged(
    lmdb_store: LmdbStore, lmdb_raw: LmdbRawAccess
) -> None:
    put(lmdb_store, LINKS)
    record = lmdb_raw.record(key_of(1))
    link = LINKS[1]
    for offset in range(len(record)):
        for mask in (0x01, 0x80, 0xFF):
            damaged = bytearray(record)
            damaged[offset] ^= mask
            with pytest.raises(CorruptRecord):
                decode_meta(key_of(1), bytes(damaged))
            status = check_record(bytes(damaged), root_and_parent=NSID.root + link.parent,
                                  tokens=link.tokens, depth=1, now=T0)  # fmt: skip
            assert status == DAMAGED
    assert issubclass(CorruptRecord, ValueError)
    for cut in (0, 1, 8, 100, len(record) - 1):
        with pytest.raises(CorruptRecord):
            decode_meta(key_of(1), record[:cut])


# -- a damaged record is a miss everywhere, never an error -------------------------------------


@pytest.mark.parametrize("field", list(RECORD_FIELDS))
def test_a_damaged_record_is_a_miss_on_every_path_and_is_dropped_with_its_subtree(
    lmdb_store: LmdbStore, lmdb_raw: LmdbRawAccess, field: str
) -> None:
    store = lmdb_store
    put(store, LINKS)
    record = lmdb_raw.record(key_of(DAMAGED_AT))
    lmdb_raw.flip(key_of(DAMAGED_AT), field_offset(field, record))
    keys = [link.key for link in LINKS]

    # Reads: a miss at the damaged block, right bytes before it.
    assert store.match(NSID, LINKS, now=T0).matched == DAMAGED_AT
    answer = store.match(NSID, LINKS, now=T0, with_payloads=True)
    assert (answer.matched, answer.collisions, answer.corrupt) == (DAMAGED_AT, 0, 0)
    assert answer.payloads == tuple(payload_of(link) for link in LINKS[:DAMAGED_AT])
    payloads, corrupt = store.get_payloads(NSID, keys, now=T0)
    assert payloads[DAMAGED_AT] is None and corrupt == 0
    assert payloads[:DAMAGED_AT] == [payload_of(link) for link in LINKS[:DAMAGED_AT]]
    assert store.inspect(NSID, LINKS[DAMAGED_AT], now=T0).status == "corrupt"
    with pytest.raises(NotStored):
        store.links_of(NSID, keys, now=T0)
    with pytest.raises(NotStored):
        store.pin(NSID, LINKS, now=T0, by="test")
    # Writes over it neither raise nor write over the damaged record.
    put(store, LINKS)
    store.touch([])
    from cache_service.core.blocks import Touch  # noqa: PLC0415

    store.touch([Touch(tuple(keys), at=T0 + 1, retention="chat", ttl_seconds=TTL)])
    assert store.evict(now=T0, max_blocks=10, expired_only=True) == []
    assert store.damage_pending() == 1

    dropped = store.drop_damaged(now=T0 + 2, ttl_seconds=TTL)
    assert (dropped.records, dropped.payloads) == (1, 0)
    assert {e.key for e in dropped.removed} == {key_of(i) for i in range(DAMAGED_AT, 5)}
    assert {e.reason for e in dropped.removed} == {"corrupt"}
    assert store.damage_pending() == 0
    assert store.drop_damaged(now=T0 + 2, ttl_seconds=TTL).records == 0  # once only
    _assert_consistent(store, lmdb_raw, blocks=DAMAGED_AT)
    # The block above is a leaf again: eviction reaches it, and nothing stalls.
    assert store.usage().payload_bytes == sum(len(payload_of(link)) for link in LINKS[:2])
    evicted = store.evict(now=T0 + 3, max_blocks=10)
    assert [e.key for e in evicted] == [key_of(1), key_of(0)]
    assert lmdb_raw.index_entries(VICTIMS) == []
    # The damaged block's expiry entry could not be told: the sweep that reaches it drops it.
    left = lmdb_raw.index_entries(EXPIRY)
    assert [entry[8:] for entry in left] in ([], [key_of(DAMAGED_AT)])
    assert store.evict(now=T0 + 2 * TTL, max_blocks=10, expired_only=True) == []
    assert lmdb_raw.index_entries(EXPIRY) == []
    # A fresh store of the same prompt works again.
    put(store, LINKS, now=T0 + 4)
    assert matched(store, LINKS, now=T0 + 4) == 5


def _assert_consistent(store: BlockStore, raw: RawAccess, *, blocks: int) -> None:
    assert_prefix_closed(raw)
    assert_holds(store, raw, blocks=blocks)


def test_a_damaged_parent_field_still_leaves_the_true_parent_a_leaf(
    lmdb_store: LmdbStore, lmdb_raw: LmdbRawAccess
) -> None:
    put(lmdb_store, LINKS)
    other = chain([1, 2, 9])  # a sibling of block 2 under block 1
    put(lmdb_store, other, start=2)
    lmdb_raw.flip(key_of(DAMAGED_AT), RECORD_FIELDS["parent"][0] + 3)
    assert matched(lmdb_store, LINKS) == DAMAGED_AT
    dropped = lmdb_store.drop_damaged(now=T0, ttl_seconds=TTL)
    assert dropped.records == 1
    _assert_consistent(lmdb_store, lmdb_raw, blocks=3)  # blocks 0, 1 and the sibling
    assert matched(lmdb_store, other) == 3


def test_damaged_first_block_goes_with_the_whole_chain(
    lmdb_store: LmdbStore, lmdb_raw: LmdbRawAccess
) -> None:
    put(lmdb_store, LINKS)
    lmdb_raw.flip(key_of(0), RECORD_FIELDS["depth"][0])
    assert matched(lmdb_store, LINKS) == 0
    dropped = lmdb_store.drop_damaged(now=T0, ttl_seconds=TTL)
    assert (dropped.records, len(dropped.removed)) == (1, 5)
    _assert_consistent(lmdb_store, lmdb_raw, blocks=0)
    assert lmdb_store.usage().payload_bytes == 0


def test_a_damaged_record_under_a_pin_lets_the_pin_go(
    lmdb_store: LmdbStore, lmdb_raw: LmdbRawAccess
) -> None:
    put(lmdb_store, LINKS)
    lmdb_store.pin(NSID, LINKS, now=T0, by="ops")
    lmdb_raw.flip(key_of(DAMAGED_AT), RECORD_FIELDS["hits"][0])
    assert matched(lmdb_store, LINKS) == DAMAGED_AT
    lmdb_store.drop_damaged(now=T0 + 5, ttl_seconds=TTL)
    assert lmdb_store.pins(b"") == []
    kept = lmdb_raw.blocks()
    assert set(kept) == {key_of(0), key_of(1)}
    assert all(meta.expires_at == T0 + 5 + TTL for meta in kept.values())  # released
    assert not math.isinf(kept[key_of(1)].expires_at)
    _assert_consistent(lmdb_store, lmdb_raw, blocks=2)


def test_a_tenant_loses_the_bytes_of_its_damaged_block(
    lmdb_store: LmdbStore, lmdb_raw: LmdbRawAccess
) -> None:
    tenant = Namespace(model="contract-model", tenant="acme")
    links = chain([1, 2, 3], tenant)
    tenant_id = HASHER.namespace_id(tenant)
    put(lmdb_store, links, namespace=tenant)
    full = lmdb_store.tenant_bytes(tenant_id.partition)
    lmdb_raw.flip(store_key(tenant_id.partition, links[1].key), RECORD_FIELDS["tokens"][0] + 9)
    assert lmdb_store.match(tenant_id, links, now=T0).matched == 1
    lmdb_store.drop_damaged(now=T0, ttl_seconds=TTL)
    assert lmdb_store.match(tenant_id, links, now=T0).matched == 1
    assert 0 < lmdb_store.tenant_bytes(tenant_id.partition) < full
    evicted = lmdb_store.evict_tenant(tenant_id.partition, target_bytes=0, now=T0, max_blocks=9)
    assert len(evicted) == 1  # the first block, a leaf again for its tenant


def test_damage_seen_only_by_an_eviction_scan_is_noted(
    lmdb_store: LmdbStore, lmdb_raw: LmdbRawAccess
) -> None:
    put(lmdb_store, LINKS)
    lmdb_raw.flip(key_of(4), RECORD_FIELDS["eviction_rank"][0])  # the only leaf
    assert lmdb_store.evict(now=T0, max_blocks=1) == []  # its entry goes; nothing else a leaf
    assert lmdb_store.damage_pending() == 1
    assert lmdb_store.drop_damaged(now=T0, ttl_seconds=TTL).records == 1
    assert [e.key for e in lmdb_store.evict(now=T0, max_blocks=1)] == [key_of(3)]


@pytest.mark.needs("byte_records")
@pytest.mark.parametrize("field", ["depth", "parent", "tokens", "payload_size", "checksum"])
def test_a_damaged_record_is_a_miss_on_every_path_and_is_dropped(
    store: BlockStore, raw: RawAccess, field: str
) -> None:
    put(store, LINKS)
    damaging = cast("LmdbRawAccess", raw)  # LMDB's and Redis's raw access can flip a byte
    damaging.flip(key_of(DAMAGED_AT), field_offset(field, damaging.record(key_of(DAMAGED_AT))))
    keys = [link.key for link in LINKS]
    assert matched(store, LINKS) == DAMAGED_AT
    answer = store.match(NSID, LINKS, now=T0, with_payloads=True)
    assert (answer.matched, answer.collisions, answer.corrupt) == (DAMAGED_AT, 0, 0)
    assert answer.payloads == tuple(payload_of(link) for link in LINKS[:DAMAGED_AT])
    payloads, _ = store.get_payloads(NSID, keys, now=T0)
    assert payloads[DAMAGED_AT] is None
    assert payloads[:DAMAGED_AT] == [payload_of(link) for link in LINKS[:DAMAGED_AT]]
    assert store.inspect(NSID, LINKS[DAMAGED_AT], now=T0).status == "corrupt"
    put(store, LINKS)  # neither raises nor writes over the damaged record
    assert matched(store, LINKS) == DAMAGED_AT
    assert store.damage_pending() == 1
    dropped = store.drop_damaged(now=T0 + 2, ttl_seconds=TTL)
    assert dropped.records == 1
    assert key_of(DAMAGED_AT) in {e.key for e in dropped.removed}
    assert {e.reason for e in dropped.removed} == {"corrupt"}
    assert key_of(DAMAGED_AT) not in raw.blocks()
    assert store.drop_damaged(now=T0 + 2, ttl_seconds=TTL).records == 0  # once only
    put(store, LINKS, now=T0 + 4)
    assert matched(store, LINKS, now=T0 + 4) == 5


@pytest.mark.needs("byte_records")
def test_a_damaged_record_is_not_counted_as_a_corrupt_payload(
    store: BlockStore, raw: RawAccess
) -> None:
    put(store, LINKS)
    damaging = cast("LmdbRawAccess", raw)
    damaging.flip(key_of(DAMAGED_AT), field_offset("tokens", damaging.record(key_of(DAMAGED_AT))))
    payloads, corrupt = store.get_payloads(NSID, [link.key for link in LINKS], now=T0)
    assert (payloads[DAMAGED_AT], corrupt) == (None, 0)


# -- damaged payloads (every backend) ----------------------------------------------------------


def test_a_damaged_payload_is_a_miss_and_dropped(store: BlockStore, raw: RawAccess) -> None:
    put(store, LINKS)
    raw.overwrite_payload(key_of(DAMAGED_AT), b"rotten")
    answer = store.match(NSID, LINKS, now=T0, with_payloads=True)
    assert (answer.matched, answer.corrupt) == (DAMAGED_AT, 1)
    assert answer.payloads == tuple(payload_of(link) for link in LINKS[:DAMAGED_AT])
    assert store.damage_pending() == 1
    dropped = store.drop_damaged(now=T0, ttl_seconds=TTL)
    assert dropped.records + dropped.payloads == 1
    assert key_of(DAMAGED_AT) in {e.key for e in dropped.removed}
    assert key_of(DAMAGED_AT) not in raw.blocks()
    assert store.damage_pending() == 0
    assert matched(store, LINKS) == DAMAGED_AT
    put(store, LINKS)
    assert store.match(NSID, LINKS, now=T0, with_payloads=True).payloads == tuple(
        payload_of(link) for link in LINKS
    )


def test_a_dropped_damaged_payload_is_counted_as_a_payload(
    store: BlockStore, raw: RawAccess
) -> None:
    put(store, LINKS)
    raw.overwrite_payload(key_of(DAMAGED_AT), b"rotten")
    store.match(NSID, LINKS, now=T0, with_payloads=True)
    dropped = store.drop_damaged(now=T0, ttl_seconds=TTL)
    assert (dropped.records, dropped.payloads) == (0, 1)


@pytest.mark.needs("subtree_removal")
def test_a_damaged_payload_is_dropped_with_its_subtree(store: BlockStore, raw: RawAccess) -> None:
    put(store, LINKS)
    raw.overwrite_payload(key_of(DAMAGED_AT), b"rotten")
    answer = store.match(NSID, LINKS, now=T0, with_payloads=True)
    assert (answer.matched, answer.corrupt) == (DAMAGED_AT, 1)
    assert store.damage_pending() == 1
    dropped = store.drop_damaged(now=T0, ttl_seconds=TTL)
    assert (dropped.records, dropped.payloads) == (0, 1)
    assert {e.key for e in dropped.removed} == {key_of(i) for i in range(DAMAGED_AT, 5)}
    _assert_consistent(store, raw, blocks=DAMAGED_AT)
    put(store, LINKS)
    assert store.match(NSID, LINKS, now=T0, with_payloads=True).payloads == tuple(
        payload_of(link) for link in LINKS
    )


def test_a_payload_repaired_before_the_drop_is_kept(store: BlockStore, raw: RawAccess) -> None:
    put(store, LINKS)
    raw.overwrite_payload(key_of(1), b"rotten")
    assert store.get_payloads(NSID, [LINKS[1].key], now=T0)[1] == 1
    raw.overwrite_payload(key_of(1), payload_of(LINKS[1]))
    assert store.drop_damaged(now=T0, ttl_seconds=TTL).removed == ()
    assert matched(store, LINKS) == 5


# -- dangling index entries ----------------------------------------------------------------------


@pytest.mark.needs("store_eviction")
@pytest.mark.parametrize("index", [VICTIMS, EXPIRY])
def test_eviction_removes_index_entries_whose_record_is_gone(
    store: BlockStore, raw: RawAccess, index: str
) -> None:
    links: list[ChainLink] = chain([7])
    put(store, links)
    backend = store.backend  # type: ignore[attr-defined]
    with backend.write() as txn:  # entries left by records dropped as damaged
        for n in range(40):
            txn.index_add(index, bytes(8), store_key(b"", bytes([n]) * 16))  # type: ignore[arg-type]
    evicted = store.evict(now=T0 + 2 * TTL if index == EXPIRY else T0, max_blocks=5)
    assert [e.key for e in evicted] == [key_of_link(links[0])]
    with backend.read() as txn:
        assert list(txn.index_scan(index, after=None, upto=None, limit=100)) == []


def key_of_link(link: ChainLink) -> StoreKey:
    return store_key(b"", link.key)
