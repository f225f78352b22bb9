"""kill -9 under load: every acknowledged store survives, nothing returned is ever wrong.

Writer threads store prompts (whole, or continuing an acknowledged prefix) and reader
threads look them up and fetch them, checking every byte, while the server is killed with
SIGKILL at random moments and restarted on the same folder. After each restart, with the load
paused, every prompt touched is checked: each acknowledged store (a 2xx received before the
kill) is complete, every byte is right, and what is stored is prefix-closed (a fetch by the
prompt's keys has no hole before a present block, and finds what the lookup matched).

Variants: a small capacity, so that kills land in evictions too (nothing acknowledged is
owed then, but the store must stay prefix-closed and its counts right); a quarter of the
restarts killed again before they are ready; and `--workers 2`, where one worker is killed
and replaced by uvicorn's supervisor while the other serves, then the whole tree is killed.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cache_service.client import CacheClient
from cache_service.core.errors import ServiceError, ServiceUnavailable
from tests.integration.conftest import ServerProcess
from tests.reliability.processes import (
    evicted_blocks,
    kill_now,
    kill_server,
    kill_while_starting,
    logged_errors,
    restart,
    wait_serving,
    wait_workers,
)
from tests.reliability.workload import Prompt, PromptSet, Verifier

WRITERS = 3
READERS = 3
LOAD_SECONDS = (0.1, 0.4)  # load between a restart and the next kill, drawn per cycle
SERVER_FLAGS = {
    "lmdb_sync": "full",
    "capacity": "1GiB",  # far above what the test stores: nothing is evicted, nothing may go
    "block_size": "16",
    "touch_flush_interval": "0.05",
}
STARTUP_KILL_SHARE = 0.25  # cycles whose restart is itself killed before it is ready
# Refusals the load may meet while the server is starting, stopping or busy (all retried).
RETRIED_STATUSES = {503}


class KillLoad:
    """Writer and reader threads over one PromptSet, paused and resumed around each kill."""

    def __init__(
        self, url: str, prompts: PromptSet, verifier: Verifier, seed: int, *, evicting: bool
    ) -> None:
        self.url = url
        self.prompts = prompts
        self.verifier = verifier
        self.evicting = evicting  # eviction may remove acknowledged blocks: none is "lost"
        self.acked: dict[str, int] = {}  # prompt -> blocks acknowledged stored (never shrinks)
        self.acked_stores = 0  # 2xx store answers, each checked after the next restart
        self.touched: set[str] = set()  # prompts sent since the last check
        self.outcomes: Counter[str] = Counter()
        self.unexpected: list[str] = []
        self.lock = threading.Lock()
        self.go = threading.Event()
        self.done = threading.Event()
        self.busy = 0
        self.threads = [
            threading.Thread(target=self._run, args=(work, seed * 100 + n), daemon=True)
            for n, work in enumerate([self._write] * WRITERS + [self._read] * READERS)
        ]

    def start(self) -> None:
        """Start the threads (paused)."""
        for thread in self.threads:
            thread.start()

    def resume(self) -> None:
        """Let the threads send requests."""
        self.go.set()

    def pause(self) -> None:
        """Stop sending and wait for every request in flight to end."""
        self.go.clear()
        while self.in_flight():
            time.sleep(0.005)

    def in_flight(self) -> int:
        """Requests sent and not yet answered."""
        with self.lock:
            return self.busy

    def stop(self) -> None:
        """End the threads."""
        self.done.set()
        self.go.set()
        for thread in self.threads:
            thread.join(timeout=30)

    def _run(self, work: Callable[[CacheClient, random.Random], None], seed: int) -> None:
        rng = random.Random(seed)
        with CacheClient(self.url, timeout=10.0) as client:
            while not self.done.is_set():
                if not self.go.wait(0.05):
                    continue
                with self.lock:
                    self.busy += 1
                try:
                    work(client, rng)
                except ServiceError as error:
                    self._refused(error)
                except Exception as error:  # a broken answer: recorded, and the load goes on
                    with self.lock:
                        self.unexpected.append(f"{type(error).__name__}: {error}")
                finally:
                    with self.lock:
                        self.busy -= 1

    def _refused(self, error: ServiceError) -> None:
        if isinstance(error, ServiceUnavailable):
            kind = "transport"  # the server was killed, or is not listening yet
        elif error.status in RETRIED_STATUSES:
            kind = f"{error.status} {error.problem_type.rsplit('/', 1)[-1]}"
        else:
            kind = "unexpected"
            with self.lock:
                self.unexpected.append(f"{error.status}: {error.detail}")
        with self.lock:
            self.outcomes[kind] += 1
        if kind != "unexpected":
            time.sleep(0.005)  # the server is down or busy: do not spin

    def _write(self, client: CacheClient, rng: random.Random) -> None:
        prompt = self.prompts.pick(rng)
        with self.lock:
            done = self.acked.get(prompt.name, 0)
            self.touched.add(prompt.name)
        if done >= prompt.blocks:
            start = rng.randrange(prompt.blocks)  # a refresh of stored blocks, from anywhere
        else:
            start = done if done and rng.random() < 0.7 else 0  # continue the stored prefix
        end = rng.randint(start + 1, prompt.blocks)
        tokens = prompt.tokens[: end * prompt.block_size]
        try:
            result = client.store(
                prompt.model, tokens, prompt.payloads(start, end), start_block=start
            )
        except ServiceError as error:
            if error.status == 409 and start and start <= done:
                if self.evicting:  # the stored parent may have been evicted since
                    with self.lock:
                        self.outcomes["409 parent evicted"] += 1
                else:
                    self.verifier.lost.append(f"{prompt.name}: 409 on a stored parent: {error}")
                return
            raise
        if not result.as_sent or result.truncated_blocks or result.keys != prompt.keys[start:end]:
            self.verifier.wrong.append(f"{prompt.name}: store answered {result}")
        with self.lock:
            self.acked[prompt.name] = max(self.acked.get(prompt.name, 0), end)
            self.acked_stores += 1
            self.outcomes["store"] += 1

    def _read(self, client: CacheClient, rng: random.Random) -> None:
        prompt = self.prompts.pick(rng)
        with self.lock:
            at_least = self.acked_blocks(prompt)  # acknowledged before this request
        if rng.random() < 0.5:
            match = client.lookup(prompt.model, prompt.tokens, fetch=True)
            self.verifier.check_match(prompt, match, at_least=at_least)
            kind = "lookup"
        else:
            payloads = client.get_blocks(prompt.model, prompt.keys)
            self.verifier.check_fetch(prompt, payloads, at_least=at_least)
            kind = "fetch"
        with self.lock:
            self.outcomes[kind] += 1

    def acked_blocks(self, prompt: Prompt) -> int:
        """Blocks of `prompt` acknowledged stored, which must be found (0 while evicting)."""
        return 0 if self.evicting else self.acked.get(prompt.name, 0)

    def answered(self) -> int:
        """Requests answered so far (2xx)."""
        with self.lock:
            return sum(self.outcomes[kind] for kind in ("store", "lookup", "fetch"))

    def take_touched(self) -> list[Prompt]:
        """The prompts sent since the last call (the load is paused)."""
        names, self.touched = self.touched, set()
        return [prompt for prompt in self.prompts.made() if prompt.name in names]


def check_prompts(url: str, prompts: list[Prompt], load: KillLoad) -> int:
    """Check each prompt on an idle server: its acknowledged blocks are all there, lookup and
    fetch agree, every byte is right; the number of prompts with acknowledged blocks."""
    checked = 0
    verifier = load.verifier
    with CacheClient(url, timeout=30.0) as client:
        for prompt in prompts:
            at_least = load.acked_blocks(prompt)
            matched = verifier.check_match(
                prompt, client.lookup(prompt.model, prompt.tokens, fetch=True), at_least=at_least
            )
            found = verifier.check_fetch(
                prompt, client.get_blocks(prompt.model, prompt.keys), at_least=at_least
            )
            if found != matched:
                verifier.wrong.append(f"{prompt.name}: lookup matched {matched}, fetch {found}")
            checked += at_least > 0
    return checked


def fill(url: str, prompts: PromptSet) -> int:
    """Store every prompt of the set whole, in order; the blocks evicted on the way."""
    with CacheClient(url, timeout=30.0) as client:
        for family in range(prompts.families):
            for variant in range(prompts.variants):
                prompt = prompts.prompt(family, variant)
                client.store(prompt.model, prompt.tokens, prompt.payloads(0, prompt.blocks))
    return evicted_blocks(url)


def check_accounting(url: str, prompts: list[Prompt], verifier: Verifier) -> int:
    """On an idle server, the store's own counts (/v1/stats blocks and payload bytes) equal
    what fetching every prompt finds: a crash left no counter out of step with the data.
    Every block stored comes from `prompts`. The number of distinct blocks found."""
    found: dict[str, int] = {}
    with CacheClient(url, timeout=30.0) as client:
        for prompt in prompts:
            payloads = client.get_blocks(prompt.model, prompt.keys)
            verifier.check_fetch(prompt, payloads)
            found.update(
                (key, len(payload))
                for key, payload in zip(prompt.keys, payloads, strict=True)
                if payload is not None
            )
        stats = client.stats()
    counted = (stats["blocks"], stats["payload_bytes"])
    if counted != (len(found), sum(found.values())):
        verifier.wrong.append(
            f"/v1/stats counts {counted} (blocks, payload bytes); fetches find "
            f"{(len(found), sum(found.values()))}"
        )
    return len(found)


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Servers on fresh data folders; each is stopped (by its PID) when the test ends."""
    started: list[ServerProcess] = []

    def factory(**flags: str) -> ServerProcess:
        server = ServerProcess(tmp_path / f"data{len(started)}", tmp_path / "server.log", **flags)
        started.append(server)
        server.start()
        return server

    yield factory
    for server in started:
        if server.proc is not None:
            kill_server(server)  # whatever it left running goes too (--workers children)


@pytest.fixture
def scratch_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """TMPDIR for the servers: a killed --workers supervisor leaves its metrics folder."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    return folder


def summary(load: KillLoad, verifier: Verifier, restarts: list[float]) -> dict[str, object]:
    """The figures every kill test reports."""
    return {
        "acked_stores": load.acked_stores,
        "bytes_verified": verifier.checked_bytes,
        "blocks_verified": verifier.checked_blocks,
        "lost": len(verifier.lost),
        "wrong": len(verifier.wrong),
        "restart_p50_s": f"{statistics.median(restarts):.2f}",
        "restart_max_s": f"{max(restarts):.2f}",
        "requests": dict(load.outcomes),
    }


def assert_clean(load: KillLoad, verifier: Verifier, server: ServerProcess) -> None:
    """Nothing lost, nothing wrong, no refusal the load should never meet, no error logged."""
    assert not logged_errors(server.log_path), logged_errors(server.log_path)[:10]
    assert not verifier.lost, verifier.lost[:10]
    assert not verifier.wrong, verifier.wrong[:10]
    assert not load.unexpected, load.unexpected[:10]
    assert load.acked_stores > 0 and load.outcomes["lookup"] and load.outcomes["fetch"]


def kill_cycles(
    server: ServerProcess, load: KillLoad, cycles: int, rng: random.Random
) -> dict[str, object]:
    """Load, SIGKILL, restart and check the prompts touched, `cycles` times; the figures."""
    restarts: list[float] = []
    in_flight_at_kill: list[int] = []
    acked_checked = evicted = startup_kills = 0
    for _ in range(cycles):
        load.resume()
        time.sleep(rng.uniform(*LOAD_SECONDS))
        evicted += evicted_blocks(server.url)  # counted per process: read before the kill
        in_flight_at_kill.append(load.in_flight())
        kill_server(server)
        load.pause()
        if rng.random() < STARTUP_KILL_SHARE:
            kill_while_starting(server, rng.uniform(0, statistics.median(restarts or [0.5])))
            startup_kills += 1
        restarts.append(restart(server))
        acked_checked += check_prompts(server.url, load.take_touched(), load)
    acked_checked += check_prompts(server.url, load.prompts.made(), load)
    distinct_blocks = check_accounting(server.url, load.prompts.made(), load.verifier)
    return {
        "cycles": cycles,
        "acked_prompt_checks": acked_checked,
        "kills_with_requests_in_flight": sum(1 for n in in_flight_at_kill if n),
        "blocks_at_end": distinct_blocks,
        "evicted_blocks": evicted,
        "kills_while_starting": startup_kills,
        **summary(load, load.verifier, restarts),
    }


def test_sigkill_under_load_loses_no_acknowledged_store(
    make_server: Callable[..., ServerProcess],
    scale: Callable[[int, int], int],
    report: Callable[..., None],
    scratch_tmpdir: Path,
) -> None:
    verifier = Verifier()
    server = make_server(**SERVER_FLAGS)
    prompts = PromptSet(families=scale(64, 512), seed=1)
    load = KillLoad(server.url, prompts, verifier, seed=1, evicting=False)
    load.start()
    try:
        figures = kill_cycles(server, load, scale(30, 1000), random.Random(1))
    finally:
        load.stop()
    report(**figures)
    assert_clean(load, verifier, server)


def test_sigkill_while_evicting_keeps_the_store_prefix_closed_and_counted(
    make_server: Callable[..., ServerProcess],
    scale: Callable[[int, int], int],
    report: Callable[..., None],
    scratch_tmpdir: Path,
) -> None:
    """A small capacity: kills land in evictions too; what stays is right, reachable and
    counted (eviction takes leaves only, so a crash that broke a child count would show as a
    hole)."""
    verifier = Verifier()
    server = make_server(**{**SERVER_FLAGS, "capacity": "2MiB"})
    prompts = PromptSet(families=scale(64, 512), seed=4)
    # Filled first, so every cycle stores into a full store however few requests a slow
    # machine sends between kills (a slow CI machine once sent too few to reach capacity).
    filled_evictions = fill(server.url, prompts)
    assert filled_evictions, "the fill never evicted: the prompt set is smaller than capacity"
    kill_server(server)  # the eviction counters start again at 0: only the cycles' count
    restart(server)
    load = KillLoad(server.url, prompts, verifier, seed=4, evicting=True)
    load.start()
    try:
        figures = kill_cycles(server, load, scale(15, 300), random.Random(4))
    finally:
        load.stop()
    report(evicted_by_the_fill=filled_evictions, **figures)
    assert_clean(load, verifier, server)
    assert figures["evicted_blocks"], "the store never evicted: more load or less capacity"


def test_sigkill_of_workers_loses_no_acknowledged_store(
    make_server: Callable[..., ServerProcess],
    scale: Callable[[int, int], int],
    report: Callable[..., None],
    scratch_tmpdir: Path,
) -> None:
    """--workers 2: a killed worker is replaced while the other serves; then all die."""
    cycles = scale(4, 100)
    prompts = PromptSet(families=scale(64, 512), seed=2)
    verifier = Verifier()
    server = make_server(workers="2", **SERVER_FLAGS)
    load = KillLoad(server.url, prompts, verifier, seed=2, evicting=False)
    rng = random.Random(2)
    restarts: list[float] = []
    replacements: list[float] = []
    served_while_one_down = 0
    load.start()
    try:
        for _ in range(cycles):
            assert server.proc is not None
            workers = wait_workers(server.proc.pid, count=2)
            for pid in workers:
                wait_serving(server.log_path, pid)
            load.resume()
            time.sleep(rng.uniform(*LOAD_SECONDS))
            victim = rng.choice(sorted(workers))
            before = load.answered()
            killed_at = time.monotonic()
            kill_now(victim)
            (replacement,) = wait_workers(server.proc.pid, count=2, without=victim) - workers
            wait_serving(server.log_path, replacement)
            replacements.append(time.monotonic() - killed_at)
            served_while_one_down += load.answered() - before
            time.sleep(rng.uniform(*LOAD_SECONDS))  # the replacement takes its share
            kill_server(server)
            load.pause()
            restarts.append(restart(server))
            check_prompts(server.url, load.take_touched(), load)
        acked_checked = check_prompts(server.url, prompts.made(), load)
    finally:
        load.stop()
    report(
        cycles=cycles,
        acked_prompt_checks=acked_checked,
        worker_replaced_p50_s=f"{statistics.median(replacements):.2f}",
        worker_replaced_max_s=f"{max(replacements):.2f}",
        answered_while_one_worker_down=served_while_one_down,
        **summary(load, verifier, restarts),
    )
    assert served_while_one_down > 0
    assert_clean(load, verifier, server)
