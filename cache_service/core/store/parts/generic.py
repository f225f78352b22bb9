"""The lookup hot paths written once over a transaction's `check`, `get` and `put`, for
backends that have no faster way (a backend binds them as methods:
`count_hits = generic.count_hits`)."""

from __future__ import annotations

import struct
from collections.abc import Sequence

from cache_service.core.blocks import (
    BlockMeta,
    ChainLink,
    NamespaceId,
    StoreKey,
    link_parts,
    store_key,
)
from cache_service.core.store.parts.backend import PayloadSink, Txn
from cache_service.core.store.parts.codec import COLLISION, HIT, checksum
from cache_service.core.store.parts.damage import DamageLog

_SEQ = struct.Struct("<Q")  # the incarnation: a stored copy's sequence, as LMDB keeps it


def count_hits(
    txn: Txn, namespace: NamespaceId, links: Sequence[ChainLink], start: int, now: float
) -> tuple[int, int]:
    """count_hits through `check`, one block at a time."""
    matched = 0
    partition, root = namespace.partition, namespace.root
    for key, parent, tokens, depth in link_parts(links, start):
        status = txn.check(store_key(partition, key), root + parent, tokens, depth, now)
        if status != HIT:
            return matched, int(status == COLLISION)
        matched += 1
    return matched, 0


def read_hits(
    txn: Txn,
    namespace: NamespaceId,
    links: Sequence[ChainLink],
    now: float,
    sink: PayloadSink,
    *,
    copied: bool,
    damage: DamageLog,
) -> tuple[int, int, int]:
    """read_hits through `get` and `get_payload`, one decoded record at a time."""
    matched = 0
    part, root = namespace.partition, namespace.root
    lifetimes = txn.judging(now)
    for key, parent, tokens, depth in link_parts(links):
        meta = txn.get(store_key(part, key))
        if meta is None or not meta.is_alive(now, lifetimes):
            return matched, 0, 0  # absent, damaged (noted by get), expired or from the future
        if (
            meta.namespace_root != root
            or meta.parent != parent
            or meta.depth != depth
            or meta.tokens != tokens
        ):
            return matched, 1, 0
        payload = verified_payload(txn, meta, damage, copied=copied)
        if payload is None:
            return matched, 0, 1
        sink(matched, payload)
        matched += 1
    return matched, 0, 0


def verified_payload(
    txn: Txn, meta: BlockMeta, damage: DamageLog, *, copied: bool = False
) -> bytes | memoryview | None:
    """The block's payload if it passes its length and checksum; a damaged one is noted.
    With `copied`, bytes copied out first and checked while the copy is still in cache."""
    payload = txn.get_payload(meta.key)
    if copied and payload is not None:
        payload = bytes(payload)
    if payload is None or len(payload) != meta.payload_size or checksum(payload) != meta.checksum:
        damage.note_payload(meta.key)
        return None
    return payload


def lift_expiry(txn: Txn, key: StoreKey, expires_at: float, retention: str) -> StoreKey | None:
    """Raise one block's expiry by rewriting its record; its parent's key to go on with."""
    meta = txn.get(key)
    if meta is None or meta.expires_at >= expires_at:
        return None
    meta.expires_at, meta.retention = expires_at, retention
    txn.put(meta)
    return meta.parent_key if meta.depth else None


def incarnation(txn: Txn, key: StoreKey, now: float) -> bytes | None:
    """The block's stored sequence as bytes, or None if it is absent or expired."""
    meta = txn.get(key)
    if meta is None or not meta.is_alive(now, txn.judging(now)):
        return None
    return _SEQ.pack(meta.stored_seq)
