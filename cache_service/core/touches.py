"""TouchBuffer: the verified hits lookups record, applied to the store at once or deferred.

A server defers them: lookups only append, and a background job writes them in one
transaction, coalesced, so a hot prompt costs one write per flush however often it is hit.
A replay applies each at once, so its LRU order and TTLs are exact.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

from cache_service.core.blocks import BlockKey, Touch
from cache_service.core.store.protocols import BlockStore

MAX_PENDING_TOUCHES = 100_000  # lookups whose refresh waits; past this the oldest are dropped


@dataclass(frozen=True, slots=True)
class TouchOptions:
    """How a cache's hits reach its store."""

    defer: bool = False  # kept for a `flush` (a server), or applied at once, exactly (a replay)
    # Deferred touches refresh a block at most once this long: LRU order and sliding TTLs
    # are exact to that resolution.
    resolution_seconds: float = 1.0
    # Deferred touches slide a prefix's TTL only once it would move by more than this share
    # of the class TTL: a long prefix is then rewritten once per slide period, not on every
    # first hit. Its expiry may thereby fall short by up to that share.
    slide_fraction: float = 0.0


class TouchBuffer:
    """Touches on their way to one store: applied now, or kept for the next `flush`."""

    def __init__(self, store: BlockStore, options: TouchOptions | None = None) -> None:
        options = options or TouchOptions()
        self.store = store
        self.options = options
        self._pending: list[Touch] = []
        self._lock = threading.Lock()

    def add(self, hit: Touch) -> None:
        """Apply a touch now, or keep it for the next flush (within a bound)."""
        if not self.options.defer:
            self.store.touch([hit])
            return
        with self._lock:
            self._pending.append(hit)
            if len(self._pending) > MAX_PENDING_TOUCHES:
                del self._pending[0]

    def flush(self) -> int:
        """Apply deferred touches in one write; returns how many lookups were applied."""
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return 0
        try:
            self.store.touch(
                coalesce(pending),
                resolution_seconds=self.options.resolution_seconds,
                slide_fraction=self.options.slide_fraction,
            )
        except Exception:
            with self._lock:  # keep them for the next flush, within a bound
                self._pending[:0] = pending[-MAX_PENDING_TOUCHES:]
                del self._pending[MAX_PENDING_TOUCHES:]
            raise
        return len(pending)

    @property
    def pending(self) -> int:
        """Deferred touches waiting for the next flush."""
        return len(self._pending)


def coalesce(touches: list[Touch]) -> list[Touch]:
    """One touch per hit prefix and class, the latest, in order of last use: a hot prompt hit
    a hundred times between flushes is refreshed once (its `uses` keep the count). A prefix
    is known by its deepest key and length: hashing every key of every touch would cost more
    than the merge saves."""
    latest: dict[tuple[bytes, BlockKey, int, str], Touch] = {}
    for touch in touches:
        if not touch.keys:
            continue
        identity = (touch.partition, touch.keys[-1], len(touch.keys), touch.retention)
        earlier = latest.pop(identity, None)
        merged = touch
        if earlier is not None:
            merged = replace(touch, at=max(touch.at, earlier.at), uses=touch.uses + earlier.uses)
        latest[identity] = merged
    return list(latest.values())
