"""Operator controls on the Redis store: what it can do (purge a tenant or a namespace with
a SCAN on every primary, inspect one block, keep the namespace records) and what it refuses
(pins, purge under one block), with `NotSupportedByStore`, never silently."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cache_service.core.blocks import (
    KEY_BYTES,
    BlockKey,
    BlockState,
    ChainLink,
    NamespaceId,
    PinLimits,
    PinRecord,
    PurgeResult,
    StoreKey,
    store_key,
)
from cache_service.core.errors import NotSupportedByStore
from cache_service.core.store.codec import COLLISION, DAMAGED, HIT, ROOT_AT, check_record
from cache_service.core.store.redis_values import (
    BLOCK_PREFIX,
    LENGTH,
    block_key,
    glob_escape,
    namespace_key,
    record_of,
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

    def _primaries(self) -> list[Any]:
        raise NotImplementedError

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
        """Refused: the Redis store keeps no pins yet."""
        raise NotSupportedByStore("pins are not kept by the Redis store (yet): nothing was pinned")

    def unpin(
        self,
        namespace: NamespaceId,
        deepest: BlockKey,
        *,
        now: float,
        ttl_seconds: float,
        rank: int = 0,
    ) -> int:
        """Refused: the Redis store keeps no pins yet."""
        raise NotSupportedByStore("pins are not kept by the Redis store (yet): nothing to unpin")

    def pins(self, partition: bytes) -> list[PinRecord]:
        """None: the Redis store keeps no pins."""
        return []

    def links_of(
        self, namespace: NamespaceId, keys: Sequence[BlockKey], *, now: float
    ) -> list[ChainLink]:
        """Refused (it serves pins, which the Redis store does not keep)."""
        raise NotSupportedByStore("the Redis store keeps no pins (yet)")

    def encoded_namespace(self, scope: StoreKey) -> bytes | None:
        """The encoded namespace stored for a scope, if any."""
        value = self.client.get(namespace_key(scope))
        return None if value is None else bytes(value)

    def replace_namespace(self, scope: StoreKey, held: bytes, encoded: bytes) -> bool:
        """Replace a scope's namespace if it still is `held` (one script on its node)."""
        script = self.client.register_script(_REPLACE_NAMESPACE)
        return bool(script(keys=[namespace_key(scope)], args=[held, encoded]))

    def purge(
        self,
        partition: bytes,
        *,
        root: BlockKey | None = None,
        under: StoreKey | None = None,
        now: float,
        ttl_seconds: float = 0.0,
    ) -> PurgeResult:
        """Delete a tenant's blocks, or a namespace's: SCAN on every primary, in batches."""
        if under is not None:
            raise NotSupportedByStore(
                "purging under one block is not supported by the Redis store (yet): purge the "
                "namespace or the tenant"
            )
        pattern = BLOCK_PREFIX + glob_escape(partition) + b"*"
        length = len(BLOCK_PREFIX) + len(partition) + KEY_BYTES
        blocks = payload_bytes = 0
        for node in self._primaries():
            cursor = 0
            while True:
                cursor, found = node.scan(cursor, match=pattern, count=SCAN_BATCH)
                mine = [key for key in found if len(key) == length]  # not a longer partition
                if root is not None and mine:
                    pipe = node.pipeline(transaction=False)
                    for key in mine:
                        pipe.getrange(key, LENGTH.size + ROOT_AT, LENGTH.size + ROOT_AT + 15)
                    roots = pipe.execute(raise_on_error=False)
                    mine = [key for key, held in zip(mine, roots, strict=True) if held == root]
                if mine:
                    pipe = node.pipeline(transaction=False)
                    for key in mine:
                        pipe.strlen(key)
                        pipe.unlink(key)
                    answers = pipe.execute(raise_on_error=False)
                    removed = [
                        size
                        for size, gone in zip(answers[::2], answers[1::2], strict=True)
                        if gone == 1
                    ]
                    blocks += len(removed)
                    payload_bytes += sum(int(size) for size in removed)
                if cursor == 0:
                    break
        return PurgeResult(blocks=blocks, payload_bytes=payload_bytes, pins=0)

    def inspect(self, namespace: NamespaceId, link: ChainLink, *, now: float) -> BlockState:
        """Why one block does not match: absent, a collision, damaged, or stored."""
        skey = store_key(namespace.partition, link.key)
        record, _ = record_of(self.client, skey, self.client.get(block_key(skey)), whole=True)
        verdict = check_record(
            record,
            root_and_parent=namespace.root + link.parent,
            tokens=link.tokens,
            depth=link.depth,
            now=now,
        )
        status = {HIT: "stored", COLLISION: "collision", DAMAGED: "corrupt"}.get(verdict, "absent")
        return BlockState(status=status)

    def first_block_homes(
        self, partition: bytes, token_bytes: bytes
    ) -> list[tuple[BlockKey, int, bytes | None]]:
        """None known: the Redis store keeps no first-block hints."""
        return []
