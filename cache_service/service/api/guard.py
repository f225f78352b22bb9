"""StoreGuard: counts the store work handed to threads, so that a stop closes the store only
when no thread holds a transaction.

Why: a request or job runs its store work in a worker thread, and cancelling the task that
awaits it does not stop the thread. py-lmdb 3.0's `Environment.close()` under a live write
transaction waits for its owner forever (the owner's next call raises and the traceback keeps
the transaction alive); under a live read transaction it unmaps the file beneath the reader
(a payload view read after that is a segmentation fault). So every piece of work that may
call the store is counted where it is handed to a thread (`in_thread`, `counted`: routes,
operators, the write gate, background jobs, the /metrics collectors), and once the stop
closes the guard new work is refused with 503 instead of starting. Calls made on the event
loop's own thread need no count: the stop runs there too, so none can be in progress when
it closes the store.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import ParamSpec, TypeVar

from starlette.concurrency import run_in_threadpool

from cache_service.core.errors import NotReady

_IDLE_POLL_SECONDS = 0.01
T = TypeVar("T")
P = ParamSpec("P")


class StoreGuard:
    """Counts the store work in progress in threads; once closed, refuses new work."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._closed = False
        self._thread = threading.local()  # this thread's depth of counted work; admitted

    @property
    def active(self) -> int:
        """Pieces of store work in progress, in any thread."""
        return self._active

    @property
    def closed(self) -> bool:
        """Whether new work is refused."""
        return self._closed

    @property
    def held_here(self) -> bool:
        """Whether the calling thread is inside counted work (what a check of the hand-offs
        asserts for every store call off the event loop)."""
        return getattr(self._thread, "depth", 0) > 0

    @contextmanager
    def call(self) -> Iterator[None]:
        """Count one piece of store work; NotReady (503) if the guard is closed."""
        here = self._thread
        with self._lock:
            if self._closed and not getattr(here, "admitted", False):
                raise NotReady("the service is stopping; its store takes no new work")
            self._active += 1
        here.depth = getattr(here, "depth", 0) + 1
        try:
            yield
        finally:
            here.depth -= 1
            with self._lock:
                self._active -= 1

    def counted(self, work: Callable[P, T]) -> Callable[P, T]:
        """`work` counted by this guard whenever it runs (for a thread to run)."""

        @wraps(work)
        def run(*args: P.args, **kwargs: P.kwargs) -> T:
            with self.call():
                return work(*args, **kwargs)

        return run

    async def in_thread(self, work: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run `work` in a worker thread, counted: the hand-off of every route's store work."""
        return await run_in_threadpool(self.counted(work), *args, **kwargs)

    def close(self) -> None:
        """Refuse new store work from now on (work in progress goes on)."""
        with self._lock:
            self._closed = True

    def admitted(self, work: Callable[[], T]) -> Callable[[], T]:
        """`work` run past a closed guard (still counted): the stop's final touch flush."""

        def run() -> T:
            self._thread.admitted = True
            try:
                with self.call():
                    return work()
            finally:
                self._thread.admitted = False

        return run

    async def wait_idle(self, deadline: float) -> bool:
        """Wait until no store work is in progress, at most until `deadline` (monotonic);
        whether none is. Polled: the work ends in threads that cannot wake the loop."""
        while self._active and time.monotonic() < deadline:
            await asyncio.sleep(min(_IDLE_POLL_SECONDS, max(deadline - time.monotonic(), 0)))
        return not self._active
