"""How the Redis store lays out a block: its keys, its value (record and payload
together), the space it takes, and the small helpers every Redis store module shares.

    pc:b:<store key>   u32 LE record length, the block record (store/codec.py, format 4),
                       then the payload: written once with SET NX PX
    pc:n:<scope>       the encoded namespace of a (partition, root)
    pc:identity        the settings the data was made with
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import redis

from cache_service.core.blocks import BlockMeta, ChainLink, NamespaceId, StoreKey
from cache_service.core.errors import StorageFailure
from cache_service.core.store.parts.codec import (
    RECORD_FIELDS,
    RETENTION_LEN_AT,
    TOKENS_AT,
    CorruptRecord,
    check_record,
    checksum,
    decode_meta,
    encode_meta,
    intact,
)

PAYLOAD_SIZE_AT = RECORD_FIELDS["payload_size"][0]

BLOCK_PREFIX = b"pc:b:"
NAMESPACE_PREFIX = b"pc:n:"
IDENTITY_KEY = b"pc:identity"  # the settings the cluster's data was made with (no expiry)
LENGTH = struct.Struct("<I")
RETENTION_SLACK = 32  # bytes read past the tokens for the retention name (longer: read again)
BLOCK_OVERHEAD_BYTES = 96  # Redis's dict entry, key and object headers, measured roughly


def block_key(key: StoreKey) -> bytes:
    """The Redis key of a block."""
    return BLOCK_PREFIX + key


def namespace_key(scope: StoreKey) -> bytes:
    """The Redis key of a scope's encoded namespace."""
    return NAMESPACE_PREFIX + scope


def pack_value(meta: BlockMeta, payload: bytes | memoryview) -> bytes:
    """A block's value: record length, record, payload."""
    record = encode_meta(meta)
    return LENGTH.pack(len(record)) + record + bytes(payload)


def split_value(value: bytes) -> tuple[bytes, bytes] | None:
    """(record, payload) of a block's value; None if the value is cut short."""
    if len(value) < LENGTH.size:
        return None
    (length,) = LENGTH.unpack_from(value)
    end = LENGTH.size + length
    if end > len(value):
        return None
    return value[LENGTH.size : end], value[end:]


class RedisSpace:
    """How the Redis store counts the space a block takes."""

    def estimate_bytes(self, payload_size: int, token_bytes: int) -> int:
        """Payload, record, length prefix, key and Redis's per-key overhead."""
        record = TOKENS_AT + 8 + token_bytes
        return payload_size + record + LENGTH.size + 40 + BLOCK_OVERHEAD_BYTES

    def reserved_bytes(self) -> int:
        """Nothing: Redis's own memory is not the cache's to count."""
        return 0


P = ParamSpec("P")
R = TypeVar("R")
HEADER_BYTES = LENGTH.size + TOKENS_AT + 255  # the length, a record's fixed part, its class


def header_facts(head: bytes) -> tuple[str, float, int]:
    """(retention, expires_at, payload size) from a value's first HEADER_BYTES, for a
    removal's report; ("", inf, 0) where the head is cut short or damaged."""
    at = LENGTH.size
    if len(head) < at + TOKENS_AT:
        return "", math.inf, 0
    (payload_size,) = struct.unpack_from("<Q", head, at + PAYLOAD_SIZE_AT)
    length = head[at + RETENTION_LEN_AT]
    retention = head[at + TOKENS_AT : at + TOKENS_AT + length].decode("utf-8", "replace")
    return retention, math.inf, int(payload_size)


def record_of(
    client: Any, skey: StoreKey, value: bytes | None, *, whole: bool
) -> tuple[bytes | None, bytes | None]:
    """(record, payload) of a fetched value (None, None when absent; b"" for a record cut
    short, which reads as damaged). A value read only in part (`whole` False) whose record
    runs past the read, for a long retention name, is read again up to its record's end (the
    length leads the value)."""
    if value is None or value == b"":
        return None, None
    parts = split_value(value)
    if parts is None and not whole and len(value) >= LENGTH.size:
        (length,) = LENGTH.unpack_from(value)
        again = client.getrange(block_key(skey), 0, LENGTH.size + length - 1)
        parts = split_value(again or b"")
    if parts is None:
        return b"", None
    return parts


def glob_escape(raw: bytes) -> bytes:
    """`raw` as a SCAN MATCH pattern matching itself only."""
    out = bytearray()
    for byte in raw:
        if byte in b"*?[]\\":
            out += b"\\"
        out.append(byte)
    return bytes(out)


def is_redis_error(exc: BaseException) -> bool:
    """Whether an exception is redis-py's (connection, timeout, cluster, response) or a
    socket error under it: what a store call may turn into a miss or a 503."""
    # A cluster client that reaches no node raises RedisClusterException, which is not a
    # RedisError.
    return isinstance(exc, redis.RedisError | redis.exceptions.RedisClusterException | OSError)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether Redis refused a write for its maxmemory (an OOM error reply)."""
    return isinstance(exc, redis.exceptions.OutOfMemoryError) or (
        isinstance(exc, redis.ResponseError) and "maxmemory" in str(exc)
    )


# Deletes a key only if it still holds the value given: a damaged block is dropped, never a
# copy written over it since it was read.
UNLINK_IF_SAME = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('UNLINK', KEYS[1])
end
return 0
"""


def value_damage(value: bytes) -> str | None:
    """What is damaged in a block's value: "record", "payload", or None when it is whole."""
    parts = split_value(value)
    if parts is None or not intact(parts[0]):
        return "record"
    record, payload = parts
    try:
        meta = decode_meta(StoreKey(b""), record)
    except CorruptRecord:
        return "record"
    if len(payload) != meta.payload_size or checksum(payload) != meta.checksum:
        return "payload"
    return None


def storage_failures(method: Callable[P, R]) -> Callable[P, R]:
    """A store method whose Redis failures are a 503 (StorageFailure, retry in a second),
    never an unexpected error: for the calls that have no miss to answer instead."""

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(*args, **kwargs)
        except Exception as exc:
            if not is_redis_error(exc):
                raise
            raise StorageFailure(
                f"Redis failed the {method.__name__.strip('_')}: {type(exc).__name__}: {exc}",
                retry_after_seconds=1.0,
            ) from exc

    return wrapper


def link_verdict(record: bytes | None, namespace: NamespaceId, link: ChainLink, now: float) -> int:
    """`check_record` of a stored record against the chain link it should be (HIT,
    COLLISION, DAMAGED or MISSING)."""
    return check_record(
        record,
        root_and_parent=namespace.root + link.parent,
        tokens=link.tokens,
        depth=link.depth,
        now=now,
    )
