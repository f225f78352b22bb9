"""The binary record a backend keeps per block (metadata without payload)."""

from __future__ import annotations

import struct

from cache_service.blocks import BlockKey, BlockMeta

RECORD_VERSION = 1
# version, depth, children, created, last_used, expires, lru_seq, hits, payload_size,
# checksum, namespace root, parent key, retention length
_HEADER = struct.Struct("<BIIdddQQQQ16s16sB")


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
            len(retention),
        )
        + retention
        + meta.tokens
    )


def decode_meta(key: BlockKey, record: bytes | memoryview) -> BlockMeta:
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
    )


def record_size(token_bytes: int, retention_len: int = 8) -> int:
    """Bytes of one encoded record."""
    return _HEADER.size + retention_len + token_bytes
