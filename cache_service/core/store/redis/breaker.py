"""A circuit breaker for writes to a remote store: after a few failures in a row, writes
are refused at once for a while (503 with Retry-After) instead of each waiting for a timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from cache_service.core.errors import StorageFailure

FAILURES_TO_OPEN = 3
OPEN_SECONDS = 2.0


class CircuitBreaker:
    """Closed: calls go through. Open (after `failures` in a row): refused until `open_for`
    seconds pass; then one call is let through to probe, and its outcome decides."""

    def __init__(
        self,
        *,
        failures: int = FAILURES_TO_OPEN,
        open_for: float = OPEN_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failures = failures
        self.open_for = open_for
        self.clock = clock
        self.opened_total = 0
        self._in_a_row = 0
        self._open_until = 0.0
        self._lock = threading.Lock()

    def check(self, what: str) -> None:
        """StorageFailure (503, Retry-After) while open; else let the call go."""
        with self._lock:
            wait = self._open_until - self.clock()
            if wait > 0:
                raise StorageFailure(
                    f"{what} refused: the store failed {self.failures} times in a row and "
                    f"is given {self.open_for:g} s to recover",
                    retry_after_seconds=wait,
                )

    def succeeded(self) -> None:
        """A call went through: close."""
        with self._lock:
            self._in_a_row = 0

    def failed(self) -> None:
        """A call failed: open once `failures` happened in a row."""
        with self._lock:
            self._in_a_row += 1
            if self._in_a_row >= self.failures:
                self._open_until = self.clock() + self.open_for
                self._in_a_row = 0
                self.opened_total += 1
