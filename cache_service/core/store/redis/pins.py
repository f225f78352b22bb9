"""Pins on the Redis store: a pinned block has no expiry, and Redis's `volatile-*` eviction
policies only ever evict keys that have one, so a pinned block is neither expired nor evicted
until its last pin lets go.

    pc:p:<scope><deepest key>   the pin record: JSON fields, then the prefix's block keys
                                (16 bytes each), so a release needs no walk up the chain
    pc:c:<store key>            how many pins hold the block (INCR on pin, DECR on release)

Pinning takes the count first, then `PERSIST` and `PTTL` of each block: PTTL -1 says the block
exists and has no expiry, so a block that expired or was purged in between is caught (the pin
is undone and NotStored names it). A release gives each block no other pin holds back its
expiry (`ttl_seconds`, as the LMDB store does). None of this spans slots in one command: the
counts and the blocks are on the nodes their own keys choose.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from cache_service.core.blocks import KEY_BYTES, BlockKey, PinRecord, StoreKey, store_key
from cache_service.core.store.redis.values import block_key, glob_escape

PIN_PREFIX = b"pc:p:"
COUNT_PREFIX = b"pc:c:"
_SEPARATOR = b"\n"


def pin_key(scope: StoreKey, deepest: BlockKey) -> bytes:
    """The Redis key of the pin whose deepest block is `deepest`."""
    return PIN_PREFIX + scope + deepest


def count_key(key: StoreKey) -> bytes:
    """The Redis key of a block's pin count."""
    return COUNT_PREFIX + key


def pin_pattern(partition: bytes) -> tuple[bytes, int]:
    """The SCAN pattern of a tenant's pins and the length of their keys (a longer partition
    matches the pattern too, and is told apart by length)."""
    return PIN_PREFIX + glob_escape(partition) + b"*", len(PIN_PREFIX) + len(
        partition
    ) + 2 * KEY_BYTES


def encode_pin(record: PinRecord, keys: Sequence[BlockKey]) -> bytes:
    """A pin record's value: its fields as JSON, then its blocks' keys."""
    fields = {
        "blocks": record.blocks,
        "pinned_at": record.pinned_at,
        "by": record.by,
        "bytes": record.bytes,
        "rank": record.rank,
    }
    return json.dumps(fields).encode() + _SEPARATOR + b"".join(keys)


def decode_pin(redis_key: bytes, value: bytes) -> tuple[PinRecord, list[BlockKey]] | None:
    """The record and block keys `encode_pin` wrote under `redis_key`; None for a damaged
    one (its callers skip or replace it)."""
    try:
        return _decode_pin(redis_key, value)
    except (ValueError, KeyError, TypeError):  # json's errors are ValueErrors
        return None


def _decode_pin(redis_key: bytes, value: bytes) -> tuple[PinRecord, list[BlockKey]]:
    head, _, joined = value.partition(_SEPARATOR)
    fields = json.loads(head)
    scope_and_key = redis_key[len(PIN_PREFIX) :]
    scope, deepest = StoreKey(scope_and_key[:-KEY_BYTES]), BlockKey(scope_and_key[-KEY_BYTES:])
    keys = [BlockKey(joined[i : i + KEY_BYTES]) for i in range(0, len(joined), KEY_BYTES)]
    record = PinRecord(
        scope,
        deepest,
        int(fields["blocks"]),
        float(fields["pinned_at"]),
        str(fields["by"]),
        int(fields["bytes"]),
        int(fields["rank"]),
    )
    return record, keys


def hold(client: Any, partition: bytes, keys: Sequence[BlockKey]) -> list[int]:
    """Count one more pin on each block and take its expiry away; the indexes of the blocks
    that were gone (their pin must be undone)."""
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.incr(count_key(store_key(partition, key)))
    for key in keys:
        pipe.persist(block_key(store_key(partition, key)))
        pipe.pttl(block_key(store_key(partition, key)))
    answers = pipe.execute(raise_on_error=True)
    left = answers[len(keys) + 1 :: 2]
    return [index for index, ttl in enumerate(left) if ttl != -1]


def release(client: Any, partition: bytes, keys: Sequence[BlockKey], ttl_seconds: float) -> None:
    """Count one pin less on each block; a block no pin holds any more expires in
    `ttl_seconds` (kept as is when infinite). A pin taken meanwhile wins: after the expiry
    is set the count is read again, and a block counted again is made persistent again (the
    pin side persists after counting, so either order ends persistent)."""
    counts = [store_key(partition, key) for key in keys]
    left = _decrement(client, [count_key(key) for key in counts])
    freed = [key for key, count in zip(counts, left, strict=True) if int(count) <= 0]
    if not freed or math.isinf(ttl_seconds):
        return
    ttl_ms = max(1, math.ceil(ttl_seconds * 1000))
    pipe = client.pipeline(transaction=False)
    for key in freed:
        pipe.pexpire(block_key(key), ttl_ms)
    for key in freed:
        pipe.get(count_key(key))
    again = pipe.execute(raise_on_error=True)[len(freed) :]
    pinned = [
        key for key, count in zip(freed, again, strict=True) if count and pin_count(count) > 0
    ]
    if pinned:
        pipe = client.pipeline(transaction=False)
        for key in pinned:
            pipe.persist(block_key(key))
        pipe.execute(raise_on_error=True)


def pin_count(value: bytes) -> int:
    """A pin count as stored; a damaged one counts as held (a block is kept, never lost)."""
    try:
        return int(value)
    except ValueError:
        return 1


# One pin less on a block, the count deleted at zero in the same step: a pin counting up
# meanwhile starts from a fresh key, never from a count about to be deleted.
_DECREMENT = """
local left = redis.call('DECR', KEYS[1])
if left <= 0 then
    redis.call('DEL', KEYS[1])
end
return left
"""


def _decrement(client: Any, keys: list[bytes]) -> list[int]:
    """Run _DECREMENT on each key, pipelined per node (a cluster pipeline refuses scripts)."""
    script = client.register_script(_DECREMENT)
    if not hasattr(client, "get_node_from_key"):  # one node
        groups = {"": (client, list(range(len(keys))))}
    else:
        groups = {}
        for index, key in enumerate(keys):
            node = client.get_node_from_key(key)
            groups.setdefault(node.name, (client.get_redis_connection(node), []))[1].append(index)
    left = [0] * len(keys)
    for connection, indexes in groups.values():
        pipe = connection.pipeline(transaction=False)
        for index in indexes:
            script(keys=[keys[index]], client=pipe)
        for index, value in zip(indexes, pipe.execute(raise_on_error=True), strict=True):
            left[index] = int(value)
    return left
