"""CacheObserver: what the cache reports as it works, for metrics and the replay to count.

A module of its own so that the cache, its capacity and the metrics that count their events
all import it, and none of them imports another for it.
"""

from __future__ import annotations

from collections.abc import Sequence

from cache_service.core.blocks import Evicted


class CacheObserver:
    """The observer of a cache: every method does nothing here; metrics and the replay
    override what they count."""

    def on_lookup(
        self,
        *,
        retention: str,
        hit_tokens: int,
        miss_tokens: int,
        complete: bool,
        tenant: str = "",
    ) -> None:
        """A lookup finished; `complete` when every full block of the prompt hit."""

    def on_insert(self, *, stored: int, refreshed: int, conflicts: int) -> None:
        """An insert finished."""

    def on_collision(self, count: int) -> None:
        """Stored blocks whose key matched but namespace, depth, parent or tokens did not."""

    def on_corrupt(self, count: int) -> None:
        """Payloads that failed their checksum and were not served."""

    def on_corrupt_records(self, count: int) -> None:
        """Block records that failed verification (their checksum or their decoding): read
        as misses, never served."""

    def on_evicted(self, evicted: Sequence[Evicted], *, now: float) -> None:
        """Blocks removed for expiry, capacity, a tenant's quota, or on request."""
