"""Operator controls on the Redis store: pins (pins.py), purge of a tenant, a namespace
or what lies under one block (SCANs on every primary; subtrees from subtrees.py),
removal of a block with its subtree, inspecting one block, the namespace records. A Redis
failure in any of them is a 503 (storage-failure), never a 500."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from cache_service.core.blocks import (
    KEY_BYTES,
    BlockKey,
    BlockState,
    ChainLink,
    Evicted,
    NamespaceId,
    PinLimits,
    PinRecord,
    PurgeResult,
    StoreKey,
    store_key,
)
from cache_service.core.errors import Forbidden, NotStored
from cache_service.core.lifetimes import Lifetimes
from cache_service.core.store.parts import pins
from cache_service.core.store.parts.codec import (
    COLLISION,
    DAMAGED,
    HIT,
    ROOT_AT,
    decode_meta,
    intact,
)
from cache_service.core.store.redis.connect import primaries
from cache_service.core.store.redis.pins import (
    PIN_PREFIX,
    count_key,
    decode_pin,
    encode_pin,
    hold,
    pin_count,
    pin_key,
    pin_pattern,
    release,
)
from cache_service.core.store.redis.subtrees import scan, subtree, tenant_blocks
from cache_service.core.store.redis.values import (
    BLOCK_PREFIX,
    HEADER_BYTES,
    LENGTH,
    RedisSpace,
    block_key,
    header_facts,
    link_verdict,
    namespace_key,
    record_of,
    storage_failures,
)

SCAN_BATCH = 1000

_REPLACE_NAMESPACE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    redis.call('SET', KEYS[1], ARGV[2])
    return 1
end
return 0
"""


class RedisControls:
    """The OperatorControls half of the Redis store (mixed into RedisStore)."""

    client: Any
    clustered: bool
    space: RedisSpace
    lifetimes: Lifetimes

    def _primaries(self) -> list[Any]:
        return primaries(self.client, self.clustered)

    @storage_failures
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
        """Pin the prefix `links` (from block 0; every block stored and verified): its
        blocks lose their expiry until released (see pins.py). Returns the pin and
        whether it is new; a higher `rank` pinning again takes the pin over; QuotaExceeded
        past `limits`."""
        if not links or links[0].depth != 0:
            raise ValueError("a pin holds a prefix from block 0")
        part = namespace.partition
        key = pin_key(namespace.scope, links[-1].key)
        held = self._held_pin(key)
        if held is not None:
            record, keys = held
            if rank > record.rank:  # a higher role takes the pin over: only it may release
                record = replace(record, by=by, rank=rank)
                self.client.set(key, encode_pin(record, keys), xx=True)
            return record, False
        own = self.pins(part) if limits is not None else []
        if limits is not None and limits.blocks is not None:
            pins.check_blocks(own, len(links), limits.blocks)
        size = self._verified_bytes(namespace, links, now)
        if limits is not None:
            pins.check_bytes(own, size, limits.tenant_bytes, "tenant")
            if limits.total_bytes is not None:
                pins.check_bytes(self._every_pin(), size, limits.total_bytes, "all")
        keys = [link.key for link in links]
        record = PinRecord(namespace.scope, links[-1].key, len(links), float(now), by, size, rank)
        # The record is claimed before any count is taken: of two pins of one prefix at
        # once, one counts its blocks and the other is told the pin exists.
        if not self.client.set(key, encode_pin(record, keys), nx=True):
            return self.pin(namespace, links, now=now, by=by, rank=rank, limits=limits)
        gone = hold(self.client, part, keys)
        if gone:
            if self.client.delete(key):
                release(self.client, part, keys, self.lifetimes.longest_ttl_seconds)
            raise NotStored(
                f"block {gone[0]} of the prefix is not stored: store the prefix first",
                block=gone[0],
            )
        return record, True

    def _held_pin(self, key: bytes) -> tuple[PinRecord, list[BlockKey]] | None:
        """The pin stored under `key`; a damaged one is deleted and read as none."""
        value = self.client.get(key)
        if value is None:
            return None
        held = decode_pin(key, bytes(value))
        if held is None:
            self.client.delete(key)
        return held

    @storage_failures
    def unpin(
        self,
        namespace: NamespaceId,
        deepest: BlockKey,
        *,
        now: float,
        ttl_seconds: float,
        rank: int = 0,
    ) -> int:
        """Release the pin whose deepest block is `deepest`: blocks no other pin holds expire
        `ttl_seconds` from now. How many blocks it held (0: no such pin); Forbidden if a
        higher rank pinned it."""
        part = namespace.partition
        key = pin_key(namespace.scope, deepest)
        held = self._held_pin(key)
        if held is None:
            return 0
        record, keys = held
        if record.rank > rank:
            raise Forbidden(
                f"this prefix was pinned by {record.by!r}, whose role is above this key's"
            )
        if self.client.delete(key):  # once, even if two releases race
            release(self.client, part, keys, ttl_seconds)
        return record.blocks

    @storage_failures
    def pins(self, partition: bytes) -> list[PinRecord]:
        """Every pin of a tenant (SCAN on every primary)."""
        pattern, length = pin_pattern(partition)
        return [record for record, _ in self._pins_matching(pattern, length)]

    def _every_pin(self) -> list[PinRecord]:
        return [record for record, _ in self._pins_matching(PIN_PREFIX + b"*", None)]

    def _pins_matching(
        self, pattern: bytes, length: int | None
    ) -> list[tuple[PinRecord, list[BlockKey]]]:
        found = []
        for node in self._primaries():
            for batch in scan(node, pattern):
                mine = [key for key in batch if length is None or len(key) == length]
                values = node.mget(mine) if mine else []
                for key, value in zip(mine, values, strict=True):
                    held = decode_pin(key, bytes(value)) if value is not None else None
                    if held is not None:  # a damaged record is skipped (a purge deletes it)
                        found.append(held)
        return found

    def _verified_bytes(
        self, namespace: NamespaceId, links: Sequence[ChainLink], now: float
    ) -> int:
        """The estimated bytes of a stored, verified prefix; NotStored naming the first block
        that is not."""
        pipe = self.client.pipeline(transaction=False)
        for link in links:
            pipe.get(block_key(store_key(namespace.partition, link.key)))
        size = 0
        for depth, (link, value) in enumerate(
            zip(links, pipe.execute(raise_on_error=True), strict=True)
        ):
            skey = store_key(namespace.partition, link.key)
            record, _ = record_of(self.client, skey, value, whole=True)
            verdict = link_verdict(record, namespace, link, now)
            if verdict != HIT or record is None:
                raise NotStored(
                    f"block {depth} of the prefix is not stored: store the prefix first",
                    block=depth,
                )
            meta = decode_meta(skey, record)
            size += self.space.estimate_bytes(meta.payload_size, len(meta.tokens))
        return size

    @storage_failures
    def links_of(
        self, namespace: NamespaceId, keys: Sequence[BlockKey], *, now: float
    ) -> list[ChainLink]:
        """The chain links of a stored prefix given by its keys (records linked by their
        parents from the root); NotStored naming the first key that is not."""
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.get(block_key(store_key(namespace.partition, key)))
        links: list[ChainLink] = []
        parent = namespace.root
        for depth, (key, value) in enumerate(
            zip(keys, pipe.execute(raise_on_error=True), strict=True)
        ):
            skey = store_key(namespace.partition, key)
            record, _ = record_of(self.client, skey, value, whole=True)
            meta = decode_meta(skey, record) if record and intact(record) else None
            if (
                meta is None
                or meta.namespace_root != namespace.root
                or meta.depth != depth
                or meta.parent != parent
            ):
                raise _not_stored(depth)
            links.append(ChainLink(key, parent, meta.tokens, depth))
            parent = key
        return links

    @storage_failures
    def encoded_namespace(self, scope: StoreKey) -> bytes | None:
        """The encoded namespace stored for a scope, if any."""
        value = self.client.get(namespace_key(scope))
        return None if value is None else bytes(value)

    @storage_failures
    def replace_namespace(self, scope: StoreKey, held: bytes, encoded: bytes) -> bool:
        """Replace a scope's namespace if it still is `held` (one script on its node)."""
        script = self.client.register_script(_REPLACE_NAMESPACE)
        return bool(script(keys=[namespace_key(scope)], args=[held, encoded]))

    @storage_failures
    def purge(
        self,
        partition: bytes,
        *,
        root: BlockKey | None = None,
        under: StoreKey | None = None,
        now: float,
        ttl_seconds: float = 0.0,
    ) -> PurgeResult:
        """Delete a tenant's blocks, a namespace's, or those under one block, with the pins
        that lose blocks (a pin's other blocks expire in `ttl_seconds`): SCANs on every
        primary, in batches; pins first, so none is left holding deleted blocks."""
        if under is not None:
            return self._purge_under(partition, root, under, ttl_seconds)
        pattern, length = pin_pattern(partition)
        dropped = 0
        for record, _keys in self._pins_matching(pattern, length):
            if root is None or record.scope == store_key(partition, root):
                dropped += self.client.delete(pin_key(record.scope, record.key))
        if root is None:  # the whole tenant: damaged pin records go too
            for node in self._primaries():
                for batch in scan(node, pattern):
                    node.unlink(*[key for key in batch if len(key) == length])
        blocks = payload_bytes = 0
        for node in self._primaries():
            for batch in tenant_blocks(node, partition):
                mine = batch
                if root is not None:
                    pipe = node.pipeline(transaction=False)
                    for key in mine:
                        pipe.getrange(key, LENGTH.size + ROOT_AT, LENGTH.size + ROOT_AT + 15)
                    roots = pipe.execute(raise_on_error=False)
                    mine = [key for key, held in zip(mine, roots, strict=True) if held == root]
                gone, size = self._unlink(
                    [StoreKey(key[len(BLOCK_PREFIX) :]) for key in mine], node=node
                )
                blocks += gone
                payload_bytes += size
        return PurgeResult(blocks=blocks, payload_bytes=payload_bytes, pins=dropped)

    def _purge_under(
        self, partition: bytes, root: BlockKey | None, under: StoreKey, ttl_seconds: float
    ) -> PurgeResult:
        top = BlockKey(under[len(partition) :])
        if root is None:
            held = self.client.getrange(
                block_key(under), LENGTH.size + ROOT_AT, LENGTH.size + ROOT_AT + KEY_BYTES - 1
            )
            if len(held) != KEY_BYTES:
                return PurgeResult()
            root = BlockKey(held)
        tree = [key for key, _parent in subtree(self._primaries(), partition, root, top)]
        dropped = self._let_pins_go(partition, set(tree), ttl_seconds)
        gone, size = self._unlink(tree)
        return PurgeResult(blocks=gone, payload_bytes=size, pins=dropped)

    def _let_pins_go(self, partition: bytes, removed: set[StoreKey], ttl_seconds: float) -> int:
        """Drop the tenant's pins that hold any of `removed` (their other blocks expire in
        `ttl_seconds`); how many."""
        dropped = 0
        pattern, length = pin_pattern(partition)
        for record, keys in self._pins_matching(pattern, length):
            held_keys = [store_key(partition, key) for key in keys]
            if removed.isdisjoint(held_keys):
                continue
            if self.client.delete(pin_key(record.scope, record.key)):
                kept = [
                    key for key, held in zip(keys, held_keys, strict=True) if held not in removed
                ]
                release(self.client, partition, kept, ttl_seconds)
                dropped += 1
        return dropped

    @storage_failures
    def remove_subtree(self, namespace: NamespaceId, key: BlockKey, *, now: float) -> list[Evicted]:
        """Remove block `key` and its stored descendants, deepest first (reason "removed");
        pinned blocks and their ancestors stay. A pass over the tenant's keys."""
        part = namespace.partition
        tree = subtree(self._primaries(), part, namespace.root, key)
        if not tree:
            return []
        pipe = self.client.pipeline(transaction=False)
        for skey, _parent in tree:
            pipe.get(count_key(skey))
        counts = pipe.execute(raise_on_error=True)
        parent_of = dict(tree)
        keep: set[StoreKey] = set()
        for (skey, _parent), count in zip(tree, counts, strict=True):
            at: StoreKey | None = skey if count is not None and pin_count(count) > 0 else None
            while at is not None and at in parent_of and at not in keep:
                keep.add(at)  # a pinned block and every ancestor of it in the subtree
                at = store_key(part, parent_of[at])
        return self._remove_keys(
            [skey for skey, _parent in reversed(tree) if skey not in keep], reason="removed"
        )

    def _remove_keys(self, keys: list[StoreKey], *, reason: str) -> list[Evicted]:
        """Delete blocks (and their pin counts), reporting each one that was there."""
        if not keys:
            return []
        pipe = self.client.pipeline(transaction=False)
        for skey in keys:
            pipe.getrange(block_key(skey), 0, HEADER_BYTES - 1)
        headers = pipe.execute(raise_on_error=True)
        self._unlink(keys)
        return [
            Evicted(skey, reason, *header_facts(header))
            for skey, header in zip(keys, headers, strict=True)
            if header
        ]

    def _unlink(self, keys: list[StoreKey], *, node: Any = None) -> tuple[int, int]:
        """Delete blocks and their pin counts; (blocks deleted, their payload bytes). With `node`,
        the blocks are that node's (a SCAN's); their counts go through the cluster client."""
        if not keys:
            return 0, 0
        pipe = (node or self.client).pipeline(transaction=False)
        for key in keys:
            pipe.getrange(block_key(key), 0, HEADER_BYTES - 1)
            pipe.unlink(block_key(key))
        answers = pipe.execute(raise_on_error=False)
        gone = [
            header_facts(head)[2] if isinstance(head, bytes) else 0
            for head, done in zip(answers[::2], answers[1::2], strict=True)
            if done == 1
        ]
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.unlink(count_key(key))
        pipe.execute(raise_on_error=False)
        return len(gone), sum(gone)

    @storage_failures
    def inspect(self, namespace: NamespaceId, link: ChainLink, *, now: float) -> BlockState:
        """Why one block does not match: absent, a collision, damaged, or stored."""
        skey = store_key(namespace.partition, link.key)
        record, _ = record_of(self.client, skey, self.client.get(block_key(skey)), whole=True)
        verdict = link_verdict(record, namespace, link, now)
        status = {HIT: "stored", COLLISION: "collision", DAMAGED: "corrupt"}.get(verdict, "absent")
        return BlockState(status=status)

    def first_block_homes(
        self, partition: bytes, token_bytes: bytes
    ) -> list[tuple[BlockKey, int, bytes | None]]:
        """None known: the Redis store keeps no first-block hints."""
        return []


def _not_stored(depth: int) -> NotStored:
    return NotStored(
        f"keys[{depth}] is not block {depth} of a stored prefix of this namespace", block=depth
    )
