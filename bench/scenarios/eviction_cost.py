"""Eviction's cost per operation: each policy's lookup and store latency against LRU's.

Issue 15 allows a policy at most 10% more lookup and store latency than LRU. Each policy
runs its own `cache-service serve --eviction-policy NAME` on a small LMDB capacity with the
high- and low-water marks equal, so that once the cache is full every store evicts about as
many blocks as it brings: the steady state where the policy ranks every stored block and
learns from every eviction. Payloads are small (1 KiB a block), so the records, indexes and
policy are most of a store's work and the comparison is the strict one; durability is
`nosync`, as an fsync costs every policy the same and would only blur the ratio.

Measured, per policy, at concurrency 1 through our client: a hit lookup of an 8k-token
prompt stored at the start and kept held by being looked up twice after every store, and a
store (put_prefix) of a new 8k-token prompt, which evicts; then the rate of a mixed loop (one
store in every eight calls, the rest hit lookups) with four calls in flight. A hit reaches
the policy in the service's deferred touch flush (at most once a second per prompt), not in
the lookup's request: lookup latency shows a policy only through that flush's write.

Fairness: every policy's service is filled to the steady state first; then, in each round,
the policies take turns step by step (a step: one store and its lookups; LRU first on even
steps, last on odd ones), and after the steps each runs its mixed loop (turns alternating by
round). Drift on a shared machine thereby reaches every policy alike. A latency row's value
is the median of the rounds' medians; its p99 (and the p90 in the note) pool every call. A
rate row's value is the median of the rounds' rates. `ratio` is a row's value over LRU's;
the note's "paired" ratio is the median of the rounds' own ratios.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field

from bench.report import Row
from bench.scenarios.context import Context
from bench.services import Service, our_service
from cache_service.client import AsyncCacheClient, CacheClient
from cache_service.core.eviction import POLICIES
from cache_service.core.tokens import tokens_to_bytes

SCENARIO = "eviction"
MODEL = "bench"
REFERENCE = "lru"
CAPACITY = "64MiB"  # about 140 stored prompts: a turnover takes seconds, the hot prompt stays
WATER_MARK = 0.9  # high = low water: every store that crosses it evicts back down to it
PROMPT_TOKENS = 8192
BLOCKS = PROMPT_TOKENS // 64  # the service's default block size
PAYLOAD = bytes(1024)
HOT_BASE = 4_000_000_000  # the hot prompt's token ids: apart from every stored prompt's
HOT = tokens_to_bytes(range(HOT_BASE, HOT_BASE + PROMPT_TOKENS))
PROMPT_STRIDE = 10_000  # token ids between the starts of two new prompts (all below HOT_BASE)
LOOKUPS_PER_STORE = 2
EVICTING_WARMUP_STORES = 10  # stores after the first eviction before anything is timed
MOST_FILL_STORES = 2_000  # a cache that never evicts by then is not what this measures
MIXED_IN_FLIGHT = 4
MIXED_STORE_EVERY = 8


def policy_names() -> list[str]:
    """Every registered policy, LRU (the reference) first."""
    return [REFERENCE, *(name for name in POLICIES if name != REFERENCE)]


@dataclass
class _Subject:
    """One policy's service and client, and what its rounds measured."""

    name: str
    service: Service
    client: CacheClient
    prompts: Iterator[int] = field(default_factory=lambda: iter(range(400_000)))
    lookups: list[list[float]] = field(default_factory=list)
    stores: list[list[float]] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    stored_blocks: int = 0  # newly stored while measured (for the eviction count)
    store_calls: int = 0
    hot_lost: int = 0  # hot lookups that missed (then stored again, untimed)

    def new_prompt(self) -> bytes:
        """Tokens no earlier prompt of this service shares a block with."""
        start = next(self.prompts) * PROMPT_STRIDE
        return tokens_to_bytes(range(start, start + PROMPT_TOKENS))

    def blocks(self) -> int:
        """Blocks the service holds now."""
        return int(self.client.stats()["blocks"])


def _store(subject: _Subject, tokens: bytes) -> int:
    return int(subject.client.put_prefix(MODEL, tokens, [PAYLOAD] * BLOCKS))


def _fill(subject: _Subject) -> None:
    """Store new prompts (looking the hot one up between them) until every store evicts."""
    _store(subject, HOT)
    held = subject.blocks()
    evicting = 0
    for _ in range(MOST_FILL_STORES):
        _store(subject, subject.new_prompt())
        for _ in range(LOOKUPS_PER_STORE):
            subject.client.lookup(MODEL, HOT)
        now_held = subject.blocks()
        evicting += now_held < held + BLOCKS
        held = now_held
        if evicting >= EVICTING_WARMUP_STORES:
            return
    raise RuntimeError(f"{subject.name}: {MOST_FILL_STORES} stores did not fill {CAPACITY}")


def _step(subject: _Subject) -> None:
    """One timed store of a new prompt, then the timed hot lookups, into the current round."""
    tokens = subject.new_prompt()
    started = time.perf_counter()
    subject.stored_blocks += _store(subject, tokens)
    subject.stores[-1].append(time.perf_counter() - started)
    subject.store_calls += 1
    for _ in range(LOOKUPS_PER_STORE):
        started = time.perf_counter()
        found = subject.client.lookup(MODEL, HOT)
        elapsed = time.perf_counter() - started
        if found.matched_blocks == BLOCKS:
            subject.lookups[-1].append(elapsed)
        else:  # evicted after all: a miss is not the lookup measured here
            subject.hot_lost += 1
            subject.stored_blocks += _store(subject, HOT)


def _alternate(subjects: list[_Subject], index: int) -> list[_Subject]:
    """The subjects in order on even turns, reversed on odd ones."""
    return subjects if index % 2 == 0 else subjects[::-1]


def _measure_round(subjects: list[_Subject], index: int, steps: int, mixed_calls: int) -> None:
    """One round: `steps` store-and-lookups steps, the policies taking turns step by step;
    then each policy's mixed loop, in turns too."""
    for subject in subjects:
        subject.stores.append([])
        subject.lookups.append([])
    for step in range(steps):
        for subject in _alternate(subjects, step):
            _step(subject)
    for subject in _alternate(subjects, index):
        subject.rates.append(asyncio.run(_mixed_rate(subject, mixed_calls)))


async def _mixed_rate(subject: _Subject, calls: int) -> float:
    """Calls a second of the mixed loop: MIXED_IN_FLIGHT tasks share one list of calls."""
    work = [subject.new_prompt() if i % MIXED_STORE_EVERY == 0 else None for i in range(calls)]
    queue = iter(work)
    async with AsyncCacheClient(subject.service.url, timeout=60) as client:
        await client.lookup(MODEL, HOT)  # the connection is open before the clock starts

        async def worker() -> None:
            for tokens in queue:
                if tokens is None:
                    found = await client.lookup(MODEL, HOT)
                    subject.hot_lost += found.matched_blocks != BLOCKS
                else:
                    stored = await client.put_prefix(MODEL, tokens, [PAYLOAD] * BLOCKS)
                    subject.stored_blocks += int(stored)
                    subject.store_calls += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(MIXED_IN_FLIGHT)))
        return calls / (time.perf_counter() - started)


def _latency_row(subject: _Subject, case: str, rounds: list[list[float]]) -> Row:
    """Median of the rounds' medians; p90 and p99 of every call pooled."""
    pooled = sorted(seconds for one in rounds for seconds in one)
    # One entry per round, kept in step with the other policies' (NaN: nothing measured).
    medians = [statistics.median(one) * 1000 if one else math.nan for one in rounds]
    value = statistics.median(m for m in medians if not math.isnan(m))
    p90 = pooled[min(len(pooled) - 1, int(len(pooled) * 0.90))] * 1000
    p99 = pooled[min(len(pooled) - 1, int(len(pooled) * 0.99))] * 1000
    row = Row(SCENARIO, case, subject.name, "our client", value, "ms", value, p99, len(pooled))
    row.extra = {"p90_ms": p90, "rounds": medians}
    return row


def _rows(subject: _Subject, evicted_per_store: float) -> list[Row]:
    """The subject's lookup, store and mixed-loop rows (ratios are set by the caller)."""
    lookup = _latency_row(subject, "8k-token hit lookup, c=1", subject.lookups)
    store = _latency_row(subject, "8k-token store that evicts, c=1", subject.stores)
    mixed_case = f"mixed 1 store:{MIXED_STORE_EVERY - 1} hits, c={MIXED_IN_FLIGHT}"
    rate = statistics.median(subject.rates)
    mixed = Row(SCENARIO, mixed_case, subject.name, "our async client", rate, "req/s")
    mixed.samples = len(subject.rates)
    mixed.extra["rounds"] = subject.rates
    store.extra["evicted_blocks_per_store"] = evicted_per_store
    lookup.extra["hot_prompt_lost"] = subject.hot_lost
    return [lookup, store, mixed]


def _compare(rows: list[Row], reference: list[Row]) -> None:
    """Each row's value over LRU's row of the same case; in `extra`, the p90's ratio and the
    paired ratio (the median of the rounds' own ratios, which drift between rounds cancels)."""
    for row, ref in zip(rows, reference, strict=True):
        assert row.value is not None and ref.value
        row.ratio, row.ratio_to = row.value / ref.value, REFERENCE
        pairs = zip(row.extra["rounds"], ref.extra["rounds"], strict=True)
        paired = statistics.median(
            own / lru for own, lru in pairs if not (math.isnan(own) or math.isnan(lru))
        )
        row.extra["paired_ratio"] = paired
        versus = "the reference" if row is ref else f"vs lru; paired {paired:.2f}x"
        if "p90_ms" in row.extra:
            row.extra["p90_ratio"] = row.extra["p90_ms"] / ref.extra["p90_ms"]
            row.note = f"p90 {row.extra['p90_ms']:.3f} ms ({row.extra['p90_ratio']:.2f}x); {versus}"
        else:
            row.note = versus if row is ref else f"share of lru's rate; paired {paired:.2f}x"


def run(ctx: Context) -> list[Row]:
    """Every policy on its own evicting service, measured in alternating rounds against LRU."""
    rounds = ctx.reps(6, 20)
    steps = ctx.reps(6, 12)
    mixed_calls = ctx.reps(48, 64)
    with ExitStack() as stack:
        subjects = []
        for name in policy_names():
            service = stack.enter_context(
                our_service(
                    eviction_policy=name,
                    capacity=CAPACITY,
                    high_water=WATER_MARK,
                    low_water=WATER_MARK,
                    lmdb_sync="nosync",
                )
            )
            client = stack.enter_context(CacheClient(service.url, timeout=60))
            subjects.append(_Subject(name, service, client))
        for subject in subjects:
            _fill(subject)
        held_before = [subject.blocks() for subject in subjects]
        for index in range(rounds):
            _measure_round(subjects, index, steps, mixed_calls)
        rows: list[Row] = []
        reference: list[Row] = []
        for subject, before in zip(subjects, held_before, strict=True):
            evicted = subject.stored_blocks - (subject.blocks() - before)
            if evicted < subject.store_calls * BLOCKS // 2:
                raise RuntimeError(f"{subject.name}: stores evicted only {evicted} blocks")
            own = _rows(subject, evicted / subject.store_calls)
            reference = reference or own
            _compare(own, reference)
            rows += own
            ctx.memory.append(
                Row("memory", f"eviction scenario, {subject.name}", "ours", "-",
                    subject.service.peak_rss_mib(), "MiB peak RSS")
            )  # fmt: skip
    return rows
