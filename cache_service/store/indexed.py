"""Transactions, index upkeep and eviction: the part of every store that orders blocks.

Invariants kept here:
- `children` counts a block's stored children; only blocks with none are in the victims index;
- a use is recorded on the deepest block it reached; a removed block's record of use passes
  to its parent, so a leaf's record covers every use of it and of its removed descendants;
- a block's expiry-index entry is at or before its real expiry (sliding a TTL leaves the entry
  early; the sweeper re-files entries it finds early);
- only leaves are removed, so the store stays prefix-closed.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import xxhash

from cache_service.blocks import KEY_BYTES, BlockKey, BlockMeta, Evicted, StoreUsage
from cache_service.eviction import EvictionPolicy, LruPolicy
from cache_service.store.base import (
    EXPIRY,
    FIRSTS,
    PIN_COUNTS,
    SORT_KEY_BYTES,
    TENANT_BYTES,
    TENANT_LEAVES,
    VICTIMS,
    BlockTxn,
)
from cache_service.store.removals import (
    DEFAULT_REMOVAL_LOG_ENTRIES,
    first_hint_key,
    remember_removal,
)

PayloadSink = Callable[[int, "bytes | memoryview | None"], None]
SCAN_FIRST = 4  # most scans need one entry: start small, widen when entries are skipped
SCAN_MOST = 1024
_Indexed = bytes | None  # the victims sort key while the block is a leaf
_I64 = struct.Struct("<q")


def checksum(payload: bytes | memoryview) -> int:
    """The payload checksum kept with every block (xxh3-64)."""
    return int(xxhash.xxh3_64_intdigest(payload))


def expiry_sort_key(expires_at: float) -> bytes:
    """Non-negative floats sort as their big-endian IEEE bytes."""
    return struct.pack(">d", max(expires_at, 0.0))


class IndexedStore:
    """Transactions (with batches), index upkeep and eviction over a backend's transactions."""

    def __init__(self, *, policy: EvictionPolicy | None = None) -> None:
        self.policy: EvictionPolicy = policy or LruPolicy()
        self.removal_log_entries = DEFAULT_REMOVAL_LOG_ENTRIES
        self._batch = threading.local()

    def _begin_read(self, *, views: bool = False) -> AbstractContextManager[BlockTxn]:
        """A read transaction; with `views`, payload reads may return views into the store
        that stay valid until the transaction ends (no copy)."""
        raise NotImplementedError

    def _begin_write(self) -> AbstractContextManager[BlockTxn]:
        raise NotImplementedError

    @contextmanager
    def _read(self, *, views: bool = False) -> Iterator[BlockTxn]:
        batch: BlockTxn | None = getattr(self._batch, "txn", None)
        if batch is not None:
            yield batch
            return
        with self._begin_read(views=views) as txn:
            yield txn

    @contextmanager
    def _write(self) -> Iterator[BlockTxn]:
        batch: BlockTxn | None = getattr(self._batch, "txn", None)
        if batch is not None:
            yield batch
            return
        with self._begin_write() as txn:
            yield txn

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Run this thread's store calls inside one write transaction (one commit).

        All or nothing: an error anywhere aborts every call in the batch. Meant for the
        replay, whose store is private; a server keeps its transactions short instead.
        """
        if getattr(self._batch, "txn", None) is not None:
            yield
            return
        with self._begin_write() as txn:
            self._batch.txn = txn
            try:
                yield
            finally:
                self._batch.txn = None

    # -- index upkeep -------------------------------------------------------------------------

    def _victim_key(self, meta: BlockMeta) -> bytes:
        return struct.pack(">Q", self.policy.priority(meta))

    def _indexed(self, meta: BlockMeta) -> _Indexed:
        """Where a block stands in the victims index now (only unpinned leaves are there);
        taken before changing it."""
        return self._victim_key(meta) if meta.children == 0 and not meta.pinned else None

    def _save(self, txn: BlockTxn, meta: BlockMeta, before: _Indexed, *, new: bool = False) -> None:
        """Write `meta`, moving its victims entry from `before`; a new block joins the expiry
        index. Later expiry changes leave that entry early on purpose: sliding a block's TTL
        on every hit then costs no index write, and the sweeper re-files early entries."""
        victim = self._indexed(meta)
        if before != victim:
            partition = meta.key[:-KEY_BYTES]  # a tenant's leaves are listed apart too
            if before is not None:
                txn.index_remove(VICTIMS, before, meta.key)
                if partition:
                    txn.aux_delete(TENANT_LEAVES, partition + before + meta.key)
            if victim is not None:
                txn.index_add(VICTIMS, victim, meta.key)
                if partition:
                    txn.aux_put(TENANT_LEAVES, partition + victim + meta.key, b"")
        if new:
            meta.indexed_expiry = meta.expires_at
            txn.index_add(EXPIRY, expiry_sort_key(meta.expires_at), meta.key)
        txn.put(meta)

    def estimate_bytes(self, payload_size: int, token_bytes: int) -> int:
        """The space one block of this size would take in this backend."""
        raise NotImplementedError

    def _tenant_delta(self, new: BlockMeta, old: BlockMeta | None) -> int:
        """What writing `new` over `old` (None: nothing) changes in its tenant's bytes."""
        delta = self.estimate_bytes(new.payload_size, len(new.tokens))
        if old is not None:
            delta -= self.estimate_bytes(old.payload_size, len(old.tokens))
        return delta

    def _add_tenant_bytes(self, txn: BlockTxn, partition: bytes, delta: int) -> None:
        """Keep a tenant's estimated bytes (the default tenant, with no partition, has none)."""
        if not partition or not delta:
            return
        held = txn.aux_get(TENANT_BYTES, partition)
        total = (_I64.unpack(held)[0] if held is not None else 0) + delta
        txn.aux_put(TENANT_BYTES, partition, _I64.pack(max(total, 0)))

    def tenant_bytes(self, partition: bytes) -> int:
        """A tenant's estimated bytes (its blocks' payloads, records and index entries)."""
        with self._read() as txn:
            held = txn.aux_get(TENANT_BYTES, partition)
            return int(_I64.unpack(held)[0]) if held is not None else 0

    def _refile_expiry(self, txn: BlockTxn, meta: BlockMeta) -> None:
        """Move an early expiry entry to the block's real expiry."""
        txn.index_remove(EXPIRY, expiry_sort_key(meta.indexed_expiry), meta.key)
        meta.indexed_expiry = meta.expires_at
        txn.index_add(EXPIRY, expiry_sort_key(meta.expires_at), meta.key)
        txn.put(meta)

    def _drop(self, txn: BlockTxn, meta: BlockMeta, *, reason: str, at: float) -> bool:
        """Delete a leaf block, remembering why; True when that made its parent a leaf."""
        victim = self._indexed(meta)
        partition = meta.key[:-KEY_BYTES]
        if victim is not None:
            txn.index_remove(VICTIMS, victim, meta.key)
            if partition:
                txn.aux_delete(TENANT_LEAVES, partition + victim + meta.key)
        if partition:
            self._add_tenant_bytes(txn, partition, -self._tenant_delta(meta, None))
        txn.index_remove(EXPIRY, expiry_sort_key(meta.indexed_expiry), meta.key)
        txn.delete(meta.key)
        txn.add_payload_bytes(-meta.payload_size)
        if meta.pinned:  # only a purge removes a pinned block
            txn.aux_delete(PIN_COUNTS, meta.key)
        remember_removal(txn, meta, reason=reason, at=at, limit=self.removal_log_entries)
        if meta.depth == 0:
            txn.aux_delete(FIRSTS, first_hint_key(meta))
            return False
        parent = txn.get(meta.parent_key)
        if parent is None:
            return False
        before = self._indexed(parent)
        parent.children = max(parent.children - 1, 0)
        # Uses are recorded on a hit's deepest block only: the parent takes over its child's
        # record, so when it becomes a leaf it ranks as if every use had marked it too.
        parent.lru_seq = max(parent.lru_seq, meta.lru_seq)
        parent.last_used_at = max(parent.last_used_at, meta.last_used_at)
        parent.hits += meta.hits
        self._save(txn, parent, before)
        return parent.children == 0

    def evict_tenant(
        self,
        partition: bytes,
        *,
        target_bytes: int,
        now: float,
        max_blocks: int,
        protected: frozenset[BlockKey] = frozenset(),
    ) -> list[Evicted]:
        """Remove a tenant's own least recently used leaves (never another tenant's, never
        a pinned block) until its estimated bytes are at most `target_bytes`."""
        evicted: list[Evicted] = []
        limit = SCAN_FIRST
        with self._write() as txn:
            while len(evicted) < max_blocks:
                held = txn.aux_get(TENANT_BYTES, partition)
                if held is None or _I64.unpack(held)[0] <= target_bytes:
                    break
                entries = txn.aux_scan(TENANT_LEAVES, partition, limit)
                victim = None
                for entry, _ in entries:
                    meta = txn.get(BlockKey(entry[len(partition) + SORT_KEY_BYTES :]))
                    if meta is None or meta.children or meta.pinned:
                        txn.aux_delete(TENANT_LEAVES, entry)  # stale: not a leaf any more
                    elif meta.key not in protected:
                        victim = meta
                        break
                if victim is None:
                    if len(entries) < limit or limit >= SCAN_MOST:
                        break  # nothing the tenant may lose is left
                    limit = min(limit * 4, SCAN_MOST)
                    continue
                # One at a time: the victim's parent may now be the tenant's oldest leaf.
                self._drop(txn, victim, reason="tenant_quota", at=now)
                evicted.append(_evicted(victim, "tenant_quota"))
        return evicted

    def usage(self) -> StoreUsage:
        """Blocks, payload bytes and the space the backend really uses."""
        with self._read() as txn:
            return txn.usage()

    def evict(
        self,
        *,
        now: float,
        max_blocks: int,
        target_used_bytes: int | None = None,
        target_blocks: int | None = None,
        expired_only: bool = False,
        protected: frozenset[BlockKey] = frozenset(),
    ) -> list[Evicted]:
        """Remove leaf blocks, expired first, then in policy order, until a target is met."""
        evicted: list[Evicted] = []
        with self._write() as txn:
            # Each eviction removes exactly one block: a block target is a count, known now.
            if target_blocks is not None:
                max_blocks = min(max_blocks, max(txn.usage().blocks - target_blocks, 0))

            def satisfied() -> bool:
                if len(evicted) >= max_blocks:
                    return True
                if target_used_bytes is None:
                    return False
                return txn.usage().used_bytes <= target_used_bytes

            self._evict_from(
                txn,
                EXPIRY,
                upto=expiry_sort_key(now),
                reason="expired",
                evicted=evicted,
                satisfied=satisfied,
                protected=protected,
                now=now,
                at=now,
            )
            if not expired_only:
                self._evict_from(
                    txn,
                    VICTIMS,
                    upto=None,
                    reason="capacity",
                    evicted=evicted,
                    satisfied=satisfied,
                    protected=protected,
                    at=now,
                )
        return evicted

    def _evict_from(
        self,
        txn: BlockTxn,
        index: str,
        *,
        upto: bytes | None,
        reason: str,
        evicted: list[Evicted],
        satisfied: Callable[[], bool],
        protected: frozenset[BlockKey],
        at: float,
        now: float | None = None,
    ) -> None:
        """Drop leaves from the front of `index`; with `now`, expired ancestors follow at once."""
        while not satisfied():
            progressed = False
            for meta in self._candidates(txn, index, upto, protected, now):
                victim: BlockMeta | None = meta
                while victim is not None:
                    new_leaf = self._drop(txn, victim, reason=reason, at=at)
                    evicted.append(_evicted(victim, reason))
                    progressed = True
                    if satisfied():
                        return
                    victim = self._expired_parent(txn, victim, now, protected) if new_leaf else None
                if new_leaf and now is None:
                    break  # the parent may now come first in policy order: scan again
            if not progressed:
                return

    @staticmethod
    def _expired_parent(
        txn: BlockTxn, child: BlockMeta, now: float | None, protected: frozenset[BlockKey]
    ) -> BlockMeta | None:
        """The dropped child's parent when it is now an expired leaf: swept next, so a long
        chain is swept in one pass instead of one index scan per block."""
        if now is None:
            return None
        parent = txn.get(child.parent_key)
        if parent is None or parent.children or parent.is_alive(now) or parent.key in protected:
            return None
        return parent

    def _candidates(
        self,
        txn: BlockTxn,
        index: str,
        upto: bytes | None,
        protected: frozenset[BlockKey],
        now: float | None,
    ) -> Iterator[BlockMeta]:
        """Leaf blocks from the front of an index; rescans after each batch it yields from."""
        after: bytes | None = None
        limit = SCAN_FIRST
        while True:
            entries = list(txn.index_scan(index, after=after, upto=upto, limit=limit))
            found = False
            for _, key in entries:
                meta = txn.get(key)
                if meta is None or key in protected:
                    continue
                if index == EXPIRY and now is not None and meta.is_alive(now):
                    self._refile_expiry(txn, meta)  # listed early: its TTL slid since
                    continue
                if meta.children:
                    continue
                found = True
                yield meta
            if found or len(entries) < limit:
                return
            after = entries[-1][0] + entries[-1][1]
            limit = min(limit * 4, SCAN_MOST)


def _evicted(meta: BlockMeta, reason: str) -> Evicted:
    """The record of a block removed for `reason`."""
    return Evicted(meta.key, reason, meta.retention, meta.expires_at, meta.payload_size)
