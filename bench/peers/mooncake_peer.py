"""Mooncake Store as a peer, on the CPU, over its TCP transport, with its own Python client.

PyPI's default `mooncake-transfer-engine` wheel links libcuda.so.1 and libcudart.so.12 and
cannot load on a machine without an NVIDIA driver; its sibling
`mooncake-transfer-engine-non-cuda` links neither, only Debian's `libibverbs1` (loaded even
when no RDMA device is used) besides libraries it bundles. That build runs here, in its own
venv (`bench/.venv-mooncake`, never committed). The bench starts three processes and stops
them by PID: `mooncake_master` with its built-in HTTP metadata server, a segment host that
mounts memory for the store (the storage server), and the timed client, which mounts none, so
every byte crosses the TCP transport (see `mooncake_client.py`).

Mooncake binds some of its ports on every address (the master's HTTP metadata and metrics
ports, whatever host is asked for, and each transfer engine's TCP transport port, which it
picks itself), and by default a transfer engine advertises the machine's first non-loopback
address (`MC_TCP_BIND_ADDRESS=127.0.0.1`, set here, makes it use loopback). So all three run
in a private network namespace made for the run (`ip netns`, root), whose only interface is
loopback, and which is deleted afterwards; where one cannot be made, the row is skipped
rather than listening on the machine's addresses.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench.peers.harness import (
    SINGLE_BLOCK_REPETITION_FACTOR,
    ensure_apt_package,
    ensure_venv,
    payload_rows,
    run_standalone,
    stop_process,
)
from bench.peers.payloads import SCENARIO, prefix_case, single_case
from bench.report import Row, skipped

HERE = Path(__file__).resolve().parent
DEFAULT_VENV = HERE.parent / ".venv-mooncake"
DISTRIBUTION = "mooncake-transfer-engine-non-cuda"
VERSION = "0.3.13.post1"
PIP_REQUIREMENTS = (f"{DISTRIBUTION}=={VERSION}",)
APT_PACKAGE, APT_LIBRARY = "libibverbs1", "libibverbs.so.1"
SUBJECT = "mooncake store (tcp)"
CLIENT = "mooncake.store, bytes API"
SEGMENT_BYTES = 1 << 30
START_SECONDS = 30
# Fixed ports are free: the namespace is new and holds nothing else.
RPC_PORT, METADATA_PORT, METRICS_PORT = 50051, 8080, 9003


def ensure_mooncake_venv(
    allow_install: bool, *, venv_dir: Path = DEFAULT_VENV
) -> tuple[Path | None, str]:
    """The venv's python and "" or, when it cannot be had, None and the reason."""
    reason = ensure_apt_package(APT_PACKAGE, APT_LIBRARY, allow_install=allow_install)
    if reason:
        return None, reason
    return ensure_venv(
        venv_dir, PIP_REQUIREMENTS, distributions=(DISTRIBUTION,), allow_install=allow_install
    )


def _wait_for_line(process: subprocess.Popen[str], expected: str) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        if line.strip() == expected:
            return
    raise RuntimeError(f"segment host exited with code {process.wait()} before it was ready")


def _create_namespace() -> str:
    """A new network namespace with loopback up; its name."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise RuntimeError("Mooncake binds all addresses; a private netns needs root and `ip`")
    name = f"bench-mooncake-{os.getpid()}"
    for command in (["ip", "netns", "add", name], ["ip", "-n", name, "link", "set", "lo", "up"]):
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            _delete_namespace(name)
            raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()}")
    return name


def _delete_namespace(name: str) -> None:
    subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)


def _run(python: Path, *, counts: dict[str, Any]) -> dict[str, Any]:
    script = str(HERE / "mooncake_client.py")
    ports = [str(RPC_PORT), str(METADATA_PORT)]
    started: list[subprocess.Popen[Any]] = []
    namespace = _create_namespace()
    inside = ["ip", "netns", "exec", namespace]  # execs the command: the PID stays its own
    # Without it a transfer engine advertises the first non-loopback address it finds.
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    with tempfile.TemporaryDirectory(prefix="bench-mooncake-") as work_dir:
        try:
            master = subprocess.Popen(
                [
                    *inside,
                    str(python.parent / "mooncake_master"),
                    f"-rpc_port={RPC_PORT}",
                    "-rpc_address=127.0.0.1",
                    "-enable_http_metadata_server=true",
                    "-http_metadata_server_host=127.0.0.1",
                    f"-http_metadata_server_port={METADATA_PORT}",
                    f"-metrics_port={METRICS_PORT}",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                cwd=work_dir,
            )
            started.append(master)
            segment = subprocess.Popen(
                [*inside, str(python), script, "segment", *ports, str(SEGMENT_BYTES)],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                cwd=work_dir,
                env=env,
            )
            started.append(segment)
            _wait_for_line(segment, "ready")
            if master.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with code {master.returncode}")
            client = subprocess.run(
                [
                    *inside,
                    str(python),
                    script,
                    "client",
                    *ports,
                    str(HERE / "payloads.py"),
                    json.dumps(counts),
                ],
                capture_output=True,
                text=True,
                check=False,
                timeout=600,
                cwd=work_dir,
                env=env,
            )
        finally:
            for process in reversed(started):
                stop_process(process)
                if process.stdout is not None:
                    process.stdout.close()
            _delete_namespace(namespace)
    if client.returncode != 0:
        tail = [line for line in client.stderr.splitlines() if line.startswith(("E", "T"))][-3:]
        raise RuntimeError(f"Mooncake client failed ({client.returncode}): {' | '.join(tail)}")
    result: dict[str, Any] = json.loads(client.stdout.strip().splitlines()[-1])
    return result


def measure(*, quick: bool, repetitions: int, allow_install: bool) -> list[Row]:
    """Mooncake Store put/get of the 32k prefix (batched) and of single blocks."""
    del quick  # the caller's `repetitions` already says how long to run
    case = prefix_case("store/fetch")
    python, reason = ensure_mooncake_venv(allow_install)
    if python is None:
        return [skipped(SCENARIO, case, SUBJECT, reason)]
    counts = {
        "prefix": repetitions,
        "single": repetitions * SINGLE_BLOCK_REPETITION_FACTOR,
        "distribution": DISTRIBUTION,
    }
    try:
        result = _run(python, counts=counts)
    except (RuntimeError, OSError, subprocess.SubprocessError, ValueError) as error:
        return [skipped(SCENARIO, case, SUBJECT, str(error))]
    version = {"mooncake": result["mooncake_version"]}
    note = "non-CUDA build, TCP transport, segment in another process, private netns"
    rows: list[Row] = []
    for label, figures in result.items():
        if not isinstance(figures, dict):
            continue
        for operation in ("store", "fetch"):
            if label == "prefix":
                name = prefix_case(operation, f"{figures['blocks']} blocks, batch")
            else:
                name = single_case(label, operation)
            rows += payload_rows(
                name,
                SUBJECT,
                CLIENT,
                figures[f"{operation}_seconds"],
                payload_bytes=figures["payload_bytes"],
                note=note,
                **version,
            )
    return rows


if __name__ == "__main__":  # python -m bench.peers.mooncake_peer [--quick] [--install]
    run_standalone(measure)
