"""CacheMetrics and StoreCollector, read through a fresh registry's samples."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from prometheus_client import CollectorRegistry

from cache_service.core.blocks import Evicted, Namespace, StoreKey
from cache_service.core.cache import PrefixCache
from cache_service.core.capacity import CapacityLimits
from cache_service.core.config import CacheConfig
from cache_service.core.retention import DEFAULT_LIFETIMES
from cache_service.core.store.lmdb.store import LmdbStore
from cache_service.core.store.memory import MemoryStore
from cache_service.core.store.protocols import BlockStore
from cache_service.service.metrics import EVICTION_REASONS, CacheMetrics, StoreCollector

if TYPE_CHECKING:
    from conftest import VirtualClock

NS = Namespace(model="m")
BLOCK = 4
CHAT_TTL = 7 * 86400.0

pytestmark = pytest.mark.store_opened(lifetimes=DEFAULT_LIFETIMES)  # the caches' retention


def blocks_of(*labels: int) -> list[int]:
    """A prompt with one block per label."""
    return [label for label in labels for _ in range(BLOCK)]


def counted(
    store: BlockStore, clock: VirtualClock, **kwargs: object
) -> tuple[PrefixCache, CollectorRegistry]:
    registry = CollectorRegistry()
    metrics = CacheMetrics(registry)
    metrics.declare_retention(["agent", "chat"])
    cache = PrefixCache(
        store,
        config=CacheConfig(default_block_size=BLOCK),
        clock=clock,
        events=metrics,
        **kwargs,  # type: ignore[arg-type]
    )
    return cache, registry


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_every_eviction_reason_and_class_starts_at_zero(
    store: BlockStore, clock: VirtualClock
) -> None:
    _, registry = counted(store, clock)
    for reason in EVICTION_REASONS:
        assert sample(registry, "prompt_cache_evicted_blocks_total", reason=reason) == 0
    for name in ("agent", "chat"):
        assert sample(registry, "prompt_cache_hit_tokens_total", retention=name) == 0
        assert sample(registry, "prompt_cache_evicted_before_ttl_total", retention=name) == 0
    for outcome in ("full", "partial", "miss"):
        assert sample(registry, "prompt_cache_lookups_total", outcome=outcome) == 0


def test_lookups_count_tokens_by_class_and_outcome(store: BlockStore, clock: VirtualClock) -> None:
    cache, registry = counted(store, clock)
    prompt = blocks_of(1, 2, 3)
    cache.match_prefix(NS, prompt)
    cache.insert(NS, prompt[: 2 * BLOCK], [b"a", b"b"])
    cache.match_prefix(NS, prompt)
    cache.match_prefix(NS, prompt[: 2 * BLOCK], retention="agent")

    assert sample(registry, "prompt_cache_lookups_total", outcome="miss") == 1
    assert sample(registry, "prompt_cache_lookups_total", outcome="partial") == 1
    assert sample(registry, "prompt_cache_lookups_total", outcome="full") == 1
    assert sample(registry, "prompt_cache_hit_tokens_total", retention="chat") == 2 * BLOCK
    assert sample(registry, "prompt_cache_miss_tokens_total", retention="chat") == 4 * BLOCK
    assert sample(registry, "prompt_cache_hit_tokens_total", retention="agent") == 2 * BLOCK
    assert sample(registry, "prompt_cache_stored_blocks_total") == 2


def test_refreshed_and_conflicting_blocks_are_counted(
    store: BlockStore, clock: VirtualClock
) -> None:
    cache, registry = counted(store, clock)
    cache.insert(NS, blocks_of(1, 2), [b"a", b"b"])
    cache.insert(NS, blocks_of(1, 2), [b"a", b"other"])
    assert sample(registry, "prompt_cache_stored_blocks_total") == 2
    assert sample(registry, "prompt_cache_refreshed_blocks_total") == 2
    assert sample(registry, "prompt_cache_payload_conflicts_total") == 1


def test_capacity_evictions_before_the_ttl_are_counted(
    store: BlockStore, clock: VirtualClock
) -> None:
    cache, registry = counted(store, clock, limits=CapacityLimits(capacity_blocks=2))
    cache.insert(NS, blocks_of(1, 2), [b"a", b"b"])
    clock.advance(1)
    cache.insert(NS, blocks_of(3, 4), [b"c", b"d"])
    assert sample(registry, "prompt_cache_evicted_blocks_total", reason="capacity") == 2
    assert sample(registry, "prompt_cache_evicted_before_ttl_total", retention="chat") == 2


def test_a_tenant_evicting_its_own_blocks_for_its_quota_is_not_an_eviction_before_ttl() -> None:
    """The before-TTL counter (and its alert) says the store is too small for the TTLs; a
    tenant over its own quota is that tenant's choice."""
    metrics = CacheMetrics(CollectorRegistry())
    young = {"retention": "chat", "expires_at": 1_000.0, "payload_size": 1}
    evicted = [
        Evicted(key=StoreKey(b"k1"), reason="tenant_quota", **young),  # type: ignore[arg-type]
        Evicted(key=StoreKey(b"k2"), reason="capacity", **young),  # type: ignore[arg-type]
    ]
    metrics.on_evicted(evicted, now=10.0)
    registry = metrics.registry
    assert sample(registry, "prompt_cache_evicted_blocks_total", reason="tenant_quota") == 1
    assert sample(registry, "prompt_cache_evicted_before_ttl_total", retention="chat") == 1


def test_expired_blocks_are_counted_as_expired_not_before_their_ttl(
    store: BlockStore, clock: VirtualClock
) -> None:
    cache, registry = counted(store, clock)
    cache.insert(NS, blocks_of(1, 2), [b"a", b"b"])
    clock.advance(CHAT_TTL + 1)
    assert cache.capacity.sweep_expired() == 2
    assert sample(registry, "prompt_cache_evicted_blocks_total", reason="expired") == 2
    assert sample(registry, "prompt_cache_evicted_before_ttl_total", retention="chat") == 0


def test_removed_blocks_are_counted_as_removed(store: BlockStore, clock: VirtualClock) -> None:
    cache, registry = counted(store, clock)
    cache.insert(NS, blocks_of(1, 2, 3), [b"a", b"b", b"c"])
    key = cache.chain(NS, blocks_of(1, 2)).keys[1]
    assert len(cache.remove_block(NS, key)) == 2
    assert sample(registry, "prompt_cache_evicted_blocks_total", reason="removed") == 2
    assert sample(registry, "prompt_cache_evicted_blocks_total", reason="capacity") == 0
    # Removed on request, not to make room: not an eviction before the TTL.
    assert sample(registry, "prompt_cache_evicted_before_ttl_total", retention="chat") == 0


def test_tenants_are_counted_by_name_only_when_declared(
    store: BlockStore, clock: VirtualClock
) -> None:
    registry = CollectorRegistry()
    metrics = CacheMetrics(registry)
    metrics.declare_tenants(["team-a"])
    cache = PrefixCache(
        store, config=CacheConfig(default_block_size=BLOCK), clock=clock, events=metrics
    )
    cache.match_prefix(Namespace("m", tenant="team-a"), blocks_of(1))
    cache.match_prefix(Namespace("m", tenant="team-b"), blocks_of(1))
    assert sample(registry, "prompt_cache_tenant_miss_tokens_total", tenant="team-a") == BLOCK
    assert sample(registry, "prompt_cache_tenant_miss_tokens_total", tenant="team-b") is None
    assert metrics.tenant_token_totals("team-a") == (0, BLOCK)


def test_store_collector_reports_usage_and_capacity_at_scrape_time(
    store: BlockStore, clock: VirtualClock
) -> None:
    cache, _ = counted(store, clock)
    registry = CollectorRegistry()
    registry.register(StoreCollector(cache.capacity.usage, 10_000))
    assert sample(registry, "prompt_cache_blocks") == 0
    cache.insert(NS, blocks_of(1, 2), [b"aa", b"bbb"])
    assert sample(registry, "prompt_cache_blocks") == 2
    assert sample(registry, "prompt_cache_payload_bytes") == 5
    assert sample(registry, "prompt_cache_capacity_bytes") == 10_000


def test_store_collector_shows_the_disk_under_an_lmdb_store(tmp_path: Path) -> None:
    store = LmdbStore(tmp_path / "lmdb", map_size_bytes=1 << 30, lifetimes=DEFAULT_LIFETIMES)
    cache = PrefixCache(
        store,
        config=CacheConfig(default_block_size=BLOCK),
        limits=CapacityLimits(capacity_bytes=1 << 60),
    )
    registry = CollectorRegistry()
    # As the service wires it: the capacity's usage and its disk report.
    registry.register(StoreCollector(cache.capacity.usage, 1 << 60, disk=cache.capacity.disk))
    free = sample(registry, "prompt_cache_disk_free_bytes")
    assert free is not None and free > 0
    assert sample(registry, "prompt_cache_disk_file_bytes") == store.space.file_bytes()
    shortfall = sample(registry, "prompt_cache_disk_shortfall_bytes")
    assert shortfall is not None and shortfall > 0  # no disk here holds 2**60 bytes
    store.close()


def test_store_collector_shows_no_disk_for_a_memory_store() -> None:
    cache = PrefixCache(
        MemoryStore(lifetimes=DEFAULT_LIFETIMES), config=CacheConfig(default_block_size=BLOCK)
    )
    registry = CollectorRegistry()
    registry.register(StoreCollector(cache.capacity.usage, None, disk=cache.capacity.disk))
    assert sample(registry, "prompt_cache_disk_free_bytes") is None


def test_a_scrape_skips_a_worker_file_created_but_not_yet_sized(tmp_path: Path) -> None:
    """prometheus_client creates a worker's file empty and sizes it a moment later; a scrape
    in between read it and failed (struct.error: a 500 on /metrics under --workers)."""
    from prometheus_client import generate_latest  # noqa: PLC0415

    from cache_service.service.metrics import SettledFilesCollector  # noqa: PLC0415

    (tmp_path / "counter_4242.db").write_bytes(b"")  # a starting worker's file
    registry = CollectorRegistry()
    SettledFilesCollector(registry, path=str(tmp_path))  # type: ignore[no-untyped-call]
    assert generate_latest(registry) == b""  # nothing settled yet, and no error


def test_requests_are_counted_by_route_template_and_status_code() -> None:
    """The request timer counts every answer: a matched route by its template, an unknown
    path as route 'other'; the latency histogram sees the same requests."""
    import asyncio  # noqa: PLC0415

    import httpx  # noqa: PLC0415

    from cache_service.service.api.app import create_app  # noqa: PLC0415
    from cache_service.service.settings import Settings  # noqa: PLC0415

    registry = CollectorRegistry()
    app = create_app(Settings(store="memory://"), registry=registry)

    async def traffic() -> list[int]:
        # The app in this process with its lifespan (the store) running; no server needed.
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://service") as client,
        ):
            answers = [
                await client.get("/healthz"),
                await client.get("/v1/info"),
                await client.get("/v1/no-such-route"),
                await client.post(
                    "/v1/lookup",
                    content=b"not json",
                    headers={"Content-Type": "application/json"},
                ),
            ]
        return [answer.status_code for answer in answers]

    assert asyncio.run(traffic()) == [200, 200, 404, 400]

    def requests(route: str, code: str) -> float | None:
        return sample(registry, "prompt_cache_requests_total", route=route, code=code)

    assert requests("/healthz", "200") == 1
    assert requests("/v1/info", "200") == 1
    assert requests("other", "404") == 1
    assert requests("/v1/lookup", "400") == 1
    assert requests("/v1/no-such-route", "404") is None  # never the raw path: bounded labels
    duration = "prompt_cache_request_duration_seconds_count"
    assert sample(registry, duration, route="/v1/lookup") == 1
    assert sample(registry, duration, route="other") == 1
