"""Counting what a request costs Redis, without MONITOR: round trips seen by strace on the
service process (a turn is a run of sends then receives on one node's socket), and read
events and commands counted by the primaries themselves (INFO stats, INFO commandstats).
Used by the redis scenario (bench/redis_scaling.py)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def node_counters(cluster: Any) -> dict[str, tuple[int, dict[str, int]]]:
    """Per primary: read events so far and the calls of each command."""
    counters = {}
    for address in cluster.primaries():
        node = cluster.node_client(address)
        reads = int(node.info("stats")["total_reads_processed"])
        calls = {name.removeprefix("cmdstat_"): int(stat["calls"])
                 for name, stat in node.info("commandstats").items()}  # fmt: skip
        counters[str(address)] = (reads, calls)
    return counters


def count_redis_work(
    cluster: Any, run_all: Callable[[], object], count: int
) -> tuple[float, dict[str, float], int]:
    """Run `run_all` (`count` calls); per call: read events on the primaries, commands by name
    (the counting's own INFO calls left out), and how many primaries served any."""
    before = node_counters(cluster)
    run_all()
    after = node_counters(cluster)
    reads = 0
    commands: dict[str, float] = {}
    busy = 0
    for address, (read_after, calls_after) in after.items():
        read_before, calls_before = before[address]
        # Between the two reads of total_reads_processed: the first snapshot's INFO
        # commandstats and the second's INFO stats; commandstats counts both INFOs likewise.
        reads += read_after - read_before - 2
        served = False
        for name, number in calls_after.items():
            delta = number - calls_before.get(name, 0) - 2 * (name == "info")
            if delta > 0:
                commands[name] = commands.get(name, 0) + delta / count
                served = True
        busy += served
    return reads / count, commands, busy


TRACED = "sendto,sendmsg,write,recvfrom,recvmsg,read"
SYSCALL = re.compile(r"^\d+ +(send\w*|write|recv\w*|read)\((\d+)<TCP:\[[\d.]+:\d+->[\d.]+:(\d+)\]>")


def traced_turns(
    pid: int, ports: set[int], run_all: Callable[[], object], count: int
) -> tuple[float, float]:
    """Round trips to Redis of `run_all`'s `count` calls, seen by strace on the service `pid`:
    on each socket to a Redis node, a turn is a run of sends followed by receives. Per
    call: all turns, and the most on any one node's socket (the turns taken in sequence,
    since a cluster pipeline writes to every node before it reads from any)."""
    strace = shutil.which("strace")
    if strace is None:
        raise RuntimeError("strace is not installed")
    with tempfile.TemporaryDirectory(prefix="bench-strace-") as folder:
        out = Path(folder) / "trace"
        command = [strace, "-f", "-qq", "-yy", "-e", f"trace={TRACED}", "-o", str(out)]
        tracer = subprocess.Popen([*command, "-p", str(pid)], stderr=subprocess.DEVNULL)
        try:
            time.sleep(0.5)  # attached to every thread by then
            run_all()
            time.sleep(0.2)
        finally:
            os.kill(tracer.pid, signal.SIGINT)  # strace detaches and exits
            tracer.wait(timeout=10)
        turns: dict[str, int] = {}
        sending: dict[str, bool] = {}
        for line in out.read_text(errors="replace").splitlines():
            found = SYSCALL.match(line)
            if found is None or int(found.group(3)) not in ports:
                continue
            fd, sends = found.group(2), found.group(1).startswith(("send", "write"))
            if sends and not sending.get(fd, False):
                turns[fd] = turns.get(fd, 0) + 1
            sending[fd] = sends
    if not turns:
        raise RuntimeError("strace saw no traffic to Redis")
    return sum(turns.values()) / count, max(turns.values()) / count
