"""Removing blocks: eviction (expired first, then in policy order), a tenant's own eviction
down to its quota, and the removal of one block with its subtree on request.

Only leaves are ever removed, so the store is prefix-closed after every single removal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from cache_service.core.blocks import BlockKey, BlockMeta, Evicted, NamespaceId, StoreKey, store_key
from cache_service.core.store.parts import expiry, subtrees
from cache_service.core.store.parts.backend import EXPIRY, SORT_KEY_BYTES, VICTIMS, Txn
from cache_service.core.store.parts.records import Records, evicted_record
from cache_service.core.store.parts.txns import Transactions

SCAN_FIRST = 4  # most scans need one entry: start small, widen when entries are skipped
SCAN_MOST = 1024


class Evictions:
    """evict, evict_tenant and remove_subtree over transactions and block records."""

    txns: Transactions  # both set by ComposedStore, whose base this is
    records: Records

    def evict(
        self,
        *,
        now: float,
        max_blocks: int,
        target_used_bytes: int | None = None,
        target_blocks: int | None = None,
        expired_only: bool = False,
        protected: frozenset[StoreKey] = frozenset(),
    ) -> list[Evicted]:
        """Remove leaf blocks, expired first, then in policy order, until a target is met."""
        evicted: list[Evicted] = []
        with self.txns.write() as txn:
            # Each eviction removes exactly one block: a block target is a count, known now.
            if target_blocks is not None:
                max_blocks = min(max_blocks, max(txn.usage().blocks - target_blocks, 0))

            def satisfied() -> bool:
                if len(evicted) >= max_blocks:
                    return True
                if target_used_bytes is None:
                    return False
                return txn.usage().used_bytes <= target_used_bytes

            scan = _Scan(txn, self.records, evicted, satisfied, protected, at=now)
            scan.drain(EXPIRY, upto=expiry.sort_key(now), reason="expired", now=now)
            if expired_only:  # the sweeper's; a store's eviction never pays for this scan
                scan.drain_future(now)
            else:
                scan.drain(VICTIMS, upto=None, reason="capacity")
        return evicted

    def evict_tenant(
        self,
        partition: bytes,
        *,
        target_bytes: int,
        now: float,
        max_blocks: int,
        protected: frozenset[StoreKey] = frozenset(),
    ) -> list[Evicted]:
        """Remove a tenant's own least recently used leaves (never another tenant's, never
        a pinned block) until its estimated bytes are at most `target_bytes`."""
        evicted: list[Evicted] = []
        tenants = self.records.tenants
        limit = SCAN_FIRST
        with self.txns.write() as txn:
            while len(evicted) < max_blocks:
                held = tenants.held(txn, partition)
                if held is None or held <= target_bytes:
                    break
                entries = tenants.leaves(txn, partition, limit)
                victim = None
                listed_at = slice(len(partition), len(partition) + SORT_KEY_BYTES)
                for entry, key in entries:
                    meta = txn.get(key)
                    if meta is None or entry[listed_at] != self.records.position(meta):
                        tenants.forget(txn, entry)  # stale: gone, damaged, or not this leaf now
                    elif meta.key not in protected:
                        victim = meta
                        break
                if victim is None:
                    if len(entries) < limit or limit >= SCAN_MOST:
                        break  # nothing the tenant may lose is left
                    limit = min(limit * 4, SCAN_MOST)
                    continue
                # One at a time: the victim's parent may now be the tenant's oldest leaf.
                self.records.drop(txn, victim, reason="tenant_quota", at=now)
                evicted.append(evicted_record(victim, "tenant_quota"))
        return evicted

    def remove_subtree(self, namespace: NamespaceId, key: BlockKey, *, now: float) -> list[Evicted]:
        """Remove block `key` of `namespace` and every stored descendant, deepest first, each
        reported with reason "removed"; an unknown key removes nothing.

        A pinned block stays, and so do its ancestors (a pin holds its prefix): the rest of
        the subtree goes. Large subtrees go in short transactions, like a purge."""
        stored = store_key(namespace.partition, key)
        with self.txns.write() as txn:
            meta = txn.get(stored)
            if meta is None or meta.namespace_root != namespace.root:
                return []
            if not meta.children:  # the usual case (an engine drops leaves): no scan
                if meta.pinned:
                    return []
                self.records.drop(txn, meta, reason="removed", at=now)
                return [evicted_record(meta, "removed")]
        targets = subtrees.find(self.txns, namespace.partition, under=stored)
        removed: list[Evicted] = []
        for start in range(0, len(targets), subtrees.REMOVE_BATCH_BLOCKS):
            with self.txns.write() as txn:
                for target in targets[start : start + subtrees.REMOVE_BATCH_BLOCKS]:
                    found = txn.get(target.key)
                    # gone, pinned, or above a block that stays (or one stored since the scan)
                    if found is None or found.children or found.pinned:
                        continue
                    self.records.drop(txn, found, reason="removed", at=now)
                    removed.append(evicted_record(found, "removed"))
        return removed


class _Scan:
    """One eviction's walk over the indexes, dropping leaves until it is satisfied."""

    def __init__(
        self,
        txn: Txn,
        records: Records,
        evicted: list[Evicted],
        satisfied: Callable[[], bool],
        protected: frozenset[StoreKey],
        *,
        at: float,
    ) -> None:
        self.txn = txn
        self.records = records
        self.evicted = evicted
        self.satisfied = satisfied
        self.protected = protected
        self.at = at
        self._held: int | None = None

    def drain(
        self, index: str, *, upto: bytes | None, reason: str, now: float | None = None
    ) -> None:
        """Drop leaves from the front of `index`; with `now`, expired ancestors follow at once."""
        while not self.satisfied():
            progressed = False
            for meta in self._candidates(index, upto, now):
                victim: BlockMeta | None = meta
                while victim is not None:
                    new_leaf = self.records.drop(self.txn, victim, reason=reason, at=self.at)
                    self.evicted.append(evicted_record(victim, reason))
                    if reason == "capacity":  # what a policy may learn from: room was needed
                        self._evicted_for_room(victim)
                    progressed = True
                    if self.satisfied():
                        return
                    victim = self._expired_parent(victim, now) if new_leaf else None
                if new_leaf and now is None:
                    break  # the parent may now come first in policy order: scan again
            if not progressed:
                return

    def _evicted_for_room(self, victim: BlockMeta) -> None:
        # The blocks held are read once a scan (a read of every table's size on LMDB), then
        # counted down: the policy needs about how many, to bound what it remembers.
        if self._held is None:
            self._held = self.txn.usage().blocks
        else:
            self._held -= 1
        self.records.victims.policy.evicted(victim, held_blocks=self._held)

    def drain_future(self, now: float) -> None:
        """Once the clock reads earlier than a write was made at, remove the blocks stored
        while it ran ahead (`Lifetimes.from_future`), leaf first, as expired. One that still
        has a child which is not from the future (so not removed) takes the longest class's
        expiry from now instead, which outlives that child. One pass does it all, whatever
        the sweep's block limit: it reads every block (one from the future can be listed
        anywhere in the expiry index), so it runs once per step back of the clock, not once
        a batch; lookups treat such blocks as misses until then. Only sweeps run it."""
        txn, lifetimes = self.txn, self.txn.lifetimes
        if txn.latest_write() <= now + lifetimes.slack_seconds:
            return  # the usual case: the clock never went back past a write
        future = [
            meta
            for meta in self._every_block()
            if lifetimes.from_future(meta.expires_at, meta.retention, now)
            and meta.key not in self.protected
        ]
        future.sort(key=lambda meta: -meta.depth)  # children before their parents
        for listed in future:
            meta = txn.get(listed.key)  # read again: a child of it may have gone since
            if meta is None or not lifetimes.from_future(meta.expires_at, meta.retention, now):
                continue
            if meta.children:
                before = self.records.position(meta)
                meta.expires_at = now + lifetimes.longest_ttl_seconds
                meta.retention = lifetimes.longest_class
                meta.last_used_at = min(meta.last_used_at, now)  # not a use from the future
                self.records.save(txn, meta, before)
                if meta.indexed_expiry > meta.expires_at:
                    expiry.refile(txn, meta)  # an entry stays at or before the expiry
                continue
            self.records.drop(txn, meta, reason="expired", at=self.at)
            self.evicted.append(evicted_record(meta, "expired"))
        txn.set_latest_write(now)

    def _every_block(self) -> Iterator[BlockMeta]:
        """Every block the expiry index lists (a stale entry is skipped)."""
        after: bytes | None = None
        while True:
            entries = list(self.txn.index_scan(EXPIRY, after=after, upto=None, limit=SCAN_MOST))
            for _sort_key, key in entries:
                meta = self.txn.get(key)
                if meta is not None:
                    yield meta
            if len(entries) < SCAN_MOST:
                return
            after = entries[-1][0] + entries[-1][1]

    def _expired_parent(self, child: BlockMeta, now: float | None) -> BlockMeta | None:
        """The dropped child's parent when it is now an expired leaf: swept next, so a long
        chain is swept in one pass instead of one index scan per block."""
        if now is None:
            return None
        parent = self.txn.get(child.parent_key)
        if (
            parent is None
            or parent.children
            or parent.is_alive(now, self.txn.judging(now))
            or parent.key in self.protected
        ):
            return None
        return parent

    def _listed_at(self, index: str, meta: BlockMeta) -> bytes | None:
        """Where `index` should list the block, as its record says."""
        if index == EXPIRY:
            return expiry.sort_key(meta.indexed_expiry)
        return self.records.position(meta)

    def _candidates(self, index: str, upto: bytes | None, now: float | None) -> Iterator[BlockMeta]:
        """Leaf blocks from the front of an index; rescans after each batch it yields from."""
        txn = self.txn
        after: bytes | None = None
        limit = SCAN_FIRST
        while True:
            entries = list(txn.index_scan(index, after=after, upto=upto, limit=limit))
            found = False
            for sort_key, key in entries:
                if key in self.protected:
                    continue
                meta = txn.get(key)
                if meta is None or sort_key != self._listed_at(index, meta):
                    # Its record is gone (dropped as damaged, whose entries could not be
                    # told) or disagrees: a stale entry, removed so no scan meets it again.
                    txn.index_remove(index, sort_key, key)
                    continue
                if index == EXPIRY and now is not None and meta.is_alive(now, txn.judging(now)):
                    expiry.refile(txn, meta)  # listed early: its TTL slid since
                    continue
                if meta.children:
                    continue
                found = True
                yield meta
            if found or len(entries) < limit:
                return
            after = entries[-1][0] + entries[-1][1]
            limit = min(limit * 4, SCAN_MOST)
