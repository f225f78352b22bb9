"""Per-key rate quotas (requests and bytes per second), shared by every worker process.

Each key with a quota has two token buckets (requests, bytes), kept in a small memory-mapped
file beside the data: every worker maps the same file and changes a key's slot under a POSIX
record lock on that slot, so the quota holds for the machine, not per process. A bucket
holds one second of its rate; a request is admitted while its buckets are not empty, costs
one request at once and its bytes (body in and out) when it ends, so a large transfer can
take a bucket below zero and the key then waits until it has paid for it. A declared body
(Content-Length) is charged on admission, so concurrent large uploads cannot all slip in
while the bucket is still full.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import xxhash

from cache_service.service.api_keys import ApiKey

_SLOT = struct.Struct("<dddd")  # request tokens, at; byte tokens, at
_HEADER = struct.Struct("<8sQ")  # magic, fingerprint of the slot layout
_MAGIC = b"PCQUOTA1"


class QuotaBook:
    """Token buckets by key id over a shared file (or private memory when `path` is None)."""

    def __init__(
        self,
        keys: Sequence[ApiKey],
        folder: Path | None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._keys = {key.id: key for key in keys if key.has_quota}
        ids = sorted(self._keys)
        self._slots = {key_id: index for index, key_id in enumerate(ids)}
        self._clock = clock
        self._lock = threading.Lock()  # record locks are per process: threads need this too
        size = _HEADER.size + _SLOT.size * max(len(ids), 1)
        layout = xxhash.xxh3_64_intdigest("\0".join(ids).encode())
        self._fd: int | None = None
        header = _HEADER.pack(_MAGIC, layout)
        if folder is None:
            self._map = mmap.mmap(-1, size)
        else:
            # One file per set of keys: workers started from another key file map another
            # file, so a file in use is never resized under a worker that maps it.
            path = folder / f"quotas-{layout:016x}.bin"
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.lockf(self._fd, fcntl.LOCK_EX)
            try:
                if os.fstat(self._fd).st_size < size:  # new: every bucket starts full
                    os.ftruncate(self._fd, size)
                    os.pwrite(self._fd, header, 0)
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN)
            self._map = mmap.mmap(self._fd, size)
        if folder is None:
            self._map[: _HEADER.size] = header

    def admit(self, key: ApiKey, upfront_bytes: int = 0) -> tuple[float, str] | None:
        """Take one request (and `upfront_bytes`, its declared body) from the key's buckets;
        None if admitted, else how many seconds to wait and which quota is spent."""
        if key.id not in self._slots:
            return None
        with self._locked(key.id) as offset:
            request_tokens, byte_tokens, now = self._read(key, offset)
            wait: tuple[float, str] | None = None
            if key.requests_per_second is not None and request_tokens < 1:
                wait = ((1 - request_tokens) / key.requests_per_second, "requests_per_second")
            elif key.bytes_per_second is not None and byte_tokens < 0:
                wait = (-byte_tokens / key.bytes_per_second, "bytes_per_second")
            else:
                request_tokens -= 1
                byte_tokens -= upfront_bytes
            self._write(offset, request_tokens, byte_tokens, now)
        return wait

    def spend_bytes(self, key: ApiKey, count: int) -> None:
        """Charge bytes a request moved beyond what it was charged on admission (negative:
        a refund, for a body that came short of its declared length)."""
        if key.bytes_per_second is None or key.id not in self._slots or count == 0:
            return
        with self._locked(key.id) as offset:
            request_tokens, byte_tokens, now = self._read(key, offset)
            self._write(offset, request_tokens, byte_tokens - count, now)

    @contextmanager
    def _locked(self, key_id: str) -> Iterator[int]:
        """A key's slot offset, locked in this process and across processes while in use."""
        offset = _HEADER.size + _SLOT.size * self._slots[key_id]
        with self._lock:
            if self._fd is not None:
                fcntl.lockf(self._fd, fcntl.LOCK_EX, _SLOT.size, offset)
            try:
                yield offset
            finally:
                if self._fd is not None:
                    fcntl.lockf(self._fd, fcntl.LOCK_UN, _SLOT.size, offset)

    def _read(self, key: ApiKey, offset: int) -> tuple[float, float, float]:
        """Both buckets of a slot, refilled for the time passed, and the time."""
        now = self._clock()
        request_tokens, request_at, byte_tokens, byte_at = _SLOT.unpack_from(self._map, offset)
        return (
            _refill(request_tokens, request_at, now, key.requests_per_second, minimum=1.0),
            _refill(byte_tokens, byte_at, now, key.bytes_per_second, minimum=0.0),
            now,
        )

    def _write(self, offset: int, request_tokens: float, byte_tokens: float, now: float) -> None:
        _SLOT.pack_into(self._map, offset, request_tokens, now, byte_tokens, now)

    def close(self) -> None:
        """Unmap and close the file."""
        self._map.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _refill(tokens: float, at: float, now: float, rate: float | None, *, minimum: float) -> float:
    """A bucket after `now - at` seconds at `rate`, holding at most one second's worth (and
    at least `minimum`, so that a slow rate still admits one request). A slot never written
    (at == 0) starts full."""
    if rate is None:
        return 0.0
    capacity = max(rate, minimum)
    if at == 0.0:
        return capacity
    return min(capacity, tokens + max(now - at, 0.0) * rate)
