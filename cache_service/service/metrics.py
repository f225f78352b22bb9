"""Prometheus metrics on a registry passed in, fed by cache events and a scrape-time collector.

Names share the `prompt_cache_` prefix and use base units; no label takes unbounded values
(no keys): labels are the configured retention classes, eviction reasons, lookup outcomes,
route templates, and the tenants of the key file (a bounded set, the one place a tenant is a
label; a tenant outside it is never counted by name).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, multiprocess
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cache_service.core.blocks import REMOVAL_REASONS, Evicted, StoreUsage
from cache_service.core.cache_observer import CacheObserver
from cache_service.core.disk import DiskRoom

# Purges are not evictions: an operator's purge answers with what it removed.
EVICTION_REASONS = tuple(reason for reason in REMOVAL_REASONS if reason != "purged")
LATENCY_BUCKETS = (
    0.0002, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


class CacheMetrics(CacheObserver):
    """The service's metrics, counted from the cache's events."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        # With several worker processes (PROMETHEUS_MULTIPROC_DIR set), every process counts
        # into files of one folder and a scrape adds them up; otherwise the registry is read.
        self.multiprocess_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        self.scrape_registry = registry
        if self.multiprocess_dir:
            self.scrape_registry = CollectorRegistry()
            SettledFilesCollector(self.scrape_registry)  # type: ignore[no-untyped-call]
        self.hit_tokens = Counter(
            "prompt_cache_hit_tokens",
            "Prompt tokens served from the cache, by the lookup's retention class.",
            ["retention"],
            registry=registry,
        )
        self.miss_tokens = Counter(
            "prompt_cache_miss_tokens",
            "Prompt tokens not found in the cache, by the lookup's retention class.",
            ["retention"],
            registry=registry,
        )
        self.lookups = Counter(
            "prompt_cache_lookups",
            "Lookups, by outcome: full (every full block hit), partial, or miss.",
            ["outcome"],
            registry=registry,
        )
        self.stored_blocks = Counter(
            "prompt_cache_stored_blocks", "Blocks newly stored.", registry=registry
        )
        self.refreshed_blocks = Counter(
            "prompt_cache_refreshed_blocks",
            "Blocks sent for storing that were already stored (refreshed).",
            registry=registry,
        )
        self.payload_conflicts = Counter(
            "prompt_cache_payload_conflicts",
            "Blocks stored again with different payload bytes; the first writer was kept.",
            registry=registry,
        )
        self.collisions = Counter(
            "prompt_cache_hash_collisions",
            "Stored blocks whose key matched a request but whose parent or tokens did not.",
            registry=registry,
        )
        self.corrupt_payloads = Counter(
            "prompt_cache_corrupt_payloads",
            "Payloads that failed their checksum and were treated as misses.",
            registry=registry,
        )
        self.corrupt_records = Counter(
            "prompt_cache_corrupt_records",
            "Block records (metadata) that failed their checksum or their decoding and were "
            "treated as misses; the block is dropped with its subtree.",
            registry=registry,
        )
        self.evicted_blocks = Counter(
            "prompt_cache_evicted_blocks",
            "Blocks removed, by reason: expired, capacity, tenant_quota (a tenant over "
            "its quota evicting its own), removed (on request, with the blocks under it), or "
            "corrupt (its record or payload failed verification, with the blocks under it).",
            ["reason"],
            registry=registry,
        )
        self.evicted_before_ttl = Counter(
            "prompt_cache_evicted_before_ttl",
            "Blocks evicted for capacity while their TTL had not yet run out.",
            ["retention"],
            registry=registry,
        )
        self.request_duration = Histogram(
            "prompt_cache_request_duration_seconds",
            "HTTP request latency by route template.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.requests = Counter(
            "prompt_cache_requests",
            "HTTP requests answered, by route template and status code.",
            ["route", "code"],
            registry=registry,
        )
        self.tenant_hit_tokens = Counter(
            "prompt_cache_tenant_hit_tokens",
            "Prompt tokens served from the cache, by tenant (tenants of the key file only).",
            ["tenant"],
            registry=registry,
        )
        self.tenant_miss_tokens = Counter(
            "prompt_cache_tenant_miss_tokens",
            "Prompt tokens not found in the cache, by tenant (tenants of the key file only).",
            ["tenant"],
            registry=registry,
        )
        self._by_tenant: dict[str, tuple[Any, Any]] = {}
        for reason in EVICTION_REASONS:
            self.evicted_blocks.labels(reason=reason)
        self._outcomes = {o: self.lookups.labels(outcome=o) for o in ("full", "partial", "miss")}
        self._by_class: dict[str, tuple[Any, Any]] = {}

    def declare_retention(self, classes: Sequence[str]) -> None:
        """Create the labelled series of every configured class, so dashboards see zeros."""
        for name in classes:
            self.hit_tokens.labels(retention=name)
            self.miss_tokens.labels(retention=name)
            self.evicted_before_ttl.labels(retention=name)

    def declare_tenants(self, tenants: Sequence[str]) -> None:
        """The tenants counted by name (those of the key file), their series at zero."""
        for tenant in tenants:
            self._by_tenant[tenant] = (
                self.tenant_hit_tokens.labels(tenant=tenant),
                self.tenant_miss_tokens.labels(tenant=tenant),
            )

    def on_lookup(
        self,
        *,
        retention: str,
        hit_tokens: int,
        miss_tokens: int,
        complete: bool,
        tenant: str = "",
    ) -> None:
        """Count a lookup's tokens and its outcome."""
        hits, misses = self._by_class.get(retention) or self._children(retention)
        hits.inc(hit_tokens)
        misses.inc(miss_tokens)
        by_tenant = self._by_tenant.get(tenant)
        if by_tenant is not None:
            by_tenant[0].inc(hit_tokens)
            by_tenant[1].inc(miss_tokens)
        outcome = "miss" if hit_tokens == 0 else "full" if complete else "partial"
        self._outcomes[outcome].inc()

    def _children(self, retention: str) -> tuple[Any, Any]:
        """The labelled counters of a class, looked up once (labels() is a dict walk)."""
        pair = (
            self.hit_tokens.labels(retention=retention),
            self.miss_tokens.labels(retention=retention),
        )
        self._by_class[retention] = pair
        return pair

    def on_insert(self, *, stored: int, refreshed: int, conflicts: int) -> None:
        """Count stored, refreshed and conflicting blocks."""
        self.stored_blocks.inc(stored)
        self.refreshed_blocks.inc(refreshed)
        self.payload_conflicts.inc(conflicts)

    def on_collision(self, count: int) -> None:
        """Count rejected hash collisions."""
        self.collisions.inc(count)

    def on_corrupt(self, count: int) -> None:
        """Count payloads that failed their checksum."""
        self.corrupt_payloads.inc(count)

    def on_corrupt_records(self, count: int) -> None:
        """Count block records that failed verification."""
        self.corrupt_records.inc(count)

    def on_evicted(self, evicted: Sequence[Evicted], *, now: float) -> None:
        """Count evictions by reason, and capacity evictions that came before the TTL."""
        for block in evicted:
            self.evicted_blocks.labels(reason=block.reason).inc()
            # Capacity only: a tenant over its quota evicting its own blocks is its choice
            # (reason tenant_quota above), not a store too small for the promised TTLs.
            if block.reason == "capacity" and now < block.expires_at:
                self.evicted_before_ttl.labels(retention=block.retention).inc()

    @property
    def tenants(self) -> list[str]:
        """The tenants counted by name."""
        return sorted(self._by_tenant)

    def tenant_token_totals(self, tenant: str) -> tuple[int, int]:
        """Hit and miss tokens counted so far for a tenant (all worker processes)."""
        return self._totals("prompt_cache_tenant", {"tenant": tenant})

    def _totals(self, prefix: str, labels: dict[str, str]) -> tuple[int, int]:
        hits = self.scrape_registry.get_sample_value(f"{prefix}_hit_tokens_total", labels)
        misses = self.scrape_registry.get_sample_value(f"{prefix}_miss_tokens_total", labels)
        return int(hits or 0), int(misses or 0)

    def token_totals(self, retention: str) -> tuple[int, int]:
        """Hit and miss tokens counted so far for a class (all worker processes)."""
        return self._totals("prompt_cache", {"retention": retention})

    def close(self) -> None:
        """Tell the multiprocess files this process is gone (its counts stay in the sums)."""
        if self.multiprocess_dir:
            multiprocess.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]


class SettledFilesCollector(multiprocess.MultiProcessCollector):
    """The multiprocess sums, without the files a worker has just created: prometheus_client
    creates a worker's file empty and sizes it a moment later, and a scrape that reads it in
    between fails (struct.error: a 500 on /metrics or /v1/stats while a worker starts)."""

    def collect(self) -> Iterator[Metric]:
        """Merge every worker's file that has its header."""
        folder = self._path
        files = [path for path in glob.glob(os.path.join(folder, "*.db")) if _has_header(path)]
        return self.merge(files, accumulate=True)  # type: ignore[no-untyped-call,no-any-return]


def _has_header(path: str) -> bool:
    try:
        return os.path.getsize(path) >= 8  # the used-bytes header; a file only grows
    except FileNotFoundError:  # a live gauge's file removed by mark_process_dead
        return False


class StoreCollector(Collector):
    """Store gauges computed at scrape time from the store itself, and from its disk."""

    def __init__(
        self,
        usage: Callable[[], StoreUsage],
        capacity_bytes: int | None,
        disk: Callable[[], DiskRoom | None] | None = None,
    ) -> None:
        self._usage = usage
        self._capacity_bytes = capacity_bytes
        self._disk = disk  # the room on the store's disk (None: not on a disk, or not shown)

    def collect(self) -> Iterator[Metric]:
        """Read the store's usage now."""
        usage = self._usage()
        yield GaugeMetricFamily("prompt_cache_blocks", "Blocks stored.", value=usage.blocks)
        yield GaugeMetricFamily(
            "prompt_cache_bytes",
            "Bytes the store really uses (LMDB: live pages times page size).",
            value=usage.used_bytes,
        )
        yield GaugeMetricFamily(
            "prompt_cache_payload_bytes", "KV payload bytes stored.", value=usage.payload_bytes
        )
        if self._capacity_bytes is not None:
            yield GaugeMetricFamily(
                "prompt_cache_capacity_bytes", "Configured capacity.", value=self._capacity_bytes
            )
        room = self._disk() if self._disk is not None else None
        if room is not None:
            yield from disk_gauges(room)


def disk_gauges(room: DiskRoom) -> Iterator[Metric]:
    """The disk under the store: its free room, the data file, the capacity it cannot back."""
    yield GaugeMetricFamily(
        "prompt_cache_disk_free_bytes",
        "Bytes the file system holding the store can still give it (beyond its data file).",
        value=room.free_bytes,
    )
    yield GaugeMetricFamily(
        "prompt_cache_disk_file_bytes",
        "Bytes the store's data file takes on disk (live pages and LMDB's free pages).",
        value=room.file_bytes,
    )
    yield GaugeMetricFamily(
        "prompt_cache_disk_shortfall_bytes",
        "Capacity the disk cannot back: the capacity minus the data file and the free "
        "bytes; above 0, the store stops growing at the disk's size (it evicts there).",
        value=room.shortfall_bytes,
    )
