"""Operator controls over any backend: pin and unpin a prefix, purge blocks, and inspect why
a block does not match (for explanations).

A pin holds a prefix from block 0: every block of it is pinned, and a pinned block's expiry is
infinite (so neither it nor, by the expiry invariant, any ancestor expires) and it is never a
victim of capacity eviction. Blocks count the pins that hold them, so overlapping pins (a
system prompt, and that prompt plus a few-shot block) are released independently.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import orjson

from cache_service.blocks import (
    KEY_BYTES,
    BlockKey,
    BlockMeta,
    BlockState,
    ChainLink,
    NamespaceId,
    PinRecord,
    PurgeResult,
)
from cache_service.errors import NotStored, QuotaExceeded
from cache_service.store.base import FIRSTS, PIN_COUNTS, PINS, BlockTxn
from cache_service.store.codec import COLLISION, HIT
from cache_service.store.indexed import IndexedStore
from cache_service.store.removals import hint_prefix, parse_hint, recall_removal

PURGE_BATCH_BLOCKS = 1024  # blocks deleted per write transaction: writers never wait long
SCAN_BATCH_BLOCKS = 4096
_COUNT = struct.Struct("<I")


class OperatorControls(IndexedStore):
    """Pins, purges and inspections, written once over backend transactions."""

    # -- pins ---------------------------------------------------------------------------------

    def pin(
        self,
        namespace: NamespaceId,
        links: Sequence[ChainLink],
        *,
        now: float,
        by: str,
        quota_blocks: int | None = None,
    ) -> tuple[PinRecord, bool]:
        """Pin the prefix `links` (from block 0; every block must be stored and alive);
        returns its pin and whether it is new (pinning a pinned prefix again changes nothing).
        QuotaExceeded if the tenant's pins would hold more than `quota_blocks` blocks."""
        if not links or links[0].depth != 0:
            raise ValueError("a pin holds a prefix from block 0")
        part = namespace.partition
        pin_key = namespace.scope + links[-1].key
        with self._write() as txn:
            held = txn.aux_get(PINS, pin_key)
            if held is not None:
                return _pin_record(pin_key, held, part), False
            metas = self._verified(txn, namespace, links, now)
            if quota_blocks is not None:
                pinned = sum(record.blocks for record in self._pins(txn, part))
                if pinned + len(links) > quota_blocks:
                    raise QuotaExceeded(
                        f"the tenant's pins hold {pinned} blocks; {len(links)} more would pass "
                        f"its pin quota of {quota_blocks} blocks (pin_quota_blocks)",
                        limit="pin_quota_blocks",
                        limit_blocks=quota_blocks,
                    )
            for meta in metas:
                count = _count(txn, meta.key)
                txn.aux_put(PIN_COUNTS, meta.key, _COUNT.pack(count + 1))
                if count == 0:
                    before = self._indexed(meta)
                    meta.expires_at = math.inf
                    self._save(txn, meta, before)
            value = orjson.dumps({"blocks": len(links), "pinned_at": now, "by": by})
            txn.aux_put(PINS, pin_key, value)
        return _pin_record(pin_key, value, part), True

    def unpin(
        self, namespace: NamespaceId, deepest: BlockKey, *, now: float, ttl_seconds: float
    ) -> int:
        """Release the pin whose deepest block is `deepest`; its blocks that no other pin
        holds expire `ttl_seconds` from now (the longest class's TTL, so that none expires
        before a descendant). Returns how many blocks the pin held (0 if no such pin)."""
        part = namespace.partition
        pin_key = namespace.scope + deepest
        with self._write() as txn:
            value = txn.aux_get(PINS, pin_key)
            if value is None:
                return 0
            record = _pin_record(pin_key, value, part)
            key: BlockKey | None = BlockKey(part + deepest)
            for _ in range(record.blocks):  # deepest first, up the chain
                meta = txn.get(key) if key is not None else None
                if meta is None:
                    break
                count = _count(txn, meta.key)
                if count <= 1:
                    txn.aux_delete(PIN_COUNTS, meta.key)
                    before = self._indexed(meta)
                    meta.expires_at = now + ttl_seconds
                    self._save(txn, meta, before)
                else:
                    txn.aux_put(PIN_COUNTS, meta.key, _COUNT.pack(count - 1))
                key = meta.parent_key if meta.depth else None
            txn.aux_delete(PINS, pin_key)
        return record.blocks

    def pins(self, partition: bytes) -> list[PinRecord]:
        """Every pin of a tenant (by its partition)."""
        with self._read() as txn:
            return self._pins(txn, partition)

    @staticmethod
    def _pins(txn: BlockTxn, partition: bytes) -> list[PinRecord]:
        size = len(partition) + 2 * KEY_BYTES  # a pin key: partition, root, deepest key
        return [
            _pin_record(key, value, partition)
            for key, value in txn.aux_scan(PINS, partition, 1 << 30)
            if len(key) == size
        ]

    def links_of(
        self, namespace: NamespaceId, keys: Sequence[BlockKey], *, now: float
    ) -> list[ChainLink]:
        """The chain links of a prefix given by its keys, from the records the store holds
        (a record is stored under the hash of its parent and tokens, so a run of records
        linked by their parents from the root is a genuine prefix); NotStored naming the
        first key that is not block `i` of such a run."""
        links: list[ChainLink] = []
        parent = namespace.root
        with self._read() as txn:
            for depth, key in enumerate(keys):
                meta = txn.get(BlockKey(namespace.partition + key))
                if (
                    meta is None
                    or not meta.is_alive(now)
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

    def encoded_namespace(self, scope: BlockKey) -> bytes | None:
        """The encoded namespace stored for a scope (partition + root), if any."""
        with self._read() as txn:
            return txn.get_namespace(scope)

    @staticmethod
    def _verified(
        txn: BlockTxn, namespace: NamespaceId, links: Sequence[ChainLink], now: float
    ) -> list[BlockMeta]:
        """The stored, alive, verified blocks of `links`; NotStored naming the first
        that is not."""
        found = []
        part, root = namespace.partition, namespace.root
        for link in links:
            key = BlockKey(part + link.key)
            status = txn.check(key, root + link.parent, link.tokens, link.depth, now)
            meta = txn.get(key) if status == HIT else None
            if meta is None:
                raise NotStored(
                    f"block {link.depth} of the prefix is not stored: store the prefix first",
                    block=link.depth,
                )
            found.append(meta)
        return found

    # -- purge --------------------------------------------------------------------------------

    def purge(
        self,
        partition: bytes,
        *,
        root: BlockKey | None = None,
        under: BlockKey | None = None,
        now: float,
    ) -> PurgeResult:
        """Delete every block of a tenant, of one of its namespaces (`root`), or every block
        under the block `under` (its own key, with its partition) and itself. Runs in short
        transactions, deepest blocks first; durable once it returns."""
        with self._read() as txn:
            targets = self._purge_targets(txn, partition, root, under)
        blocks = payload_bytes = 0
        dropped: set[BlockKey] = set()
        targets.sort(key=lambda meta: -meta.depth)  # children before parents
        for start in range(0, len(targets), PURGE_BATCH_BLOCKS):
            with self._write() as txn:
                for target in targets[start : start + PURGE_BATCH_BLOCKS]:
                    meta = txn.get(target.key)
                    if meta is None or meta.children:  # gone, or given a child since the scan
                        continue
                    self._drop(txn, meta, reason="purged", at=now)
                    dropped.add(meta.key)
                    blocks += 1
                    payload_bytes += meta.payload_size
        with self._write() as txn:
            pins = 0
            for record in self._pins(txn, partition):
                if (root is None or record.scope.endswith(root)) and (
                    partition + record.key in dropped
                ):
                    txn.aux_delete(PINS, record.scope + record.key)
                    pins += 1
        return PurgeResult(blocks=blocks, payload_bytes=payload_bytes, pins=pins)

    @staticmethod
    def _purge_targets(
        txn: BlockTxn, partition: bytes, root: BlockKey | None, under: BlockKey | None
    ) -> list[BlockMeta]:
        found: list[BlockMeta] = []
        after: bytes | None = None
        while batch := txn.scan_blocks(partition, after, SCAN_BATCH_BLOCKS):
            found += [m for m in batch if root is None or m.namespace_root == root]
            after = batch[-1].key
        if under is None:
            return found
        children: dict[bytes, list[BlockMeta]] = {}
        for meta in found:
            if meta.depth:
                children.setdefault(meta.parent_key, []).append(meta)
        start = next((meta for meta in found if meta.key == under), None)
        subtree = [start] if start is not None else []
        for meta in subtree:  # grows as it goes: a breadth-first walk
            subtree += children.get(meta.key, [])
        return subtree

    # -- explanations -------------------------------------------------------------------------

    def inspect(self, namespace: NamespaceId, link: ChainLink, *, now: float) -> BlockState:
        """Why one block of a chain (whose parent matched) does not match."""
        key = BlockKey(namespace.partition + link.key)
        with self._read() as txn:
            status = txn.check(key, namespace.root + link.parent, link.tokens, link.depth, now)
            held = txn.get_namespace(namespace.scope)
            if status == COLLISION or (held is not None and held != namespace.encoded):
                return BlockState("collision")  # the block's, or the namespace root's
            if status == HIT:
                return BlockState("stored")  # stored since the lookup
            meta = txn.get(key)
            if meta is not None and not meta.is_alive(now):
                return BlockState("expired", expires_at=meta.expires_at, retention=meta.retention)
            return BlockState("absent", removal=recall_removal(txn, key))

    def first_block_homes(
        self, partition: bytes, token_bytes: bytes
    ) -> list[tuple[BlockKey, int, bytes | None]]:
        """Where first blocks starting like `token_bytes` are stored in this partition:
        (namespace root, block size, encoded namespace)."""
        prefix = hint_prefix(partition, token_bytes)
        with self._read() as txn:
            homes = []
            for key, _ in txn.aux_scan(FIRSTS, prefix, 64):
                if len(key) != len(prefix) + KEY_BYTES + 4:
                    continue
                root, block_size = parse_hint(key, prefix)
                homes.append((root, block_size, txn.get_namespace(BlockKey(partition + root))))
            return homes


def _count(txn: BlockTxn, key: BlockKey) -> int:
    raw = txn.aux_get(PIN_COUNTS, key)
    return int(_COUNT.unpack(raw)[0]) if raw is not None else 0


def _pin_record(pin_key: bytes, value: bytes, partition: bytes) -> PinRecord:
    fields = orjson.loads(value)
    scope = BlockKey(pin_key[: len(partition) + KEY_BYTES])
    key = BlockKey(pin_key[len(partition) + KEY_BYTES :])
    return PinRecord(scope, key, int(fields["blocks"]), float(fields["pinned_at"]), fields["by"])
