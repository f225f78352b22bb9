"""The KV-event subscriber's per-engine counters as Prometheus metrics, read at scrape time.

`prompt_cache_kv_events_<name>_total{engine}` per counter of `EngineCounters`, and gauges
for the ranks whose view is stale, the entries each engine's view holds, whether the engine
is live and for how long it has been down. The `engine`
label takes the configured engine names only: a bounded set. With `--workers N` a scrape
reads the hub of the worker that answers it (every worker follows every engine).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cache_service.service.kv_events.hub import KvEventsHub

PREFIX = "prompt_cache_kv_events_"

# EngineCounters field -> (metric name without prefix and _total, HELP text).
COUNTERS: dict[str, tuple[str, str]] = {
    "batches": ("batches", "Event batches decoded and applied, live or replayed, by engine."),
    "events": ("events", "Known events (stores, removals, clears) in those batches, by engine."),
    "unknown_events": (
        "unknown_events",
        "Events of tags this service does not know, skipped, by engine.",
    ),
    "malformed": (
        "malformed_messages",
        "Messages skipped as malformed (bad framing, or a payload that is no event batch), "
        "by engine.",
    ),
    "malformed_events": (
        "malformed_events",
        "Malformed events skipped inside otherwise sound batches, by engine.",
    ),
    "duplicates": (
        "duplicate_batches",
        "Batches received again after being applied (replay overlapping the live stream), "
        "by engine.",
    ),
    "gaps": ("gaps", "Times sequence numbers were missing mid-stream, by engine."),
    "replays": ("replay_requests", "Replay requests sent to the engine's replay socket."),
    "replayed_batches": ("replayed_batches", "Batches applied from replay, by engine."),
    "replay_failures": (
        "replay_failures",
        "Replays that did not reach their end marker in time, by engine.",
    ),
    "restarts": (
        "restarts",
        "Publisher restarts detected (sequence numbers starting over), by engine.",
    ),
    "downs": (
        "rank_downs",
        "Times a rank of the engine went down: its publisher disconnected (or stopped "
        "answering heartbeats), or was silent past --kv-events-silence-timeout.",
    ),
    "dropped_entries": (
        "dropped_entries",
        "View entries dropped by the per-engine bound (--kv-events-max-blocks), by engine.",
    ),
    "verified": (
        "verified_events",
        "Stored events whose block hashes the configured scheme and seed reproduced.",
    ),
    "mismatches": (
        "mismatch",
        "Stored events whose block hashes the configured scheme and seed did NOT reproduce "
        "from their tokens: wrong PYTHONHASHSEED, hash algorithm or block size; routing "
        "scores for the engine are wrong (run cache-service doctor).",
    ),
    "verify_errors": (
        "verify_errors",
        "Stored events whose verification raised an error, by engine.",
    ),
}


class KvEventsCollector(Collector):
    """The hub's counters and gauges, by engine, read when scraped."""

    def __init__(self, hub: KvEventsHub) -> None:
        self._hub = hub

    def collect(self) -> Iterator[Metric]:
        """Read every engine's counters now."""
        hub = self._hub
        stats = hub.subscriber.stats()
        names = [engine.name for engine in hub.engines]
        for field, (name, help_text) in COUNTERS.items():
            counter = CounterMetricFamily(PREFIX + name, help_text, labels=["engine"])
            for engine in names:
                counter.add_metric([engine], getattr(stats[engine], field))
            yield counter
        stale = GaugeMetricFamily(
            PREFIX + "stale_ranks",
            "Data-parallel ranks whose view may miss events (lost batches not replayed), by "
            "engine; sound again after the engine restarts or clears its cache.",
            labels=["engine"],
        )
        blocks = GaugeMetricFamily(
            PREFIX + "view_blocks",
            "Entries (rank, group, block, medium) in the engine's view of what it holds.",
            labels=["engine"],
        )
        live = GaugeMetricFamily(
            PREFIX + "engine_live",
            "1 while any rank of the engine is up (connected, and heard from within the "
            "silence timeout), 0 once every rank is down.",
            labels=["engine"],
        )
        down = GaugeMetricFamily(
            PREFIX + "engine_down_seconds",
            "Seconds since the engine's last rank went down (0 while live); past "
            "--kv-events-grace it is left out of routing answers.",
            labels=["engine"],
        )
        liveness = hub.subscriber.liveness()
        now = time.monotonic()
        for engine in names:
            stale.add_metric([engine], stats[engine].stale_ranks)
            blocks.add_metric([engine], hub.views.block_count(engine))
            live.add_metric([engine], 1 if liveness[engine].live else 0)
            down.add_metric([engine], liveness[engine].down_for(now))
        yield stale
        yield blocks
        yield live
        yield down
