"""Metrics of a remote store (Redis): what the backend failed.

A lookup Redis fails is answered as a miss and a write is tried again before it is refused:
neither shows as a 5xx, so these counters are where an outage or a failover shows. The store
keeps plain counts (the core knows no metrics library); each worker process copies what they
grew by into real Counters once a second, so that with --workers a scrape adds up every
worker's (PROMETHEUS_MULTIPROC_DIR), as the other counters do.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter

_SERIES = (
    ("lookup_errors", "prompt_cache_backend_lookup_errors",
     "Lookups and payload reads the backend failed, answered as misses."),
    ("write_retries", "prompt_cache_backend_write_retries",
     "Writes tried again after the backend failed them."),
    ("write_failures", "prompt_cache_backend_write_failures",
     "Writes refused (503) after their retries failed."),
    ("touch_errors", "prompt_cache_backend_touch_errors",
     "Hits whose expiry the backend could not slide (forgotten: the blocks expire sooner)."),
    ("breaker_opened", "prompt_cache_backend_breaker_opened",
     "Times the write circuit breaker opened (writes refused at once for a while)."),
)  # fmt: skip
SYNC_SECONDS = 1.0


class BackendCounters:
    """Counters following a store's `health_counts()`."""

    def __init__(
        self, health_counts: Callable[[], dict[str, int]], registry: CollectorRegistry
    ) -> None:
        self._health_counts = health_counts
        self._seen: dict[str, int] = {}
        self._counters = {
            field: Counter(name, documentation, registry=registry)
            for field, name, documentation in _SERIES
        }

    def sync(self) -> None:
        """Add what each count grew by since the last sync."""
        counts = self._health_counts()
        for field, counter in self._counters.items():
            now = counts.get(field, 0)
            grown = now - self._seen.get(field, 0)
            if grown > 0:
                counter.inc(grown)
            self._seen[field] = now
