"""Server processes of the reliability tests: find them, SIGKILL them, restart them, and
read what they counted.

`kill_server` kills a server and everything below it by PID (a `--workers` supervisor's
children are collected first: an orphaned worker would keep serving the socket);
`worker_pids` tells uvicorn's workers from the supervisor's other children.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from tests.integration.conftest import ServerProcess

EVICTED = re.compile(
    r'^prompt_cache_evicted_blocks_total\{[^}]*reason="([^"]+)"[^}]*\} (\S+)$', re.MULTILINE
)


def kill_now(pid: int) -> None:
    """SIGKILL one process by its PID."""
    with contextlib.suppress(ProcessLookupError):  # it died already
        os.kill(pid, signal.SIGKILL)


def children(pid: int) -> list[int]:
    """The PIDs of a process's children, from /proc (every thread's list)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):  # the thread or the process ended meanwhile
            found += [int(child) for child in (task / "children").read_text().split()]
    return found


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, children first."""
    below = children(pid)
    return below + [grandchild for child in below for grandchild in descendants(child)]


def worker_pids(supervisor: int) -> set[int]:
    """uvicorn's worker processes: the supervisor's children started by multiprocessing spawn
    (its resource tracker is a child too, and is not a worker)."""
    workers = set()
    for child in children(supervisor):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in command:
            workers.add(child)
    return workers


def wait_gone(pids: list[int], timeout_seconds: float = 10.0) -> None:
    """Wait until none of `pids` runs (reaped, or a zombie)."""
    deadline = time.monotonic() + timeout_seconds
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                break
            if state == "Z":
                break
            time.sleep(0.01)


def kill_tree(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL a server process and every process below it (collected first: an orphan
    would keep serving the socket), and wait until they are gone."""
    below = descendants(process.pid)
    kill_now(process.pid)  # the supervisor first, so it restarts nothing
    for pid in below:
        kill_now(pid)
    process.wait()
    wait_gone(below)


def kill_server(server: ServerProcess) -> None:
    """SIGKILL the server and its children, then forget the dead process."""
    assert server.proc is not None
    kill_tree(server.proc)
    server.stop()  # it has exited: this only forgets it


def kill_while_starting(server: ServerProcess, delay_seconds: float) -> None:
    """Start the killed server and SIGKILL it `delay_seconds` later, most often before it is
    ready (opening, checking or repairing its store); it may have become ready."""

    def start() -> None:
        with contextlib.suppress(RuntimeError):  # "server exited early": the kill came first
            server.start()

    starter = threading.Thread(target=start)
    starter.start()
    while server.proc is None and starter.is_alive():
        time.sleep(0.001)
    time.sleep(delay_seconds)
    if server.proc is not None:
        kill_tree(server.proc)
    starter.join()
    server.stop()  # it has exited: this only forgets it


def restart(server: ServerProcess) -> float:
    """Start the killed server again on its folder and port; seconds until it was ready."""
    began = time.monotonic()
    server.start()
    return time.monotonic() - began


def wait_workers(
    supervisor: int, *, count: int, without: int | None = None, timeout_seconds: float = 30.0
) -> set[int]:
    """The supervisor's workers once there are `count` of them, none of them `without`."""
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        workers = worker_pids(supervisor)
        if len(workers) == count and without not in workers:
            return workers
        time.sleep(0.02)
    raise AssertionError(f"{count} workers not running after {timeout_seconds}s: {workers}")


def wait_serving(log_path: Path, pid: int, timeout_seconds: float = 60.0) -> None:
    """Wait until worker `pid` has opened its store and serves: its start-up line (written
    by the service's start-up, `process <pid> serves ...`) is in the server's log."""
    line = f"process {pid} serves ".encode()
    deadline = time.monotonic() + timeout_seconds
    while line not in log_path.read_bytes():
        if time.monotonic() > deadline:
            raise AssertionError(f"worker {pid} not serving after {timeout_seconds}s")
        time.sleep(0.02)


def evicted_blocks(url: str) -> int:
    """Blocks evicted since the server last started, every reason, from /metrics."""
    return sum(evicted_in(httpx.get(url + "/metrics", timeout=30.0).text).values())


def evicted_in(metrics_text: str) -> Counter[str]:
    """Blocks removed by reason (capacity, expired, ...) in a /metrics answer."""
    found: Counter[str] = Counter()
    for reason, value in EVICTED.findall(metrics_text):
        found[reason] += int(float(value))
    return found


def logged_errors(log_path: Path) -> list[str]:
    """The server log's error lines and tracebacks (a failure no answer showed, such as one
    in a background job)."""
    lines = log_path.read_text(errors="replace").splitlines()
    return [line for line in lines if line.startswith(("ERROR", "CRITICAL", "Traceback"))]
