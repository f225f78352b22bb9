"""A real Prometheus scraping a real service: the recording rules give the hit ratios the
service itself reports in /v1/stats, overall, by retention class and by tenant."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pytest

from tests.deploy.prometheus_process import values_by

if TYPE_CHECKING:
    from tests.deploy.live_stack import LiveStack

TOLERANCE = 1e-9


def ratio(hits: int, misses: int) -> float:
    """The hit share of looked-up tokens."""
    return hits / (hits + misses)


def test_every_rule_loaded_and_evaluated_without_error(live_stack: LiveStack) -> None:
    rules = live_stack.prometheus.rule_health()
    assert len(rules) >= 20
    failing = {rule["name"]: rule.get("lastError") for rule in rules if rule["health"] != "ok"}
    assert not failing


def test_the_traffic_the_stats_report_is_what_the_answers_said(live_stack: LiveStack) -> None:
    """The yardstick itself: /v1/stats adds up the usage each lookup answered."""
    by_class: dict[str, list[int]] = {}
    by_tenant: dict[str, list[int]] = {}
    for (tenant, retention), (hits, misses) in live_stack.usage.items():
        for table, name in ((by_class, retention), (by_tenant, tenant)):
            table.setdefault(name, [0, 0])
            table[name][0] += hits
            table[name][1] += misses
    for name, (hits, misses) in by_class.items():
        assert live_stack.stats["retention"][name] == {"hit_tokens": hits, "miss_tokens": misses}
    for name, (hits, misses) in by_tenant.items():
        tenant = live_stack.stats["tenants"][name]
        assert (tenant["hit_tokens"], tenant["miss_tokens"]) == (hits, misses)
    # Both classes and both tenants saw hits and misses, in different shares.
    assert all(hits > 0 and misses > 0 for hits, misses in by_class.values())
    assert len({ratio(*pair) for pair in by_class.values()}) == 2


@pytest.mark.parametrize("window", ["5m", "1h"])
def test_overall_hit_ratio_rule_matches_the_service(live_stack: LiveStack, window: str) -> None:
    classes = live_stack.stats["retention"].values()
    expected = ratio(sum(c["hit_tokens"] for c in classes), sum(c["miss_tokens"] for c in classes))
    result = live_stack.query(f"job:prompt_cache_token_hit_ratio:rate{window}")
    assert [item["metric"] for item in result] == [
        {"__name__": f"job:prompt_cache_token_hit_ratio:rate{window}", "job": "prompt-cache"}
    ]
    assert math.isclose(float(result[0]["value"][1]), expected, rel_tol=TOLERANCE)


@pytest.mark.parametrize("window", ["5m", "1h"])
def test_hit_ratio_by_class_rule_matches_the_service(live_stack: LiveStack, window: str) -> None:
    expected = {
        name: ratio(c["hit_tokens"], c["miss_tokens"])
        for name, c in live_stack.stats["retention"].items()
        if c["hit_tokens"] + c["miss_tokens"] > 0
    }
    got = values_by(
        live_stack.query(f"job_retention:prompt_cache_token_hit_ratio:rate{window}"), "retention"
    )
    assert got.keys() == expected.keys() == {"agent", "chat"}
    for name, value in expected.items():
        assert math.isclose(got[name], value, rel_tol=TOLERANCE), name


@pytest.mark.parametrize("window", ["5m", "1h"])
def test_hit_ratio_by_tenant_rule_matches_the_service(live_stack: LiveStack, window: str) -> None:
    tenants = live_stack.stats["tenants"]
    expected = {
        name: ratio(t["hit_tokens"], t["miss_tokens"])
        for name, t in tenants.items()
        if t["hit_tokens"] + t["miss_tokens"] > 0
    }
    got = values_by(
        live_stack.query(f"job_tenant:prompt_cache_token_hit_ratio:rate{window}"), "tenant"
    )
    # The admin's tenant looked nothing up: it has no ratio (no series), not NaN.
    assert "operators" in tenants
    assert got.keys() == expected.keys() == {"team-a", "team-b"}
    for name, value in expected.items():
        assert math.isclose(got[name], value, rel_tol=TOLERANCE), name


def test_capacity_share_rule_matches_the_stores_own_figures(live_stack: LiveStack) -> None:
    """bytes over capacity, the capacity being what /v1/stats reports; the bytes gauge is
    read at scrape time, so it is taken at the rule's own evaluation time."""
    share = live_stack.query("instance:prompt_cache_bytes_per_capacity:ratio")
    assert len(share) == 1
    evaluated_at = float(share[0]["value"][0])
    used = live_stack.query("prompt_cache_bytes", at=evaluated_at)
    expected = float(used[0]["value"][1]) / live_stack.stats["capacity_bytes"]
    assert 0 < expected < 1
    assert math.isclose(float(share[0]["value"][1]), expected, rel_tol=TOLERANCE)


def test_request_rate_rule_counts_answers_by_route_and_code(live_stack: LiveStack) -> None:
    codes = {
        (item["metric"]["route"], item["metric"]["code"])
        for item in live_stack.query("job_route_code:prompt_cache_requests:rate5m")
    }
    assert ("/v1/lookup", "200") in codes
    assert ("/v1/lookup", "400") in codes  # the body that is not JSON
    assert ("other", "401") in codes  # no key: refused before routing, so route "other"
    assert ("other", "404") in codes  # the unknown path


def test_latency_quantile_rule_gives_ordered_quantiles_for_lookups(
    live_stack: LiveStack,
) -> None:
    name = "job_route:prompt_cache_request_duration_seconds:histogram_quantile_rate5m"
    got = values_by(live_stack.query(f'{name}{{route="/v1/lookup"}}'), "quantile")
    assert got.keys() == {"0.5", "0.9", "0.99"}
    assert 0 < got["0.5"] <= got["0.9"] <= got["0.99"] <= 10.0


def test_no_alert_fires_on_a_healthy_service(live_stack: LiveStack) -> None:
    firing = live_stack.query('ALERTS{alertstate="firing"}')
    assert firing == []
