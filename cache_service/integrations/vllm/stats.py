"""The connector's counts through vLLM's connector stats: logged, and exported to Prometheus.

vLLM gathers each worker's and the scheduler's `get_kv_connector_stats()` every step, adds
them up with `aggregate`, logs `reduce()` with its throughput line, and feeds them to the
`PromptCachePromMetrics` it built in the API server, which adds them to counters named
`vllm:prompt_cache_connector_<count>_total` (and `..._misses_total{reason}` for the misses),
beside vLLM's own `vllm:external_prefix_cache_*`. Stats flow only with stats logging on (the
OpenAI server's default; an offline `LLM` turns it off).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from cache_service.integrations.vllm.counters import COUNTERS, MISS_PREFIX, merged

METRIC_PREFIX = "vllm:prompt_cache_connector_"
COUNTER_HELP = {
    "lookups": "Prompts looked up in the prompt cache service.",
    "lookup_tokens": "Tokens of the prompts looked up.",
    "hit_tokens": "Tokens vLLM loaded from the service instead of computing them.",
    "loaded_blocks": "vLLM blocks written into the paged KV cache from the service.",
    "loaded_bytes": "Bytes of KV loaded from the service.",
    "load_seconds": "Seconds spent fetching, checking and writing loaded blocks.",
    "stored_blocks": "vLLM blocks the service newly stored.",
    "stored_bytes": "Bytes of the blocks the service newly stored, headers included.",
    "store_seconds": "Seconds spent copying out and sending stored blocks.",
    "engine_seconds": "Seconds the connector's worker half spent on vLLM's own thread.",
    "dropped_blocks": "vLLM blocks not stored because the store queue was full.",
    "prefill_waits": "Lookups that waited for a prefill engine's stores to reach the service.",
    "prefill_wait_seconds": "Seconds those lookups waited.",
}


@dataclass
class PromptCacheStats(KVConnectorStats):  # type: ignore[misc]
    """Counts since the last collection, as a flat {name: amount} in `data`."""

    def reset(self) -> None:
        """Forget the counts."""
        self.data: dict[str, float] = {}

    def aggregate(self, other: KVConnectorStats) -> PromptCacheStats:
        """These counts and another's added up."""
        self.data = merged(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        """The counts, rounded for vLLM's log line."""
        return {name: round(value, 3) for name, value in sorted(self.data.items())}

    def is_empty(self) -> bool:
        """Whether nothing was counted."""
        return not any(self.data.values())


class PromptCachePromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """Prometheus counters of the connector, one child per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(
                name=METRIC_PREFIX + name, documentation=text, labelnames=labelnames
            )
            for name, text in COUNTER_HELP.items()
        }
        self._misses = self._counter_cls(
            name=METRIC_PREFIX + "misses",
            documentation="Cache problems the connector turned into misses, by reason.",
            labelnames=[*labelnames, "reason"],
        )
        assert set(self._counters) == set(COUNTERS)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one collection's counts to the counters."""
        engine = self.per_engine_labelvalues[engine_idx]
        for name, amount in transfer_stats_data.items():
            if amount <= 0:
                continue
            if name.startswith(MISS_PREFIX):
                self._misses.labels(*engine, name.removeprefix(MISS_PREFIX)).inc(amount)
            elif name in self._counters:
                self._counters[name].labels(*engine).inc(amount)
