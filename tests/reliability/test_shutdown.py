"""SIGTERM always stops the service within its bound, with status 0, losing no acknowledged
store: idle, under lookups with deferred refreshes pending, under many uploads still arriving,
with bodies trickling in over raw sockets, and with --workers 2.

Each cycle starts a real `cache-service serve` on the same folder (and first checks, with no
load, every prompt stored in the previous cycle: each 2xx store is fully readable, every byte
right), runs the load for a moment, sends SIGTERM and times the exit. A last start checks
every prompt again, and that lookups and fetches by key agree.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cache_service.client import CacheClient
from cache_service.core.errors import ServiceError
from cache_service.service.server import SUPERVISOR_MARGIN_SECONDS, exit_bound_seconds
from tests.integration.conftest import ServerProcess
from tests.reliability.shutdown_load import Acks, Load, check_prompts
from tests.reliability.workload import PromptSet, Verifier

SHUTDOWN_TIMEOUT = 1.5
# The stated bound: uvicorn's graceful wait, the stop, the final flush, the margin (and the
# supervisor's own margin with --workers). A stop past it exits with status 1, not 0.
EXIT_BOUND_SECONDS = exit_bound_seconds(SHUTDOWN_TIMEOUT) + SUPERVISOR_MARGIN_SECONDS
SERVER_FLAGS = {
    "lmdb_sync": "full",
    "capacity": "1GiB",  # nothing is evicted: every acknowledged block must be there
    "block_size": "16",
    "shutdown_timeout": str(SHUTDOWN_TIMEOUT),
    "touch_flush_interval": "3600",  # lookups' refreshes are all still pending at the stop
}
LOAD_SECONDS = (0.1, 0.3)
LEFTOVER_GRACE_SECONDS = 5.0


@dataclass
class Scenario:
    """One kind of load at the moment of the SIGTERM."""

    name: str
    writers: int = 0
    readers: int = 0
    slow: int = 0
    workers: int = 1
    preload: int = 0  # stores before the load starts, so that lookups hit
    cycles: tuple[int, int] = (10, 100)  # short, long


SCENARIOS = [
    Scenario("idle", preload=1, cycles=(12, 100)),
    Scenario("lookups", readers=4, preload=12, cycles=(12, 150)),
    Scenario("stores", writers=6, readers=1, cycles=(14, 200)),
    Scenario("slow_bodies", writers=1, slow=4, cycles=(6, 80)),
    Scenario("workers", writers=4, readers=3, workers=2, cycles=(6, 80)),
]


@dataclass
class Exits:
    """What each SIGTERM led to."""

    seconds: list[float] = field(default_factory=list)
    statuses: list[int | None] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)  # processes alive after the exit


def children_of(pid: int) -> list[int]:
    """Every process below `pid` (from /proc)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):  # the thread or the process ended meanwhile
            found += [int(child) for child in (task / "children").read_text().split()]
    return found + [grandchild for child in found for grandchild in children_of(child)]


def alive(pid: int) -> bool:
    """Whether `pid` runs (not gone, not a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def command_of(pid: int) -> str:
    """A process's command line, for a finding."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "(gone)"


def kill_tree(server: ServerProcess) -> None:
    """SIGKILL what is left of a server this test started, by PID, children included."""
    if server.proc is None:
        return
    below = children_of(server.proc.pid)
    server.proc.kill()
    server.proc.wait()
    for pid in below:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    server.proc = None


def sigterm_and_time(server: ServerProcess, exits: Exits) -> None:
    """SIGTERM the server; record how long it took to exit, its status, and any process of
    it still running afterwards."""
    assert server.proc is not None
    below = children_of(server.proc.pid)
    began = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    try:
        status: int | None = server.proc.wait(timeout=EXIT_BOUND_SECONDS + 20)
    except subprocess.TimeoutExpired:
        status = None
    exits.seconds.append(time.monotonic() - began)
    exits.statuses.append(status)
    if status is None:
        kill_tree(server)
        return
    # The workers are joined by the supervisor; its resource tracker ends once it sees the
    # supervisor gone, a moment later.
    deadline = time.monotonic() + LEFTOVER_GRACE_SECONDS
    while any(alive(pid) for pid in below) and time.monotonic() < deadline:
        time.sleep(0.02)
    exits.leftovers += [f"{pid}: {command_of(pid)}" for pid in below if alive(pid)]
    server.proc = None


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Servers on fresh folders (not started); whatever is left of them is killed at the end."""
    made: list[ServerProcess] = []

    def factory(**flags: str) -> ServerProcess:
        server = ServerProcess(tmp_path / f"data{len(made)}", tmp_path / "server.log", **flags)
        made.append(server)
        return server

    yield factory
    for server in made:
        kill_tree(server)


@pytest.fixture
def scratch_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """TMPDIR for the servers (a --workers supervisor keeps its metrics folder there)."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    return folder


def preload(url: str, prompts: PromptSet, acks: Acks, count: int, rng: random.Random) -> None:
    """Store `count` whole prompts before the load, so that lookups hit."""
    with CacheClient(url, timeout=30.0) as client:
        for _ in range(count):
            prompt = prompts.pick(rng)
            client.store(prompt.model, prompt.tokens, prompt.payloads(0, prompt.blocks))
            acks.acknowledged(prompt, prompt.blocks)


def pending_refreshes(url: str) -> int:
    """Lookups' deferred refreshes the server holds now (the stop must flush them)."""
    try:
        with CacheClient(url, timeout=5.0) as client:
            return int(client.stats()["pending_touches"])
    except ServiceError:
        return 0  # busy or stopping: not counted


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_sigterm_exits_in_bound_with_status_0_and_keeps_every_acknowledged_store(
    scenario: Scenario,
    servers: Callable[..., ServerProcess],
    scale: Callable[[int, int], int],
    report: Callable[..., None],
    scratch_tmpdir: Path,
) -> None:
    cycles = scale(*scenario.cycles)
    seed = SCENARIOS.index(scenario) + 1
    prompts = PromptSet(families=scale(16, 256), seed=seed)
    verifier, acks, exits = Verifier(), Acks(), Exits()
    server = servers(workers=str(scenario.workers), **SERVER_FLAGS)
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    unexpected: list[str] = []
    blocks_checked = pending_touches = 0
    for _ in range(cycles):
        server.start()
        blocks_checked += check_prompts(
            server.url, acks.take_fresh(prompts), acks, verifier, thorough=False
        )
        preload(server.url, prompts, acks, scenario.preload, rng)
        load = Load(server.url, prompts, acks, verifier, seed=rng.randrange(1 << 30))
        load.start(writers=scenario.writers, readers=scenario.readers, slow=scenario.slow)
        time.sleep(rng.uniform(*LOAD_SECONDS))
        pending_touches += pending_refreshes(server.url)
        sigterm_and_time(server, exits)
        load.stop()
        for kind, count in load.outcomes.items():
            outcomes[kind] = outcomes.get(kind, 0) + count
        unexpected += load.unexpected
    server.start()  # the last cycle's stores, and every prompt once more
    blocks_checked += check_prompts(server.url, prompts.made(), acks, verifier, thorough=True)
    sigterm_and_time(server, exits)
    log = server.log_path.read_text(errors="replace")
    errors = log.count("Traceback") + log.count("Exception in ASGI application")
    report(
        scenario=scenario.name,
        cycles=cycles,
        exit_p50_s=f"{statistics.median(exits.seconds):.2f}",
        exit_max_s=f"{max(exits.seconds):.2f}",
        bound_s=f"{EXIT_BOUND_SECONDS:.1f}",
        statuses=sorted(set(exits.statuses), key=str),
        acked_stores=acks.stores,
        acked_blocks_checked=blocks_checked,
        bytes_verified=verifier.checked_bytes,
        lost=len(verifier.lost),
        wrong=len(verifier.wrong),
        requests=outcomes,
        refreshes_pending_at_sigterm=pending_touches,
        log_errors=errors,
    )
    assert all(status == 0 for status in exits.statuses), exits.statuses
    assert max(exits.seconds) <= EXIT_BOUND_SECONDS, exits.seconds
    assert not exits.leftovers, f"processes still running after the exit: {exits.leftovers}"
    assert not verifier.lost, verifier.lost[:10]
    assert not verifier.wrong, verifier.wrong[:10]
    assert not unexpected, unexpected[:10]
    assert not errors, f"tracebacks in the server log: {server.log_path}"
    if scenario.writers or scenario.slow:
        assert acks.stores > 0
