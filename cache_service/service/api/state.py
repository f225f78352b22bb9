"""What the routes share: the cache, metrics and settings of one running service."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from starlette.requests import Request

from cache_service.core.cache import PrefixCache
from cache_service.core.errors import Overloaded, StorageError
from cache_service.core.operators import Operators
from cache_service.service.metrics import CacheMetrics
from cache_service.service.quotas import QuotaBook
from cache_service.service.settings import Settings
from cache_service.service.usage import UsageLog

_IDLE_POLL_SECONDS = 0.01


class WriteGate:
    """Bounds the stores one worker process has waiting for (or in) the store at once: past
    the bound a store is refused at once (503, Retry-After) instead of queueing for LMDB's
    single writer, and the threads it would have held stay free for reads."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pending = 0

    @contextmanager
    def admit(self) -> Iterator[None]:
        """Hold a place for one store request; Overloaded if none is free."""
        if self.pending >= self.limit:
            raise Overloaded(
                f"{self.pending} store requests are already waiting for the store "
                f"(max_pending_writes); retry shortly. Lookups and fetches are still served.",
                retry_after_seconds=1.0,
                limit="max_pending_writes",
            )
        self.pending += 1
        try:
            yield
        finally:
            self.pending -= 1

    async def wait_idle(self, timeout_seconds: float) -> bool:
        """Wait until no store request holds a place, at most `timeout_seconds`; whether
        none does. Polled: a place is taken and given back on the event loop's thread."""
        deadline = time.monotonic() + timeout_seconds
        while self.pending and time.monotonic() < deadline:
            await asyncio.sleep(min(_IDLE_POLL_SECONDS, max(deadline - time.monotonic(), 0)))
        return not self.pending


@dataclass
class ServiceState:
    """The resources the lifespan opened."""

    cache: PrefixCache
    metrics: CacheMetrics
    settings: Settings
    store_kind: str
    writes: WriteGate
    usage_log: UsageLog | None = None
    quotas: QuotaBook | None = None
    operators: Operators = field(init=False)

    def __post_init__(self) -> None:
        self.operators = Operators.for_cache(self.cache)


class NotReady(StorageError):
    """The service is starting or stopping; its store is not open."""

    status = 503
    problem = "not-ready"
    title = "Service not ready"


def service_state(request: Request) -> ServiceState:
    """The running service's state; 503 while the store is not open."""
    state: ServiceState | None = getattr(request.app.state, "service", None)
    if state is None:
        raise NotReady("the store is not open yet")
    return state
