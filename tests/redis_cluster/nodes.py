"""Single redis-server processes (not a cluster) for the Redis store's tests: refused
settings, a node killed or full, a node restarted."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.redis_cluster.conftest import require_tools

MEMORY = ["--maxmemory", str(64 * 2**20), "--maxmemory-policy", "volatile-lru"]


@contextmanager
def single_node(directory: Path, *args: str) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """One redis-server (not a cluster) on a free port, stopped after. A port taken between
    choosing and binding it (other tests start servers too) is chosen again."""
    server, _cli = require_tools()
    for _attempt in range(5):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        process = subprocess.Popen(
            [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(directory), *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        if _answers(process, port):
            break
        process.kill()
        process.wait()
    else:
        raise AssertionError("redis-server did not start on any of 5 ports")
    try:
        yield process, port
    finally:
        process.kill()
        process.wait()


def _answers(process: subprocess.Popen[bytes], port: int) -> bool:
    """Whether the server listens on `port` within 20 s (False at once if it exited)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and process.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            time.sleep(0.05)
    return False
