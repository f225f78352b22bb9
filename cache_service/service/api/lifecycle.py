"""One running service: the store, the cache over it, its metrics, quotas, usage log and
background workers, started and stopped as one (the app's lifespan calls `start`, `stop`)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace

from starlette.concurrency import run_in_threadpool

from cache_service.core.cache import Clock, PrefixCache
from cache_service.core.hashing import BlockHasher
from cache_service.core.store.protocols import BlockStore
from cache_service.core.store.registry import OpenedStore, describe_store
from cache_service.service.api.background import (
    DISK_CHECK_SECONDS,
    METRICS_RETRY_SECONDS,
    ElectionLock,
    MetricsPort,
    disk_check,
    repeat,
    sweeper,
)
from cache_service.service.api.guard import StoreGuard
from cache_service.service.api.startup import open_store, serving_line, store_capacity
from cache_service.service.api.state import LocalReadsOffer, ServiceState, WriteGate
from cache_service.service.backend_metrics import SYNC_SECONDS, BackendCounters
from cache_service.service.config import ServiceConfig, StoreConfig
from cache_service.service.kv_events.hub import KvEventsHub
from cache_service.service.kv_events.metrics import KvEventsCollector
from cache_service.service.metrics import CacheMetrics, StoreCollector
from cache_service.service.quotas import QuotaBook
from cache_service.service.status_history import SAMPLE_SECONDS, read_totals
from cache_service.service.usage import UsageLog

log = logging.getLogger("cache_service")

# The stop's last touch flush gets what is left of --shutdown-timeout, but at least this.
FINAL_FLUSH_SECONDS = 1.0
# With --local-reads, how often the reader slots of clients that died reading are freed.
READER_CHECK_SECONDS = 60.0


def given_store(store: BlockStore, config: StoreConfig) -> OpenedStore:
    """A store the caller opened (tests, embedders), held to the settings that steer a store
    (ValueError naming both): its policy must be `--eviction-policy`, its removal log (where
    it keeps one) `--removal-log-entries` long, and its lifetimes the `--retention` classes'.
    The service never changes a store it is given."""
    if store.policy.name != config.eviction_policy:
        raise ValueError(
            f"the store given orders eviction by {store.policy.name!r}, the settings by "
            f"{config.eviction_policy!r} (--eviction-policy)"
        )
    lifetimes = config.lifetimes
    if store.lifetimes != lifetimes:
        raise ValueError(
            f"the store given bounds lifetimes by {store.lifetimes.describe()}, the settings "
            f"by {lifetimes.describe()} (--retention)"
        )
    entries = config.removal_log_entries
    if store.capabilities.has("removal_log") and store.removal_log_entries != entries:
        raise ValueError(
            f"the store given keeps {store.removal_log_entries} recent removals, the settings "
            f"{entries} (--removal-log-entries)"
        )
    return describe_store(store)


@dataclass
class _Running:
    """What `start` opened, for `stop` to close."""

    opened: OpenedStore
    state: ServiceState
    guard: StoreGuard
    collector: StoreCollector
    sweeper_lock: ElectionLock
    metrics_port: MetricsPort
    kv_events_collector: KvEventsCollector | None = None
    backend: BackendCounters | None = None  # a remote store's failures, as counters
    workers: list[asyncio.Task[None]] = field(default_factory=list)


class ServiceLifecycle:
    """Owns what one service process runs; `state` is what the routes see while it runs."""

    def __init__(
        self,
        config: ServiceConfig,
        *,
        metrics: CacheMetrics,
        store: BlockStore | None = None,
        clock: Clock = time.time,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.keys = config.auth.keys
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
        config = self.config
        # `cache-service serve` checks the store first, so that a refusal exits with the
        # message rather than a worker's traceback.
        opened = (
            open_store(config) if self._given is None else given_store(self._given, config.store)
        )
        try:
            self._running = self._wire(opened)
        except BaseException:
            if self._given is None:
                opened.store.close()
            raise
        try:
            # The capacity may have been lowered since the data was written.
            await self._running.state.in_thread(self._running.state.cache.capacity.enforce)
            hub = self._running.state.kv_events
            if hub is not None:  # its start waits for the subscriber's sockets: off the loop
                await run_in_threadpool(hub.start)
        except BaseException:
            await self.stop()
            raise
        await self._first_status_sample()
        self._running.workers = self._start_workers(self._running)
        capacity = self._running.state.cache.capacity.capacity_bytes or config.store.capacity_bytes
        log.info("%s", serving_line(config.server, config.auth.mode, opened.where, capacity))
        return self._running.state

    def _build_cache(self, store: BlockStore, capacity_bytes: int) -> PrefixCache:
        """The cache over the store opened, within `capacity_bytes` (the store's own on
        Redis); the store's lifetimes are the retention's (PrefixCache checks)."""
        config = self.config
        return PrefixCache(
            store,
            config=config.cache,
            limits=replace(config.capacity, capacity_bytes=capacity_bytes),
            touches=config.touches,
            hasher=BlockHasher(seed=config.seed),
            clock=self.clock,
            events=self.metrics,
        )

    def _wire(self, opened: OpenedStore) -> _Running:
        config, metrics = self.config, self.metrics
        # Store work reaches a thread only through the guard (routes, operators, the write
        # gate, jobs, the collectors that scrapes run), so that the stop knows when no thread
        # is inside the store.
        guard = StoreGuard()
        capacity_bytes = store_capacity(opened, config.store.capacity_bytes)
        cache = self._build_cache(opened.store, capacity_bytes)
        usage, disk = guard.counted(cache.capacity.usage), guard.counted(cache.capacity.disk)
        collector = StoreCollector(usage, capacity_bytes, disk=disk)
        metrics.scrape_registry.register(collector)
        # Jobs one worker process runs are elected through lock files beside the data;
        # a store with no such folder has a single process, which runs them all.
        folder = opened.folder
        sweeper_lock = ElectionLock(folder, "sweeper.lock")
        metrics_port = MetricsPort(
            config.server.metrics_host,
            config.server.metrics_port,
            metrics.scrape_registry,
            ElectionLock(folder, "metrics.lock"),
        )
        metrics_port.ensure()
        jobs = config.jobs
        usage_log = (
            UsageLog(jobs.usage_log, max_bytes=jobs.usage_log_max_bytes, clock=self.clock)
            if jobs.usage_log is not None
            else None
        )
        quotas = QuotaBook(list(self.keys), folder) if self.keys is not None else None
        writes = WriteGate(config.limits.max_pending_writes, guard)
        state = ServiceState(cache, metrics, config.limits, opened.kind, writes, usage_log, quotas)
        on_disk = opened.store.disk
        if config.store.local_reads and on_disk is not None:  # refused at start elsewhere
            state.local_reads = LocalReadsOffer(
                str(on_disk.folder.resolve()),
                on_disk.store_id,
                config.seed,
                config.store.lifetimes,
            )
        running = _Running(opened, state, guard, collector, sweeper_lock, metrics_port)
        remote = opened.store.remote
        if remote is not None:  # a remote store: its failures are misses, not 5xx
            running.backend = BackendCounters(remote.health_counts, metrics.registry)
        if config.engines.engines:  # started by `start` once the store is ready; never touches it
            state.kv_events = KvEventsHub.following(config.engines)
            running.kv_events_collector = KvEventsCollector(state.kv_events)
            metrics.scrape_registry.register(running.kv_events_collector)
        return running

    def _start_workers(self, running: _Running) -> list[asyncio.Task[None]]:
        jobs, cache = self.config.jobs, running.state.cache
        workers = [
            asyncio.create_task(repeat(jobs.touch_flush_interval, self._flush, "touch flush")),
            asyncio.create_task(
                repeat(
                    jobs.sweep_interval,
                    sweeper(
                        cache.capacity.sweep_expired,
                        running.sweeper_lock,
                        lambda work: running.state.writes.run(work, refusable=False),
                    ),
                    "sweeper",
                )
            ),
        ]
        # The disk may fill from outside: its warning (and the room eviction keeps within)
        # follows it even while nothing is written or scraped.
        workers.append(
            asyncio.create_task(
                repeat(
                    DISK_CHECK_SECONDS,
                    disk_check(running.guard.counted(cache.capacity.disk)),
                    "disk check",
                )
            )
        )
        workers.append(
            asyncio.create_task(repeat(SAMPLE_SECONDS, self._sample_status, "status history"))
        )
        on_disk = running.opened.store.disk
        if running.state.local_reads is not None and on_disk is not None:

            async def check_readers() -> None:
                freed = on_disk.clear_stale_readers()
                if freed:
                    log.info("freed %d reader slots of processes that died reading", freed)

            workers.append(
                asyncio.create_task(repeat(READER_CHECK_SECONDS, check_readers, "reader check"))
            )
        backend = running.backend
        if backend is not None:

            async def sync_backend() -> None:
                backend.sync()

            workers.append(
                asyncio.create_task(repeat(SYNC_SECONDS, sync_backend, "backend counters"))
            )
        if self.config.server.metrics_port is not None:  # a worker that did not get it retries
            workers.append(
                asyncio.create_task(
                    repeat(METRICS_RETRY_SECONDS, running.metrics_port.ensure_async, "metrics port")
                )
            )
        return workers

    async def _sample_status(self) -> None:
        """Note the fleet's totals in the status page's history (a scrape's reading)."""
        state = self.state
        if state is None:
            return
        state.history.record(await run_in_threadpool(read_totals, self.metrics.scrape_registry))

    async def _first_status_sample(self) -> None:
        """The history's first point, so that the charts start at the start; the page is
        not worth failing a start for."""
        try:
            await self._sample_status()
        except Exception:
            log.exception("the status page's first sample failed; retrying every %.0fs",
                          SAMPLE_SECONDS)  # fmt: skip

    async def _flush(self) -> None:
        state = self.state
        if state is None:
            return
        if state.cache.touches.pending:
            await state.writes.run(state.cache.touches.flush, refusable=False)
        if state.cache.damage_pending:  # reads only note damage: the flush drops it
            await state.writes.run(state.cache.drop_damaged, refusable=False)
        if state.usage_log is not None:
            await run_in_threadpool(state.usage_log.flush)

    async def stop(self) -> None:
        """Stop the background jobs; give the writes in flight until --shutdown-timeout to
        commit; then refuse new store calls and wait (same deadline) for those in progress in
        any thread, reads too; flush touches and usage, and close. Returns within
        --shutdown-timeout + FINAL_FLUSH_SECONDS (and the small files' flushes): a store
        call still running then keeps the store open (closing under it would wait forever,
        or unmap a reader's pages), which the log says; LMDB keeps every committed write."""
        running, self._running = self._running, None
        if running is None:
            return
        state, guard = running.state, running.guard
        timeout = self.config.server.shutdown_timeout
        deadline = time.monotonic() + timeout
        # The subscriber's thread ends within a poll slice or two; it is joined beside the
        # writes' wait, within the same deadline, and holds nothing of the store.
        hub, hub_stopped = state.kv_events, None
        if hub is not None:
            hub_stopped = asyncio.ensure_future(
                run_in_threadpool(hub.stop, timeout_seconds=timeout)
            )
        for task in running.workers:
            task.cancel()
        await asyncio.gather(*running.workers, return_exceptions=True)
        running.metrics_port.close()  # its scrapes read the store too
        # A cancelled job's or request's write goes on in its thread, holding its place.
        if not await state.writes.wait_idle(max(deadline - time.monotonic(), 0)):
            log.warning(
                "%d writes still running after %.1fs; the store refuses them from now on",
                state.writes.pending,
                timeout,
            )
        guard.close()
        idle = await guard.wait_idle(deadline) and await self._final_flush(running, deadline)
        if not idle:
            log.warning(
                "%d store calls still running after %.1fs; stopping without flushing touches "
                "or closing the store (its committed writes are safe)",
                guard.active,
                timeout,
            )
        if state.usage_log is not None:
            state.usage_log.flush()
        running.sweeper_lock.release()
        if state.quotas is not None:
            state.quotas.close()
        self.metrics.scrape_registry.unregister(running.collector)
        if hub_stopped is not None:
            await self._stop_kv_events(running, hub_stopped, deadline)
        self.metrics.close()
        if idle and self._given is None:
            running.opened.store.close()

    async def _stop_kv_events(
        self, running: _Running, stopped: asyncio.Future[bool], deadline: float
    ) -> None:
        """Wait for the KV-event subscriber to end (until `deadline`, at least a second) and
        take its metrics out."""
        try:
            await asyncio.wait_for(
                asyncio.shield(stopped), max(deadline - time.monotonic(), FINAL_FLUSH_SECONDS)
            )
        except TimeoutError:  # a daemon thread: it cannot keep the process alive
            log.warning("the KV-event subscriber did not stop in time")
        except Exception:
            log.exception("stopping the KV-event subscriber failed")
        if running.kv_events_collector is not None:
            self.metrics.scrape_registry.unregister(running.kv_events_collector)

    async def _final_flush(self, running: _Running, deadline: float) -> bool:
        """Apply the deferred touches past the closed guard, in a thread, for at most what is
        left until `deadline` (or FINAL_FLUSH_SECONDS); whether the store is idle after it."""
        touches, guard = running.state.cache.touches, running.guard
        if not touches.pending:
            return True
        flush = asyncio.ensure_future(run_in_threadpool(guard.admitted(touches.flush)))
        flush.add_done_callback(lambda done: done.cancelled() or done.exception())
        allowed = max(deadline - time.monotonic(), FINAL_FLUSH_SECONDS)
        try:
            await asyncio.wait_for(asyncio.shield(flush), allowed)
        except TimeoutError:
            log.warning("the final touch flush did not end in %.1fs", allowed)
        except Exception:  # the touches stay pending; the data they refresh is safe
            log.exception("the final touch flush failed")
        return not guard.active
