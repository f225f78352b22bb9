"""Operator controls: pin and unpin a prefix, purge blocks, and inspect why a block does not
match (for explanations); a protocol of their own, implemented once over the store's parts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from cache_service.core.blocks import (
    KEY_BYTES,
    BlockKey,
    BlockMeta,
    BlockState,
    ChainLink,
    NamespaceId,
    PinLimits,
    PinRecord,
    PurgeResult,
    StoreKey,
    store_key,
)
from cache_service.core.errors import Forbidden, NotStored
from cache_service.core.store.parts import pins, subtrees
from cache_service.core.store.parts.backend import FIRSTS, Txn
from cache_service.core.store.parts.batches import in_batches
from cache_service.core.store.parts.codec import COLLISION, HIT
from cache_service.core.store.parts.records import Records, release
from cache_service.core.store.parts.removals import hint_prefix, parse_hint
from cache_service.core.store.parts.txns import Transactions

PURGE_BATCH_BLOCKS = 1024  # blocks per write transaction at most: writers never wait long


class Controls:
    """OperatorControls over transactions and block records."""

    txns: Transactions  # both set by ComposedStore, whose base this is
    records: Records

    # -- pins ---------------------------------------------------------------------------------

    def pin(
        self,
        namespace: NamespaceId,
        links: Sequence[ChainLink],
        *,
        now: float,
        by: str,
        rank: int = 0,
        limits: PinLimits | None = None,
    ) -> tuple[PinRecord, bool]:
        """Pin the prefix `links` (from block 0; every block must be stored and alive);
        returns its pin and whether it is new (pinning a pinned prefix again changes nothing).
        `rank` is the pinner's (only as high a rank may release it); QuotaExceeded when the
        pin would pass one of `limits`."""
        if not links or links[0].depth != 0:
            raise ValueError("a pin holds a prefix from block 0")
        part = namespace.partition
        key = pins.pin_key(namespace.scope, links[-1].key)
        with self.txns.write() as txn:
            held = pins.get_record(txn, key, part)
            if held is not None:
                if rank > held.rank:  # a higher role takes the pin over: only it may release
                    held = PinRecord(held.scope, held.key, held.blocks, held.pinned_at, by,
                                     held.bytes, rank)  # fmt: skip
                    pins.put_record(txn, key, held)
                return held, False
            own = pins.records(txn, part) if limits is not None else []
            if limits is not None and limits.blocks is not None:
                pins.check_blocks(own, len(links), limits.blocks)
            metas = _verified(txn, namespace, links, now)
            size = sum(self.records.tenants.block_bytes(meta) for meta in metas)
            if limits is not None:
                pins.check_bytes(own, size, limits.tenant_bytes, "tenant")
                if limits.total_bytes is not None:
                    every = pins.records(txn, b"", every=True)
                    pins.check_bytes(every, size, limits.total_bytes, "all")
            for meta in metas:
                count = pins.holders(txn, meta.key)
                pins.set_holders(txn, meta.key, count + 1)
                if count == 0:
                    before = self.records.position(meta)
                    meta.expires_at = math.inf
                    self.records.save(txn, meta, before)
            record = PinRecord(
                namespace.scope, links[-1].key, len(links), float(now), by, size, rank
            )
            pins.put_record(txn, key, record)
        return record, True

    def unpin(
        self,
        namespace: NamespaceId,
        deepest: BlockKey,
        *,
        now: float,
        ttl_seconds: float,
        rank: int = 0,
    ) -> int:
        """Release the pin whose deepest block is `deepest`; its blocks that no other pin
        holds expire `ttl_seconds` from now (the longest class's TTL, so that none expires
        before a descendant). Returns how many blocks the pin held (0 if no such pin);
        Forbidden if it was pinned by a higher rank than `rank`."""
        part = namespace.partition
        key = pins.pin_key(namespace.scope, deepest)
        with self.txns.write() as txn:
            record = pins.get_record(txn, key, part)
            if record is None:
                return 0
            if record.rank > rank:
                raise Forbidden(
                    f"this prefix was pinned by {record.by!r}, whose role is above this key's"
                )
            held_from = store_key(part, deepest)
            release(
                self.records, txn, held_from, count=record.blocks, now=now, ttl_seconds=ttl_seconds
            )
            pins.delete_record(txn, key)
        return record.blocks

    def pins(self, partition: bytes) -> list[PinRecord]:
        """Every pin of a tenant (by its partition)."""
        with self.txns.read() as txn:
            return pins.records(txn, partition)

    # -- reads --------------------------------------------------------------------------------

    def links_of(
        self, namespace: NamespaceId, keys: Sequence[BlockKey], *, now: float
    ) -> list[ChainLink]:
        """The chain links of a prefix given by its keys, from the records the store holds
        (a record is stored under the hash of its parent and tokens, so a run of records
        linked by their parents from the root is a genuine prefix); NotStored naming the
        first key that is not block `i` of such a run."""
        links: list[ChainLink] = []
        parent = namespace.root
        with self.txns.read() as txn:
            for depth, key in enumerate(keys):
                meta = txn.get(store_key(namespace.partition, key))
                if (
                    meta is None
                    or not meta.is_alive(now, txn.judging(now))
                    or meta.namespace_root != namespace.root
                    or meta.depth != depth
                    or meta.parent != parent
                ):
                    raise NotStored(
                        f"keys[{depth}] is not block {depth} of a stored prefix of this namespace",
                        block=depth,
                    )
                links.append(ChainLink(key, parent, meta.tokens, depth))
                parent = key
        return links

    def encoded_namespace(self, scope: StoreKey) -> bytes | None:
        """The encoded namespace stored for a scope (partition + root), if any."""
        with self.txns.read() as txn:
            return txn.get_namespace(scope)

    def replace_namespace(self, scope: StoreKey, held: bytes, encoded: bytes) -> bool:
        """Replace a scope's stored namespace if it still is `held` (a damaged copy, as the
        cache judged: the store never hashes); whether it was."""
        with self.txns.write() as txn:
            if txn.get_namespace(scope) != held:
                return False
            txn.put_namespace(scope, encoded)
            return True

    # -- purge --------------------------------------------------------------------------------

    def purge(
        self,
        partition: bytes,
        *,
        root: BlockKey | None = None,
        under: StoreKey | None = None,
        now: float,
        ttl_seconds: float = 0.0,
    ) -> PurgeResult:
        """Delete every block of a tenant, of one of its namespaces (`root`), or every block
        under the block `under` (its own key, with its partition) and itself. Runs in short
        transactions, deepest blocks first; durable once it returns. A pin whose blocks
        went lets go of the blocks that stay (above `under`), which then expire
        `ttl_seconds` from now unless another pin holds them."""
        targets = subtrees.find(self.txns, partition, root=root, under=under)
        done = PurgeResult(blocks=0, payload_bytes=0, pins=0)
        position = 0

        def one_batch(max_blocks: int) -> int:
            nonlocal done, position
            batch = targets[position : position + max_blocks]
            if not batch:
                return 0
            # Counted once the transaction commits: a batch refused as full did nothing.
            with self.txns.write() as txn:
                purged = self._purge_batch(txn, partition, batch, now, ttl_seconds)
            done = PurgeResult(
                blocks=done.blocks + purged.blocks,
                payload_bytes=done.payload_bytes + purged.payload_bytes,
                pins=done.pins + purged.pins,
            )
            position += len(batch)
            return len(batch)

        # Smaller batches on a full disk: a deletion needs fresh pages before it frees any.
        in_batches(one_batch, largest=PURGE_BATCH_BLOCKS)
        return done

    def _purge_batch(
        self,
        txn: Txn,
        partition: bytes,
        targets: Sequence[subtrees.Target],
        now: float,
        ttl_seconds: float,
    ) -> PurgeResult:
        """Delete `targets` (deepest first) in one transaction; what went."""
        blocks = payload_bytes = released = 0
        for target in targets:
            meta = txn.get(target.key)
            if meta is None or meta.children:  # gone, or given a child since the scan
                continue
            # A pin ending at this block goes with it, in the same transaction, and lets go
            # of the blocks above (which may be purged next, or stay).
            key = pins.pin_key(
                store_key(partition, meta.namespace_root), BlockKey(meta.key[len(partition) :])
            )
            record = pins.get_record(txn, key, partition)
            if record is not None:
                pins.delete_record(txn, key)
                if meta.depth and record.blocks > 1:
                    release(
                        self.records,
                        txn,
                        meta.parent_key,
                        count=record.blocks - 1,
                        now=now,
                        ttl_seconds=ttl_seconds,
                    )
                released += 1
            self.records.drop(txn, meta, reason="purged", at=now)
            blocks += 1
            payload_bytes += meta.payload_size
        return PurgeResult(blocks=blocks, payload_bytes=payload_bytes, pins=released)

    # -- explanations -------------------------------------------------------------------------

    def inspect(self, namespace: NamespaceId, link: ChainLink, *, now: float) -> BlockState:
        """Why one block of a chain (whose parent matched) does not match."""
        key = store_key(namespace.partition, link.key)
        with self.txns.read() as txn:
            status = txn.check(key, namespace.root + link.parent, link.tokens, link.depth, now)
            held = txn.get_namespace(namespace.scope)
            if status == COLLISION or (held is not None and held != namespace.encoded):
                return BlockState("collision")  # the block's, or the namespace root's
            if status == HIT:
                return BlockState("stored")  # stored since the lookup
            meta = txn.get(key)
            if meta is None and txn.salvage(key) is not None:
                return BlockState("corrupt")  # its record fails verification: dropped soon
            if meta is not None and not meta.is_alive(now, txn.judging(now)):
                return BlockState("expired", expires_at=meta.expires_at, retention=meta.retention)
            return BlockState("absent", removal=self.records.removal_log.recall(txn, key))

    def first_block_homes(
        self, partition: bytes, token_bytes: bytes
    ) -> list[tuple[BlockKey, int, bytes | None]]:
        """Where first blocks starting like `token_bytes` are stored in this partition:
        (namespace root, block size, encoded namespace)."""
        prefix = hint_prefix(partition, token_bytes)
        with self.txns.read() as txn:
            homes = []
            for key, _ in txn.aux_scan(FIRSTS, prefix, 64):
                if len(key) != len(prefix) + KEY_BYTES + 4:
                    continue
                root, block_size = parse_hint(key, prefix)
                homes.append((root, block_size, txn.get_namespace(store_key(partition, root))))
            return homes


def _verified(
    txn: Txn, namespace: NamespaceId, links: Sequence[ChainLink], now: float
) -> list[BlockMeta]:
    """The stored, alive, verified blocks of `links`; NotStored naming the first that is not."""
    found = []
    part, root = namespace.partition, namespace.root
    for link in links:
        key = store_key(part, link.key)
        status = txn.check(key, root + link.parent, link.tokens, link.depth, now)
        meta = txn.get(key) if status == HIT else None
        if meta is None:
            raise NotStored(
                f"block {link.depth} of the prefix is not stored: store the prefix first",
                block=link.depth,
            )
        found.append(meta)
    return found
