"""The usage log: one JSON line per lookup (time, tenant, key, model, hit and miss tokens),
for billing. Append-only and rotated by size.

Several worker processes append to one file. Each flush opens the file by name, writes its
lines in one O_APPEND write and closes it, so a flush right after a rotation lands in the new
file; rotation itself takes a lock file, so two workers never rotate at once.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import orjson

DEFAULT_MAX_BYTES = 100 * 2**20
DEFAULT_KEEP = 5


class UsageLog:
    """Buffered usage records, written by `flush` (the service flushes it with its touches)."""

    def __init__(
        self,
        path: Path,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        keep: int = DEFAULT_KEEP,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self._clock = clock
        self._lines: list[bytes] = []
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)

    def record(
        self, *, tenant: str, key_id: str, model: str, hit_tokens: int, miss_tokens: int
    ) -> None:
        """Queue one lookup's record."""
        at = datetime.fromtimestamp(self._clock(), UTC).isoformat(timespec="milliseconds")
        line = orjson.dumps(
            {
                "time": at.replace("+00:00", "Z"),
                "tenant": tenant,
                "key": key_id,
                "model": model,
                "prompt_cache_hit_tokens": hit_tokens,
                "prompt_cache_miss_tokens": miss_tokens,
            }
        )
        with self._lock:
            self._lines.append(line + b"\n")

    def flush(self) -> int:
        """Append the queued records; returns how many. Rotates once the file is too big."""
        with self._lock:
            lines, self._lines = self._lines, []
        if not lines:
            return 0
        descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        try:
            os.write(descriptor, b"".join(lines))
            size = os.fstat(descriptor).st_size
        finally:
            os.close(descriptor)
        if size >= self.max_bytes:
            self._rotate()
        return len(lines)

    def _rotate(self) -> None:
        """usage.jsonl -> usage.jsonl.1 -> ... -> .keep (the oldest is dropped)."""
        with self.path.with_name(self.path.name + ".lock").open("ab") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:  # another worker may have rotated while this one waited
                if self.path.stat().st_size < self.max_bytes:
                    return
            except FileNotFoundError:
                return
            for index in range(self.keep - 1, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{index}")
                if older.exists():
                    older.replace(self.path.with_name(f"{self.path.name}.{index + 1}"))
            self.path.replace(self.path.with_name(self.path.name + ".1"))
