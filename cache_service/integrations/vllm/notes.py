"""Warnings the connector logs at most once per interval, with how many were held back.

A cache problem repeats on every request (a service down, a layout refused): one line per
request would flood vLLM's log, none would hide it. The counts by reason are in the counters.
"""

from __future__ import annotations

import logging
import threading
import time

INTERVAL_SECONDS = 30.0
# vLLM configures only its own logger tree (its handler, format and VLLM_LOGGING_LEVEL): under
# it the connector's lines reach vLLM's log as vLLM's own do, the INFO start-up line included;
# under this package's own name they reached nobody but Python's last-resort stderr.
LOGGER_PREFIX = "vllm.prompt_cache_connector"


def connector_logger(module: str) -> logging.Logger:
    """The logger of the connector's module `module` (its `__name__`), in vLLM's tree."""
    return logging.getLogger(f"{LOGGER_PREFIX}.{module.rsplit('.', 1)[-1]}")


class RateLimitedLog:
    """A logger's warnings, at most one per INTERVAL_SECONDS."""

    def __init__(
        self, logger: logging.Logger, *, interval_seconds: float = INTERVAL_SECONDS
    ) -> None:
        self.logger = logger
        self.interval_seconds = interval_seconds
        self._lock = threading.Lock()
        self._next_at = 0.0
        self._held = 0

    def warn(self, text: str) -> None:
        """Log `text` unless a warning went out less than an interval ago (then count it)."""
        now = time.monotonic()
        with self._lock:
            if now < self._next_at:
                self._held += 1
                return
            held, self._held = self._held, 0
            self._next_at = now + self.interval_seconds
        suffix = f" ({held} more since the last such line)" if held else ""
        self.logger.warning("%s%s", text, suffix)
