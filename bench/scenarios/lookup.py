"""Lookup latency and throughput: prompt sizes x cache states x concurrency, against the floor."""

from __future__ import annotations

import asyncio
import http.client
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from functools import partial
from pathlib import Path

from bench.peers.harness import time_calls
from bench.report import Row, compare, latency_row, skipped
from bench.scenarios.context import Context
from bench.services import Service, floor_service, our_service
from cache_service.client import AsyncCacheClient, CacheClient
from cache_service.core.framing import MEDIA_TYPE, encode_frames, join_frames
from cache_service.core.tokens import tokens_to_bytes

SIZES = {"1k": 1024, "8k": 8192, "32k": 32768, "128k": 131072}
STATES = ("fully cached", "half cached", "uncached")
MODEL = "bench"
WRK_SCRIPT = """
local f = io.open("{body}", "rb")
wrk.method = "POST"
wrk.body = f:read("*all")
f:close()
wrk.headers["Content-Type"] = "{media}"
"""


def _prompt(size: int, state: str) -> bytes:
    """Distinct tokens per (size, state), so states never share blocks."""
    base = (list(SIZES.values()).index(size) * 3 + STATES.index(state)) * 1_000_000
    return tokens_to_bytes(range(base, base + size))


def _body(token_bytes: bytes) -> bytes:
    return join_frames(encode_frames({"model": MODEL}, [token_bytes]))


def ensure_wrk(allow_install: bool) -> str | None:
    """The wrk binary, installed from Debian's packages when allowed."""
    found = shutil.which("wrk")
    if found or not allow_install:
        return found
    subprocess.run(["apt-get", "install", "-y", "-q", "wrk"], check=False, capture_output=True)
    return shutil.which("wrk")


def wrk_rate(wrk: str, url: str, body: bytes, seconds: int) -> tuple[float, float | None]:
    """(requests/s, p99 ms) of wrk at 16 connections on one thread."""
    with tempfile.TemporaryDirectory() as folder:
        body_path = Path(folder) / "body.bin"
        body_path.write_bytes(body)
        script = Path(folder) / "post.lua"
        script.write_text(WRK_SCRIPT.format(body=body_path, media=MEDIA_TYPE))
        out = subprocess.run(
            [wrk, "-t1", "-c16", f"-d{seconds}s", "--latency", "-s", str(script), url],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p99 = re.search(r"99%\s+([\d.]+)(us|ms|s)", out)
    scale = {"us": 0.001, "ms": 1.0, "s": 1000.0}
    return rate, (float(p99.group(1)) * scale[p99.group(2)] if p99 else None)


async def _client_rate(url: str, token_bytes: bytes, total: int) -> float:
    """Requests/s of AsyncCacheClient with 16 lookups in flight."""
    async with AsyncCacheClient(url, timeout=30) as client:
        await client.lookup(MODEL, token_bytes)
        left = total

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await client.lookup(MODEL, token_bytes)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(16)))
        return total / (time.perf_counter() - started)


def _wrk_rows(ctx: Context, ours: Service, floor: Service, name: str) -> list[Row]:
    """wrk at c=16 on ours (each cache state) and on the floor, alternating in rounds so that
    drift on a shared machine hits both alike; medians, with every round kept."""
    wrk = ensure_wrk(ctx.allow_install)
    case = f"{name} tokens, %s, c=16"
    if wrk is None:
        return [skipped("lookup", case % "any", "ours", "wrk is not installed (--install)")]
    seconds = ctx.reps(2, 4)
    runs: dict[str, list[tuple[float, float | None]]] = {state: [] for state in (*STATES, "floor")}
    for _ in range(ctx.reps(3, 3)):
        for state in STATES:
            body = _body(_prompt(SIZES[name], state))
            runs[state].append(wrk_rate(wrk, ours.url + "/v1/lookup", body, seconds))
        floor_body = _body(_prompt(SIZES[name], "fully cached"))
        runs["floor"].append(wrk_rate(wrk, floor.url + "/v1/lookup", floor_body, seconds))
    rows = []
    for state, measured in runs.items():
        rates = [rate for rate, _ in measured]
        p99s = [p99 for _, p99 in measured if p99 is not None]
        subject = "framework floor" if state == "floor" else "ours"
        label = "fully cached" if state == "floor" else state
        p99 = statistics.median(p99s) if p99s else None
        rate = statistics.median(rates)
        row = Row("lookup", case % label, subject, "wrk -t1 -c16", rate, "req/s", p99=p99)
        row.samples = len(rates)
        row.extra["rounds"] = rates
        rows.append(row)
    floor_row = rows[-1]
    for row in rows[:-1]:
        compare(row, floor_row)
    rows[0].note = "target: at least 0.60 of the framework floor"
    return rows


def _client_rows(ctx: Context, service: Service, subject: str, name: str) -> list[Row]:
    """Our async client with 16 lookups in flight, for comparison with wrk."""
    total = ctx.reps(300, 2000)
    token_bytes = _prompt(SIZES[name], "fully cached")
    rate = asyncio.run(_client_rate(service.url, token_bytes, total))
    case = f"{name} tokens, fully cached, c=16"
    return [Row("lookup", case, subject, "our async client, 16 tasks", rate, "req/s")]


def _raw_client_row(ctx: Context, service: Service, token_bytes: bytes) -> Row:
    """The same lookup through the standard library's http.client: the floor for any client."""
    host, port = service.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = _body(token_bytes)

    def lookup() -> bytes:
        conn.request("POST", "/v1/lookup", body, {"Content-Type": MEDIA_TYPE})
        return conn.getresponse().read()

    seconds = time_calls(lookup, repetitions=ctx.reps(100, 500), warmup=10)
    conn.close()
    return latency_row(
        "lookup", "32k tokens, fully cached, c=1", "ours", "raw http.client", seconds
    )


def _distinct_prompts(count: int) -> list[bytes]:
    return [
        tokens_to_bytes(range(50_000_000 + i * 40_000, 50_032_768 + i * 40_000))
        for i in range(count)
    ]


def _first_sight(ctx: Context, client: CacheClient) -> Row:
    """32k lookups of distinct prompts, each looked up once right after this process stored
    it (the writer's memo makes that one read, as for a repeated prompt)."""
    prompts = _distinct_prompts(ctx.reps(30, 200))
    for prompt in prompts:
        client.put_prefix(MODEL, prompt, [b""] * 512)
    order = iter(prompts)
    seconds = time_calls(lambda: client.lookup(MODEL, next(order)), repetitions=len(prompts) - 1)
    return latency_row(
        "lookup", "32k tokens, first lookup after storing it", "ours", "our client", seconds
    )


def _cold_first_sight(ctx: Context) -> Row:
    """The same after a restart: nothing in memory, every block is read and verified."""
    prompts = _distinct_prompts(ctx.reps(30, 200))
    with tempfile.TemporaryDirectory(prefix="bench-cold-") as folder:
        with our_service(Path(folder)) as service, CacheClient(service.url) as client:
            for prompt in prompts:
                client.put_prefix(MODEL, prompt, [b""] * 512)
        with our_service(Path(folder)) as service, CacheClient(service.url) as client:
            order = iter(prompts)
            seconds = time_calls(
                lambda: client.lookup(MODEL, next(order)), repetitions=len(prompts) - 1
            )
    row = latency_row(
        "lookup", "32k tokens, first lookup after a restart", "ours", "our client", seconds
    )
    row.note = "no memo: 512 blocks read and verified"
    return row


def run(ctx: Context) -> list[Row]:
    """Latency at concurrency 1 through our client; throughput at 16 against the floor."""
    sizes = ["1k", "32k"] if ctx.quick else list(SIZES)
    concurrent_sizes = ["32k"] if ctx.quick else list(SIZES)
    rows: list[Row] = []
    with our_service() as service, CacheClient(service.url, timeout=30) as client:
        for name in sizes:
            size = SIZES[name]
            for state in STATES:
                token_bytes = _prompt(size, state)
                stored = {"fully cached": size // 64, "half cached": size // 128}.get(state, 0)
                if stored:
                    client.put_prefix(MODEL, token_bytes[: stored * 256], [b""] * stored)
                found = client.lookup(MODEL, token_bytes)
                assert found.matched_blocks == stored, (name, state, found.matched_blocks)
                seconds = time_calls(
                    partial(client.lookup, MODEL, token_bytes),
                    repetitions=ctx.reps(100, 500),
                    warmup=10,
                )
                row = latency_row(
                    "lookup", f"{name} tokens, {state}, c=1", "ours", "our client", seconds
                )
                if name == "32k" and state == "fully cached":
                    row.note = "target: p50 under 2 ms"
                    rows.append(row)
                    bare = _raw_client_row(ctx, service, token_bytes)
                    compare(row, bare)  # our client's latency as a multiple of a bare client's
                    row = bare
                    row.note = "the same lookup by a bare http.client"
                rows.append(row)
        rows.append(_first_sight(ctx, client))
        rows.append(_cold_first_sight(ctx))
        ctx.memory.append(
            Row("memory", "lookup scenario", "ours", "-", service.peak_rss_mib(), "MiB peak RSS")
        )
        with floor_service() as floor:
            for name in concurrent_sizes:
                rows += _wrk_rows(ctx, service, floor, name)
                rows += _client_rows(ctx, service, "ours", name)
                rows += _client_rows(ctx, floor, "framework floor", name)
    return rows
