"""Capacity: how much a store may hold, fitting writes to it, and evicting down to it."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from cache_service.core.blocks import Evicted, NewBlock, StoreKey, StoreUsage
from cache_service.core.events import CacheEvents
from cache_service.core.hashing import tenant_partition
from cache_service.core.store.base import BlockStore

EVICT_BATCH_BLOCKS = 1024  # blocks per eviction transaction: keeps the write lock short


class Capacity:
    """A byte capacity with high and low water marks, or an exact capacity in blocks; and
    the tenants' byte quotas, each with the same marks."""

    def __init__(
        self,
        store: BlockStore,
        *,
        capacity_bytes: int | None = None,
        capacity_blocks: int | None = None,
        high_water: float = 0.95,
        low_water: float = 0.85,
        tenant_capacity_bytes: Mapping[str, int] | None = None,
        clock: Callable[[], float] = time.time,
        events: CacheEvents | None = None,
    ) -> None:
        if capacity_bytes is not None and capacity_blocks is not None:
            raise ValueError("give capacity_bytes or capacity_blocks, not both")
        if not 0 < low_water <= high_water <= 1:
            raise ValueError("need 0 < low_water <= high_water <= 1")
        self.store = store
        self.space = store.space  # the backend's measure of the space a block takes
        self.capacity_bytes = capacity_bytes
        self.capacity_blocks = capacity_blocks
        self.high_water = high_water
        self.low_water = low_water
        # A tenant over its quota evicts its own least recently used blocks, first.
        self.tenant_capacity_bytes = dict(tenant_capacity_bytes or {})
        self.clock = clock
        self.events = events or CacheEvents()

    def usage(self) -> StoreUsage:
        """What the store holds now."""
        return self.store.usage()

    def tenant_bytes(self, tenant: str) -> int:
        """The estimated bytes a tenant's blocks take now."""
        return self.store.tenant_bytes(tenant_partition(tenant))

    def estimate(self, block: NewBlock) -> int:
        """The space a block would take in the store."""
        return self.space.estimate_bytes(len(block.payload), len(block.link.tokens))

    def fit(self, blocks: Sequence[NewBlock], start_block: int) -> Sequence[NewBlock]:
        """The longest head of `blocks` that the whole cache could hold."""
        if self.capacity_blocks is not None:
            return blocks[: max(self.capacity_blocks - start_block, 0)]
        if self.capacity_bytes is None:
            return blocks
        total = self.space.reserved_bytes()
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

    def enforce(self, protected: set[StoreKey] | None = None) -> list[Evicted]:
        """Evict down to the capacity: to the low-water mark once above the high-water mark."""
        now = self.clock()
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
        protected: frozenset[StoreKey] = frozenset(),
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
        self, tenant: str, *, protected: frozenset[StoreKey] = frozenset()
    ) -> list[Evicted]:
        """Evict a tenant's own blocks down to its quota's low-water mark once it is above
        the quota's high-water mark (never the `protected` blocks just written)."""
        quota_bytes = self.tenant_capacity_bytes.get(tenant)
        if quota_bytes is None:
            return []
        partition = tenant_partition(tenant)
        if self.store.tenant_bytes(partition) <= quota_bytes * self.high_water:
            return []
        now = self.clock()
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

    def sweep_expired(self, *, max_blocks: int = EVICT_BATCH_BLOCKS) -> int:
        """Delete up to `max_blocks` expired blocks, leaf first, in one short transaction."""
        now = self.clock()
        batch = self.store.evict(now=now, max_blocks=max_blocks, expired_only=True)
        if batch:
            self.events.on_evicted(batch, now=now)
        return len(batch)
