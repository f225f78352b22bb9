"""An LMDB store written in format 3 (records without a checksum) is migrated in place when
opened: nothing is thrown away, and a migration cut short is resumed."""

from __future__ import annotations

import logging
import struct
from pathlib import Path

import lmdb
import pytest

from cache_service.core.blocks import BlockMeta
from cache_service.core.errors import StorageError
from cache_service.core.store.lmdb import migrations
from cache_service.core.store.lmdb.store import LmdbStore
from cache_service.core.store.parts.codec import decode_meta, intact
from tests.store.chains import LMDB_MAP_SIZE_BYTES, NSID, T0, chain, matched, payload_of, put

# Format 3's record, written out here from its documentation rather than imported.
V3 = struct.Struct("<BIIdddQQQQ16s16sdQB")
LINKS = chain(list(range(1, 13)))


def encode_v3(meta: BlockMeta) -> bytes:
    retention = meta.retention.encode()
    header = V3.pack(3, meta.depth, meta.children, meta.created_at, meta.last_used_at,
                     meta.expires_at, meta.eviction_rank, meta.hits, meta.payload_size,
                     meta.checksum, meta.namespace_root, meta.parent, meta.indexed_expiry,
                     meta.stored_seq, len(retention))  # fmt: skip
    return header + retention + meta.tokens


def write_format_3(folder: Path, *, leave_v4: int = 0) -> dict[bytes, BlockMeta]:
    """Store LINKS, then rewrite the store as a format-3 one (but `leave_v4` records)."""
    store = LmdbStore(folder, map_size_bytes=LMDB_MAP_SIZE_BYTES)
    put(store, LINKS)
    store.close()
    env = lmdb.open(str(folder), max_dbs=16, map_size=LMDB_MAP_SIZE_BYTES)
    blocks, meta_db = env.open_db(b"blocks"), env.open_db(b"meta")
    metas = {}
    with env.begin(write=True) as txn:
        records = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=blocks)]
        for index, (key, record) in enumerate(records):
            meta = decode_meta(key, record)  # type: ignore[arg-type]
            metas[key] = meta
            if index >= leave_v4:
                txn.put(key, encode_v3(meta), db=blocks)
        txn.put(b"format", b"3", db=meta_db)
    env.close()
    return metas


def stored_records(folder: Path) -> tuple[bytes, dict[bytes, bytes]]:
    env = lmdb.open(str(folder), max_dbs=16, map_size=LMDB_MAP_SIZE_BYTES, readonly=True)
    meta_db, blocks = env.open_db(b"meta", create=False), env.open_db(b"blocks", create=False)
    with env.begin() as txn:
        found = bytes(txn.get(b"format", db=meta_db))
        records = {bytes(k): bytes(v) for k, v in txn.cursor(db=blocks)}
    env.close()
    return found, records


@pytest.mark.parametrize("leave_v4", [0, 5])  # 5: a migration cut short, resumed
def test_a_format_3_store_is_migrated_in_place_and_keeps_every_block(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, leave_v4: int
) -> None:
    monkeypatch.setattr(migrations, "MIGRATE_BATCH_RECORDS", 4)  # several transactions
    metas = write_format_3(tmp_path, leave_v4=leave_v4)
    with caplog.at_level(logging.INFO, logger="cache_service"):
        store = LmdbStore(tmp_path, map_size_bytes=LMDB_MAP_SIZE_BYTES)
    try:
        answer = store.match(NSID, LINKS, now=T0, with_payloads=True)
        assert answer.matched == len(LINKS)
        assert answer.payloads == tuple(payload_of(link) for link in LINKS)
    finally:
        store.close()
    found, records = stored_records(tmp_path)
    assert found == b"4"
    assert all(intact(record) for record in records.values())
    assert {key: decode_meta(key, r) for key, r in records.items()} == metas  # type: ignore[arg-type]
    assert f"migrated {len(LINKS) - leave_v4} block records" in caplog.text


def test_a_record_that_reads_as_neither_format_is_left_to_be_dropped_as_damaged(
    tmp_path: Path,
) -> None:
    write_format_3(tmp_path)
    env = lmdb.open(str(tmp_path), max_dbs=16, map_size=LMDB_MAP_SIZE_BYTES)
    key, blocks = LINKS[6].key, env.open_db(b"blocks")
    with env.begin(write=True) as txn:
        txn.put(key, b"\x07" + bytes(200), db=blocks)  # no known version
    env.close()
    store = LmdbStore(tmp_path, map_size_bytes=LMDB_MAP_SIZE_BYTES)
    try:
        assert matched(store, LINKS) == 6
        assert store.drop_damaged(now=T0, ttl_seconds=1.0).records == 1
        assert matched(store, LINKS) == 6
        put(store, LINKS)
        assert matched(store, LINKS) == len(LINKS)
    finally:
        store.close()


def test_an_unknown_format_is_still_refused(tmp_path: Path) -> None:
    LmdbStore(tmp_path, map_size_bytes=LMDB_MAP_SIZE_BYTES).close()
    env = lmdb.open(str(tmp_path), max_dbs=16, map_size=LMDB_MAP_SIZE_BYTES)
    meta_db = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.put(b"format", b"9", db=meta_db)
    env.close()
    with pytest.raises(StorageError, match="format b'9'"):
        LmdbStore(tmp_path, map_size_bytes=LMDB_MAP_SIZE_BYTES)
