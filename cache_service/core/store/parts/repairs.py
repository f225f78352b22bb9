"""Dropping damaged blocks: a block whose record or payload failed verification goes, with
every block stored under it (reason "corrupt"), and the store is mended where its loss
breaks an invariant.

A damaged record cannot be trusted for anything it says: not its parent, its children, its
size nor its place in the indexes. So:
- its descendants are found by their own parent keys (a scan of its tenant's blocks);
- its parent is the block whose recorded children outnumber the children found pointing at
  it in that scan (preferring the parent the damaged record names, and one a level above
  the damaged block's own children); that block is counted one child fewer;
- its index entries are left for the eviction scans, which drop entries whose record is gone
  or disagrees with them;
- its payload bytes are the stored payload's length, its tenant bytes an estimate from its
  record's length (a tenant's bytes are an estimate anyway);
- pins ending at it or under it let go, and what they held above it expires as after unpin.

A block whose payload alone is damaged has a sound record: it and its subtree are dropped
as any removal drops blocks.
"""

from __future__ import annotations

import logging
from collections import Counter
from itertools import groupby
from typing import NamedTuple

from cache_service.core.blocks import KEY_BYTES, BlockKey, BlockMeta, Evicted, StoreKey
from cache_service.core.store.parts import pins, subtrees
from cache_service.core.store.parts.backend import Txn
from cache_service.core.store.parts.codec import checksum, record_size
from cache_service.core.store.parts.damage import DamageLog, Salvage
from cache_service.core.store.parts.records import Records, evicted_record, release
from cache_service.core.store.parts.subtrees import REMOVE_BATCH_BLOCKS, Target
from cache_service.core.store.parts.txns import Transactions
from cache_service.core.store.protocols import Dropped

log = logging.getLogger("cache_service")
REASON = "corrupt"


class Repairs:
    """drop_damaged over transactions, block records and the backend's damage log."""

    txns: Transactions  # these three are set by ComposedStore, whose base this is
    records: Records
    damage: DamageLog

    def damage_pending(self) -> int:
        """How many damaged blocks wait for `drop_damaged`."""
        return self.damage.pending

    def drop_damaged(self, *, now: float, ttl_seconds: float) -> Dropped:
        """Remove every block noted damaged that still is, with its subtree; blocks a pin
        held above it expire `ttl_seconds` from now. On an error, the noted keys stay noted."""
        noted = self.damage.take()
        if not noted.records and not noted.payloads:
            return Dropped()
        try:
            return self._drop(set(noted.records), set(noted.payloads), now, ttl_seconds)
        except BaseException:
            self.damage.give_back(noted.records, noted.payloads)
            raise

    def _drop(
        self, records: set[StoreKey], payloads: set[StoreKey], now: float, ttl_seconds: float
    ) -> Dropped:
        with self.txns.read() as txn:  # what is still damaged (another worker may have dropped it)
            records = {key for key in records if txn.salvage(key) is not None}
            payloads = {key for key in payloads - records if _payload_damaged(txn, key)}
        removed: list[Evicted] = []
        dropped_records = dropped_payloads = 0
        damaged = sorted(records | payloads, key=_partition)
        for partition, keys in groupby(damaged, key=_partition):
            snapshot = subtrees.scan(self.txns, partition)
            deficits = _deficits(snapshot)
            children = subtrees.children_of(snapshot)  # once: many keys may be damaged
            for key in keys:
                under = subtrees.subtree(snapshot, key, children)
                below = sorted((t for t in under if t.key != key), key=lambda t: -t.depth)
                removed += self._drop_blocks(below, now)
                with self.txns.write() as txn:
                    if key in records:
                        evicted = self._drop_record(
                            txn, key, under=under, damaged=records, deficits=deficits, now=now
                        )
                        dropped_records += evicted is not None
                    else:
                        evicted = self._drop_payload(txn, key, now)
                        dropped_payloads += evicted is not None
                    if evicted is not None:
                        parent = evicted.parent
                        self._let_pins_go(txn, partition, under=under, key=key,
                                          parent=parent, now=now, ttl=ttl_seconds)  # fmt: skip
                        removed.append(evicted.evicted)
        self.damage.forget(damaged)  # noted again as the drop read around them
        return Dropped(dropped_records, dropped_payloads, tuple(removed))

    def _drop_blocks(self, targets: list[Target], now: float) -> list[Evicted]:
        """Drop sound blocks deepest first, in short transactions (pinned ones too: the
        damaged block above them breaks their pin's prefix)."""
        removed = []
        for start in range(0, len(targets), REMOVE_BATCH_BLOCKS):
            with self.txns.write() as txn:
                for target in targets[start : start + REMOVE_BATCH_BLOCKS]:
                    meta = txn.get(target.key)
                    if meta is None or meta.children:  # gone, damaged, or given a child since
                        continue
                    self.records.drop(txn, meta, reason=REASON, at=now)
                    removed.append(evicted_record(meta, REASON))
        return removed

    def _drop_payload(self, txn: Txn, key: StoreKey, now: float) -> _Removed | None:
        """Drop a leaf whose payload fails its checksum (its record is sound)."""
        meta = txn.get(key)
        if meta is None or meta.children or not _payload_damaged(txn, key):
            return None  # gone, rewritten, or a child it keeps (stored since the scan)
        self.records.drop(txn, meta, reason=REASON, at=now)
        return _Removed(evicted_record(meta, REASON), meta.parent_key if meta.depth else None)

    def _drop_record(
        self,
        txn: Txn,
        key: StoreKey,
        *,
        under: list[Target],
        damaged: set[StoreKey],
        deficits: Counter[StoreKey],
        now: float,
    ) -> _Removed | None:
        """Delete a damaged record and its payload, and mend what its loss breaks."""
        salvage = txn.salvage(key)
        if salvage is None:
            return None  # dropped or rewritten since
        txn.delete(key)
        txn.add_payload_bytes(-salvage.payload_bytes)
        partition = _partition(key)
        tenants = self.records.tenants
        if partition:
            tokens = max(salvage.record_bytes - record_size(0), 0)
            tenants.add(
                txn, partition, -tenants.space.estimate_bytes(salvage.payload_bytes, tokens)
            )
        pins.set_holders(txn, key, 0)
        stub = _stub(key, salvage, now)
        self.records.removal_log.remember(txn, stub, reason=REASON, at=now)
        parent = _guess_parent(
            txn, key, salvage=salvage, under=under, damaged=damaged, deficits=deficits
        )
        if parent is not None:
            held = txn.get(parent)
            if held is not None and held.children:
                before = self.records.position(held)
                held.children -= 1
                self.records.save(txn, held, before)
                deficits[parent] -= 1
        else:
            log.warning("dropped a damaged block record; its parent could not be told")
        return _Removed(Evicted(key, REASON, "", now, salvage.payload_bytes), parent)

    def _let_pins_go(
        self,
        txn: Txn,
        partition: bytes,
        *,
        under: list[Target],
        key: StoreKey,
        parent: StoreKey | None,
        now: float,
        ttl: float,
    ) -> None:
        """Pins ending at the dropped block or under it go; what they held above it is let go."""
        gone = {target.key for target in under} | {key}
        for record in pins.records(txn, partition):
            if store_key_of(partition, record.key) not in gone:
                continue
            pins.delete_record(txn, pins.pin_key(record.scope, record.key))
            if parent is not None:
                release(self.records, txn, parent, count=record.blocks, now=now, ttl_seconds=ttl)


class _Removed(NamedTuple):
    """A dropped block and the parent it leaves (None: a first block, or not told)."""

    evicted: Evicted
    parent: StoreKey | None


def store_key_of(partition: bytes, key: BlockKey) -> StoreKey:
    """The stored key of a tenant's block."""
    return StoreKey(partition + key)


def _partition(key: StoreKey) -> bytes:
    return key[:-KEY_BYTES]


def _payload_damaged(txn: Txn, key: StoreKey) -> bool:
    """Whether a sound record's payload fails its length or checksum."""
    meta = txn.get(key)
    if meta is None:
        return False
    payload = txn.get_payload(key)
    return (
        payload is None or len(payload) != meta.payload_size or checksum(payload) != meta.checksum
    )


def _deficits(snapshot: list[Target]) -> Counter[StoreKey]:
    """Blocks whose recorded children outnumber those found pointing at them: the parents of
    damaged records (which the scan cannot read)."""
    pointing = Counter(target.parent_key for target in snapshot if target.depth)
    deficits: Counter[StoreKey] = Counter()
    for target in snapshot:
        missing = target.children - pointing[target.key]
        if missing > 0:
            deficits[target.key] = missing
    return deficits


def _guess_parent(
    txn: Txn,
    key: StoreKey,
    *,
    salvage: Salvage,
    under: list[Target],
    damaged: set[StoreKey],
    deficits: Counter[StoreKey],
) -> StoreKey | None:
    """The parent a damaged record leaves, or None when it is a first block, is itself
    damaged, or cannot be told apart."""
    named = store_key_of(_partition(key), BlockKey(salvage.parent))
    if named in damaged or txn.salvage(named) is not None:
        return None  # damaged too: dropped in turn, nothing to mend
    if deficits[named] > 0:
        return named
    children = [target.depth for target in under if target.parent_key == key]
    depth = min(children) - 1 if children else None  # the damaged block's own depth
    if depth == 0:
        return None  # a first block: its parent is the namespace root, not a block
    candidates = [
        parent
        for parent, missing in deficits.items()
        if missing > 0 and (depth is None or _depth_of(txn, parent) == depth - 1)
    ]
    return candidates[0] if len(candidates) == 1 else None


def _depth_of(txn: Txn, key: StoreKey) -> int | None:
    meta = txn.get(key)
    return meta.depth if meta is not None else None


def _stub(key: StoreKey, salvage: Salvage, now: float) -> BlockMeta:
    """What the removal log keeps of a damaged record: its key and when it went."""
    zero = BlockKey(bytes(KEY_BYTES))
    return BlockMeta(key, zero, zero, 0, b"", salvage.payload_bytes, 0, now, now, now, "")
