"""Real `cache-service serve` processes on one data folder: another seed, block size or
eviction policy is refused with a message, another capacity starts and says what changed,
every process says what it serves."""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from cache_service.client import CacheClient
from tests.integration.conftest import ServerProcess, free_port, service_command

MakeServer = Callable[..., ServerProcess]


def serve_once(data_dir: Path, **flags: str) -> subprocess.CompletedProcess[str]:
    """Run `cache-service serve` on `data_dir`, expecting it to exit on its own."""
    args = [*service_command(), "serve", "--host", "127.0.0.1", "--port", str(free_port())]
    args += ["--data-dir", str(data_dir)]
    for name, value in flags.items():
        args += ["--" + name.replace("_", "-"), value]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHE_SERVICE_")}
    # A server that starts instead of refusing is killed by run() at the timeout.
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=60, check=False)


@pytest.mark.parametrize(
    ("flag", "value", "line"),
    [
        ("seed", "team-b", "  --seed: stored 'prompt-cache-v1', requested 'team-b'"),
        ("block_size", "16", "  --block-size: stored 64, requested 16"),
    ],
)
def test_serve_refuses_a_folder_made_with_another_setting_that_defines_its_data(
    make_server: MakeServer, flag: str, value: str, line: str
) -> None:
    first = make_server()
    first.stop()
    refused = serve_once(first.data_dir, **{flag: value})
    assert refused.returncode != 0
    assert line in refused.stderr.splitlines()
    assert "another --data-dir" in refused.stderr
    assert "Traceback" not in refused.stderr
    first.start()  # the folder still serves its own settings


def test_a_folder_served_under_lru_adopts_the_default_policy_keeping_its_blocks(
    make_server: MakeServer,
) -> None:
    """The upgrade of docs/content/upgrading.md: a folder last served with `--eviction-policy lru`,
    started with no policy named, serves under the new default, says so, and loses nothing."""
    prompt = list(range(9000, 9256))  # 4 blocks of 64
    payloads = [f"kv {i}".encode() for i in range(4)]
    server = make_server(eviction_policy="lru")
    with CacheClient(server.url) as client:
        assert client.put_prefix("m", prompt, payloads) == 4
    server.stop()
    del server.flags["eviction_policy"]
    server.start()
    assert (
        "--eviction-policy changed since the last run: lru -> adaptive; blocks keep the rank "
        "the old policy gave them until their next use" in server.log_path.read_text()
    )
    with CacheClient(server.url) as client:
        found = client.lookup("m", prompt, fetch=True)
    assert found.matched_blocks == 4
    assert list(found.payloads or ()) == payloads


def test_serve_with_another_capacity_starts_and_logs_the_change(make_server: MakeServer) -> None:
    server = make_server(capacity="1GiB")
    server.stop()
    server.flags["capacity"] = "512MiB"
    server.start()
    log = server.log_path.read_text()
    assert (
        "--capacity changed since the last run: 1 GiB -> 512 MiB; blocks over it will be evicted"
        in log
    )
    assert "(capacity 512 MiB, auth none)" in log


def test_every_worker_says_what_it_serves_with_its_pid(make_server: MakeServer) -> None:
    server = make_server(workers="2", capacity="2GiB")
    line = re.compile(
        rf"process (\d+) serves data folder {re.escape(str(server.data_dir.resolve()))} "
        rf"\(capacity 2 GiB, auth none\) on http://127\.0\.0\.1:{server.port}$",
        flags=re.MULTILINE,
    )
    deadline = time.monotonic() + 20  # the first worker to start answers /readyz already
    while len(set(line.findall(server.log_path.read_text()))) < 2:  # two pids
        assert time.monotonic() < deadline, server.log_path.read_text()
        time.sleep(0.1)


def test_serve_on_a_memory_store_keeps_no_data_folder(make_server: MakeServer) -> None:
    server = make_server(store="memory://")  # --store wins over the fixture's --data-dir
    info = httpx.get(server.url + "/v1/info", timeout=5.0).json()
    assert info["store"] == "memory"
    assert not server.data_dir.exists()
    assert "serves memory:// (capacity" in server.log_path.read_text()
