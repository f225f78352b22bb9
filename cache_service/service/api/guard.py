"""StoreGuard: counts every call inside the store, from any thread, so that a stop closes the
store only when no thread holds a transaction.

Why: a request or job runs its store work in a worker thread, and cancelling the task that
awaits it does not stop the thread. py-lmdb 3.0's `Environment.close()` under a live write
transaction waits for its owner forever (the owner's next call raises and the traceback keeps
the transaction alive); under a live read transaction it unmaps the file beneath the reader
(a payload view read after that is a segmentation fault). So every store call is counted
here, wherever it comes from (routes, operators, /metrics collectors, background jobs), and
once the stop closes the guard new calls are refused with 503 instead of starting.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Any, TypeVar, cast

from cache_service.core.store.protocols import BlockStore
from cache_service.service.api.state import NotReady

_IDLE_POLL_SECONDS = 0.01
T = TypeVar("T")


class StoreGuard:
    """Counts the calls in progress inside one store; once closed, refuses new ones."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._closed = False
        self._admitted = threading.local()  # the stop's own last calls, let through

    @property
    def active(self) -> int:
        """Store calls in progress, in any thread."""
        return self._active

    @property
    def closed(self) -> bool:
        """Whether new calls are refused."""
        return self._closed

    @contextmanager
    def call(self) -> Iterator[None]:
        """Count one store call; NotReady (503) if the guard is closed."""
        with self._lock:
            if self._closed and not getattr(self._admitted, "yes", False):
                raise NotReady("the service is stopping; its store takes no new work")
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1

    def close(self) -> None:
        """Refuse every store call from now on (calls in progress go on)."""
        with self._lock:
            self._closed = True

    def admitted(self, work: Callable[[], T]) -> Callable[[], T]:
        """`work` run past a closed guard (still counted): the stop's final touch flush."""

        def run() -> T:
            self._admitted.yes = True
            try:
                return work()
            finally:
                self._admitted.yes = False

        return run

    async def wait_idle(self, deadline: float) -> bool:
        """Wait until no store call is in progress, at most until `deadline` (monotonic);
        whether none is. Polled: the calls end in threads that cannot wake the loop."""
        while self._active and time.monotonic() < deadline:
            await asyncio.sleep(min(_IDLE_POLL_SECONDS, max(deadline - time.monotonic(), 0)))
        return not self._active

    def wrap(self, store: BlockStore) -> BlockStore:
        """The store as the cache should see it: each method call counted by this guard."""
        return cast(BlockStore, GuardedStore(store, self))


class GuardedStore:
    """A store whose every method call (a transaction, or a batch of them) is counted by a
    StoreGuard; attributes read and written pass through to the store."""

    def __init__(self, store: BlockStore, guard: StoreGuard) -> None:
        object.__setattr__(self, "_store", store)
        object.__setattr__(self, "_guard", guard)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._store, name)
        if not callable(value):
            return value
        if name == "batch":  # a context manager: counted for the whole `with` block
            return self._batch
        guard = self._guard

        @wraps(value)
        def counted(*args: Any, **kwargs: Any) -> Any:
            with guard.call():
                return value(*args, **kwargs)

        return counted

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._store, name, value)

    @contextmanager
    def _batch(self) -> Iterator[None]:
        with self._guard.call(), self._store.batch():
            yield
