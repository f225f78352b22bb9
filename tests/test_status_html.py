"""The status page's rendering, from a report and a history built by hand."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from typing import Any

from cache_service.service.api.status_html import StatusView, render_status_page
from cache_service.service.status_history import StatusHistory, Totals

HOSTILE = '<script>alert("x")</script>&'


def stats(**tenants: dict[str, Any]) -> dict[str, Any]:
    return {
        "blocks": 12,
        "payload_bytes": 3 * 2**30,
        "used_bytes": 3 * 2**30 + 2**20,
        "capacity_bytes": 10 * 2**30,
        "disk": {
            "free_bytes": 50 * 2**30,
            "file_bytes": 4 * 2**30,
            "limit_bytes": 10 * 2**30,
            "shortfall_bytes": 0,
            "full": False,
        },
        "pending_touches": 0,
        "retention": {
            "agent": {"hit_tokens": 300, "miss_tokens": 100},
            "chat": {"hit_tokens": 0, "miss_tokens": 0},
        },
        "tenants": tenants,
    }


INFO = {
    "version": "9.9.9",
    "store": "lmdb",
    "hashing": {"scheme": "xxh3-128-chained", "version": 1, "seed_fingerprint": "abc123"},
    "retention": {"classes": {"agent": 3 * 86400.0, "chat": 7 * 86400.0}, "default": "chat"},
}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def history_with_traffic(samples: int) -> StatusHistory:
    clock = Clock()
    history = StatusHistory(clock=clock)
    for i in range(samples):
        history.record(Totals(30 * i, 10 * i, 2**20, {"capacity": i}, {"agent": i}))
        clock.now += 10.0
    clock.now -= 10.0
    return history


def page(
    history: StatusHistory | None = None,
    *,
    refresh: int = 15,
    tenants: dict[str, dict[str, Any]] | None = None,
) -> str:
    view = StatusView(
        stats=stats(**(tenants or {})),
        info=INFO,
        history=history or StatusHistory(clock=Clock()),
        refresh_seconds=refresh,
    )
    return render_status_page(view)


class Collector(HTMLParser):
    """Every attribute and every text of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.attributes: list[tuple[str, str, str | None]] = []
        self.texts: list[str] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.attributes += [(tag, name, value) for name, value in attrs]

    def handle_data(self, data: str) -> None:
        self.texts.append(data)


def parsed(html: str) -> Collector:
    collector = Collector()
    collector.feed(html)
    return collector


def test_figures_carry_the_exact_values_of_the_report() -> None:
    html = page()
    stats_of = dict(re.findall(r'data-stat="([^"]+)" data-value="([^"]*)"', html))
    assert stats_of["blocks"] == "12"
    assert stats_of["used_bytes"] == str(3 * 2**30 + 2**20)
    assert stats_of["capacity_bytes"] == str(10 * 2**30)
    assert stats_of["retention.agent.hit_tokens"] == "300"
    assert stats_of["retention.agent.ttl_seconds"] == str(3 * 86400.0)
    assert stats_of["hit_ratio"] == "0.75"
    assert stats_of["seed_fingerprint"] == "" and "abc123" in html
    assert "75.0 %" in html and "3d" in html and "10 GiB" in html


def test_tenant_names_are_escaped() -> None:
    figures = {"hit_tokens": 1, "miss_tokens": 1, "estimated_bytes": 5, "capacity_bytes": None}
    html = page(tenants={HOSTILE: figures})
    assert "<script" not in html
    assert "&lt;script&gt;" in html
    assert HOSTILE in "".join(parsed(html).texts)  # shown as text, as it is
    assert "script" not in parsed(html).tags


def test_no_tenants_no_tenant_section() -> None:
    assert "<h2>Tenants</h2>" not in page()


def test_the_page_references_nothing_outside_itself() -> None:
    figures = {"hit_tokens": 1, "miss_tokens": 1, "estimated_bytes": 5, "capacity_bytes": 9}
    html = page(history_with_traffic(30), tenants={"team": figures})
    assert "http://" not in html and "https://" not in html
    tags = parsed(html)
    assert "script" not in tags.tags and "img" not in tags.tags
    for tag, name, value in tags.attributes:
        if name in ("src", "href"):
            assert value is not None
            assert value.startswith("/") or value.startswith("data:"), (tag, value)


def test_without_history_the_charts_say_when_their_first_point_comes() -> None:
    html = page()
    assert "its first point comes after 10 s of history" in html
    assert "its first point comes after 1 min of history" in html
    assert "no lookups" not in html and "<polyline" not in html


def test_a_day_chart_younger_than_a_minute_does_not_claim_there_were_no_lookups() -> None:
    html = page(history_with_traffic(3))  # 30 s at 10 s: the hour chart has points
    assert "its first point comes after 1 min of history" in html
    assert "no lookups in this window yet" not in html


def test_with_history_the_hour_chart_draws_a_line_and_the_evictions_count() -> None:
    html = page(history_with_traffic(60))  # ten minutes at 10 s
    assert html.count("<polyline") == 2  # the hour at 10 s, and the day at a minute
    assert "no lookups in this window yet" not in html
    evictions = html[html.index("<h2>Evictions</h2>") :]
    rows = re.findall(r"<tr><td>capacity</td>(.*?)</tr>", evictions)
    cells = re.findall(r"<td>([^<]*)</td>", rows[0])
    assert cells == ["30", "59", "59", "59"]  # 5 min, hour, day (the history), since start
    assert "history covers 9 min so far" in evictions


def test_refresh_zero_stops_the_reloading() -> None:
    assert '<meta http-equiv="refresh" content="15">' in page()
    assert 'http-equiv="refresh"' not in page(refresh=0)


def test_charts_span_the_shortest_window_that_holds_the_history() -> None:
    assert "Last 5 minutes, per 10 s" in page()  # a worker just started
    assert "Last 15 minutes, per 10 s" in page(history_with_traffic(60))  # ten minutes
    hours = page(history_with_traffic(4 * 360))  # four hours: the fine ring keeps one
    assert "Last hour, per 10 s" in hours and "Last 6 hours, per 1 min" in hours
    assert ">-15 min<" in page(history_with_traffic(60))  # the ticks follow the span


def test_a_tenant_without_a_capacity_gets_no_bar() -> None:
    free = {"hit_tokens": 1, "miss_tokens": 1, "estimated_bytes": 5, "capacity_bytes": None}
    held = {"hit_tokens": 1, "miss_tokens": 1, "estimated_bytes": 5, "capacity_bytes": 10}
    tenants = page(tenants={"free": free, "held": held}).split("<h2>Tenants</h2>")[1]
    assert tenants.count('class="bar"') == 1
    assert 'aria-label="held: stored against its capacity"' in tenants


def test_a_store_off_disk_without_capacity_shows_dashes() -> None:
    report = stats() | {"disk": None, "capacity_bytes": None}
    view = StatusView(stats=report, info=INFO, history=StatusHistory(), refresh_seconds=0)
    html = render_status_page(view)
    assert "disk:" not in html
    assert "no capacity set" in html
    assert 'data-stat="capacity_bytes" data-value=""' in html


def engine_figures(**changes: Any) -> dict[str, Any]:
    figures = {"live": True, "down_since": None, "down_reason": None, "routable": True}
    figures.update(blocks=17, batches=9, gaps=1, stale_ranks=0, mismatches=0)
    figures.update(changes)
    return figures


def engines_page(engines: dict[str, dict[str, Any]], now: float) -> str:
    view = StatusView(
        stats={**stats(), "kv_events": engines},
        info=INFO,
        history=StatusHistory(clock=Clock()),
        refresh_seconds=15,
        generated_at=now,
    )
    return render_status_page(view)


def test_engines_show_whether_they_are_live_and_how_long_one_has_been_down() -> None:
    html = engines_page(
        {
            "vllm-a": engine_figures(),
            "vllm-b": engine_figures(
                live=False, down_since=1000.0, down_reason="disconnected", routable=False
            ),
            HOSTILE: engine_figures(),
        },
        now=1090.0,
    )
    assert "<h2>Engines</h2>" in html and "<script" not in html
    stats_of = dict(re.findall(r'data-stat="([^"]+)" data-value="([^"]*)"', html))
    assert stats_of["kv_events.vllm-a.live"] == "True"
    assert stats_of["kv_events.vllm-b.live"] == "False"
    assert stats_of["kv_events.vllm-a.blocks"] == "17"
    assert "down (disconnected) for 90s, out of routing" in html


def test_without_kv_events_no_engine_section() -> None:
    assert "<h2>Engines</h2>" not in page()
