"""Processes the bench starts on 127.0.0.1: our service and the framework floor."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.peers.harness import free_port, stop_process, wait_for_port


@dataclass
class Service:
    """A running server process."""

    url: str
    process: subprocess.Popen[bytes]
    data_dir: Path | None = None

    def peak_rss_mib(self) -> float:
        """The process's peak resident set size so far (VmHWM)."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")


def fetch_requests(url: str) -> float:
    """How many POST /v1/blocks/fetch our service at `url` has answered (its /metrics)."""
    return route_requests(url, "/v1/blocks/fetch")


def route_requests(url: str, route: str) -> float:
    """How many requests to `route` our service at `url` has answered (its /metrics)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in httpx.get(url + "/metrics", timeout=30).text.splitlines()
        if line.startswith("prompt_cache_requests_total") and f'"{route}"' in line
    )


def _script(name: str) -> list[str]:
    script = Path(sys.executable).with_name(name)
    return [str(script)] if script.exists() else [sys.executable, "-m", "cache_service.cli"]


@contextmanager
def our_service(data_dir: Path | None = None, **flags: Any) -> Iterator[Service]:
    """`cache-service serve` on `data_dir` or a fresh folder; stopped (by PID) on exit."""
    with tempfile.TemporaryDirectory(prefix="bench-data-") as fresh:
        folder = str(data_dir or fresh)
        port = free_port()
        args = [*_script("cache-service"), "serve", "--host", "127.0.0.1", "--port", str(port)]
        args += ["--data-dir", folder, "--log-level", "warning"]
        for name, value in flags.items():
            args += ["--" + name.replace("_", "-"), str(value)]
        process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for_port(port, process=process, timeout_seconds=30)
            yield Service(f"http://127.0.0.1:{port}", process, Path(folder))
        finally:
            stop_process(process)


@contextmanager
def floor_service() -> Iterator[Service]:
    """The framework floor (bench/floor_app.py) under the same uvicorn settings."""
    port = free_port()
    args = [sys.executable, "-m", "bench.floor_app", "--port", str(port)]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, process=process, timeout_seconds=30)
        yield Service(f"http://127.0.0.1:{port}", process)
    finally:
        stop_process(process)
