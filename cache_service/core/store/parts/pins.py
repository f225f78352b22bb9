"""Pins: how many pins hold each block, and the pin records themselves.

A pin holds a prefix from block 0: every block of it is pinned, and a pinned block's expiry
is infinite (so neither it nor, by the expiry invariant, any ancestor expires) and it is never
a victim of capacity eviction. Blocks count the pins that hold them, so overlapping pins (a
system prompt, and that prompt plus a few-shot block) are released independently. A pin is
kept under its namespace scope (partition + root) then its deepest block's hash.
"""

from __future__ import annotations

import struct

import orjson

from cache_service.core.blocks import KEY_BYTES, BlockKey, PinRecord, StoreKey
from cache_service.core.errors import QuotaExceeded
from cache_service.core.store.parts.backend import PIN_COUNTS, PINS, Txn

_COUNT = struct.Struct("<I")


def holders(txn: Txn, key: StoreKey) -> int:
    """How many pins hold the block."""
    raw = txn.aux_get(PIN_COUNTS, key)
    return int(_COUNT.unpack(raw)[0]) if raw is not None else 0


def set_holders(txn: Txn, key: StoreKey, count: int) -> None:
    """Record how many pins hold the block (0: none, the entry goes)."""
    if count:
        txn.aux_put(PIN_COUNTS, key, _COUNT.pack(count))
    else:
        txn.aux_delete(PIN_COUNTS, key)


def pin_key(scope: StoreKey, deepest: BlockKey) -> bytes:
    """Where the pin ending at `deepest` in the namespace `scope` is kept."""
    return scope + deepest


def get_record(txn: Txn, key: bytes, partition: bytes) -> PinRecord | None:
    """The pin kept under `key`, or None."""
    value = txn.aux_get(PINS, key)
    return _record(key, value, partition) if value is not None else None


def put_record(txn: Txn, key: bytes, record: PinRecord) -> None:
    """Keep a pin under `key`."""
    fields = {
        "blocks": record.blocks,
        "bytes": record.bytes,
        "pinned_at": record.pinned_at,
        "by": record.by,
        "rank": record.rank,
    }
    txn.aux_put(PINS, key, orjson.dumps(fields))


def delete_record(txn: Txn, key: bytes) -> None:
    """Forget the pin kept under `key`."""
    txn.aux_delete(PINS, key)


def records(txn: Txn, partition: bytes, *, every: bool = False) -> list[PinRecord]:
    """A tenant's pins (a pin key: partition, root, deepest key); with `every`, all."""
    size = len(partition) + 2 * KEY_BYTES
    return [
        _record(key, value, key[: len(key) - 2 * KEY_BYTES] if every else partition)
        for key, value in txn.aux_scan(PINS, partition, 1 << 30)
        if every or len(key) == size
    ]


def check_blocks(pins: list[PinRecord], adding: int, limit: int) -> None:
    """QuotaExceeded if `adding` pinned blocks would pass a tenant's pin quota."""
    pinned = sum(record.blocks for record in pins)
    if pinned + adding > limit:
        raise QuotaExceeded(
            f"the tenant's pins hold {pinned} blocks; {adding} more would pass its pin quota "
            f"of {limit} blocks (pin_quota_blocks)",
            limit="pin_quota_blocks",
            limit_blocks=limit,
        )


def check_bytes(pins: list[PinRecord], adding: int, limit: int | None, whose: str) -> None:
    """QuotaExceeded if `adding` pinned bytes would pass the tenant's (or everyone's) share."""
    if limit is None:
        return
    pinned = sum(record.bytes for record in pins)
    if pinned + adding <= limit:
        return
    if whose == "tenant":
        raise QuotaExceeded(
            f"the tenant's pins hold {pinned} bytes; {adding} more would pass the {limit} "
            "bytes they may take (pinned_share of its capacity quota, or its share of the "
            "cache's)",
            limit="pinned_share",
            limit_bytes=limit,
        )
    # Other tenants' pins are theirs: say only that the cache's pinned share is full.
    raise QuotaExceeded(
        "the share of the cache that pins may take is full (pinned_share); retry after "
        "pins are released",
        limit="pinned_share",
    )


def _record(key: bytes, value: bytes, partition: bytes) -> PinRecord:
    fields = orjson.loads(value)
    return PinRecord(
        StoreKey(key[: len(partition) + KEY_BYTES]),
        BlockKey(key[len(partition) + KEY_BYTES :]),
        int(fields["blocks"]),
        float(fields["pinned_at"]),
        fields["by"],
        int(fields.get("bytes", 0)),
        int(fields.get("rank", 0)),
    )
