"""What every peer measurement shares: free ports, server processes, timing, rows."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
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


def process_stat(pid: int) -> list[str]:
    """A process's /proc/PID/stat fields after its command name (field 3 onwards, from 0)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


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


def ensure_venv(
    venv_dir: Path,
    requirements: tuple[str, ...],
    *,
    distributions: tuple[str, ...],
    allow_install: bool,
    install_timeout_seconds: float = 1800,
) -> tuple[Path | None, str]:
    """A separate venv's python and "" or, when it cannot be had, None and the reason.

    Ready when every name in `distributions` is installed there; otherwise created and
    pip-installed with `requirements` only when `allow_install`. The venv holds a `.gitignore`
    of `*`, so a venv inside the work tree is never committed, whatever the repo ignores.
    """
    python = venv_dir / "bin" / "python"
    if _installed(python, distributions):
        return python, ""
    if not allow_install:
        return None, f"no venv with {', '.join(distributions)} at {venv_dir} (allow_install)"
    try:
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv_dir)], check=True)
        (venv_dir / ".gitignore").write_text("# made by bench/peers: never committed\n*\n")
        result = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "--no-input", *requirements],
            capture_output=True,
            text=True,
            check=False,
            timeout=install_timeout_seconds,
        )
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"could not create the venv {venv_dir}: {error}"
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if "WARNING" not in line]
        return None, f"pip install {' '.join(requirements)} failed: {lines[-1:]}"
    if not _installed(python, distributions):
        return None, f"installed {' '.join(requirements)} in {venv_dir}, but not found there"
    return python, ""


def _installed(python: Path, distributions: tuple[str, ...]) -> bool:
    if not python.exists():
        return False
    probe = "import importlib.metadata as m, sys; [m.version(n) for n in sys.argv[1:]]"
    result = subprocess.run(
        [str(python), "-c", probe, *distributions], capture_output=True, check=False, timeout=60
    )
    return result.returncode == 0


def ensure_apt_package(package: str, library: str, *, allow_install: bool) -> str:
    """ "" when `library` (a soname, e.g. "libibverbs.so.1") is on the linker's path, else why not.

    Installs Debian's `package` with apt-get only when `allow_install` (root only).
    """

    def present() -> bool:
        listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False)
        return f"{library} " in listing.stdout

    if present():
        return ""
    if not allow_install:
        return f"{library} missing (apt-get install {package})"
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"{library} missing and apt-get as root unavailable ({package})"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", package]
    result = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:  # an empty or stale package list: update once, try again
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=False)
        result = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
    if not present():
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"apt-get install {package} failed: {tail[0]}"
    return ""


def run_standalone(measure: Callable[..., list[Row]]) -> None:
    """`python -m bench.peers.X [--quick] [--install]`: one peer's table (BENCH_REPETITIONS)."""
    import sys  # noqa: PLC0415 - only a peer run as a script reads its argv

    from bench.report import format_table  # noqa: PLC0415

    rows = measure(
        quick="--quick" in sys.argv,
        repetitions=int(os.environ.get("BENCH_REPETITIONS", "5")),
        allow_install="--install" in sys.argv,
    )
    print(format_table(rows))
