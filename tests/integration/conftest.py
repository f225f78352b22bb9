"""A real `cache-service serve` process on 127.0.0.1, started and stopped by its fixture."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

STARTUP_SECONDS = 20.0


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def service_command() -> list[str]:
    """The installed `cache-service` console script beside this Python, as users run it."""
    script = Path(sys.executable).with_name("cache-service")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "cache_service.cli"]  # not installed: run the module


def wait_until_ready(
    proc: subprocess.Popen[bytes], ready_url: str, log_path: Path, seconds: float
) -> bool:
    """Whether `ready_url` answered 200 within `seconds`; RuntimeError with the process's log
    if the process ends first."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited early:\n{log_path.read_text()}")
        try:
            if httpx.get(ready_url, timeout=1.0).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    return False


def stop_process(proc: subprocess.Popen[bytes], *, seconds: float) -> None:
    """Stop a process a test started: SIGTERM, then SIGKILL after `seconds`, by its PID."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ServerProcess:
    """One service process; `restart()` keeps its data folder and port."""

    def __init__(self, data_dir: Path, log_path: Path, **flags: str) -> None:
        self.data_dir = data_dir
        self.log_path = log_path
        self.flags = flags
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Base URL of the service."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start the process and wait until /readyz answers 200."""
        args = [*service_command(), "serve", "--host", "127.0.0.1"]
        args += ["--port", str(self.port), "--data-dir", str(self.data_dir)]
        for name, value in self.flags.items():
            args += ["--" + name.replace("_", "-"), value]
        env = {k: v for k, v in os.environ.items() if not k.startswith("CACHE_SERVICE_")}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        if not wait_until_ready(self.proc, self.url + "/readyz", self.log_path, STARTUP_SECONDS):
            self.stop()
            raise RuntimeError(
                f"server not ready in {STARTUP_SECONDS}s:\n{self.log_path.read_text()}"
            )

    def stop(self) -> None:
        """Stop the process this object started (SIGTERM, then SIGKILL), by its PID."""
        if self.proc is None:
            return
        stop_process(self.proc, seconds=15)
        self.proc = None

    def restart(self) -> None:
        """Stop and start again on the same data folder and port."""
        self.stop()
        self.start()


@pytest.fixture
def server(make_server: Callable[..., ServerProcess]) -> ServerProcess:
    """One service on default settings (touch flushes every 50 ms to keep tests quick)."""
    return make_server(touch_flush_interval="0.05")


# Keys of two tenants and an operator, for the servers that run with --auth keys.
KEY_ROLES = {
    "a-writer": ("team-a", "writer"),
    "a-reader": ("team-a", "reader"),
    "b-writer": ("team-b", "writer"),
    "ops": ("operators", "admin"),
}


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, str]:
    """Fresh secrets by key id; `tmp_path/keys.toml` holds only their digests."""
    from cache_service.service.api_keys import Role, key_file_entry, new_key  # noqa: PLC0415

    secrets = {key_id: new_key() for key_id in KEY_ROLES}
    entries = [
        key_file_entry(key_id, tenant, Role.parse(role), secrets[key_id])
        for key_id, (tenant, role) in KEY_ROLES.items()
    ]
    (tmp_path / "keys.toml").write_text("\n".join(entries))
    return secrets
