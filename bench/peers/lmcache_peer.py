"""LMCache's cache server as a peer, driven by LMCache's own Python client.

`lmcache` (PyPI) pins numpy<=2.2.6 and prometheus_client<=0.24.1 and pulls in torch, so it
lives in its own virtual environment (`bench/.venv-lmcache`, never committed: the venv holds
a `.gitignore` of `*`), with PyTorch's CPU build (`torch==2.13.0`, a wheel this machine keeps
on disk). There `lmcache_server HOST PORT cpu` runs LMCache's remote cache server
(`lmcache.v1.server`: a threaded Python socket server keeping chunks in a dict), and
`lmcache_client.py` drives `LMCServerConnector`, the client behind an `lm://host:port` remote
URL, through one connection: the 32k prefix as 512 chunks of 64 tokens, and the single blocks.

Two servers are measured. `lmcache_server` as shipped: it sends a GET's 28-byte header and
its payload in two `sendall` calls with Nagle's algorithm on, and the client delays its ACK,
so each 56,960-byte chunk waits about 40 ms (a 32k-prefix fetch takes over 20 s). And the same
server with TCP_NODELAY set on accepted sockets by a three-line wrapper in this module (the
subject says so), which shows what its Python data path costs without that stall. Quick mode
measures only the second; full mode both, the stock server's prefix fetch with 2 runs.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.peers.harness import (
    SINGLE_BLOCK_REPETITION_FACTOR,
    ensure_venv,
    free_port,
    payload_rows,
    run_standalone,
    stop_process,
    wait_for_port,
)
from bench.peers.payloads import SCENARIO, prefix_case, single_case
from bench.report import Row, skipped

HERE = Path(__file__).resolve().parent
DEFAULT_VENV = HERE.parent / ".venv-lmcache"
LMCACHE_VERSION = "0.5.6"
TORCH_VERSION = "2.13.0"  # the CPU build kept on this machine's disk; newer ones pull CUDA
PIP_REQUIREMENTS = (f"torch=={TORCH_VERSION}", f"lmcache=={LMCACHE_VERSION}")
CLIENT = "LMCServerConnector"
SUBJECT_STOCK = "lmcache_server"
SUBJECT_NODELAY = "lmcache_server+NODELAY"
STOCK_FETCH_REPETITIONS = 2  # each 32k-prefix fetch from the stock server takes ~23 s
SERVER_START_SECONDS = 60  # importing torch and lmcache takes a few seconds

NODELAY_SERVER = """
import socket, sys
_accept = socket.socket.accept
def accept(self):
    conn, address = _accept(self)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn, address
socket.socket.accept = accept
from lmcache.v1.server.__main__ import main
main()
"""


def ensure_lmcache_venv(
    allow_install: bool, *, venv_dir: Path = DEFAULT_VENV
) -> tuple[Path | None, str]:
    """The venv's python and "" or, when it cannot be had, None and the reason.

    Creates the venv and pip-installs torch's CPU build and lmcache only when `allow_install`
    (about 70 s and 1.9 GB here; pip finds torch on this machine's disk).
    """
    python, reason = ensure_venv(
        venv_dir,
        PIP_REQUIREMENTS,
        distributions=("lmcache", "torch"),
        allow_install=allow_install,
    )
    if python is not None and not (venv_dir / "bin" / "lmcache_server").exists():
        return None, f"{venv_dir} has lmcache but no lmcache_server script"
    return python, reason


def _run_against(
    python: Path, server_command: list[str], *, repetitions: dict[str, int], timeout_seconds: float
) -> dict[str, Any]:
    """Start a server, run the client script against it, stop the server; the client's JSON."""
    port = free_port()
    with tempfile.TemporaryFile() as server_log:
        server = subprocess.Popen(
            [*server_command, "127.0.0.1", str(port), "cpu"],
            stdout=server_log,
            stderr=subprocess.STDOUT,
            cwd=tempfile.gettempdir(),
        )
        try:
            wait_for_port(port, process=server, timeout_seconds=SERVER_START_SECONDS)
            client = subprocess.run(
                [
                    str(python),
                    str(HERE / "lmcache_client.py"),
                    str(HERE / "payloads.py"),
                    str(port),
                    json.dumps(repetitions),
                ],
                capture_output=True,
                text=True,
                check=False,
                timeout=timeout_seconds,
                cwd=tempfile.gettempdir(),
            )
        finally:
            stop_process(server)
        if client.returncode != 0:
            tail = [line for line in client.stderr.splitlines() if line.strip()][-3:]
            raise RuntimeError(f"LMCache client failed: {' | '.join(tail)}")
    result: dict[str, Any] = json.loads(client.stdout.strip().splitlines()[-1])
    return result


def _rows(result: dict[str, Any], subject: str, note: str) -> list[Row]:
    extra = {"lmcache": result["lmcache_version"], "torch": result["torch_version"]}
    rows: list[Row] = []
    prefix = result["prefix"]
    for operation in ("store", "fetch"):
        seconds = prefix.get(f"{operation}_seconds")
        if seconds:
            rows += payload_rows(
                prefix_case(operation, f"{prefix['blocks']} blocks"),
                subject,
                CLIENT,
                seconds,
                payload_bytes=prefix["payload_bytes"],
                note=note,
                **extra,
            )
    for label, single in result.items():
        if not isinstance(single, dict) or label == "prefix":
            continue
        for operation in ("store", "fetch"):
            seconds = single.get(f"{operation}_seconds")
            if seconds:
                rows += payload_rows(
                    single_case(label, operation),
                    subject,
                    CLIENT,
                    seconds,
                    payload_bytes=single["payload_bytes"],
                    note=note,
                    **extra,
                )
    return rows


def measure(*, quick: bool, repetitions: int, allow_install: bool) -> list[Row]:
    """LMCache store and fetch of the 32k prefix and single blocks, stock and NODELAY server."""
    case = prefix_case("store/fetch")
    python, reason = ensure_lmcache_venv(allow_install)
    if python is None:
        return [skipped(SCENARIO, case, SUBJECT_STOCK, reason)]
    single = repetitions * SINGLE_BLOCK_REPETITION_FACTOR
    rows: list[Row] = []
    runs: list[tuple[str, list[str], dict[str, int], str]] = [
        (
            SUBJECT_NODELAY,
            [str(python), "-c", NODELAY_SERVER],
            {"prefix_store": repetitions, "prefix_fetch": repetitions, "single": single},
            "server sockets patched with TCP_NODELAY by the bench",
        ),
    ]
    if quick:
        rows.append(
            skipped(
                SCENARIO,
                prefix_case("fetch"),
                SUBJECT_STOCK,
                "quick mode: the stock server stalls ~40 ms per chunk (Nagle + delayed ACK), "
                "over 20 s per 32k prefix; measured in full mode",
            )
        )
    else:
        stock_fetch = min(repetitions, STOCK_FETCH_REPETITIONS)
        runs.insert(
            0,
            (
                SUBJECT_STOCK,
                [str(python.parent / "lmcache_server")],
                {
                    "prefix_store": repetitions,
                    "prefix_fetch": stock_fetch,
                    "prefix_fetch_warmup": 0,
                    "single": single,
                },
                f"as shipped; prefix fetch: {stock_fetch} runs, no warm-up",
            ),
        )
    for subject, command, counts, note in runs:
        started = time.monotonic()
        try:
            result = _run_against(python, command, repetitions=counts, timeout_seconds=900)
        except (RuntimeError, OSError, subprocess.SubprocessError, ValueError) as error:
            rows.append(skipped(SCENARIO, case, subject, str(error)))
            continue
        for row in _rows(result, subject, note):
            row.extra["run_seconds"] = round(time.monotonic() - started, 1)
            rows.append(row)
    return rows


if __name__ == "__main__":  # python -m bench.peers.lmcache_peer [--quick] [--install]
    run_standalone(measure)
