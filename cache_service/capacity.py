"""Capacity: how much a store may hold, fitting writes to it, and evicting down to it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from cache_service.blocks import BlockKey, Evicted, NewBlock
from cache_service.store.base import BlockStore

if TYPE_CHECKING:
    from cache_service.cache import CacheEvents

EVICT_BATCH_BLOCKS = 1024  # blocks per eviction transaction: keeps the write lock short


class Capacity:
    """A byte capacity with high and low water marks, or an exact capacity in blocks."""

    def __init__(
        self,
        store: BlockStore,
        *,
        capacity_bytes: int | None,
        capacity_blocks: int | None,
        high_water: float,
        low_water: float,
        events: CacheEvents,
    ) -> None:
        self.store = store
        self.capacity_bytes = capacity_bytes
        self.capacity_blocks = capacity_blocks
        self.high_water = high_water
        self.low_water = low_water
        self.events = events

    def estimate(self, block: NewBlock) -> int:
        """The space a block would take in the store."""
        return self.store.estimate_bytes(len(block.payload), len(block.link.tokens))

    def fit(self, blocks: Sequence[NewBlock], start_block: int) -> Sequence[NewBlock]:
        """The longest head of `blocks` that the whole cache could hold."""
        if self.capacity_blocks is not None:
            return blocks[: max(self.capacity_blocks - start_block, 0)]
        if self.capacity_bytes is None:
            return blocks
        total = self.store.reserved_bytes()
        for count, block in enumerate(blocks):
            total += self.estimate(block)
            if total > self.capacity_bytes:
                return blocks[:count]
        return blocks

    def make_room(self, needed_bytes: int, now: float) -> bool:
        """Evict for a write the backend refused as full; False if nothing could go."""
        usage = self.store.usage()
        target = max(usage.used_bytes - needed_bytes, 0)
        if self.capacity_bytes is not None:
            target = min(target, int(self.capacity_bytes * self.low_water))
        return bool(self._evict_until(now=now, target_used_bytes=target))

    def enforce(self, *, now: float, protected: set[BlockKey] | None = None) -> list[Evicted]:
        """Evict down to the capacity: to the low-water mark once above the high-water mark."""
        if self.capacity_blocks is not None:
            if self.store.usage().blocks <= self.capacity_blocks:
                return []
            return self._evict_until(now=now, target_blocks=self.capacity_blocks)
        if self.capacity_bytes is None:
            return []
        if self.store.usage().used_bytes <= self.capacity_bytes * self.high_water:
            return []
        # Older blocks go first; the blocks just written only if they alone overflow the cache.
        evicted = self._evict_until(
            now=now,
            target_used_bytes=int(self.capacity_bytes * self.low_water),
            protected=frozenset(protected or ()),
        )
        if self.store.usage().used_bytes > self.capacity_bytes:
            evicted += self._evict_until(now=now, target_used_bytes=self.capacity_bytes)
        return evicted

    def _evict_until(
        self,
        *,
        now: float,
        target_used_bytes: int | None = None,
        target_blocks: int | None = None,
        protected: frozenset[BlockKey] = frozenset(),
    ) -> list[Evicted]:
        return self._in_batches(
            lambda: self.store.evict(
                now=now,
                max_blocks=EVICT_BATCH_BLOCKS,
                target_used_bytes=target_used_bytes,
                target_blocks=target_blocks,
                protected=protected,
            ),
            now=now,
        )

    def _in_batches(self, evict: Callable[[], list[Evicted]], *, now: float) -> list[Evicted]:
        """Run `evict` (one short transaction of up to a batch) until a batch falls short."""
        evicted: list[Evicted] = []
        while True:
            batch = evict()
            evicted += batch
            if batch:
                self.events.on_evicted(batch, now=now)
            if len(batch) < EVICT_BATCH_BLOCKS:
                return evicted

    def enforce_tenant(
        self,
        partition: bytes,
        quota_bytes: int,
        *,
        now: float,
        protected: frozenset[BlockKey] = frozenset(),
    ) -> list[Evicted]:
        """Evict a tenant's own blocks down to its quota's low-water mark once it is above
        the quota's high-water mark (never the `protected` blocks just written)."""
        if self.store.tenant_bytes(partition) <= quota_bytes * self.high_water:
            return []
        return self._in_batches(
            lambda: self.store.evict_tenant(
                partition,
                target_bytes=int(quota_bytes * self.low_water),
                now=now,
                max_blocks=EVICT_BATCH_BLOCKS,
                protected=protected,
            ),
            now=now,
        )

    def sweep_expired(self, *, now: float, max_blocks: int = EVICT_BATCH_BLOCKS) -> int:
        """Delete up to `max_blocks` expired blocks, leaf first, in one short transaction."""
        batch = self.store.evict(now=now, max_blocks=max_blocks, expired_only=True)
        if batch:
            self.events.on_evicted(batch, now=now)
        return len(batch)
