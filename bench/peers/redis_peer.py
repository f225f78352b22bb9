"""Redis as a peer: Debian's redis-server, no persistence, redis-py with hiredis.

What a user would otherwise pick for a shared block store. The bench starts its own
`redis-server` on a free 127.0.0.1 port (`--save "" --appendonly no`), stores and fetches the
32k prefix's 512 blocks in one pipeline each (`transaction=False`: no MULTI/EXEC), and single
256 KiB and 2 MiB blocks with one SET or GET each. Every fetch is compared with the payload.
The server is stopped by its PID in a `finally`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from functools import partial
from typing import Any

from bench.peers.harness import (
    SINGLE_BLOCK_REPETITION_FACTOR,
    check_equal,
    free_port,
    payload_rows,
    stop_process,
    time_calls,
    wait_for_port,
)
from bench.peers.payloads import (
    SCENARIO,
    block_keys,
    prefix_blocks,
    prefix_case,
    single_blocks,
    single_case,
)
from bench.report import Row, skipped

SUBJECT = "redis"
CLIENT_PIPELINED = "redis-py+hiredis, pipelined"
CLIENT_SINGLE = "redis-py+hiredis"
APT_PACKAGE = "redis-server"
PIP_PACKAGES = ("redis", "hiredis")


def ensure_redis(*, allow_install: bool) -> tuple[str | None, str]:
    """The path of `redis-server` and "" or, when it cannot be had, None and the reason.

    Installs Debian's package with apt-get only when `allow_install` is true (root only).
    """
    found = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None
    )
    if found:
        return found, ""
    if not allow_install:
        return None, f"redis-server not installed (apt-get install {APT_PACKAGE})"
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return None, f"redis-server not installed and apt-get as root unavailable ({APT_PACKAGE})"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", APT_PACKAGE]
    result = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:  # an empty or stale package list: update once, try again
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=False)
        result = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
    found = shutil.which("redis-server")
    if found is None:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        return None, f"apt-get install {APT_PACKAGE} failed: {tail[0]}"
    return found, ""


def hiredis_reason() -> str:
    """ "" when redis-py imports and parses with hiredis, else why not."""
    try:
        import hiredis  # noqa: F401, PLC0415
        import redis.connection  # noqa: PLC0415
    except ImportError as error:
        return f"{error.name} not importable (pip install {' '.join(PIP_PACKAGES)})"
    parser = getattr(redis.connection, "DefaultParser", None)
    if parser is None or "Hiredis" not in parser.__name__:
        return f"redis-py does not use hiredis (parser {parser!r})"
    return ""


def start_server(path: str, data_dir: str) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    command = [
        path,
        "--bind", "127.0.0.1",
        "--port", str(port),
        "--save", "",
        "--appendonly", "no",
        "--daemonize", "no",
        "--dir", data_dir,
        "--logfile", "",
        "--loglevel", "warning",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, process=process, timeout_seconds=10)
    except BaseException:
        stop_process(process)
        raise
    return process, port


def _measure_server(port: int, *, repetitions: int) -> list[Row]:
    import redis  # noqa: PLC0415

    blocks = prefix_blocks()
    keys = block_keys(len(blocks), namespace=b"redis-prefix")
    prefix_bytes = sum(map(len, blocks))
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=60)
    rows: list[Row] = []
    try:
        client.ping()

        def store_prefix() -> Any:
            pipe = client.pipeline(transaction=False)
            for key, value in zip(keys, blocks, strict=True):
                pipe.set(key, value)
            return pipe.execute()

        def fetch_prefix() -> Any:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
            return pipe.execute()

        seconds = time_calls(store_prefix, repetitions=repetitions, before=client.flushall)
        rows += payload_rows(
            prefix_case("store", f"{len(blocks)} blocks"),
            SUBJECT,
            CLIENT_PIPELINED,
            seconds,
            payload_bytes=prefix_bytes,
            note="no persistence",
        )
        seconds = time_calls(fetch_prefix, repetitions=repetitions, check=check_equal(blocks))
        rows += payload_rows(
            prefix_case("fetch", f"{len(blocks)} blocks"),
            SUBJECT,
            CLIENT_PIPELINED,
            seconds,
            payload_bytes=prefix_bytes,
        )
        client.flushall()
        single_repetitions = repetitions * SINGLE_BLOCK_REPETITION_FACTOR
        for label, value in single_blocks().items():
            key = block_keys(1, namespace=f"redis-{label}".encode())[0]
            seconds = time_calls(partial(client.set, key, value), repetitions=single_repetitions)
            rows += payload_rows(
                single_case(label, "store"),
                SUBJECT,
                CLIENT_SINGLE,
                seconds,
                payload_bytes=len(value),
                note="no persistence",
            )
            seconds = time_calls(
                partial(client.get, key),
                repetitions=single_repetitions,
                check=check_equal([value]),
            )
            rows += payload_rows(
                single_case(label, "fetch"),
                SUBJECT,
                CLIENT_SINGLE,
                seconds,
                payload_bytes=len(value),
            )
    finally:
        client.close()
    return rows


def measure(*, quick: bool, repetitions: int, allow_install: bool) -> list[Row]:
    """Redis pipelined SET/GET of the 32k prefix and single SET/GET of 256 KiB and 2 MiB."""
    del quick  # the caller's `repetitions` already says how long to run
    case = prefix_case("store/fetch")
    reason = hiredis_reason()
    if reason:
        return [skipped(SCENARIO, case, SUBJECT, reason)]
    path, reason = ensure_redis(allow_install=allow_install)
    if path is None:
        return [skipped(SCENARIO, case, SUBJECT, reason)]
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as data_dir:
        process, port = start_server(path, data_dir)
        try:
            return _measure_server(port, repetitions=repetitions)
        finally:
            stop_process(process)
