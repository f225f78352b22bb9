"""uvicorn, run so that a stop always ends, and a clean stop exits with status 0.

uvicorn re-raises the signal that stopped it once it has shut down, so a clean SIGTERM ends
the process with -15; here the stop the signal asked for counts as done (status 0). From the
signal on, a watchdog bounds the whole stop: should anything in it hang (a thread that never
leaves the store, say), the process exits anyway, with status 1, after the bound. With
`--workers N` the supervisor runs the same server in every worker and waits for its workers
at most that bound (plus a margin) before it kills what is left.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
from collections.abc import Iterator
from types import FrameType

import uvicorn
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors import multiprocess

from cache_service.service.api.lifecycle import FINAL_FLUSH_SECONDS

log = logging.getLogger("cache_service")

EXIT_STOP_OVERRAN = 1  # the stop did not finish in its bound; LMDB keeps committed writes
# What the process needs past the stop itself: uvicorn's pause before its graceful wait,
# the end of the event loop, threads joined at exit, and a loaded machine's delays.
EXIT_MARGIN_SECONDS = 3.0
SUPERVISOR_MARGIN_SECONDS = 2.0


def exit_bound_seconds(shutdown_timeout: float) -> float:
    """How long after SIGTERM a service process has exited at the latest: open connections
    get --shutdown-timeout (uvicorn's graceful timeout), the stop as long again for the
    store calls still in flight, then the final touch flush, then the margin."""
    return 2 * shutdown_timeout + FINAL_FLUSH_SECONDS + EXIT_MARGIN_SECONDS


def _exit_after(seconds: float) -> None:
    threading.Event().wait(seconds)
    log.error(
        "the stop did not finish within %.1fs of the signal; exiting now without it "
        "(the store keeps every committed write)",
        seconds,
    )
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    os._exit(EXIT_STOP_OVERRAN)


class StoppingServer(uvicorn.Server):
    """uvicorn's server whose signal-driven stop is bounded and ends in a normal exit."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._watchdog: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Begin the graceful stop, and arm the watchdog that bounds it."""
        super().handle_exit(sig, frame)
        if self._watchdog is None:
            graceful = self.config.timeout_graceful_shutdown or 0.0
            self._watchdog = threading.Thread(
                target=_exit_after,
                args=(exit_bound_seconds(graceful),),
                name="stop-watchdog",
                daemon=True,  # the process never waits for it
            )
            self._watchdog.start()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's signal handling, without raising the signal again after a clean stop."""
        with super().capture_signals():
            yield
            # The stop the signal asked for is done: what remains is a normal exit.
            self._captured_signals.clear()


class WorkerProcess(multiprocess.Process):
    """A `--workers` process that runs a StoppingServer."""

    @property
    def server(self) -> uvicorn.Server:
        """This worker's server (made in the worker process)."""
        if self._server is None:
            self._server = StoppingServer(config=self.config)
        return self._server


class Supervisor(multiprocess.Multiprocess):
    """uvicorn's supervisor of `--workers` processes, whose workers stop like a single
    process does, and which waits for them a bounded time only."""

    def run(self) -> None:
        """Run the workers until a signal, then stop them."""
        # uvicorn's supervisor makes every worker (at start, on a restart, on SIGTTIN) with
        # its module's `Process`: ours for as long as it runs.
        original = multiprocess.Process
        multiprocess.Process = WorkerProcess  # type: ignore[misc]
        try:
            super().run()
        finally:
            multiprocess.Process = original  # type: ignore[misc]

    def join_all(self) -> None:
        """Wait for the workers at most their exit bound plus a margin; kill those left."""
        graceful = self.config.timeout_graceful_shutdown or 0.0
        wait_seconds = exit_bound_seconds(graceful) + SUPERVISOR_MARGIN_SECONDS
        for process in self.processes:
            process.process.join(wait_seconds)  # each worker stops on its own watchdog
        for process in self.processes:
            if process.exitcode is None:
                log.error("worker %s did not exit in %.1fs; killing it", process.pid, wait_seconds)
                process.kill()
                process.process.join()

    @property
    def status(self) -> int:
        """0 if every worker ended its stop cleanly, else EXIT_STOP_OVERRAN."""
        clean = all(process.exitcode == 0 for process in self.processes)
        return 0 if clean else EXIT_STOP_OVERRAN


def run_single(config: uvicorn.Config) -> int:
    """Serve in this process until a signal; the exit status."""
    server = StoppingServer(config)
    server.run()
    return 0 if server.started else STARTUP_FAILURE


def run_workers(config: uvicorn.Config) -> int:
    """Serve with `config.workers` processes on one socket until a signal; the exit status."""
    sock: socket.socket = config.bind_socket()
    try:
        supervisor = Supervisor(config, sockets=[sock])
        supervisor.run()
    finally:
        sock.close()
    return supervisor.status
