"""Block records and the indexes that follow them: every write of a record goes through here.

Invariants kept here:
- `children` counts a block's stored children; only unpinned blocks with none are in the
  victims index (and, for a tenant, in its leaves);
- a new block joins the expiry index; its entry is at or before its real expiry;
- only leaves are removed, so the store stays prefix-closed; a removed block leaves its
  parent one child fewer and, by the policy's rule, what the policy ranks it by;
- a tenant's bytes count its blocks, and the payload byte counter every block's payload.
"""

from __future__ import annotations

from cache_service.core.blocks import BlockMeta, Evicted, StoreKey
from cache_service.core.store.parts import expiry, pins
from cache_service.core.store.parts.backend import Txn
from cache_service.core.store.parts.removals import RemovalLog, forget_first_block
from cache_service.core.store.parts.tenants import TenantAccounts
from cache_service.core.store.parts.victims import VictimIndex


class Records:
    """Writes and removals of block records, with their index entries."""

    def __init__(
        self, victims: VictimIndex, tenants: TenantAccounts, removal_log: RemovalLog
    ) -> None:
        self.victims = victims
        self.tenants = tenants
        self.removal_log = removal_log

    def position(self, meta: BlockMeta) -> bytes | None:
        """Where a block stands in the victims index now; taken before changing it."""
        return self.victims.position(meta)

    def save(self, txn: Txn, meta: BlockMeta, before: bytes | None, *, new: bool = False) -> None:
        """Write `meta`, moving its victims entry from `before`; a new block joins the expiry
        index. Later expiry changes leave that entry early on purpose: sliding a block's TTL
        on every hit then costs no index write, and the sweeper re-files early entries."""
        after = self.victims.position(meta)
        if before != after:
            self.victims.move(txn, meta.key, before, after)
            self.tenants.move_leaf(txn, meta, before, after)
        if new:
            expiry.add(txn, meta)
        longest_class = txn.lifetimes.longest_class
        if meta.pinned and longest_class:
            # A pin lets go by giving the block the longest TTL from then (controls.release):
            # its class must allow that much, or it would read as stored in the future.
            meta.retention = longest_class
        # Every record written notes the latest clock its block was used at (stored, hit):
        # blocks from the future are looked for only once the clock reads earlier than that.
        # Not the clock its expiry implies under today's TTLs: a TTL lowered since the block
        # was stored would make every old block rewritten (a child added, a hit) look like a
        # write from the future, and old expiries stand as they were given.
        txn.note_write(meta.last_used_at)
        txn.put(meta)

    def add_child(self, txn: Txn, parent_key: StoreKey) -> None:
        """Count a newly stored child on its parent."""
        parent = txn.get(parent_key)
        if parent is not None:
            before = self.position(parent)
            parent.children += 1
            self.save(txn, parent, before)

    def drop(self, txn: Txn, meta: BlockMeta, *, reason: str, at: float) -> bool:
        """Delete a leaf block, remembering why; True when that made its parent a leaf."""
        position = self.position(meta)
        self.victims.move(txn, meta.key, position, None)
        self.tenants.move_leaf(txn, meta, position, None)
        if meta.partition:
            self.tenants.add(txn, meta.partition, -self.tenants.block_bytes(meta))
        expiry.remove(txn, meta)
        txn.delete(meta.key)
        txn.add_payload_bytes(-meta.payload_size)
        if meta.pinned:  # only a purge removes a pinned block
            pins.set_holders(txn, meta.key, 0)
        self.removal_log.remember(txn, meta, reason=reason, at=at)
        if meta.depth == 0:
            forget_first_block(txn, meta)
            return False
        parent = txn.get(meta.parent_key)
        if parent is None:
            return False
        before = self.position(parent)
        parent.children = max(parent.children - 1, 0)
        self.victims.child_removed(parent, meta)
        self.save(txn, parent, before)
        return parent.children == 0


def release(
    records: Records, txn: Txn, key: StoreKey, *, count: int, now: float, ttl_seconds: float
) -> None:
    """Take one pin off `count` blocks from `key` up the chain; a block no pin holds any
    more expires `ttl_seconds` from now, and its expiry-index entry (moved to never while
    it was pinned) comes back to that time."""
    at: StoreKey | None = key
    for _ in range(count):  # deepest first, up the chain
        meta = txn.get(at) if at is not None else None
        if meta is None:
            return
        held = pins.holders(txn, meta.key)
        pins.set_holders(txn, meta.key, max(held - 1, 0))
        if held <= 1:
            before = records.position(meta)
            meta.expires_at = now + ttl_seconds
            records.save(txn, meta, before)
            if meta.indexed_expiry > meta.expires_at:
                expiry.refile(txn, meta)
        at = meta.parent_key if meta.depth else None


def evicted_record(meta: BlockMeta, reason: str) -> Evicted:
    """The record of a block removed for `reason`."""
    return Evicted(meta.key, reason, meta.retention, meta.expires_at, meta.payload_size)
