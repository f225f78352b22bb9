"""What the store keeps so that a miss can be explained: a bounded log of removed blocks, and
hints of where a prompt's first block is stored (under which namespace and block size).

Both live in the store's own tables, so every worker process sees them. The removal log
holds the most recent removals only (a cache may forget why it forgot), and never so many
that it starves the blocks it describes: nothing evicts it, and in a small store (a small
map, a small disk) a log of the configured length would take the room of every block. A
first-block hint lives exactly as long as its block.
"""

from __future__ import annotations

import struct

import xxhash

from cache_service.core.blocks import (
    KEY_BYTES,
    REMOVAL_REASONS,
    BlockKey,
    BlockMeta,
    Removal,
    StoreKey,
)
from cache_service.core.store.parts.backend import FIRSTS, REMOVAL_ORDER, REMOVALS, Txn
from cache_service.core.tokens import bytes_of_tokens, tokens_in

DEFAULT_REMOVAL_LOG_ENTRIES = 0  # off unless the owner turns it on (the service does)
HINT_TOKENS = 16  # a first-block hint fingerprints this many leading tokens (or the block)
# The log's bytes are kept to a share of the store's, whatever `entries` allows.
LOG_SHARE = 1 / 16  # of the bytes the store uses (its blocks, tables and this log)
ENTRY_BYTES = 128  # an entry's pages in LMDB, both tables (measured: 119 over 20,000)
FLOOR_ENTRIES = 1024  # kept in any store (128 KiB), however small it is
CHECK_EVERY = 256  # removals between measures of the store (a measure reads table stats)
TRIM_STEP = 64  # the oldest entries dropped per removal at most: a removal stays short
_REMOVAL = struct.Struct("<QBdd")  # removal sequence, reason, at, expires_at; then retention
_SEQ = struct.Struct(">Q")
_SIZE = struct.Struct("<I")


# The log numbers removals with a counter of its own, kept beside its entries (a key shorter
# than any block's), not with the use sequence: policies rank blocks by that sequence, and a
# removal is not a use (a store that logs removals would otherwise evict in another order than
# a replay whose store does not). Missing or damaged, it starts again from the use sequence,
# which is past the numbers earlier versions drew from it.
_ORDER_COUNTER = b"#order"


def _next_order(txn: Txn) -> int:
    """The next removal's number."""
    raw = txn.aux_get(REMOVALS, _ORDER_COUNTER)
    order = _SEQ.unpack(raw)[0] if raw is not None and len(raw) == _SEQ.size else txn.next_seq(0)
    txn.aux_put(REMOVALS, _ORDER_COUNTER, _SEQ.pack(order + 1))
    return int(order)


class RemovalLog:
    """The most recent `entries` removals (0: none are kept), within the store's share."""

    def __init__(self, entries: int = DEFAULT_REMOVAL_LOG_ENTRIES) -> None:
        self.entries = entries
        self._share_entries: int | None = None  # the share's entries, at the last measure
        self._until_measure = 0

    def remember(self, txn: Txn, meta: BlockMeta, *, reason: str, at: float) -> None:
        """Log a block's removal, dropping the oldest entries beyond the limit."""
        if self.entries <= 0:
            return
        earlier = txn.aux_get(REMOVALS, meta.key)
        if earlier is not None:
            txn.aux_delete(REMOVAL_ORDER, _SEQ.pack(_REMOVAL.unpack_from(earlier)[0]))
        seq = _next_order(txn)
        record = _REMOVAL.pack(seq, REMOVAL_REASONS.index(reason), at, meta.expires_at)
        txn.aux_put(REMOVALS, meta.key, record + meta.retention.encode())
        txn.aux_put(REMOVAL_ORDER, _SEQ.pack(seq), meta.key)
        held = txn.aux_count(REMOVAL_ORDER)
        excess = min(held - self.limit(txn, held), TRIM_STEP)
        if excess > 0:
            for order_key, key in txn.aux_scan(REMOVAL_ORDER, b"", excess):
                txn.aux_delete(REMOVAL_ORDER, order_key)
                txn.aux_delete(REMOVALS, key)

    def limit(self, txn: Txn, held: int) -> int:
        """How many entries the log may hold now (it holds `held`): `entries`, and no more
        than `LOG_SHARE` of the store's bytes take (at least `FLOOR_ENTRIES`)."""
        if held <= min(self.entries, FLOOR_ENTRIES):
            return self.entries
        self._until_measure -= 1
        if self._share_entries is None or self._until_measure <= 0:
            used_bytes = txn.usage().used_bytes
            self._share_entries = max(int(used_bytes * LOG_SHARE) // ENTRY_BYTES, FLOOR_ENTRIES)
            self._until_measure = CHECK_EVERY
        return min(self.entries, self._share_entries)

    @staticmethod
    def recall(txn: Txn, key: StoreKey) -> Removal | None:
        """Why and when the block under `key` was removed, if the log still says."""
        record = txn.aux_get(REMOVALS, key)
        if record is None:
            return None
        _, reason, at, expires_at = _REMOVAL.unpack_from(record)
        retention = record[_REMOVAL.size :].decode()
        return Removal(REMOVAL_REASONS[reason], at, retention, expires_at)


def fingerprint(token_bytes: bytes) -> bytes:
    """The fingerprint of a first block's leading tokens (uint32 LE bytes)."""
    return bytes(xxhash.xxh3_64_digest(token_bytes[: bytes_of_tokens(HINT_TOKENS)]))


def first_hint_key(meta: BlockMeta) -> bytes:
    """The hint of a first block: its partition, the fingerprint of its leading tokens,
    its namespace root and its block size."""
    size = _SIZE.pack(tokens_in(meta.tokens))
    return meta.partition + fingerprint(meta.tokens) + meta.namespace_root + size


def hint_prefix(partition: bytes, token_bytes: bytes) -> bytes:
    """Where the hints of first blocks starting like `token_bytes` are."""
    return partition + fingerprint(token_bytes)


def parse_hint(key: bytes, prefix: bytes) -> tuple[BlockKey, int]:
    """(namespace root, block size) of a hint found under `prefix`."""
    root = BlockKey(key[len(prefix) : len(prefix) + KEY_BYTES])
    return root, _SIZE.unpack_from(key, len(prefix) + KEY_BYTES)[0]


def record_first_block(txn: Txn, meta: BlockMeta) -> None:
    """Note where a newly stored first block is, for explanations."""
    txn.aux_put(FIRSTS, first_hint_key(meta), b"")


def forget_first_block(txn: Txn, meta: BlockMeta) -> None:
    """Drop the hint of a first block that leaves the store."""
    txn.aux_delete(FIRSTS, first_hint_key(meta))
