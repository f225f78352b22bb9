"""The binary record a backend keeps per block (metadata without payload)."""

from __future__ import annotations

import struct

from cache_service.core.blocks import BlockKey, BlockMeta, StoreKey

RECORD_VERSION = 3
# version, depth, children, created, last_used, expires, lru_seq, hits, payload_size,
# checksum, namespace root, parent key, indexed expiry, stored seq, retention length
_HEADER = struct.Struct("<BIIdddQQQQ16s16sdQB")


def encode_meta(meta: BlockMeta) -> bytes:
    """Pack a block's metadata: fixed header, retention name, then its token bytes."""
    retention = meta.retention.encode("utf-8")
    return (
        _HEADER.pack(
            RECORD_VERSION,
            meta.depth,
            meta.children,
            meta.created_at,
            meta.last_used_at,
            meta.expires_at,
            meta.lru_seq,
            meta.hits,
            meta.payload_size,
            meta.checksum,
            meta.namespace_root,
            meta.parent,
            meta.indexed_expiry,
            meta.stored_seq,
            len(retention),
        )
        + retention
        + meta.tokens
    )


def decode_meta(key: StoreKey, record: bytes | memoryview) -> BlockMeta:
    """Unpack what `encode_meta` wrote; ValueError for an unknown record version."""
    (
        version,
        depth,
        children,
        created_at,
        last_used_at,
        expires_at,
        lru_seq,
        hits,
        payload_size,
        checksum,
        namespace_root,
        parent,
        indexed_expiry,
        stored_seq,
        retention_len,
    ) = _HEADER.unpack_from(record)
    if version != RECORD_VERSION:
        raise ValueError(f"unknown block record version {version}")
    offset = _HEADER.size
    retention = bytes(record[offset : offset + retention_len]).decode("utf-8")
    return BlockMeta(
        key=key,
        namespace_root=BlockKey(namespace_root),
        parent=BlockKey(parent),
        depth=depth,
        tokens=bytes(record[offset + retention_len :]),
        payload_size=payload_size,
        checksum=checksum,
        created_at=created_at,
        last_used_at=last_used_at,
        expires_at=expires_at,
        retention=retention,
        children=children,
        lru_seq=lru_seq,
        hits=hits,
        indexed_expiry=indexed_expiry,
        stored_seq=stored_seq,
    )


def record_size(token_bytes: int, retention_len: int = 8) -> int:
    """Bytes of one encoded record."""
    return _HEADER.size + retention_len + token_bytes


# Fixed offsets into the header, for reads that check a record without decoding it.
DEPTH = struct.Struct("<I")
EXPIRES = struct.Struct("<d")
DEPTH_AT, EXPIRES_AT, ROOT_AT, PARENT_AT, PARENT_END, RETENTION_LEN_AT = 1, 25, 65, 81, 97, 113
STORED_SEQ_AT, STORED_SEQ_END = 105, 113  # a stored copy's incarnation: unique per write
TOKENS_AT = _HEADER.size  # plus the retention name's length

MISSING, HIT, COLLISION = 0, 1, 2


def check_record(
    record: bytes | memoryview | None,
    *,
    root_and_parent: bytes,
    tokens: bytes,
    depth: int,
    now: float,
) -> int:
    """MISSING (absent or expired), HIT (this very block, alive) or COLLISION, read straight
    from the record: a lookup checks hundreds of blocks and decodes none of them."""
    if record is None:
        return MISSING
    raw = bytes(record)  # a no-op for bytes (LMDB reads here return bytes, not views)
    if now >= EXPIRES.unpack_from(raw, EXPIRES_AT)[0]:
        return MISSING
    if (
        raw[ROOT_AT:PARENT_END] == root_and_parent
        and DEPTH.unpack_from(raw, DEPTH_AT)[0] == depth
        and raw[TOKENS_AT + raw[RETENTION_LEN_AT] :] == tokens
    ):
        return HIT
    return COLLISION
