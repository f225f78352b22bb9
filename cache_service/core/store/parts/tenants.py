"""Tenant accounting: each tenant's estimated bytes, and its evictable leaves listed apart so
that a tenant over its quota loses its own least recently used blocks first.

The default tenant (no partition) has no quota and is not counted.
"""

from __future__ import annotations

import struct

from cache_service.core.blocks import BlockMeta, StoreKey
from cache_service.core.store.parts.backend import SORT_KEY_BYTES, TENANT_BYTES, TENANT_LEAVES, Txn
from cache_service.core.store.protocols import Space

_I64 = struct.Struct("<q")


class TenantAccounts:
    """Tenant bytes and tenant leaves, sized by the backend's capacity report."""

    def __init__(self, space: Space) -> None:
        self.space = space

    @staticmethod
    def move_leaf(txn: Txn, meta: BlockMeta, before: bytes | None, after: bytes | None) -> None:
        """Follow a block's victims entry from `before` to `after` in its tenant's list."""
        partition = meta.partition
        if not partition:
            return
        if before is not None:
            txn.aux_delete(TENANT_LEAVES, partition + before + meta.key)
        if after is not None:
            txn.aux_put(TENANT_LEAVES, partition + after + meta.key, b"")

    def block_bytes(self, meta: BlockMeta) -> int:
        """What one block counts for its tenant."""
        return self.space.estimate_bytes(meta.payload_size, len(meta.tokens))

    def delta(self, new: BlockMeta, old: BlockMeta | None) -> int:
        """What writing `new` over `old` (None: nothing) changes in its tenant's bytes."""
        return self.block_bytes(new) - (self.block_bytes(old) if old is not None else 0)

    @staticmethod
    def add(txn: Txn, partition: bytes, delta: int) -> None:
        """Adjust a tenant's estimated bytes (never below zero)."""
        if not partition or not delta:
            return
        total = (TenantAccounts.held(txn, partition) or 0) + delta
        txn.aux_put(TENANT_BYTES, partition, _I64.pack(max(total, 0)))

    @staticmethod
    def held(txn: Txn, partition: bytes) -> int | None:
        """A tenant's estimated bytes, None if it never had any."""
        raw = txn.aux_get(TENANT_BYTES, partition)
        return int(_I64.unpack(raw)[0]) if raw is not None else None

    @staticmethod
    def leaves(txn: Txn, partition: bytes, limit: int) -> list[tuple[bytes, StoreKey]]:
        """Up to `limit` of a tenant's listed leaves, oldest first: (entry, store key).
        An entry may be stale (its block since gained a child): drop it with `forget`."""
        skip = len(partition) + SORT_KEY_BYTES
        return [
            (entry, StoreKey(entry[skip:]))
            for entry, _ in txn.aux_scan(TENANT_LEAVES, partition, limit)
        ]

    @staticmethod
    def forget(txn: Txn, entry: bytes) -> None:
        """Drop a stale leaf entry."""
        txn.aux_delete(TENANT_LEAVES, entry)
