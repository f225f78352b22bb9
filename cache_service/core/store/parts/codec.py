"""The binary record a backend keeps per block (metadata without payload).

Layout (little-endian), format 4:

    offset  bytes  field
         0      8  checksum: xxh3-64 (canonical, big-endian) of every byte after it
         8      1  record version (4)
         9      4  depth                       13   4  children
        17      8  created_at                  25   8  last_used_at
        33      8  expires_at                  41   8  eviction_rank
        49      8  hits                        57   8  payload_size
        65      8  payload checksum            73  16  namespace root
        89     16  parent key                 105   8  indexed expiry
       113      8  stored seq                 121   1  retention name length
       122      n  retention name (UTF-8), then the block's token bytes (uint32 LE each)

The checksum covers the whole record, so a flipped bit anywhere in it makes the record read
as damaged (`CorruptRecord` from `decode_meta`, `DAMAGED` from `check_record`): a miss,
never a hit, never an exception for the caller.
"""

from __future__ import annotations

import math
import struct

import xxhash

from cache_service.core.blocks import BlockKey, BlockMeta, StoreKey
from cache_service.core.lifetimes import UNBOUNDED, Lifetimes
from cache_service.core.tokens import whole_tokens

RECORD_VERSION = 4
SUM_BYTES = 8
# version, depth, children, created, last_used, expires, eviction_rank, hits, payload_size,
# payload checksum, namespace root, parent key, indexed expiry, stored seq, retention length
_BODY = struct.Struct("<BIIdddQQQQ16s16sdQB")
# The checksum of a record's body (every byte after the checksum): the function itself, not
# a wrapper, as a lookup's hot loop calls it once a block.
seal = _digest = xxhash.xxh3_64_digest


class CorruptRecord(ValueError):
    """A stored block record that fails verification (internal: read as a miss)."""


def encode_meta(meta: BlockMeta) -> bytes:
    """Pack a block's metadata: checksum, fixed header, retention name, then its tokens."""
    retention = meta.retention.encode("utf-8")
    body = (
        _BODY.pack(
            RECORD_VERSION,
            meta.depth,
            meta.children,
            meta.created_at,
            meta.last_used_at,
            meta.expires_at,
            meta.eviction_rank,
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
    return _digest(body) + body


def intact(record: bytes | memoryview) -> bool:
    """Whether a stored record passes its checksum and is of this version and length."""
    return (
        len(record) >= TOKENS_AT
        and record[VERSION_AT] == RECORD_VERSION
        and record[:SUM_BYTES] == _digest(record[SUM_BYTES:])
    )


def decode_meta(key: StoreKey, record: bytes | memoryview) -> BlockMeta:
    """Unpack what `encode_meta` wrote; CorruptRecord for a record that fails its checksum or
    whose fields do not hold together (any damage reads as corruption, never another error)."""
    raw = bytes(record)
    if not intact(raw):
        raise CorruptRecord("block record fails its checksum, version or length")
    (
        _version,
        depth,
        children,
        created_at,
        last_used_at,
        expires_at,
        eviction_rank,
        hits,
        payload_size,
        checksum,
        namespace_root,
        parent,
        indexed_expiry,
        stored_seq,
        retention_len,
    ) = _BODY.unpack_from(raw, SUM_BYTES)
    tokens_at = TOKENS_AT + retention_len
    tokens = raw[tokens_at:]
    if tokens_at > len(raw) or not tokens or not whole_tokens(tokens):
        raise CorruptRecord("block record's retention name or tokens are cut short")
    if depth == 0 and parent != namespace_root:
        raise CorruptRecord("a first block's parent is not its namespace root")
    try:
        retention = raw[TOKENS_AT:tokens_at].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptRecord("block record's retention name is not UTF-8") from exc
    return BlockMeta(
        key=key,
        namespace_root=BlockKey(namespace_root),
        parent=BlockKey(parent),
        depth=depth,
        tokens=tokens,
        payload_size=payload_size,
        checksum=checksum,
        created_at=created_at,
        last_used_at=last_used_at,
        expires_at=expires_at,
        retention=retention,
        children=children,
        eviction_rank=eviction_rank,
        hits=hits,
        indexed_expiry=indexed_expiry,
        stored_seq=stored_seq,
    )


def record_size(token_bytes: int, retention_len: int = 8) -> int:
    """Bytes of one encoded record."""
    return TOKENS_AT + retention_len + token_bytes


# Fixed offsets into the record, for reads that check a record without decoding it.
DEPTH = struct.Struct("<I")
EXPIRES = struct.Struct("<d")
PAYLOAD_FIELDS = struct.Struct("<QQ")  # payload_size, payload checksum
PAYLOAD_AT = 57
VERSION_AT, DEPTH_AT, EXPIRES_AT = 8, 9, 33
ROOT_AT, PARENT_AT, PARENT_END, RETENTION_LEN_AT = 73, 89, 105, 121
STORED_SEQ_AT, STORED_SEQ_END = 113, 121  # a stored copy's incarnation: unique per write
TOKENS_AT = SUM_BYTES + _BODY.size  # plus the retention name's length

MISSING, HIT, COLLISION, DAMAGED = 0, 1, 2, 3


def raw_alive(raw: bytes, expires_at: float, now: float, lifetimes: Lifetimes) -> bool:
    """`Lifetimes.alive` for a verified record whose expiry (`expires_at`) is still ahead: the
    hot paths call it only past the shortest bound, where the class must be looked up."""
    if expires_at == math.inf:
        return True  # pinned
    retention = raw[TOKENS_AT : TOKENS_AT + raw[RETENTION_LEN_AT]]
    return expires_at - now <= lifetimes.bound(retention)


# Every field of the record: (offset, bytes); the last two run to the retention name's length
# and to the record's end (None). Tests damage each of them.
RECORD_FIELDS: dict[str, tuple[int, int | None]] = {
    "checksum": (0, SUM_BYTES),
    "version": (VERSION_AT, 1),
    "depth": (DEPTH_AT, 4),
    "children": (13, 4),
    "created_at": (17, 8),
    "last_used_at": (25, 8),
    "expires_at": (EXPIRES_AT, 8),
    "eviction_rank": (41, 8),
    "hits": (49, 8),
    "payload_size": (57, 8),
    "payload_checksum": (65, 8),
    "namespace_root": (ROOT_AT, 16),
    "parent": (PARENT_AT, 16),
    "indexed_expiry": (105, 8),
    "stored_seq": (STORED_SEQ_AT, 8),
    "retention_length": (RETENTION_LEN_AT, 1),
    "retention": (TOKENS_AT, None),
    "tokens": (TOKENS_AT, None),
}


def check_record(
    record: bytes | memoryview | None,
    *,
    root_and_parent: bytes,
    tokens: bytes,
    depth: int,
    now: float,
    lifetimes: Lifetimes = UNBOUNDED,
) -> int:
    """MISSING (absent or expired), HIT (this very block, alive), COLLISION, or DAMAGED (the
    record fails its checksum: read as missing), straight from the record: a lookup checks
    hundreds of blocks and decodes none of them."""
    if record is None:
        return MISSING
    raw = bytes(record)  # a no-op for bytes (LMDB reads here return bytes, not views)
    if not intact(raw):
        return DAMAGED
    expires_at = EXPIRES.unpack_from(raw, EXPIRES_AT)[0]
    if now >= expires_at:
        return MISSING
    if expires_at - now > lifetimes.shortest_bound and not raw_alive(
        raw, expires_at, now, lifetimes
    ):
        return MISSING  # stored while the clock ran ahead: read as expired
    if (
        raw[ROOT_AT:PARENT_END] == root_and_parent
        and DEPTH.unpack_from(raw, DEPTH_AT)[0] == depth
        and raw[TOKENS_AT + raw[RETENTION_LEN_AT] :] == tokens
    ):
        return HIT
    return COLLISION


def checksum(payload: bytes | memoryview) -> int:
    """The payload checksum kept with every block (xxh3-64)."""
    return int(xxhash.xxh3_64_intdigest(payload))
