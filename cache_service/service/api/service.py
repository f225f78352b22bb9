"""One running service: the store, the cache over it, its metrics, quotas, usage log and
background workers, started and stopped as one (the app's lifespan calls `start`, `stop`)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool

from cache_service.core.cache import Clock, PrefixCache
from cache_service.core.hashing import BlockHasher
from cache_service.core.store.base import BlockStore
from cache_service.core.store.registry import OpenedStore, describe_store
from cache_service.service.api.background import (
    METRICS_RETRY_SECONDS,
    ElectionLock,
    MetricsPort,
    repeat,
    sweeper,
)
from cache_service.service.api.startup import open_store, serving_line
from cache_service.service.api.state import ServiceState, WriteGate
from cache_service.service.api_keys import KeyRing
from cache_service.service.metrics import CacheMetrics, StoreCollector
from cache_service.service.quotas import QuotaBook
from cache_service.service.settings import Settings
from cache_service.service.usage import UsageLog

log = logging.getLogger("cache_service")


def given_store(store: BlockStore, settings: Settings) -> OpenedStore:
    """A store the caller opened (tests, embedders), held to the settings that steer a store:
    its removal log keeps `--removal-log-entries`, and its policy must be `--eviction-policy`."""
    if store.policy.name != settings.eviction_policy:
        raise ValueError(
            f"the store given orders eviction by {store.policy.name!r}, the settings by "
            f"{settings.eviction_policy!r} (--eviction-policy)"
        )
    store.removal_log_entries = settings.removal_log_entries
    return describe_store(store)


@dataclass
class _Running:
    """What `start` opened, for `stop` to close."""

    opened: OpenedStore
    state: ServiceState
    collector: StoreCollector
    sweeper_lock: ElectionLock
    metrics_port: MetricsPort
    workers: list[asyncio.Task[None]] = field(default_factory=list)


class Service:
    """Owns what one service process runs; `state` is what the routes see while it runs."""

    def __init__(
        self,
        settings: Settings,
        *,
        metrics: CacheMetrics,
        keys: KeyRing | None = None,
        store: BlockStore | None = None,
        clock: Clock = time.time,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.keys = keys
        self.clock = clock
        self._given = store
        self._running: _Running | None = None

    @property
    def state(self) -> ServiceState | None:
        """The routes' view of the running service; None unless started."""
        return self._running.state if self._running is not None else None

    async def start(self) -> ServiceState:
        """Open the store (refused if its data was made with other settings), wire the cache
        and start the background workers."""
        settings = self.settings
        # `cache-service serve` checks the store first, so that a refusal exits with the
        # message rather than a worker's traceback.
        opened = open_store(settings) if self._given is None else given_store(self._given, settings)
        try:
            self._running = self._wire(opened)
        except BaseException:
            if self._given is None:
                opened.store.close()
            raise
        try:
            # The capacity may have been lowered since the data was written.
            await run_in_threadpool(self._running.state.cache.capacity.enforce)
        except BaseException:
            await self.stop()
            raise
        self._running.workers = self._start_workers(self._running)
        log.info("%s", serving_line(settings, opened.where))
        return self._running.state

    def _build_cache(self, store: BlockStore) -> PrefixCache:
        settings, keys = self.settings, self.keys
        return PrefixCache(
            store,
            hasher=BlockHasher(seed=settings.seed),
            retention=settings.retention_policy(),
            clock=self.clock,
            default_block_size=settings.block_size,
            model_block_sizes=settings.model_block_sizes(),
            capacity_bytes=settings.capacity,
            high_water=settings.high_water,
            low_water=settings.low_water,
            defer_touches=True,
            ttl_slide_fraction=settings.ttl_slide_fraction,
            tenant_capacity_bytes=keys.tenant_capacity if keys is not None else None,
            events=self.metrics,
        )

    def _wire(self, opened: OpenedStore) -> _Running:
        settings, metrics = self.settings, self.metrics
        cache = self._build_cache(opened.store)
        collector = StoreCollector(cache.capacity.usage, settings.capacity)
        metrics.scrape_registry.register(collector)
        # Jobs one worker process runs are elected through lock files beside the data;
        # a store with no such folder has a single process, which runs them all.
        folder = opened.folder
        sweeper_lock = ElectionLock(folder, "sweeper.lock")
        metrics_port = MetricsPort(
            settings.metrics_host,
            settings.metrics_port,
            metrics.scrape_registry,
            ElectionLock(folder, "metrics.lock"),
        )
        metrics_port.ensure()
        usage_log = (
            UsageLog(settings.usage_log, max_bytes=settings.usage_log_max_bytes, clock=self.clock)
            if settings.usage_log is not None
            else None
        )
        quotas = QuotaBook(list(self.keys), folder) if self.keys is not None else None
        writes = WriteGate(settings.max_pending_writes)
        state = ServiceState(cache, metrics, settings, opened.kind, writes, usage_log, quotas)
        return _Running(opened, state, collector, sweeper_lock, metrics_port)

    def _start_workers(self, running: _Running) -> list[asyncio.Task[None]]:
        settings, cache = self.settings, running.state.cache
        workers = [
            asyncio.create_task(repeat(settings.touch_flush_interval, self._flush, "touch flush")),
            asyncio.create_task(
                repeat(
                    settings.sweep_interval,
                    sweeper(
                        cache.capacity.sweep_expired,
                        running.sweeper_lock,
                        lambda work: running.state.writes.run(work, refusable=False),
                    ),
                    "sweeper",
                )
            ),
        ]
        if settings.metrics_port is not None:  # a worker that did not get the port retries
            workers.append(
                asyncio.create_task(
                    repeat(METRICS_RETRY_SECONDS, running.metrics_port.ensure_async, "metrics port")
                )
            )
        return workers

    async def _flush(self) -> None:
        state = self.state
        if state is None:
            return
        if state.cache.touches.pending:
            await state.writes.run(state.cache.touches.flush, refusable=False)
        if state.usage_log is not None:
            await run_in_threadpool(state.usage_log.flush)

    async def stop(self) -> None:
        """Stop the background jobs, wait for every write still running in a thread (store
        requests and the jobs' own, at most --shutdown-timeout), flush touches and usage, and
        close; returns within the timeout plus the flushes."""
        running, self._running = self._running, None
        if running is None:
            return
        state = running.state
        for task in running.workers:
            task.cancel()
        await asyncio.gather(*running.workers, return_exceptions=True)
        # A cancelled job's or request's write goes on in its thread, holding its place.
        drained = await state.writes.wait_idle(self.settings.shutdown_timeout)
        if drained:
            state.cache.touches.flush()
        else:
            # A write still in progress holds the store's writer: a flush would wait for it,
            # and closing under it is unsafe. Committed data is kept; its touches are lost.
            log.warning(
                "%d writes still running after %.1fs; stopping without flushing "
                "touches or closing the store",
                state.writes.pending,
                self.settings.shutdown_timeout,
            )
        if state.usage_log is not None:
            state.usage_log.flush()
        running.sweeper_lock.release()
        running.metrics_port.close()
        if state.quotas is not None:
            state.quotas.close()
        self.metrics.scrape_registry.unregister(running.collector)
        self.metrics.close()
        if drained and self._given is None:
            running.opened.store.close()
