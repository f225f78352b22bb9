"""How the proxy words failures: an httpx error as one line, and warnings at most once per
interval per subject (a down engine fails every request sent its way; one line says so)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("cache_service.tools.pd_proxy")
LOG_INTERVAL_SECONDS = 30.0


def describe_error(exc: BaseException) -> str:
    """An error as one short line: its class, and its message when it has one."""
    message = str(exc).strip()
    name = type(exc).__name__
    return f"{name}: {message}" if message else name


class ThrottledLog:
    """Warnings on the proxy's logger, at most one per subject every `interval_seconds`."""

    def __init__(
        self,
        *,
        interval_seconds: float = LOG_INTERVAL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._interval_seconds = interval_seconds
        self._clock = clock
        self._logged_at: dict[str, float] = {}

    def warning(self, subject: str, message: str, *args: object) -> bool:
        """Log `message % args` unless `subject` was logged within the interval; whether it
        was logged."""
        now = self._clock()
        last = self._logged_at.get(subject)
        if last is not None and now - last < self._interval_seconds:
            return False
        self._logged_at[subject] = now
        log.warning(message, *args)
        return True
