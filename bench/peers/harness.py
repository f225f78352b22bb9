"""What every peer measurement shares: free ports, server processes, timing, rows."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any

from bench.peers.payloads import MB_PER_S, SCENARIO
from bench.report import Row, latency_row

SINGLE_BLOCK_REPETITION_FACTOR = 10  # single blocks are cheap: more samples make a real p99


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def wait_for_port(port: int, *, process: subprocess.Popen[Any], timeout_seconds: float) -> None:
    """Wait until something accepts on 127.0.0.1:port; raise if the process died or time ran out."""
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with code {process.returncode} before listening")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.02)
    raise RuntimeError(f"server did not listen on 127.0.0.1:{port} within {timeout_seconds} s")


def stop_process(process: subprocess.Popen[Any], *, timeout_seconds: float = 5.0) -> None:
    """Stop a process this module started, by its PID: SIGTERM, then SIGKILL."""
    if process.poll() is not None:
        return
    os.kill(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout_seconds)
    except subprocess.TimeoutExpired:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=timeout_seconds)


def time_calls(
    work: Callable[[], object],
    *,
    repetitions: int,
    warmup: int = 1,
    before: Callable[[], object] | None = None,
    check: Callable[[object], None] | None = None,
) -> list[float]:
    """Seconds per call of `work`, after `warmup` untimed calls.

    `before` runs untimed before each call (e.g. to empty the store before a write);
    `check` runs untimed on each result (e.g. to compare fetched bytes with the payload).
    """
    seconds = []
    for index in range(warmup + repetitions):
        if before is not None:
            before()
        started = time.perf_counter()
        result = work()
        elapsed = time.perf_counter() - started
        if check is not None:
            check(result)
        if index >= warmup:
            seconds.append(elapsed)
    return seconds


def payload_rows(
    case: str,
    subject: str,
    client: str,
    seconds: list[float],
    *,
    payload_bytes: int,
    note: str = "",
    **extra: Any,
) -> list[Row]:
    """Two rows for one case: latency (p50 and p99, ms) and bandwidth at p50 (MB/s, 10^6 B)."""
    latency = latency_row(SCENARIO, case, subject, client, seconds, note=note)
    latency.extra = {"payload_bytes": payload_bytes, **extra}
    assert latency.p50 is not None and latency.p99 is not None
    p50_seconds, p99_seconds = latency.p50 / 1000, latency.p99 / 1000
    bandwidth = Row(
        SCENARIO,
        case,
        subject,
        client,
        payload_bytes / p50_seconds / 1e6,
        MB_PER_S,
        samples=len(seconds),
        note=note,
        extra={
            "payload_bytes": payload_bytes,
            "mb_per_s_at_p99_latency": payload_bytes / p99_seconds / 1e6,
            **extra,
        },
    )
    return [latency, bandwidth]


def check_equal(expected: list[bytes]) -> Callable[[object], None]:
    """A `check` for time_calls: the fetched values equal `expected`, in order."""

    def check(result: object) -> None:
        values = list(result) if isinstance(result, list | tuple) else [result]
        if len(values) != len(expected) or any(
            got != want for got, want in zip(values, expected, strict=True)
        ):
            raise AssertionError("fetched payload differs from what was stored")

    return check
