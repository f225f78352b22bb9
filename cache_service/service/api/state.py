"""What the routes share: the cache, metrics and request limits of one running service."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from cache_service.core.cache import PrefixCache
from cache_service.core.errors import NotReady, Overloaded
from cache_service.core.lifetimes import Lifetimes
from cache_service.core.operators import Operators
from cache_service.service.api.guard import StoreGuard
from cache_service.service.config import RequestLimits
from cache_service.service.kv_events.hub import KvEventsHub
from cache_service.service.metrics import CacheMetrics
from cache_service.service.quotas import QuotaBook
from cache_service.service.status_history import StatusHistory
from cache_service.service.usage import UsageLog

_IDLE_POLL_SECONDS = 0.01
T = TypeVar("T")
P = ParamSpec("P")


class WriteGate:
    """Bounds the stores one worker process has waiting for (or in) the store at once: past
    the bound a store is refused at once (503, Retry-After) instead of queueing for LMDB's
    single writer, and the threads it would have held stay free for reads. It also counts
    every write still running in a thread, so that a stop can wait for them all."""

    def __init__(self, limit: int, guard: StoreGuard | None = None) -> None:
        self.limit = limit
        self.pending = 0
        self.guard = guard or StoreGuard()  # the service's: every write is counted there too

    async def run(self, work: Callable[[], T], *, refusable: bool = True) -> T:
        """Run one store write's `work` in a worker thread, holding a place until the
        thread is done; Overloaded if no place is free (`refusable=False`: the service's own
        background writes, a sweep or a touch flush, are counted but never refused).

        The place is held by a task of its own, shielded from the request: a request that is
        cancelled (a client gone, a server shutting down) leaves its write running in the
        thread, and the place stays taken until that write ends, so a stop that waits for
        the gate to empty never closes the store under a writer."""
        if refusable and self.pending >= self.limit:
            raise Overloaded(
                f"{self.pending} store requests are already waiting for the store "
                f"(max_pending_writes); retry shortly. Lookups and fetches are still served.",
                retry_after_seconds=1.0,
                limit="max_pending_writes",
            )
        self.pending += 1

        async def held() -> T:
            try:
                return await run_in_threadpool(self.guard.counted(work))
            finally:
                self.pending -= 1

        task = asyncio.ensure_future(held())
        # Retrieve the outcome even when the request is gone, so that nothing is logged as
        # an exception never retrieved.
        task.add_done_callback(lambda done: done.cancelled() or done.exception())
        return await asyncio.shield(task)

    async def wait_idle(self, timeout_seconds: float) -> bool:
        """Wait until no store request holds a place, at most `timeout_seconds`; whether
        none does. Polled: a place is taken and given back on the event loop's thread."""
        deadline = time.monotonic() + timeout_seconds
        while self.pending and time.monotonic() < deadline:
            await asyncio.sleep(min(_IDLE_POLL_SECONDS, max(deadline - time.monotonic(), 0)))
        return not self.pending


@dataclass(frozen=True)
class LocalReadsOffer:
    """What --local-reads tells a same-host client (with its tenant): the store's folder, the
    hash seed and the retention table."""

    path: str
    store_id: str
    seed: str
    lifetimes: Lifetimes


@dataclass
class ServiceState:
    """The resources the lifespan opened."""

    cache: PrefixCache
    metrics: CacheMetrics
    limits: RequestLimits
    store_kind: str
    writes: WriteGate
    usage_log: UsageLog | None = None
    quotas: QuotaBook | None = None
    # The engines' KV events (their views, for routing scores); None unless configured.
    kv_events: KvEventsHub | None = None
    # The status page's charts: this worker's samples of the fleet's totals.
    history: StatusHistory = field(default_factory=StatusHistory)
    # Where same-host clients read the LMDB files themselves; None without --local-reads.
    local_reads: LocalReadsOffer | None = None
    operators: Operators = field(init=False)

    def __post_init__(self) -> None:
        self.operators = Operators.for_cache(self.cache)

    @property
    def guard(self) -> StoreGuard:
        """What a stop waits on: the store work in threads (the write gate's guard)."""
        return self.writes.guard

    async def in_thread(self, work: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run store work in a worker thread, counted by the guard (see api.guard)."""
        return await self.writes.guard.in_thread(work, *args, **kwargs)


def service_state(request: Request) -> ServiceState:
    """The running service's state; 503 while the store is not open."""
    state: ServiceState | None = getattr(request.app.state, "service", None)
    if state is None:
        raise NotReady("the store is not open yet")
    return state
