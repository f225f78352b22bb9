"""A bounded history of the service's running totals, for the status page's charts.

Every SAMPLE_SECONDS a worker records the cumulative hit and miss tokens, the bytes the store
uses and the blocks evicted by reason, read from the metrics registry's sums: with
`--workers N` each worker reads the whole fleet's totals (every worker counts into the
multiprocess files the sums are made of), so whichever worker answers the page shows the
same figures. Each worker keeps its own copy, from its own start.

Two rings hold the samples: a fine one (every sample, for the last hour) and a coarse one
(a sample a minute, for the last day); 360 + 1440 samples at most, whatever the traffic. A
chart is the differences of consecutive samples, so a counter that starts again (a fleet
restarted under a longer-lived worker's files) counts from zero, as Prometheus' rate() does.

Times are a monotonic clock's (injected): the page shows how long ago, never a wall-clock
time, so a wall clock stepped back or forward bends no chart.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

SAMPLE_SECONDS = 10.0
FINE_SPAN_SECONDS = 3600.0
COARSE_STEP_SECONDS = 60.0
COARSE_SPAN_SECONDS = 86400.0


@dataclass(frozen=True, slots=True)
class Totals:
    """Cumulative counts at one moment (the used bytes: a level, not a count)."""

    hit_tokens: int
    miss_tokens: int
    used_bytes: int
    evicted: Mapping[str, int]  # blocks, by reason
    evicted_before_ttl: Mapping[str, int]  # blocks, by retention class


@dataclass(frozen=True, slots=True)
class Sample:
    """Totals and when (the history's monotonic clock) they were read."""

    at: float
    totals: Totals


@dataclass(frozen=True, slots=True)
class Change:
    """What happened between two samples: tokens, evictions, and the used bytes at the end."""

    start: float
    end: float
    hit_tokens: int
    miss_tokens: int
    used_bytes: int
    evicted: Mapping[str, int]
    evicted_before_ttl: Mapping[str, int]

    @property
    def seconds(self) -> float:
        """How long the change took."""
        return self.end - self.start

    @property
    def hit_ratio(self) -> float | None:
        """Hit tokens over looked-up tokens; None without lookups."""
        looked_up = self.hit_tokens + self.miss_tokens
        return self.hit_tokens / looked_up if looked_up else None


def _grown(before: int, after: int) -> int:
    """A counter's growth; a counter lower than before started again from zero."""
    return after - before if after >= before else after


def _grown_by(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    return {name: _grown(before.get(name, 0), value) for name, value in after.items()}


def change_between(first: Sample, last: Sample) -> Change:
    """The change from `first` to `last`."""
    old, new = first.totals, last.totals
    return Change(
        start=first.at,
        end=last.at,
        hit_tokens=_grown(old.hit_tokens, new.hit_tokens),
        miss_tokens=_grown(old.miss_tokens, new.miss_tokens),
        used_bytes=new.used_bytes,
        evicted=_grown_by(old.evicted, new.evicted),
        evicted_before_ttl=_grown_by(old.evicted_before_ttl, new.evicted_before_ttl),
    )


class Ring:
    """Samples at least `step_seconds` apart, the last `span_seconds`' worth at most."""

    def __init__(self, *, step_seconds: float, span_seconds: float) -> None:
        self.step_seconds = step_seconds
        self.span_seconds = span_seconds
        # One more than the span holds steps: N + 1 samples make N intervals.
        self.samples: deque[Sample] = deque(maxlen=math.ceil(span_seconds / step_seconds) + 1)

    def offer(self, sample: Sample, *, slack_seconds: float = 0.0) -> bool:
        """Keep `sample` if it comes a step (less `slack_seconds`) after the last kept one."""
        if self.samples and sample.at - self.samples[-1].at < self.step_seconds - slack_seconds:
            return False
        self.samples.append(sample)
        return True

    def changes(self) -> list[Change]:
        """The changes between consecutive samples, oldest first."""
        kept = list(self.samples)
        return [change_between(a, b) for a, b in itertools.pairwise(kept)]


class StatusHistory:
    """The fine and coarse rings, fed one sample at a time by the service's sampler."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        sample_seconds: float = SAMPLE_SECONDS,
        fine_span_seconds: float = FINE_SPAN_SECONDS,
        coarse_step_seconds: float = COARSE_STEP_SECONDS,
        coarse_span_seconds: float = COARSE_SPAN_SECONDS,
    ) -> None:
        self.clock = clock
        self.sample_seconds = sample_seconds
        self.fine = Ring(step_seconds=sample_seconds, span_seconds=fine_span_seconds)
        self.coarse = Ring(step_seconds=coarse_step_seconds, span_seconds=coarse_span_seconds)

    def record(self, totals: Totals) -> Sample:
        """Note `totals` as of now."""
        sample = Sample(self.clock(), totals)
        # A sampler's sleeps run a little long or short: half a sample's slack keeps every
        # sample in the fine ring and one a minute in the coarse one.
        slack = self.sample_seconds / 2
        self.fine.offer(sample, slack_seconds=slack)
        self.coarse.offer(sample, slack_seconds=slack)
        return sample

    @property
    def latest(self) -> Sample | None:
        """The last sample recorded, if any."""
        return self.fine.samples[-1] if self.fine.samples else None

    def change_over(self, seconds: float) -> Change | None:
        """The change over the last `seconds` (from the newest sample at least that old, or
        the oldest kept if the history is shorter: `Change.seconds` says what it covers);
        None before two samples."""
        latest = self.latest
        if latest is None:
            return None
        ring = self.fine if seconds <= self.fine.span_seconds else self.coarse
        since = latest.at - seconds
        first = ring.samples[0]
        for sample in ring.samples:
            if sample.at > since:
                break
            first = sample
        if first.at >= latest.at:
            return None
        return change_between(first, latest)


def totals_of(families: Iterable[Metric]) -> Totals:
    """The totals in a registry's metric families (the service's names; classes summed)."""
    hits = misses = used = 0.0
    evicted: dict[str, int] = {}
    before_ttl: dict[str, int] = {}
    for family in families:
        for sample in family.samples:
            if sample.name == "prompt_cache_hit_tokens_total":
                hits += sample.value
            elif sample.name == "prompt_cache_miss_tokens_total":
                misses += sample.value
            elif sample.name == "prompt_cache_bytes":
                used = sample.value
            elif sample.name == "prompt_cache_evicted_blocks_total":
                reason = sample.labels["reason"]
                evicted[reason] = evicted.get(reason, 0) + int(sample.value)
            elif sample.name == "prompt_cache_evicted_before_ttl_total":
                name = sample.labels["retention"]
                before_ttl[name] = before_ttl.get(name, 0) + int(sample.value)
    return Totals(int(hits), int(misses), int(used), evicted, before_ttl)


def read_totals(registry: CollectorRegistry) -> Totals:
    """The totals a scrape of `registry` gives now (one pass: one consistent reading; the
    store's gauges read the store, so call this off the event loop)."""
    return totals_of(registry.collect())
