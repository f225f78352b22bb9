"""What a service process does besides answering requests: repeated jobs, and the jobs only
one worker process may run (the expiry sweeper, the separate metrics port)."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO, Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

from cache_service.core.capacity import EVICT_BATCH_BLOCKS
from cache_service.core.errors import StorageError

log = logging.getLogger("cache_service")

METRICS_RETRY_SECONDS = 5.0
DISK_CHECK_SECONDS = 30.0
# A store error (a full disk) repeats on every run of a job until it clears: say it once a
# minute with its reason, not a traceback every 50 ms.
STORE_ERROR_LOG_SECONDS = 60.0


async def repeat(interval_seconds: float, job: Callable[[], Awaitable[Any]], name: str) -> None:
    """Run `job` every `interval_seconds` until cancelled; a failure is logged, not fatal (a
    store error at most once every STORE_ERROR_LOG_SECONDS while it lasts)."""
    logged_at: float | None = None
    while True:
        await asyncio.sleep(interval_seconds)
        try:
            await job()
        except StorageError as exc:
            now = time.monotonic()
            if logged_at is None or now - logged_at >= STORE_ERROR_LOG_SECONDS:
                logged_at = now
                log.warning("background job %s: %s; retrying every %.1fs", name, exc,
                            interval_seconds)  # fmt: skip
        except Exception:
            log.exception("background job %s failed; retrying in %.1fs", name, interval_seconds)
        else:
            if logged_at is not None:
                log.info("background job %s runs again", name)
                logged_at = None


def disk_check(measure: Callable[[], object]) -> Callable[[], Awaitable[None]]:
    """The disk check job: `measure` (the capacity's `disk`, counted by the store guard) the
    room the store's file system has left (its warning, rate-limited, is the capacity's; the
    gauges read the same measure at scrape time)."""

    async def check() -> None:
        await asyncio.to_thread(measure)

    return check


class ElectionLock:
    """Elects one worker process for a job (an advisory lock file beside the data); if that
    process exits, the lock is free and another worker takes the job at its next try."""

    def __init__(self, folder: Path | None, name: str) -> None:
        self._path = folder / name if folder is not None else None
        self._file: IO[bytes] | None = None

    def held(self) -> bool:
        """Whether this process has the job (trying to take it if nobody has)."""
        if self._path is None or self._file is not None:
            return True
        handle = self._path.open("ab")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            return False
        self._file = handle
        return True

    def release(self) -> None:
        """Give the job up (closing the file drops the lock)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def sweeper(
    sweep_batch: Callable[[], int],
    lock: ElectionLock,
    run_write: Callable[[Callable[[], int]], Awaitable[int]],
) -> Callable[[], Awaitable[None]]:
    """The expiry sweep job: `sweep_batch` (one batch, returning the blocks it removed) run
    by the worker holding `lock` only, each batch through `run_write` (the write gate, so
    that a stop waits for a batch in progress)."""

    async def sweep() -> None:
        if not lock.held():
            return  # another worker sweeps: deleting the same blocks twice would only contend
        # Short batches, each its own transaction, so writers never wait long for the lock.
        while await run_write(sweep_batch) >= EVICT_BATCH_BLOCKS:
            await asyncio.sleep(0)

    return sweep


class MetricsPort:
    """/metrics on a port of its own, without authentication, served by one worker: every
    worker's counts are in the scrape registry (multiprocess mode), so one server suffices."""

    def __init__(
        self,
        host: str,
        port: int | None,
        registry: CollectorRegistry,
        lock: ElectionLock,
    ) -> None:
        self._host = host
        self._port = port
        self._registry = registry
        self._lock = lock
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def ensure(self) -> None:
        """Serve the port if configured, this worker is elected and it is not served yet."""
        if self._port is None or self._server is not None or not self._lock.held():
            return
        try:
            self._server, self._thread = start_http_server(
                self._port, addr=self._host, registry=self._registry
            )
        except OSError as exc:
            self._lock.release()
            log.error("cannot serve metrics on %s:%s: %s", self._host, self._port, exc)

    async def ensure_async(self) -> None:
        """`ensure`, for the repeated-job runner."""
        self.ensure()

    def close(self) -> None:
        """Stop serving and give the port up."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self._lock.release()
