"""Capacity: how much a store may hold, fitting writes to it, and evicting down to it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from cache_service.core.blocks import Evicted, NewBlock, StoreKey, StoreUsage
from cache_service.core.cache_observer import CacheObserver
from cache_service.core.disk import DiskRoom, DiskWarning, measure_room
from cache_service.core.errors import DiskFull, StoreFull
from cache_service.core.hashing import tenant_partition
from cache_service.core.reserve import DiskReserve
from cache_service.core.store.parts.batches import in_batches
from cache_service.core.store.protocols import BlockStore

EVICT_BATCH_BLOCKS = 1024  # blocks per eviction transaction: keeps the write lock short
DISK_MEASURE_SECONDS = 1.0  # the disk's room is measured at most this often for writes

log = logging.getLogger("cache_service")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class CapacityLimits:
    """What a cache may hold: a byte capacity with high and low water marks, or an exact
    capacity in blocks (neither: no limit but the store's own); and the tenants' byte
    quotas, each with the same marks (a tenant over its quota evicts its own least recently
    used blocks, first)."""

    capacity_bytes: int | None = None
    capacity_blocks: int | None = None
    high_water: float = 0.95
    low_water: float = 0.85
    tenant_capacity_bytes: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.capacity_bytes is not None and self.capacity_blocks is not None:
            raise ValueError("give capacity_bytes or capacity_blocks, not both")
        if not 0 < self.low_water <= self.high_water <= 1:
            raise ValueError("need 0 < low_water <= high_water <= 1")


class Capacity:
    """A store's capacity (`CapacityLimits`) kept: writes fitted to it, eviction down to it,
    expiry swept."""

    def __init__(
        self,
        store: BlockStore,
        limits: CapacityLimits | None = None,
        *,
        clock: Callable[[], float] = time.time,
        events: CacheObserver | None = None,
    ) -> None:
        limits = limits or CapacityLimits()
        self.store = store
        self.space = store.space  # the backend's measure of the space a block takes
        # A store that evicts on its own (Redis) is never asked to: its declaration says so.
        self.evicts = store.capabilities.has("store_eviction")
        self.limits = limits
        self.capacity_bytes = limits.capacity_bytes
        self.capacity_blocks = limits.capacity_blocks
        self.high_water = limits.high_water
        self.low_water = limits.low_water
        self.tenant_capacity_bytes = dict(limits.tenant_capacity_bytes)
        self.clock = clock
        self.events = events or CacheObserver()
        self.disk_warning = DiskWarning()
        self._folder = store.disk.folder if store.disk is not None else None
        self.reserve = DiskReserve(self._folder) if self._folder is not None else None
        self._room: tuple[float, DiskRoom | None] | None = None

    def usage(self) -> StoreUsage:
        """What the store holds now."""
        return self.store.usage()

    def disk(self) -> DiskRoom | None:
        """The room the store's file system has now (None for a store not on a disk), and a
        rate-limited warning when the disk cannot back the capacity or is full."""
        disk = self.store.disk
        if disk is None:
            return None
        room = measure_room(disk.folder, int(disk.file_bytes()), self.capacity_bytes)
        self._room = (time.monotonic(), room)
        self.disk_warning.check(room)
        if self.reserve is not None and not room.full:
            self.reserve.ensure()  # given up on a full disk: made again once there is room
        return room

    def limit_bytes(self) -> int | None:
        """The bytes the store may use: the capacity, or less where the disk cannot back it
        (what it can, less a margin kept for deletions); None without a byte capacity."""
        if self.capacity_bytes is None:
            return None
        measured = self._room
        if measured is None or time.monotonic() - measured[0] >= DISK_MEASURE_SECONDS:
            room = self.disk()
        else:
            room = measured[1]
        if room is None:
            return self.capacity_bytes
        return min(self.capacity_bytes, room.limit_bytes)

    def on_full_disk(self, write: Callable[[], T]) -> T:
        """Run an operator's deletion (a purge); if the disk is too full for it, give the
        reserve up and run it once more (a deletion needs fresh pages before it frees any).
        Only a purge takes the reserve: it is the way out when eviction is stuck."""
        try:
            return write()
        except DiskFull:
            if not self._release_reserve():
                raise
            return write()

    def _release_reserve(self) -> bool:
        if self.reserve is None or not self.reserve.release():
            return False
        log.warning(
            "the disk under %s is full: gave up its %d-byte reserve so that deletions can run",
            self._folder,
            self.reserve.size_bytes,
        )
        return True

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
        """Evict for a write the backend refused as full; False if nothing could go. When
        the disk is what is full and nothing could go, DiskFull says so (a 507 naming the
        disk, not the store's capacity)."""
        usage = self.store.usage()
        target = max(usage.used_bytes - needed_bytes, 0)
        limit = self.limit_bytes()
        if limit is not None:
            target = min(target, int(limit * self.low_water))
        # Eviction only deletes: LMDB reuses the pages the last commits freed for it.
        if self._evict_until(now=now, target_used_bytes=target):
            return True
        room = self.disk()
        if room is not None and room.full:
            raise DiskFull(
                f"{room.describe()}; nothing in the store can be evicted to make room (pinned "
                "or none left): purge, unpin or free space on the disk"
            )
        return False

    def enforce(self, protected: set[StoreKey] | None = None) -> list[Evicted]:
        """Evict down to the capacity: to the low-water mark once above the high-water mark.
        On a full disk it evicts what it can and leaves the rest for the next time: what
        was just written is stored, and a write that needs room makes its own."""
        return _until_disk_full(lambda: self._enforce(protected))

    def _enforce(self, protected: set[StoreKey] | None) -> list[Evicted]:
        if not self.evicts:
            return []
        now = self.clock()
        if self.capacity_blocks is not None:
            if self.store.usage().blocks <= self.capacity_blocks:
                return []
            # As with bytes: older blocks first (a policy may rank a reused block above the
            # ones just written), the request's own only if they alone overflow the cache.
            evicted = self._evict_until(
                now=now, target_blocks=self.capacity_blocks, protected=frozenset(protected or ())
            )
            if self.store.usage().blocks > self.capacity_blocks:
                evicted += self._evict_until(now=now, target_blocks=self.capacity_blocks)
            return evicted
        limit = self.limit_bytes()  # the capacity, or what the disk can back
        if limit is None:
            return []
        if self.store.usage().used_bytes <= limit * self.high_water:
            return []
        # Older blocks go first; the blocks just written only if they alone overflow the cache.
        evicted = self._evict_until(
            now=now,
            target_used_bytes=int(limit * self.low_water),
            protected=frozenset(protected or ()),
        )
        if self.store.usage().used_bytes > limit:
            evicted += self._evict_until(now=now, target_used_bytes=limit)
        return evicted

    def _evict_until(
        self,
        *,
        now: float,
        target_used_bytes: int | None = None,
        target_blocks: int | None = None,
        protected: frozenset[StoreKey] = frozenset(),
    ) -> list[Evicted]:
        if not self.evicts:
            return []
        return self._in_batches(
            lambda max_blocks: self.store.evict(
                now=now,
                max_blocks=max_blocks,
                target_used_bytes=target_used_bytes,
                target_blocks=target_blocks,
                protected=protected,
            ),
            now=now,
        )

    def _in_batches(self, evict: Callable[[int], list[Evicted]], *, now: float) -> list[Evicted]:
        """Run `evict` (one short transaction of up to `max_blocks`) until a batch falls
        short, smaller on a full disk (see store.parts.batches); the reserve is kept for a purge:
        the operator's way out."""
        evicted: list[Evicted] = []

        def one_batch(max_blocks: int) -> int:
            batch = evict(max_blocks)
            evicted.extend(batch)
            if batch:
                self.events.on_evicted(batch, now=now)
            return len(batch)

        in_batches(one_batch, largest=EVICT_BATCH_BLOCKS)
        return evicted

    def enforce_tenant(
        self, tenant: str, *, protected: frozenset[StoreKey] = frozenset()
    ) -> list[Evicted]:
        """Evict a tenant's own blocks down to its quota's low-water mark once it is above
        the quota's high-water mark (never the `protected` blocks just written); on a full
        disk, as far as it can (as `enforce`)."""
        return _until_disk_full(lambda: self._enforce_tenant(tenant, protected))

    def _enforce_tenant(self, tenant: str, protected: frozenset[StoreKey]) -> list[Evicted]:
        quota_bytes = self.tenant_capacity_bytes.get(tenant)
        if quota_bytes is None or not self.evicts:
            return []
        partition = tenant_partition(tenant)
        if self.store.tenant_bytes(partition) <= quota_bytes * self.high_water:
            return []
        now = self.clock()
        return self._in_batches(
            lambda max_blocks: self.store.evict_tenant(
                partition,
                target_bytes=int(quota_bytes * self.low_water),
                now=now,
                max_blocks=max_blocks,
                protected=protected,
            ),
            now=now,
        )

    def sweep_expired(self, *, max_blocks: int = EVICT_BATCH_BLOCKS) -> int:
        """Delete up to `max_blocks` expired blocks, leaf first, in one short transaction."""
        if not self.evicts:
            return 0
        now = self.clock()
        batch = self.store.evict(now=now, max_blocks=max_blocks, expired_only=True)
        if batch:
            self.events.on_evicted(batch, now=now)
        return len(batch)


def _until_disk_full(evict: Callable[[], list[Evicted]]) -> list[Evicted]:
    """Run an eviction down to a limit; on a full disk, stop (batches already committed
    stay done) and leave the rest for the next write, which makes its own room."""
    try:
        return evict()
    except StoreFull as exc:  # a full disk or map
        log.warning("eviction down to the capacity waits for room: %s", exc)
        return []
