"""In-place migrations of an LMDB store written by an older build, run when it is opened.

Format 3 -> 4: block records gain a checksum over the whole record (`store.parts.codec`). Every
record is re-encoded, in write transactions of `MIGRATE_BATCH_RECORDS`, so no transaction is
long; the store's format is written as 4 only once every record is done. A migration cut
short (a crash, a kill) is resumed by the next opener: records already in format 4 pass
their checksum and are skipped. A record that does not read as format 3 either is left as it
is: it reads as damaged, and is dropped as such when first met.
"""

from __future__ import annotations

import logging
import struct
import time
from typing import Any

from cache_service.core.blocks import BlockKey, BlockMeta, StoreKey
from cache_service.core.store.parts.codec import encode_meta, intact
from cache_service.core.tokens import whole_tokens

log = logging.getLogger("cache_service")

MIGRATE_BATCH_RECORDS = 4096
# Format 3's record: version (3), depth, children, created, last_used, expires, eviction_rank, hits,
# payload_size, checksum, namespace root, parent key, indexed expiry, stored seq, retention
# length; then the retention name and the tokens. No checksum of its own.
V3_RECORD = struct.Struct("<BIIdddQQQQ16s16sdQB")


def decode_v3(key: StoreKey, raw: bytes) -> BlockMeta | None:
    """A format-3 record's metadata, or None if it does not read as one."""
    if len(raw) < V3_RECORD.size or raw[0] != 3:
        return None
    fields = V3_RECORD.unpack_from(raw)
    tokens_at = V3_RECORD.size + fields[14]
    try:
        retention = raw[V3_RECORD.size : tokens_at].decode("utf-8")
    except UnicodeDecodeError:
        return None
    tokens = raw[tokens_at:]
    if tokens_at > len(raw) or not tokens or not whole_tokens(tokens):
        return None
    return BlockMeta(
        key=key,
        namespace_root=BlockKey(fields[10]),
        parent=BlockKey(fields[11]),
        depth=fields[1],
        tokens=tokens,
        payload_size=fields[8],
        checksum=fields[9],
        created_at=fields[3],
        last_used_at=fields[4],
        expires_at=fields[5],
        retention=retention,
        children=fields[2],
        eviction_rank=fields[6],
        hits=fields[7],
        indexed_expiry=fields[12],
        stored_seq=fields[13],
    )


def migrate(env: Any, blocks_db: Any, *, where: str) -> int:
    """Re-encode every format-3 block record as format 4; returns how many were."""
    log.info("%s: migrating block records from store format 3 to 4", where)
    started = time.monotonic()
    migrated = unreadable = 0
    after: bytes | None = None
    while True:
        with env.begin(write=True) as txn:
            batch = _next_batch(txn, blocks_db, after)
            for key, raw in batch:
                if intact(raw):
                    continue  # already format 4: an earlier migration was cut short
                meta = decode_v3(StoreKey(key), raw)
                if meta is None:
                    unreadable += 1
                    continue
                txn.put(key, encode_meta(meta), db=blocks_db)
                migrated += 1
        if len(batch) < MIGRATE_BATCH_RECORDS:
            break
        after = batch[-1][0]
    log.info(
        "%s: migrated %d block records to store format 4 in %.1fs (%d unreadable, left to "
        "be dropped as damaged)",
        where,
        migrated,
        time.monotonic() - started,
        unreadable,
    )
    return migrated


def _next_batch(txn: Any, blocks_db: Any, after: bytes | None) -> list[tuple[bytes, bytes]]:
    """Up to MIGRATE_BATCH_RECORDS (key, record) pairs in key order, after `after`."""
    batch: list[tuple[bytes, bytes]] = []
    with txn.cursor(db=blocks_db) as cursor:
        positioned = cursor.set_range(after) if after is not None else cursor.first()
        if positioned and after is not None and bytes(cursor.key()) == after:
            positioned = cursor.next()
        while positioned and len(batch) < MIGRATE_BATCH_RECORDS:
            batch.append((bytes(cursor.key()), bytes(cursor.value())))
            positioned = cursor.next()
    return batch
