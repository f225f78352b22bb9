"""The backend's rules, alerts and panels on a real Redis outage: the service on a real
redis-server that is killed mid-run, scraped by a real Prometheus with our rules. The
recorded rates and share agree with the service's own counters, both backend alerts'
conditions hold (their `for:` durations are the promtool tests' part), and every query of the
dashboard's "Backend (Redis)" row returns a series."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.deploy.kit import promtool_check_metrics
from tests.deploy.prometheus_process import values_by
from tests.deploy.redis_stack import FAILED_LOOKUPS, REFUSED_STORES
from tests.deploy.test_metric_names import RAW_METRIC, exported_names

if TYPE_CHECKING:
    from tests.deploy.redis_stack import RedisStack

TOLERANCE = 1e-9
BACKEND_ALERTS = ("PromptCacheBackendLookupErrors", "PromptCacheBackendWritesRefused")
RATES = ("lookup_errors", "write_retries", "write_failures", "breaker_opened")


def one_value(stack: RedisStack, expr: str) -> float:
    """The value of the single series `expr` returns, for the stack's one instance."""
    (value,) = values_by(stack.query(expr), "instance").values()
    return value


def test_the_service_counted_the_outage(redis_stack: RedisStack) -> None:
    """The yardstick: every lookup after the kill failed, every store was refused after its
    retries, and the third refusal in a row opened the breaker."""
    counts = redis_stack.counts
    assert counts["lookup_errors"] >= FAILED_LOOKUPS
    assert counts["lookups"] > counts["lookup_errors"]  # the hits before the kill
    assert counts["write_failures"] == REFUSED_STORES
    assert counts["write_retries"] >= REFUSED_STORES
    assert counts["breaker_opened"] == 1


def test_the_lookup_error_share_is_the_services_errors_per_lookup(
    redis_stack: RedisStack,
) -> None:
    counts = redis_stack.counts
    share = one_value(
        redis_stack, "instance:prompt_cache_backend_lookup_errors_per_lookup:ratio_rate5m"
    )
    assert share == pytest.approx(counts["lookup_errors"] / counts["lookups"], rel=TOLERANCE)


def test_the_backend_rates_are_in_the_proportion_of_the_services_counts(
    redis_stack: RedisStack,
) -> None:
    # Every counter started at 0 in the same scrapes, so each 5-minute rate is its count
    # times one and the same factor: the rates stand in the proportion of the counts.
    counts = redis_stack.counts
    rates = {
        field: one_value(redis_stack, f"instance:prompt_cache_backend_{field}:rate5m")
        for field in RATES
    }
    for field in RATES:
        assert rates[field] > 0, field
        expected = counts[field] / counts["lookup_errors"]
        assert rates[field] / rates["lookup_errors"] == pytest.approx(expected, rel=TOLERANCE)
    touch = redis_stack.query("instance:prompt_cache_backend_touch_errors:rate5m")
    assert len(touch) == 1  # recorded (its value depends on touches pending at the kill)


def test_both_backend_alert_conditions_hold_on_the_outage(redis_stack: RedisStack) -> None:
    from tests.deploy.test_rules import rules  # noqa: PLC0415

    exprs = {rule["alert"]: rule["expr"] for rule in rules() if "alert" in rule}
    instance = redis_stack.prometheus.targets[0]
    for name in BACKEND_ALERTS:
        result = redis_stack.query(exprs[name])
        assert [series["metric"]["instance"] for series in result] == [instance], name


def test_every_backend_panel_query_returns_a_series_on_redis(redis_stack: RedisStack) -> None:
    from tests.deploy.test_dashboard import backend_expressions, substitute  # noqa: PLC0415

    queries = backend_expressions()
    assert len(queries) >= 6
    empty = [name for name, expr in queries if not redis_stack.query(substitute(expr))]
    assert empty == []


def test_the_backend_metrics_the_rules_and_panels_read_are_exported_on_redis(
    redis_stack: RedisStack, promtool: Path
) -> None:
    from tests.deploy.test_dashboard import backend_expressions  # noqa: PLC0415
    from tests.deploy.test_rules import rules  # noqa: PLC0415

    text = httpx.get(redis_stack.metrics_url, timeout=10.0).text
    texts = [rule["expr"] for rule in rules()] + [expr for _, expr in backend_expressions()]
    read = {name for expr in texts for name in RAW_METRIC.findall(expr)}
    backend = {name for name in read if name.startswith("prompt_cache_backend_")}
    assert len(backend) == 5
    assert sorted(backend - exported_names(text)) == []
    promtool_check_metrics(promtool, text)
