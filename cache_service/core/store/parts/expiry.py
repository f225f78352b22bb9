"""The expiry index: every block, by the time it expires.

A block's entry is at or before its real expiry: sliding a TTL on a hit leaves the entry
early (no index write per hit), and the sweeper re-files the early entries it meets.
"""

from __future__ import annotations

import struct

from cache_service.core.blocks import BlockMeta
from cache_service.core.store.parts.backend import EXPIRY, Txn


def sort_key(expires_at: float) -> bytes:
    """Non-negative floats sort as their big-endian IEEE bytes."""
    return struct.pack(">d", max(expires_at, 0.0))


def add(txn: Txn, meta: BlockMeta) -> None:
    """List a new block at its expiry (the caller writes its record)."""
    meta.indexed_expiry = meta.expires_at
    txn.index_add(EXPIRY, sort_key(meta.expires_at), meta.key)


def remove(txn: Txn, meta: BlockMeta) -> None:
    """Take a block's entry out of the index."""
    txn.index_remove(EXPIRY, sort_key(meta.indexed_expiry), meta.key)


def refile(txn: Txn, meta: BlockMeta) -> None:
    """Move an early entry to the block's real expiry, and write its record."""
    remove(txn, meta)
    add(txn, meta)
    txn.put(meta)
