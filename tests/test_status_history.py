"""The status history: bounded rings of the fleet's totals, and the changes the page draws."""

from __future__ import annotations

import itertools
import sys
import tracemalloc

from prometheus_client import CollectorRegistry

from cache_service.core.blocks import Evicted, StoreKey, StoreUsage
from cache_service.service.metrics import EVICTION_REASONS, CacheMetrics, StoreCollector
from cache_service.service.status_history import (
    Sample,
    StatusHistory,
    Totals,
    change_between,
    read_totals,
)


class FakeClock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def totals(hits: int = 0, misses: int = 0, *, used: int = 0, **evicted: int) -> Totals:
    return Totals(hits, misses, used, dict(evicted), {})


def test_change_between_samples_is_the_counters_growth() -> None:
    first = Sample(0.0, totals(100, 50, used=10, capacity=3))
    last = Sample(10.0, totals(160, 70, used=99, capacity=5, expired=2))
    change = change_between(first, last)
    assert (change.hit_tokens, change.miss_tokens) == (60, 20)
    assert change.hit_ratio == 0.75
    assert change.used_bytes == 99  # a level: the end's
    assert change.evicted == {"capacity": 2, "expired": 2}
    assert change.seconds == 10.0


def test_a_counter_lower_than_before_counts_from_zero() -> None:
    change = change_between(Sample(0, totals(500, 500)), Sample(10, totals(30, 10)))
    assert (change.hit_tokens, change.miss_tokens) == (30, 10)


def test_no_lookups_means_no_ratio() -> None:
    assert change_between(Sample(0, totals(5, 5)), Sample(10, totals(5, 5))).hit_ratio is None


def test_fine_ring_keeps_every_sample_for_an_hour_and_coarse_one_a_minute() -> None:
    clock = FakeClock()
    history = StatusHistory(clock=clock)
    for i in range(2 * 360):  # two hours of samples every 10 s
        history.record(totals(i, i))
        clock.now += 10.0
    fine, coarse = list(history.fine.samples), list(history.coarse.samples)
    assert len(fine) == 361  # the last hour: 360 intervals
    assert fine[-1].at - fine[0].at == 3600
    assert all(b.at - a.at == 10 for a, b in itertools.pairwise(fine))
    assert len(coarse) == 120  # one a minute over two hours
    assert all(b.at - a.at == 60 for a, b in itertools.pairwise(coarse))


def test_coarse_ring_tolerates_a_sampler_that_runs_slightly_early() -> None:
    clock = FakeClock()
    history = StatusHistory(clock=clock)
    for _ in range(60):
        history.record(totals())
        clock.now += 9.9  # sleeps that end a little early must not lose the minute's sample
    gaps = [b.at - a.at for a, b in itertools.pairwise(history.coarse.samples)]
    assert gaps and all(55 < gap < 65 for gap in gaps), gaps


def test_coarse_ring_holds_a_day_at_most() -> None:
    clock = FakeClock()
    history = StatusHistory(clock=clock)
    for i in range(3 * 1440):  # three days, a sample a minute
        history.record(totals(i))
        clock.now += 60.0
    coarse = list(history.coarse.samples)
    assert len(coarse) == 1441
    assert coarse[-1].at - coarse[0].at == 86400


def test_change_over_a_window_starts_at_the_newest_sample_old_enough() -> None:
    clock = FakeClock()
    history = StatusHistory(clock=clock)
    for i in range(100):  # 1000 s of samples; a hit token a second, a miss every other second
        history.record(totals(10 * i, 5 * i, capacity=i))
        clock.now += 10.0
    last_5_min = history.change_over(300)
    assert last_5_min is not None
    assert last_5_min.seconds == 300
    assert (last_5_min.hit_tokens, last_5_min.miss_tokens) == (300, 150)
    assert last_5_min.evicted == {"capacity": 30}
    assert last_5_min.hit_ratio == 2 / 3


def test_change_over_a_window_longer_than_the_history_says_what_it_covers() -> None:
    clock = FakeClock()
    history = StatusHistory(clock=clock)
    assert history.change_over(300) is None
    history.record(totals(0, 0))
    assert history.change_over(300) is None  # one sample: no change yet
    clock.now += 10.0
    history.record(totals(8, 2))
    change = history.change_over(3600)
    assert change is not None and change.seconds == 10.0 and change.hit_ratio == 0.8


def test_change_over_a_day_reads_the_coarse_ring() -> None:
    clock = FakeClock()
    history = StatusHistory(clock=clock)
    for i in range(6 * 360):  # six hours at 10 s: the fine ring keeps one
        history.record(totals(i))
        clock.now += 10.0
    day = history.change_over(86400)
    assert day is not None
    assert day.seconds == 6 * 3600 - 10
    assert day.hit_tokens == 6 * 360 - 1


def test_totals_are_read_from_the_registry_as_a_scrape_sees_them() -> None:
    registry = CollectorRegistry()
    metrics = CacheMetrics(registry)
    metrics.declare_retention(["agent", "chat"])
    metrics.on_lookup(retention="agent", hit_tokens=64, miss_tokens=32, complete=False)
    metrics.on_lookup(retention="chat", hit_tokens=0, miss_tokens=16, complete=False)
    gone = [
        Evicted(
            StoreKey(b"k" * 16), reason="capacity", retention="chat", expires_at=2e9, payload_size=1
        ),
        Evicted(
            StoreKey(b"j" * 16), reason="expired", retention="agent", expires_at=0.0, payload_size=1
        ),
    ]
    metrics.on_evicted(gone, now=1e9)
    usage = StoreUsage(blocks=3, payload_bytes=300, used_bytes=4096)
    registry.register(StoreCollector(lambda: usage, 1 << 20))
    read = read_totals(registry)
    assert (read.hit_tokens, read.miss_tokens, read.used_bytes) == (64, 48, 4096)
    assert read.evicted == {reason: 0 for reason in EVICTION_REASONS} | {
        "capacity": 1,
        "expired": 1,
    }
    assert read.evicted_before_ttl == {"agent": 0, "chat": 1}


def test_a_day_of_history_stays_within_a_small_memory_bound() -> None:
    # The sampler's real totals: every eviction reason and a few classes, as the registry has.
    evicted = {reason: 123_456 for reason in EVICTION_REASONS}
    before_ttl = {name: 7 for name in ("agent", "chat", "batch")}
    clock = FakeClock()
    tracemalloc.start()
    try:
        history = StatusHistory(clock=clock)
        for i in range(3 * 8640):  # three days at 10 s: both rings full, and turned over
            history.record(Totals(10**9 + i, 10**9 + i, 10**10, dict(evicted), dict(before_ttl)))
            clock.now += 10.0
        held, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(history.fine.samples) + len(history.coarse.samples) == 361 + 1441
    print(f"history of {361 + 1441} samples holds {held / 2**20:.2f} MiB", file=sys.stderr)
    assert held < 2 * 2**20
