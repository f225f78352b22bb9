"""The status page's HTML: the /v1/stats and /v1/info reports and the status history, drawn
for people (sizes in GiB, TTLs as --retention takes them, ratios in %).

Server-rendered, no script: a `<meta http-equiv="refresh">` reloads it. Every figure that
/v1/stats reports is also in a `data-stat`/`data-value` pair (the exact number), so a test,
or a person, can check what is shown against the API. Every text is escaped.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from html import escape
from typing import Any

from cache_service.core.units import show_duration, show_size
from cache_service.service.api.status_svg import time_chart, usage_bar
from cache_service.service.status_history import Change, Ring, Sample, StatusHistory

NONE = "\u2013"  # an en dash: no figure (nothing looked up, no limit set)
RECENT_WINDOWS = ((300.0, "last 5 min"), (3600.0, "last hour"), (86400.0, "last 24 h"))
RATIO_TICKS = ((0.0, "0 %"), (0.5, "50 %"), (1.0, "100 %"))
# A chart spans the shortest of these that holds all of its ring's history, so that a worker
# started a minute ago draws a line, not a dot at the right edge: (minutes, caption, minutes
# between ticks).
FINE_SPANS = ((5, "Last 5 minutes", 1), (15, "Last 15 minutes", 5), (60, "Last hour", 15))
COARSE_SPANS = ((180, "Last 3 hours", 60), (360, "Last 6 hours", 120),
                (1440, "Last 24 hours", 360))  # fmt: skip
STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:0 auto;max-width:1100px;padding:16px;
color:#18181b;background:#fafafa}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:24px 0 8px}
.meta{color:#52525b;font-size:13px}.meta code{font-size:12px}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(180px,1fr));gap:10px;margin-top:14px}
.card{background:#fff;border:1px solid #e4e4e7;border-radius:8px;padding:10px 12px}
.card .big{font-size:24px;font-weight:600}.card .sub{color:#52525b;font-size:12px}
.charts{display:grid;grid-template-columns:repeat(auto-fit,minmax(420px,1fr));gap:12px}
figure{margin:0;background:#fff;border:1px solid #e4e4e7;border-radius:8px;padding:8px}
figcaption{font-size:13px;color:#3f3f46;margin-bottom:2px}
svg.chart{width:100%;height:auto;display:block}
svg.bar{width:160px;height:10px;display:inline-block;vertical-align:middle}
table{border-collapse:collapse;background:#fff;border:1px solid #e4e4e7;min-width:60%}
th,td{padding:5px 10px;border-bottom:1px solid #f4f4f5;text-align:right}
th:first-child,td:first-child{text-align:left}th{font-weight:600;color:#3f3f46}
.note{color:#71717a;font-size:12px;margin:4px 0}a{color:#1d4ed8}
"""


@dataclass(frozen=True)
class StatusView:
    """What the page shows: the two reports, the history, and how it reloads."""

    stats: Mapping[str, Any]  # the body of GET /v1/stats
    info: Mapping[str, Any]  # the body of GET /v1/info
    history: StatusHistory
    refresh_seconds: int  # 0: the page does not reload itself
    root: str = ""  # the path prefix a proxy serves the service under
    generated_at: float = 0.0  # wall-clock seconds, shown as UTC
    process: int = 0  # the worker process that answered (each has its own history)


def _stat(name: str, value: int | float | None, shown: str) -> str:
    """A figure shown for people, with the exact value /v1/stats has for it."""
    exact = "" if value is None else str(value)
    return (f'<span data-stat="{escape(name)}" data-value="{escape(exact)}" '
            f'title="{escape(exact)}">{escape(shown)}</span>')  # fmt: skip


def _ratio(hits: int, misses: int) -> float | None:
    return hits / (hits + misses) if hits + misses else None


def show_ratio(ratio: float | None) -> str:
    """'87.5 %', or a dash when nothing was looked up."""
    return NONE if ratio is None else f"{ratio * 100:.1f} %"


def _size(name: str, value: int | None) -> str:
    return _stat(name, value, NONE if value is None else show_size(value))


def _count(name: str, value: int) -> str:
    return _stat(name, value, f"{value:,}")


def _table(head: Sequence[str] | None, rows: Sequence[Sequence[str]]) -> str:
    """Cells are HTML already (escaped by their makers); the head is text."""
    cells = "".join(f"<th>{escape(text)}</th>" for text in head or ())
    thead = f"<thead><tr>{cells}</tr></thead>" if head else ""
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table>{thead}<tbody>{body}</tbody></table>"


def _header(view: StatusView) -> str:
    info, hashing = view.info, view.info["hashing"]
    if view.refresh_seconds:
        reload = (f"reloads every {view.refresh_seconds} s · "
                  f'<a href="{escape(view.root)}/?refresh=0">stop reloading</a>')  # fmt: skip
    else:
        reload = f'not reloading · <a href="{escape(view.root)}/">reload every 15 s</a>'
    shown_at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(view.generated_at))
    return (
        "<header><h1>Prompt cache service</h1>"
        f'<div class="meta">version {_stat("version", None, info["version"])} · '
        f"store {escape(str(info['store']))} · hashing {escape(hashing['scheme'])} "
        f"v{escape(str(hashing['version']))} · seed fingerprint "
        f"<code>{_stat('seed_fingerprint', None, hashing['seed_fingerprint'])}</code></div>"
        f'<div class="meta">{escape(shown_at)} · answered by worker process '
        f"{_stat('process', view.process, str(view.process))} · {reload}</div></header>"
    )


def _cards(view: StatusView) -> str:
    stats = view.stats
    hits = sum(c["hit_tokens"] for c in stats["retention"].values())
    misses = sum(c["miss_tokens"] for c in stats["retention"].values())
    overall = _ratio(hits, misses)
    looked_up = f"{hits:,} of {hits + misses:,} tokens"
    cards = [("hit ratio since start", _stat("hit_ratio", overall, show_ratio(overall)), looked_up)]
    for seconds, name in RECENT_WINDOWS[:2]:
        change = view.history.change_over(seconds)
        ratio = change.hit_ratio if change is not None else None
        shown = _stat(f"hit_ratio.{name.replace(' ', '_')}", ratio, show_ratio(ratio))
        cards.append((f"hit ratio, {name}", shown, _covered(change, seconds)))
    capacity = stats["capacity_bytes"]
    used = f"of {show_size(capacity)}" if capacity else "no capacity set"
    cards.append(("store used", _size("used_bytes", stats["used_bytes"]), used))
    cards.append(("blocks", _count("blocks", stats["blocks"]), ""))
    return '<section class="cards">' + "".join(
        f'<div class="card"><div class="sub">{escape(title)}</div><div class="big">{big}</div>'
        f'<div class="sub">{escape(sub)}</div></div>'
        for title, big, sub in cards
    ) + "</section>"  # fmt: skip


def _covered(change: Change | None, seconds: float) -> str:
    """Which part of a window the history covers (it starts with this worker)."""
    if change is None:
        return "no history yet"
    if change.seconds < seconds * 0.95:
        return f"history covers {show_span(change.seconds)} so far"
    return ""


def show_span(seconds: float) -> str:
    """'40 s', '9 min', '5 h': a rough length of time, for people."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds // 60:.0f} min"
    return f"{seconds // 3600:.0f} h"


def _span(samples: Sequence[Sample], now: float, spans: Sequence[tuple[int, str, int]]) -> int:
    """Which of `spans` a chart of `samples` takes: the shortest that holds them all."""
    held = now - samples[0].at if samples else 0.0
    fits = (i for i, (minutes, _, _) in enumerate(spans) if held <= minutes * 60)
    return next(fits, len(spans) - 1)


def _ticks(minutes: int, every_minutes: int) -> list[tuple[float, str]]:
    """A tick every `every_minutes` across the span, 'now' at the right."""
    unit, name = (1, "min") if minutes <= 60 else (60, "h")
    return [(ago * 60.0, f"-{ago // unit} {name}" if ago else "now")
            for ago in range(minutes, -1, -every_minutes)]  # fmt: skip


def _chart(ring: Ring, now: float, spans: Sequence[tuple[int, str, int]], per: str) -> str:
    minutes, caption, every = spans[_span(ring.samples, now, spans)]
    points = [(now - change.end, change.hit_ratio) for change in ring.changes()]
    # A point needs two samples: a chart without one says when it comes, not "no lookups".
    note = "no lookups in this window yet" if len(ring.samples) >= 2 else (
        f"its first point comes after {per} of history")  # fmt: skip
    chart = time_chart(points, span_seconds=minutes * 60, x_ticks=_ticks(minutes, every),
                       y_ticks=RATIO_TICKS, y_max=1.0, label=f"hit ratio, {caption.lower()}",
                       empty_note=note)  # fmt: skip
    return f"<figure><figcaption>{escape(caption)}, per {escape(per)}</figcaption>{chart}</figure>"


def _charts(view: StatusView) -> str:
    history, now = view.history, view.history.clock()
    per_sample = show_span(history.sample_seconds)
    return (
        '<h2>Hit ratio</h2><div class="charts">'
        + _chart(history.fine, now, FINE_SPANS, per_sample)
        + _chart(history.coarse, now, COARSE_SPANS, show_span(history.coarse.step_seconds))
        + "</div>"
        '<p class="note">Hit tokens over looked-up tokens in each interval, all retention '
        "classes and all worker processes; a gap is an interval without lookups.</p>"
    )


def _store(stats: Mapping[str, Any]) -> str:
    capacity, used = stats["capacity_bytes"], stats["used_bytes"]
    used_bar = usage_bar(used, capacity, label="used bytes against capacity")
    used_share = used / capacity if capacity else None
    rows = [
        ["blocks", _count("blocks", stats["blocks"])],
        ["payload bytes", _size("payload_bytes", stats["payload_bytes"])],
        ["used bytes", _size("used_bytes", used)],
        ["capacity", _size("capacity_bytes", capacity)],
        ["used of capacity", f"{used_bar} {escape(show_ratio(used_share))}"],
        ["touches waiting to be written", _count("pending_touches", stats["pending_touches"])],
    ]
    disk = stats["disk"]
    if disk is not None:
        room = disk["file_bytes"] + disk["free_bytes"]
        file_bar = usage_bar(disk["file_bytes"], room, label="data file against the disk's room")
        rows += [
            ["disk: data file", _size("disk.file_bytes", disk["file_bytes"])],
            ["disk: free", _size("disk.free_bytes", disk["free_bytes"])],
            ["disk: store limit", _size("disk.limit_bytes", disk["limit_bytes"])],
            [
                "disk: capacity it cannot back",
                _size("disk.shortfall_bytes", disk["shortfall_bytes"]),
            ],
            ["disk: data file of its room", file_bar + (" full" if disk["full"] else "")],
        ]
    return "<h2>Store</h2>" + _table(None, rows)


def _retention(view: StatusView) -> str:
    classes = view.info["retention"]["classes"]
    default = view.info["retention"]["default"]
    latest = view.history.latest
    before_ttl = latest.totals.evicted_before_ttl if latest is not None else {}
    rows = []
    for name in sorted(classes):
        counts = view.stats["retention"].get(name, {"hit_tokens": 0, "miss_tokens": 0})
        hits, misses = counts["hit_tokens"], counts["miss_tokens"]
        rows.append([
            escape(name) + (" (default)" if name == default else ""),
            _stat(f"retention.{name}.ttl_seconds", classes[name], show_duration(classes[name])),
            _count(f"retention.{name}.hit_tokens", hits),
            _count(f"retention.{name}.miss_tokens", misses),
            escape(show_ratio(_ratio(hits, misses))),
            f"{before_ttl.get(name, 0):,}",
        ])  # fmt: skip
    evicted = "evicted before TTL, since start"
    head = ["class", "TTL", "hit tokens", "miss tokens", "hit ratio", evicted]
    return "<h2>Retention classes</h2>" + _table(head, rows)


def _evictions(view: StatusView) -> str:
    history = view.history
    changes = [history.change_over(seconds) for seconds, _ in RECENT_WINDOWS]
    latest = history.latest
    totals = dict(latest.totals.evicted) if latest is not None else {}
    rows = [
        [escape(reason)]
        + [f"{change.evicted.get(reason, 0):,}" if change else NONE for change in changes]
        + [f"{count:,}"]
        for reason, count in sorted(totals.items())
    ]
    head = ["reason", *(name for _, name in RECENT_WINDOWS), "since start"]
    covered = _covered(changes[-1], RECENT_WINDOWS[-1][0])
    covered = f" ({covered})" if covered else ""
    note = f'<p class="note">Blocks removed by the service, by reason{escape(covered)}.</p>'
    return "<h2>Evictions</h2>" + _table(head, rows) + note


def _tenants(stats: Mapping[str, Any]) -> str:
    tenants = stats["tenants"]
    if not tenants:
        return ""
    rows = []
    for name, figures in sorted(tenants.items()):
        hits, misses = figures["hit_tokens"], figures["miss_tokens"]
        stored, quota = figures["estimated_bytes"], figures["capacity_bytes"]
        rows.append([
            escape(name),
            _count(f"tenant.{name}.hit_tokens", hits),
            _count(f"tenant.{name}.miss_tokens", misses),
            escape(show_ratio(_ratio(hits, misses))),
            _size(f"tenant.{name}.estimated_bytes", stored),
            _size(f"tenant.{name}.capacity_bytes", quota),
            usage_bar(stored, quota, label=f"{name}: stored against its capacity"),
        ])  # fmt: skip
    head = ["tenant", "hit tokens", "miss tokens", "hit ratio", "stored (est.)", "capacity", ""]
    return "<h2>Tenants</h2>" + _table(head, rows)


def _engines(view: StatusView) -> str:
    engines = view.stats.get("kv_events")
    if not engines:
        return ""
    rows = []
    for name, figures in sorted(engines.items()):
        if figures["live"]:
            state = "live"
        else:
            since = figures["down_since"]
            ago = show_duration(int(max(0.0, view.generated_at - since))) if since else NONE
            left = "" if figures["routable"] else ", out of routing"
            state = f"down ({figures['down_reason']}) for {ago}{left}"
        rows.append([
            escape(name),
            _stat(f"kv_events.{name}.live", figures["live"], state),
            _count(f"kv_events.{name}.blocks", figures["blocks"]),
            _count(f"kv_events.{name}.batches", figures["batches"]),
            _count(f"kv_events.{name}.gaps", figures["gaps"]),
            _count(f"kv_events.{name}.stale_ranks", figures["stale_ranks"]),
            _count(f"kv_events.{name}.mismatches", figures["mismatches"]),
        ])  # fmt: skip
    head = ["engine", "state", "view entries", "batches", "gaps", "stale ranks", "mismatches"]
    note = (
        '<p class="note">Engines whose KV events this service follows. A down engine is '
        "ranked after live ones in routing answers, and left out after the grace "
        "(--kv-events-grace).</p>"
    )
    return "<h2>Engines</h2>" + _table(head, rows) + note


def _footer(root: str) -> str:
    links = " · ".join(f'<a href="{escape(root)}/{path}">{path}</a>'
                       for path in ("v1/stats", "v1/info", "metrics", "docs"))  # fmt: skip
    note = f"The same figures as JSON and for Prometheus: {links}"
    return f'<footer><p class="note">{note}</p></footer>'


def render_status_page(view: StatusView) -> str:
    """The whole page."""
    reload = (f'<meta http-equiv="refresh" content="{view.refresh_seconds}">'
              if view.refresh_seconds else "")  # fmt: skip
    body = "".join([
        _header(view), _cards(view), _charts(view), _store(view.stats), _retention(view),
        _evictions(view), _tenants(view.stats), _engines(view), _footer(view.root),
    ])  # fmt: skip
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"{reload}<title>Prompt cache service: status</title>"
        # No favicon request: the browser would ask for /favicon.ico, and fail.
        f'<link rel="icon" href="data:,"><style>{STYLE}</style></head>'
        f"<body>{body}</body></html>"
    )
