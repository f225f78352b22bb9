"""Payload fetch and store: ours through our client, against Redis, LMDB, TCP and LMCache."""

from __future__ import annotations

import http.client
import importlib
import json
import time
from collections.abc import Callable
from functools import partial

from bench.peers import PEER_MODULES
from bench.peers.harness import check_equal, payload_rows, time_calls
from bench.peers.payloads import SCENARIO, prefix_blocks, prefix_case, single_blocks, single_case
from bench.report import Row, compare, skipped
from bench.scenarios.context import Context
from bench.services import Service, our_service
from cache_service.client import CacheClient
from cache_service.core.tokens import tokens_to_bytes

MODEL = "bench"

OURS = "ours (lmdb-sync full)"
OURS_NOSYNC = "ours (lmdb-sync nosync)"


def _server_fetch_rate(service: Service, keys: list[str], total_bytes: int, reps: int) -> Row:
    """The service's own fetch bandwidth: a raw http.client reading into one buffer."""
    body = json.dumps({"model": MODEL, "keys": keys}).encode()
    conn = http.client.HTTPConnection(service.url.removeprefix("http://").split(":")[0],
                                      int(service.url.rsplit(":", 1)[1]), timeout=60)  # fmt: skip
    buffer = memoryview(bytearray(total_bytes + (1 << 20)))

    def fetch() -> int:
        conn.request("POST", "/v1/blocks/fetch", body, {"Content-Type": "application/json"})
        return conn.getresponse().readinto(buffer)

    seconds = time_calls(fetch, repetitions=reps, warmup=2)
    conn.close()
    rows = payload_rows(
        prefix_case("fetch", "service bandwidth"), "ours", "raw http.client readinto", seconds,
        payload_bytes=total_bytes,
    )  # fmt: skip
    return rows[1]


def _ours(ctx: Context, reps: int) -> tuple[list[Row], dict[str, Row]]:
    blocks = prefix_blocks()
    total = sum(len(b) for b in blocks)
    tokens = tokens_to_bytes(range(len(blocks) * 64))
    rows: list[Row] = []
    key: dict[str, Row] = {}
    with our_service(capacity="4GiB") as service, CacheClient(service.url, timeout=120) as client:
        salts = iter(range(10**6))
        stored = time_calls(
            lambda: client.put_prefix(MODEL, tokens, blocks, salt=str(next(salts))),
            repetitions=reps,
        )
        store_rows = payload_rows(
            prefix_case("store", "512 blocks"), OURS, "our client", stored, payload_bytes=total
        )
        client.put_prefix(MODEL, tokens, blocks)
        keys = client.lookup(MODEL, tokens).keys
        fetched = time_calls(
            lambda: client.get_blocks(MODEL, keys, copy=False),
            repetitions=reps,
            warmup=2,
            check=check_equal(blocks),
        )
        fetch_rows = payload_rows(
            prefix_case("fetch", "512 blocks"), OURS, "our client, copy=False", fetched,
            payload_bytes=total,
        )  # fmt: skip
        both = time_calls(
            lambda: client.lookup(MODEL, tokens, fetch=True, copy=False).payloads,
            repetitions=reps,
            warmup=2,
            check=check_equal(blocks),
        )
        lookup_rows = payload_rows(
            prefix_case("lookup+fetch", "one round trip"), OURS, "our client, copy=False", both,
            payload_bytes=total,
        )  # fmt: skip
        server = _server_fetch_rate(service, keys, total, reps)
        rows += store_rows + fetch_rows + lookup_rows + [server]
        key.update(store=store_rows[1], fetch=fetch_rows[1], server=server)
        fresh = iter(range(10**6))
        for index, (label, value) in enumerate(single_blocks().items()):
            one = tokens_to_bytes(range(9_000_000 + index * 64, 9_000_064 + index * 64))

            def store_once(value: bytes = value, tokens: bytes = one) -> None:
                # A fresh salt each time: every call stores, none merely refreshes.
                client.put_prefix(MODEL, tokens, [value], salt=f"s{next(fresh)}")

            seconds = time_calls(store_once, repetitions=reps * 4)
            rows += payload_rows(
                single_case(label, "store"), OURS, "our client", seconds, payload_bytes=len(value)
            )
            client.put_prefix(MODEL, one, [value])
            single_key = client.lookup(MODEL, one).keys
            seconds = time_calls(
                partial(client.get_blocks, MODEL, single_key, copy=False),
                repetitions=reps * 4,
                check=check_equal([value]),
            )
            rows += payload_rows(
                single_case(label, "fetch"), OURS, "our client, copy=False", seconds,
                payload_bytes=len(value),
            )  # fmt: skip
        ctx.memory.append(
            Row("memory", "payload scenario", "ours", "-", service.peak_rss_mib(), "MiB peak RSS")
        )
    return rows, key


def _peer(name: str) -> Callable[..., list[Row]] | None:
    try:
        module = importlib.import_module(name)
    except ImportError:
        return None
    measure: Callable[..., list[Row]] = module.measure
    return measure


def _find(rows: list[Row], subject: str, case: str, unit_prefix: str) -> Row | None:
    for row in rows:
        if (
            subject in row.subject
            and row.case.startswith(case)
            and row.unit.startswith(unit_prefix)
        ):
            return row
    return None


def _ours_nosync(ctx: Context, reps: int) -> list[Row]:
    """The store again with LMDB flushing left to the OS: the durability Redis has here."""
    blocks = prefix_blocks()
    tokens = tokens_to_bytes(range(len(blocks) * 64))
    with (
        our_service(capacity="4GiB", lmdb_sync="nosync") as service,
        CacheClient(service.url, timeout=120) as client,
    ):
        salts = iter(range(10**6))
        stored = time_calls(
            lambda: client.put_prefix(MODEL, tokens, blocks, salt=str(next(salts))),
            repetitions=reps,
        )
    return payload_rows(
        prefix_case("store", "512 blocks"), OURS_NOSYNC, "our client", stored,
        payload_bytes=sum(len(b) for b in blocks),
        note="nosync: a process crash loses nothing, a power loss may lose recent writes",
    )  # fmt: skip


def run(ctx: Context) -> list[Row]:
    """Ours first, then each peer on the same bytes; ratios to Redis and the TCP floor."""
    reps = ctx.reps(3, 15)
    started = time.perf_counter()
    rows, ours = _ours(ctx, reps)
    nosync = _ours_nosync(ctx, reps)
    rows += nosync
    for name in PEER_MODULES:
        measure = _peer(name)
        if measure is None:
            rows.append(skipped(SCENARIO, prefix_case("store/fetch"), name, "not available"))
            continue
        rows += measure(quick=ctx.quick, repetitions=reps, allow_install=ctx.allow_install)
    redis_fetch = _find(rows, "redis", prefix_case("fetch"), "MB/s")
    redis_store = _find(rows, "redis", prefix_case("store"), "MB/s")
    tcp = _find(rows, "loopback tcp", prefix_case("fetch"), "MB/s")
    compare(ours["fetch"], redis_fetch)
    ours["fetch"].note = "target: at least 1.2x Redis pipelined GET"
    compare(ours["store"], redis_store)
    compare(nosync[1], redis_store)
    nosync[1].note = "target: at least 0.8x Redis pipelined SET (which persists nothing)"
    compare(ours["server"], tcp)
    ours["server"].note = "share of loopback TCP bulk"
    rows[0].extra["scenario_seconds"] = round(time.perf_counter() - started, 1)
    return rows
