"""The proxy's metrics, `prompt_cache_pd_proxy_*`, on a registry of its own.

Base units, `_total` on counters (prometheus_client adds it). Engine names are labels: the
engines are configured, so the set is bounded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)

from cache_service.tools.pd_proxy.options import Role

PREFIX = "prompt_cache_pd_proxy_"
PREFILL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DECODE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
FIRST_BYTE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Why D ran without P's params; the labels exist from the start, at 0.
FALLBACK_REASONS = ("prefill_error", "prefill_timeout", "no_prefill")
ROUTE_FAILURE_REASONS = ("tokenize", "route")


class ProxyMetrics:
    """Every metric of the proxy; `registry` is what GET /metrics exposes."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # `*_created` series double every counter on a scrape and no dashboard uses them (as
        # the service's app; a process-wide switch of prometheus_client's).
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            PREFIX + "requests",
            "Requests answered, by endpoint (completions, chat_completions) and outcome: ok "
            "(D answered 2xx), engine_status (D answered otherwise, passed through), "
            "bad_request, no_decode_engine, decode_error, decode_timeout, decode_cut (D's "
            "stream broke off), client_gone.",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.prefill_seconds = Histogram(
            PREFIX + "prefill_seconds",
            "Time from sending P the request to its answer (or its failure).",
            buckets=PREFILL_BUCKETS,
            registry=r,
        )
        self.decode_seconds = Histogram(
            PREFIX + "decode_seconds",
            "Time from sending D the request to the end of its answer.",
            buckets=DECODE_BUCKETS,
            registry=r,
        )
        self.decode_first_byte_seconds = Histogram(
            PREFIX + "decode_first_byte_seconds",
            "Time from sending D the request to its answer's status line.",
            buckets=FIRST_BYTE_BUCKETS,
            registry=r,
        )
        self.fallbacks = Counter(
            PREFIX + "fallbacks",
            "Requests D computed alone (without P's KV), by reason: prefill_error, "
            "prefill_timeout, no_prefill (no healthy prefill engine).",
            ["reason"],
            registry=r,
        )
        self.failovers = Counter(
            PREFIX + "failovers",
            "Decode engines that could not be reached, the request sent to another.",
            registry=r,
        )
        self.route_failures = Counter(
            PREFIX + "route_failures",
            "Requests whose engines were chosen by requests in flight because the prefix "
            "question failed, by step: tokenize (the engine's /tokenize) or route (the "
            "cache's /v1/route).",
            ["reason"],
            registry=r,
        )
        self.engine_up = Gauge(
            PREFIX + "engine_up",
            "1 while the engine's last health check (or request) succeeded, else 0.",
            ["engine", "role"],
            registry=r,
        )
        self.engine_in_flight = Gauge(
            PREFIX + "engine_in_flight",
            "Requests the proxy has sent the engine and not yet seen answered.",
            ["engine", "role"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens",
            "Prompt tokens of D's answers that carried usage.",
            registry=r,
        )
        self.completion_tokens = Counter(
            PREFIX + "completion_tokens",
            "Completion tokens of D's answers that carried usage.",
            registry=r,
        )
        for reason in FALLBACK_REASONS:
            self.fallbacks.labels(reason)
        for reason in ROUTE_FAILURE_REASONS:
            self.route_failures.labels(reason)

    def add_engine(self, name: str, role: Role) -> None:
        """Show an engine's gauges from the start, down and idle."""
        self.engine_up.labels(name, role).set(0)
        self.engine_in_flight.labels(name, role).set(0)

    def count_usage(self, usage: Mapping[str, Any] | None) -> None:
        """Add an OpenAI `usage` object's token counts (ignored unless integers)."""
        if usage is None:
            return
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int) and not isinstance(prompt, bool) and prompt >= 0:
            self.prompt_tokens.inc(prompt)
        if isinstance(completion, int) and not isinstance(completion, bool) and completion >= 0:
            self.completion_tokens.inc(completion)
