"""Lookup latency as the store grows: it must stay flat (index-only blocks)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from bench.peers.harness import time_calls
from bench.report import Row, compare, latency_row
from bench.scenarios.context import Context
from bench.services import our_service
from cache_service.client import CacheClient
from cache_service.core.blocks import Namespace
from cache_service.core.cache import PrefixCache
from cache_service.core.retention import DEFAULT_LIFETIMES
from cache_service.core.store.lmdb.store import LmdbStore
from cache_service.core.tokens import tokens_to_bytes

MODEL = "bench"
CHAIN_BLOCKS = 512  # stored as 32k-token prompts of 64-token blocks
MAP_BYTES = 64 * 2**30


def populate(folder: Path, blocks: int) -> float:
    """Fill an LMDB store in-process with `blocks` index-only blocks; seconds taken."""
    started = time.perf_counter()
    store = LmdbStore(
        folder, map_size_bytes=MAP_BYTES, sync_mode="nosync", lifetimes=DEFAULT_LIFETIMES
    )
    cache = PrefixCache(store)
    namespace = Namespace(MODEL)
    chains = max(1, blocks // CHAIN_BLOCKS)
    for chain in range(chains):
        base = 100_000_000 + chain * CHAIN_BLOCKS * 64
        with store.batch():
            cache.insert(namespace, tokens_to_bytes(range(base, base + CHAIN_BLOCKS * 64)),
                         [b""] * CHAIN_BLOCKS)  # fmt: skip
    store.env.sync(True)
    store.close()
    return time.perf_counter() - started


def run(ctx: Context) -> list[Row]:
    """p50 of a fully cached 32k lookup at each store size, as a multiple of the smallest."""
    sizes = [10**4, 10**5] if ctx.quick else [10**4, 10**6, 10**7]
    rows: list[Row] = []
    first: Row | None = None
    probe = tokens_to_bytes(range(32768))
    for blocks in sizes:
        with tempfile.TemporaryDirectory(prefix="bench-size-") as folder:
            seconds_to_fill = populate(Path(folder), blocks)
            with (
                our_service(Path(folder), capacity="30GiB") as service,
                CacheClient(service.url, timeout=60) as client,
            ):
                client.put_prefix(MODEL, probe, [b""] * 512)
                timings = time_calls(
                    lambda: client.lookup(MODEL, probe),
                    repetitions=ctx.reps(100, 500),
                    warmup=10,
                )
                stats = client.stats()
                rss = service.peak_rss_mib()
        ctx.memory.append(Row("memory", f"{blocks:,} blocks", "ours", "-", rss, "MiB peak RSS"))
        case = f"32k lookup, {stats['blocks']:,} blocks stored"
        row = latency_row("store-size", case, "ours", "our client", timings)
        row.extra = {"fill_seconds": round(seconds_to_fill, 1), "used_bytes": stats["used_bytes"]}
        if first is None:
            first = row
        else:
            compare(row, first)
            row.note = "target: p50 within 1.3x of the smallest store"
        rows.append(row)
    return rows
