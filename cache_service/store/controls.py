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
from typing import NamedTuple

import orjson

from cache_service.blocks import (
    KEY_BYTES,
    BlockKey,
    BlockMeta,
    BlockState,
    ChainLink,
    NamespaceId,
    PinLimits,
    PinRecord,
    PurgeResult,
)
from cache_service.errors import Forbidden, NotStored, QuotaExceeded
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
        pin_key = namespace.scope + links[-1].key
        with self._write() as txn:
            held = txn.aux_get(PINS, pin_key)
            if held is not None:
                record = _pin_record(pin_key, held, part)
                if rank > record.rank:  # a higher role takes the pin over: only it may release
                    fields = {**orjson.loads(held), "by": by, "rank": rank}
                    txn.aux_put(PINS, pin_key, orjson.dumps(fields))
                    record = _pin_record(pin_key, orjson.dumps(fields), part)
                return record, False
            own = self._pins(txn, part) if limits is not None else []
            if limits is not None and limits.blocks is not None:
                _check_blocks(own, len(links), limits.blocks)
            metas = self._verified(txn, namespace, links, now)
            size = sum(self.estimate_bytes(m.payload_size, len(m.tokens)) for m in metas)
            if limits is not None:
                _check_bytes(own, size, limits.tenant_bytes, "tenant")
                if limits.total_bytes is not None:
                    every = self._pins(txn, b"", every=True)
                    _check_bytes(every, size, limits.total_bytes, "all")
            for meta in metas:
                count = _count(txn, meta.key)
                txn.aux_put(PIN_COUNTS, meta.key, _COUNT.pack(count + 1))
                if count == 0:
                    before = self._indexed(meta)
                    meta.expires_at = math.inf
                    self._save(txn, meta, before)
            value = orjson.dumps(
                {"blocks": len(links), "bytes": size, "pinned_at": now, "by": by, "rank": rank}
            )
            txn.aux_put(PINS, pin_key, value)
        return _pin_record(pin_key, value, part), True

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
        pin_key = namespace.scope + deepest
        with self._write() as txn:
            value = txn.aux_get(PINS, pin_key)
            if value is None:
                return 0
            record = _pin_record(pin_key, value, part)
            if record.rank > rank:
                raise Forbidden(
                    f"this prefix was pinned by {record.by!r}, whose role is above this key's"
                )
            self._release(txn, BlockKey(part + deepest), record.blocks, now, ttl_seconds)
            txn.aux_delete(PINS, pin_key)
        return record.blocks

    def _release(
        self, txn: BlockTxn, key: BlockKey, count: int, now: float, ttl_seconds: float
    ) -> None:
        """Take one pin off `count` blocks from `key` up the chain; a block no pin holds any
        more expires `ttl_seconds` from now, and its expiry-index entry (moved to never while
        it was pinned) comes back to that time."""
        at: BlockKey | None = key
        for _ in range(count):  # deepest first, up the chain
            meta = txn.get(at) if at is not None else None
            if meta is None:
                return
            held = _count(txn, meta.key)
            if held <= 1:
                txn.aux_delete(PIN_COUNTS, meta.key)
                before = self._indexed(meta)
                meta.expires_at = now + ttl_seconds
                self._save(txn, meta, before)
                if meta.indexed_expiry > meta.expires_at:
                    self._refile_expiry(txn, meta)
            else:
                txn.aux_put(PIN_COUNTS, meta.key, _COUNT.pack(held - 1))
            at = meta.parent_key if meta.depth else None

    def pins(self, partition: bytes) -> list[PinRecord]:
        """Every pin of a tenant (by its partition)."""
        with self._read() as txn:
            return self._pins(txn, partition)

    @staticmethod
    def _pins(txn: BlockTxn, partition: bytes, *, every: bool = False) -> list[PinRecord]:
        """A tenant's pins (a pin key: partition, root, deepest key); with `every`, all."""
        size = len(partition) + 2 * KEY_BYTES
        return [
            _pin_record(key, value, key[: len(key) - 2 * KEY_BYTES] if every else partition)
            for key, value in txn.aux_scan(PINS, partition, 1 << 30)
            if every or len(key) == size
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
        ttl_seconds: float = 0.0,
    ) -> PurgeResult:
        """Delete every block of a tenant, of one of its namespaces (`root`), or every block
        under the block `under` (its own key, with its partition) and itself. Runs in short
        transactions, deepest blocks first; durable once it returns. A pin whose blocks
        went lets go of the blocks that stay (above `under`), which then expire
        `ttl_seconds` from now unless another pin holds them."""
        targets = self._purge_targets(partition, root, under)
        blocks = payload_bytes = pins = 0
        targets.sort(key=lambda target: -target.depth)  # children before parents
        for start in range(0, len(targets), PURGE_BATCH_BLOCKS):
            with self._write() as txn:
                for target in targets[start : start + PURGE_BATCH_BLOCKS]:
                    meta = txn.get(target.key)
                    if meta is None or meta.children:  # gone, or given a child since the scan
                        continue
                    # A pin ending at this block goes with it, in the same transaction, and
                    # lets go of the blocks above (which may be purged next, or stay).
                    pin_key = partition + meta.namespace_root + meta.key[len(partition) :]
                    value = txn.aux_get(PINS, pin_key)
                    if value is not None:
                        txn.aux_delete(PINS, pin_key)
                        held = _pin_record(pin_key, value, partition).blocks
                        if meta.depth and held > 1:
                            self._release(txn, meta.parent_key, held - 1, now, ttl_seconds)
                        pins += 1
                    self._drop(txn, meta, reason="purged", at=now)
                    blocks += 1
                    payload_bytes += meta.payload_size
        return PurgeResult(blocks=blocks, payload_bytes=payload_bytes, pins=pins)

    def _purge_targets(
        self, partition: bytes, root: BlockKey | None, under: BlockKey | None
    ) -> list[_Target]:
        """The blocks a purge deletes, read in batches (each its own short read)."""
        found: list[_Target] = []
        after: bytes | None = None
        while True:
            with self._read() as txn:
                batch = txn.scan_blocks(partition, after, SCAN_BATCH_BLOCKS)
            if not batch:
                break
            found += [
                _Target(meta.key, meta.depth, meta.parent_key)
                for meta in batch
                if root is None or meta.namespace_root == root
            ]
            after = batch[-1].key
        if under is None:
            return found
        children: dict[bytes, list[_Target]] = {}
        for target in found:
            if target.depth:
                children.setdefault(target.parent_key, []).append(target)
        start = next((target for target in found if target.key == under), None)
        subtree = [start] if start is not None else []
        for target in subtree:  # grows as it goes: a breadth-first walk
            subtree += children.get(target.key, [])
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


def _check_blocks(pins: list[PinRecord], adding: int, limit: int) -> None:
    pinned = sum(record.blocks for record in pins)
    if pinned + adding > limit:
        raise QuotaExceeded(
            f"the tenant's pins hold {pinned} blocks; {adding} more would pass its pin quota "
            f"of {limit} blocks (pin_quota_blocks)",
            limit="pin_quota_blocks",
            limit_blocks=limit,
        )


def _check_bytes(pins: list[PinRecord], adding: int, limit: int | None, whose: str) -> None:
    if limit is None:
        return
    pinned = sum(record.bytes for record in pins)
    if pinned + adding <= limit:
        return
    if whose == "tenant":
        raise QuotaExceeded(
            f"the tenant's pins hold {pinned} bytes; {adding} more would pass the {limit} "
            "bytes they may take (pinned_share of its capacity quota, or its share of the "
            "cache's)",
            limit="pinned_share",
            limit_bytes=limit,
        )
    # Other tenants' pins are theirs: say only that the cache's pinned share is full.
    raise QuotaExceeded(
        "the share of the cache that pins may take is full (pinned_share); retry after "
        "pins are released",
        limit="pinned_share",
    )


class _Target(NamedTuple):
    """A block a purge will delete."""

    key: BlockKey
    depth: int
    parent_key: BlockKey


def _count(txn: BlockTxn, key: BlockKey) -> int:
    raw = txn.aux_get(PIN_COUNTS, key)
    return int(_COUNT.unpack(raw)[0]) if raw is not None else 0


def _pin_record(pin_key: bytes, value: bytes, partition: bytes) -> PinRecord:
    fields = orjson.loads(value)
    scope = BlockKey(pin_key[: len(partition) + KEY_BYTES])
    key = BlockKey(pin_key[len(partition) + KEY_BYTES :])
    return PinRecord(
        scope,
        key,
        int(fields["blocks"]),
        float(fields["pinned_at"]),
        fields["by"],
        int(fields.get("bytes", 0)),
        int(fields.get("rank", 0)),
    )
