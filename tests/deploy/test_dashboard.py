"""deploy/grafana: the dashboard's structure, its provisioning, and every PromQL expression
in it run against the live Prometheus, where each must parse and return a series."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from tests.deploy.conftest import DEPLOY, require_module

if TYPE_CHECKING:
    from tests.deploy.live_stack import LiveStack

GRAFANA = DEPLOY / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "prompt-cache.json"
DATASOURCE_UID = "prometheus"
# Grafana's built-in interval variables, as a Grafana over the live stack's seconds-old data
# (scraped every second) would set them: ranges long enough to hold several scrapes.
BUILT_INS = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h"}
VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
# Series only a remote store (Redis) exports: the "Backend (Redis)" row reads nothing else.
BACKEND_SERIES = "prompt_cache_backend_"
BACKEND_ROW = "Backend (Redis)"


def dashboard() -> dict[str, Any]:
    """The dashboard JSON."""
    return dict(json.loads(DASHBOARD.read_text()))


def defaults() -> dict[str, str]:
    """Each template variable's default value, and the built-in intervals."""
    values = dict(BUILT_INS)
    for variable in dashboard()["templating"]["list"]:
        values[variable["name"]] = str(variable["current"]["value"])
    return values


def substitute(expr: str) -> str:
    """`expr` with every $variable and ${variable} replaced by its default."""
    values = defaults()

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise AssertionError(f"unknown variable ${name} in {expr!r}")
        return values[name]

    return VARIABLE.sub(value, expr)


def expressions() -> list[tuple[str, str]]:
    """(panel title and refId, expression) of every query of every panel."""
    return [
        (f"{panel['title']} {target['refId']}", target["expr"])
        for panel in dashboard()["panels"]
        for target in panel.get("targets", [])
    ]


def backend_expressions() -> list[tuple[str, str]]:
    """The queries that read the backend's series (no data on LMDB)."""
    return [(name, expr) for name, expr in expressions() if BACKEND_SERIES in expr]


def test_the_dashboard_has_its_uid_title_and_price_variables() -> None:
    board = dashboard()
    assert board["uid"] == "prompt-cache"
    assert board["title"]
    variables = {variable["name"]: variable for variable in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["datasource"]["current"]["value"] == DATASOURCE_UID
    for name, default in (("price_cached_per_mtok", "0.003"), ("price_uncached_per_mtok", "0.15")):
        assert variables[name]["type"] in {"textbox", "constant"}
        assert variables[name]["query"] == variables[name]["current"]["value"] == default


def test_panel_ids_are_unique_and_every_panel_is_placed() -> None:
    panels = dashboard()["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        grid = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= grid.keys(), panel["title"]
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]


def test_panels_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard()["panels"]:
        grid = panel["gridPos"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_every_panel_and_query_reads_the_datasource_variable() -> None:
    for panel in dashboard()["panels"]:
        if panel["type"] == "row":  # a heading: no query
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], panel["title"]


def test_the_dashboard_shows_every_part_the_issue_asks_for() -> None:
    text = " ".join(expr for _, expr in expressions())
    for needed in (
        "job:prompt_cache_token_hit_ratio",  # hit ratio over time
        "job_retention:prompt_cache_hit_tokens",  # hit and miss tokens by class
        "job_tenant:prompt_cache_miss_tokens",  # ... and by tenant
        "$price_uncached_per_mtok - $price_cached_per_mtok",  # money saved
        "prompt_cache_blocks",  # stored blocks
        "instance:prompt_cache_bytes_per_capacity:ratio",  # bytes against capacity
        "job_reason:prompt_cache_evicted_blocks",  # evictions by reason
        "histogram_quantile",  # latency quantiles
        "prompt_cache_requests_total",  # errors by status code
    ):
        assert needed in text, needed


def test_the_backend_row_holds_the_backend_panels_and_says_they_are_empty_on_lmdb() -> None:
    panels = dashboard()["panels"]
    (row,) = [panel for panel in panels if panel["type"] == "row"]
    assert row["title"] == BACKEND_ROW and not row["collapsed"]
    below = [panel for panel in panels if panel["gridPos"]["y"] > row["gridPos"]["y"]]
    above = [panel for panel in panels if panel["gridPos"]["y"] < row["gridPos"]["y"]]
    assert below, "the row has no panel"
    for panel in below:  # only backend series, and the description says LMDB shows none
        assert all(BACKEND_SERIES in target["expr"] for target in panel["targets"])
        assert "on LMDB" in panel["description"] and "no data" in panel["description"]
    for panel in above:
        assert all(BACKEND_SERIES not in target["expr"] for target in panel["targets"])
    text = " ".join(expr for _, expr in backend_expressions())
    for rule in (
        "lookup_errors_per_lookup",
        "lookup_errors",
        "write_retries",
        "write_failures",
        "touch_errors",
        "breaker_opened",
    ):
        assert f"instance:prompt_cache_backend_{rule}:" in text, rule


def test_the_provisioning_points_grafana_at_prometheus_and_the_dashboards() -> None:
    yaml = require_module("yaml")
    sources = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yaml").read_text())
    (source,) = sources["datasources"]
    assert (source["name"], source["uid"], source["type"]) == (
        "Prometheus",
        "prometheus",
        "prometheus",
    )
    assert source["url"] == "http://prometheus:9090"
    boards = yaml.safe_load((GRAFANA / "provisioning/dashboards/prompt-cache.yaml").read_text())
    (provider,) = boards["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"


def test_substitution_leaves_no_variable_behind() -> None:
    for name, expr in expressions():
        assert "$" not in substitute(expr), name


def test_every_dashboard_query_returns_a_series_from_the_live_prometheus(
    live_stack: LiveStack,
) -> None:
    empty, backend = [], []
    for name, expr in expressions():
        result = live_stack.query(substitute(expr))  # PrometheusError if it does not parse
        if BACKEND_SERIES in expr:
            # The live stack stores on LMDB, which has no backend series: these panels
            # show no data there, as their description says (test_backend_live.py runs
            # them on Redis).
            if result:
                backend.append(name)
        elif not result:
            empty.append(name)
    assert empty == [], "queries with no series (a metric or label that does not exist?)"
    assert backend == [], "backend queries with series on LMDB"
