"""Soak: 64 clients for a fixed time against a store kept above its high-water mark.

Each client acts like a prefill worker over a population of prompts with shared prefixes:
it looks prompts up (with or without their payloads), stores the blocks that missed, fetches
blocks by key and stores whole prompts. The population holds several times the capacity, so
eviction runs all the time; TTLs of seconds make blocks expire and the sweeper run as well.
Checked: no error but the documented back-pressure answers (each kind counted), every byte
returned is right, the server's memory stays flat after warm-up, the store never uses more
than its capacity, and the LMDB file stays within 1.5x the live data.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx

from cache_service.client import AsyncCacheClient
from cache_service.core.errors import ServiceError, ServiceUnavailable
from tests.integration.conftest import ServerProcess
from tests.reliability.processes import evicted_in, logged_errors
from tests.reliability.workload import PromptSet, Verifier

CLIENTS = 64
CAPACITY_BYTES = 16 * 2**20
HIGH_WATER = 0.95
MAX_PENDING_WRITES = 16
# Short TTLs and a frequent sweep: blocks expire and are swept while eviction runs too.
SERVER_FLAGS = {
    "capacity": str(CAPACITY_BYTES),
    "high_water": str(HIGH_WATER),
    "max_pending_writes": str(MAX_PENDING_WRITES),
    "block_size": "16",
    "retention": "chat=2s,agent=20s",
    "sweep_interval": "1",
}
RETENTION_CLASSES = ("chat", "agent")
# About 60 MiB of distinct blocks: nearly four times the capacity.
PROMPTS = PromptSet(families=256, variants=8, payload_bytes=(4096, 16384), seed=3)
# The store evicts after each store request's commit, so until their evictions run the
# requests in flight (at most --max-pending-writes) may take it past the high-water
# mark by up to their size: a page more than each payload, per block.
PAGE_BYTES = 4096
LARGEST_STORE_BYTES = (PROMPTS.shared_blocks[1] + PROMPTS.tail_blocks[1]) * (
    PROMPTS.payload_bytes[1] + PAGE_BYTES
)
USED_BYTES_BOUND = HIGH_WATER * CAPACITY_BYTES + MAX_PENDING_WRITES * LARGEST_STORE_BYTES
SAMPLE_SECONDS = 0.5
RSS_GROWTH_LIMIT = 0.10
FILE_TO_LIVE_LIMIT = 1.5


def refusal_kind(error: ServiceError, *, start_block: int) -> str | None:
    """The documented answer a soak may meet, by name; None for anything else."""
    problem = error.problem_type.rsplit("/", 1)[-1]
    if isinstance(error, ServiceUnavailable):
        return None  # the service dropped a connection or timed out: never acceptable
    if error.status == 503 and problem == "writes-backed-up":
        if error.problem_body.get("limit") != "max_pending_writes":
            return None  # a back-pressure answer names the limit it applies
        return "503 writes-backed-up"  # --max-pending-writes, with Retry-After
    if error.status in (429, 507):
        return f"{error.status} {problem}"
    if error.status == 409 and problem == "missing-parent" and start_block > 0:
        return "409 parent gone since the lookup"  # a continuation raced eviction or expiry
    return None


class Soak:
    """The clients' shared counts: requests by kind, refusals by kind, errors."""

    def __init__(self, verifier: Verifier) -> None:
        self.verifier = verifier
        self.requests: Counter[str] = Counter()
        self.refusals: Counter[str] = Counter()
        self.errors: list[str] = []

    async def client(self, url: str, seed: int, deadline: float) -> None:
        """One prefill worker's loop until the deadline."""
        rng = random.Random(seed)
        async with AsyncCacheClient(url, timeout=30.0) as cache:
            while time.monotonic() < deadline:
                await self._one(cache, rng)

    async def _one(self, cache: AsyncCacheClient, rng: random.Random) -> None:
        prompt = PROMPTS.pick(rng)
        draw = rng.random()
        start = 0
        try:
            if draw < 0.55:
                fetch = rng.random() < 0.5
                retention = rng.choice(RETENTION_CLASSES)
                match = await cache.lookup(
                    prompt.model, prompt.tokens, fetch=fetch, retention=retention
                )
                self.requests["lookup+fetch" if fetch else "lookup"] += 1
                start = self.verifier.check_match(prompt, match)
                if start == prompt.blocks or rng.random() < 0.3:
                    return
            elif draw < 0.8:
                found = await cache.get_blocks(prompt.model, prompt.keys)
                self.requests["fetch"] += 1
                self.verifier.check_fetch(prompt, found)
                return
            payloads = prompt.payloads(start, prompt.blocks)
            result = await cache.store(
                prompt.model,
                prompt.tokens,
                payloads,
                start_block=start,
                retention=rng.choice(RETENTION_CLASSES),
            )
            self.requests["store"] += 1
            if not result.as_sent or result.keys != prompt.keys[start:]:
                self.verifier.wrong.append(f"{prompt.name}: store answered {result}")
        except ServiceError as error:
            kind = refusal_kind(error, start_block=start)
            if kind is None:
                self.errors.append(f"{error.status} {error.problem_type}: {error.detail}")
            else:
                self.refusals[kind] += 1
                await asyncio.sleep(0.05)  # Retry-After says a second; a short pause will do


def rss_kib(pid: int) -> int:
    """The process's resident set (VmRSS), KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


async def watch(server: ServerProcess, deadline: float, samples: list[dict[str, float]]) -> None:
    """Sample the server's RSS, live data, file size and evictions until the deadline."""
    assert server.proc is not None
    data_file = server.data_dir / "data.mdb"
    async with httpx.AsyncClient(base_url=server.url, timeout=30.0) as http:
        while time.monotonic() < deadline:
            stats = (await http.get("/v1/stats")).json()
            metrics = (await http.get("/metrics")).text
            samples.append(
                {
                    "at": time.monotonic(),
                    "rss_kib": rss_kib(server.proc.pid),
                    "used_bytes": stats["used_bytes"],
                    "file_bytes": data_file.stat().st_size,
                    **{f"removed_{reason}": n for reason, n in evicted_in(metrics).items()},
                }
            )
            await asyncio.sleep(SAMPLE_SECONDS)


async def soak(server: ServerProcess, soak_seconds: float) -> tuple[Soak, list[dict[str, float]]]:
    """Run the clients and the watcher for `soak_seconds`."""
    state = Soak(Verifier())
    samples: list[dict[str, float]] = []
    deadline = time.monotonic() + soak_seconds
    await asyncio.gather(
        watch(server, deadline, samples),
        *(state.client(server.url, seed, deadline) for seed in range(CLIENTS)),
    )
    return state, samples


def thirds(samples: list[dict[str, float]]) -> tuple[list[dict[str, float]], ...]:
    """The samples of the warm-up, the middle and the last third of the run, by time."""
    began, ended = samples[0]["at"], samples[-1]["at"]
    third = (ended - began) / 3
    return tuple(
        [s for s in samples if began + n * third <= s["at"] < began + (n + 1) * third + 1e-9]
        for n in range(3)
    )


def test_soak_keeps_memory_and_file_flat_under_constant_eviction(
    tmp_path: Path, scale: Callable[[int, int], int], report: Callable[..., None]
) -> None:
    soak_seconds = scale(45, 600)
    server = ServerProcess(tmp_path / "data", tmp_path / "server.log", **SERVER_FLAGS)
    server.start()
    try:
        state, samples = asyncio.run(soak(server, soak_seconds))
        data_file_bytes = (server.data_dir / "data.mdb").stat().st_size
    finally:
        server.stop()
    verifier = state.verifier
    _warm_up, middle, last = thirds(samples)
    rss_after_warm_up = statistics.median(s["rss_kib"] for s in middle)
    rss_end = statistics.median(s["rss_kib"] for s in last)
    growth = rss_end / rss_after_warm_up - 1
    # Live data swings between the water marks as eviction runs: the last third's median.
    live_end = statistics.median(s["used_bytes"] for s in last)
    used_max = max(s["used_bytes"] for s in samples)
    evicted_in_last_third = last[-1].get("removed_capacity", 0) - middle[-1].get(
        "removed_capacity", 0
    )
    report(
        seconds=soak_seconds,
        clients=CLIENTS,
        requests=dict(state.requests),
        refusals=dict(state.refusals),
        errors=len(state.errors),
        wrong=len(verifier.wrong),
        bytes_verified=verifier.checked_bytes,
        rss_start_mib=f"{samples[0]['rss_kib'] / 1024:.1f}",
        rss_after_warm_up_mib=f"{rss_after_warm_up / 1024:.1f}",
        rss_end_mib=f"{rss_end / 1024:.1f}",
        rss_growth=f"{growth:+.1%}",
        file_mib=f"{data_file_bytes / 2**20:.1f}",
        live_mib=f"{live_end / 2**20:.1f}",
        capacity_mib=CAPACITY_BYTES // 2**20,
        used_max_of_capacity=f"{used_max / CAPACITY_BYTES:.1%}",
        removed_blocks={k[8:]: v for k, v in samples[-1].items() if k.startswith("removed_")},
    )
    assert not state.errors, state.errors[:10]
    assert not logged_errors(server.log_path), logged_errors(server.log_path)[:10]
    assert not verifier.wrong, verifier.wrong[:10]
    assert state.requests["store"] and state.requests["fetch"] and state.requests["lookup"]
    assert evicted_in_last_third > 0, "eviction stopped: the store is not above high water"
    assert used_max <= USED_BYTES_BOUND, f"{used_max} bytes used: eviction falls behind"
    assert growth < RSS_GROWTH_LIMIT, f"RSS grew {growth:.1%} after warm-up"
    assert data_file_bytes < FILE_TO_LIVE_LIMIT * live_end, (
        f"data.mdb is {data_file_bytes} bytes for {live_end} live"
    )
