"""A progress line on a terminal (stderr), silent when stderr is not one."""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR_WIDTH = 30
REFRESH_SECONDS = 0.1


class Progress:
    """`[####......]  40%  4,812/12,031 requests  1,020/s  ETA 7s`, redrawn in place."""

    def __init__(self, total: int, *, label: str, stream: TextIO | None = None) -> None:
        self.total = total
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self.started = time.perf_counter()
        self._drawn = 0.0
        self.done = 0

    def advance(self, count: int = 1) -> None:
        """Count finished work; redraws at most ten times a second."""
        self.done += count
        now = time.perf_counter()
        if self.enabled and (now - self._drawn >= REFRESH_SECONDS or self.done == self.total):
            self._drawn = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        share = self.done / self.total if self.total else 1.0
        filled = int(share * BAR_WIDTH)
        rate = self.done / max(now - self.started, 1e-9)
        eta = (self.total - self.done) / rate if rate else 0.0
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {share:4.0%} "
            f"{self.done:,}/{self.total:,} requests {rate:,.0f}/s ETA {eta:,.0f}s "
        )
        self.stream.flush()

    def close(self) -> None:
        """End the line."""
        if self.enabled:
            self._draw(time.perf_counter())
            self.stream.write("\n")
            self.stream.flush()
