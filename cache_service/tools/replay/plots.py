"""PNG figures of a replay report: hit ratio over time, the miss-ratio curve, and the
policies compared against LRU and Belady."""

from __future__ import annotations

from itertools import cycle
from pathlib import Path
from typing import Any

GIB = 2**30
# One colour per eviction policy in every panel: the policy the replay ran in blue, as its hit
# ratio over time is; LRU, the baseline, in grey; Belady in red; the others compared in the
# order the report names them (none green: the block hit ratio over time is).
RUN_COLOUR = "tab:blue"
LRU_COLOUR = "tab:gray"
BELADY_COLOUR = "tab:red"
POLICY_COLOURS = ("tab:purple", "tab:orange", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def plot_report(report: dict[str, Any], path: str | Path) -> None:
    """Write the report's figures to one PNG file."""
    figure = draw_report(report)
    import matplotlib.pyplot as plt  # noqa: PLC0415 - optional: draw_report has loaded it

    try:
        figure.savefig(path, dpi=110)
    finally:
        plt.close(figure)


def draw_report(report: dict[str, Any]) -> Any:
    """The report's figures, one panel under another: a matplotlib Figure (for a caller to
    save and close)."""
    try:
        import matplotlib  # noqa: PLC0415 - optional dependency, loaded only to plot

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError as exc:
        raise PlotUnavailable(
            "plots need matplotlib: pip install 'prompt-cache-service[plot]'"
        ) from exc
    panels = [_plot_over_time]
    if report.get("mrc") is not None:
        panels.append(_plot_curve)
    if report.get("policies"):
        panels.append(_plot_policies)
    if report.get("fleet"):
        panels.append(_plot_fleet)
        if report["fleet"].get("curves"):
            panels.append(_plot_fleet_curves)
    figure, axes = plt.subplots(
        len(panels), 1, figsize=(10, 4.8 if len(panels) == 1 else 4.5 * len(panels)), squeeze=False
    )
    for panel, row in zip(panels, axes, strict=True):
        panel(row[0], report)
    figure.suptitle(_title(report))
    # Leave the suptitle about half an inch, whatever the figure's height.
    figure.tight_layout(rect=(0, 0, 1, 1 - 0.35 / figure.get_figheight()))
    return figure


def policy_colours(report: dict[str, Any]) -> dict[str, str]:
    """The colour of each eviction policy the report draws, the same in every panel."""
    colours = {report["policy"]: RUN_COLOUR}
    colours.setdefault("lru", LRU_COLOUR)
    others = cycle(POLICY_COLOURS)
    for name in report.get("policies") or {}:
        colours.setdefault(name, next(others))
    return colours


def _title(report: dict[str, Any]) -> str:
    capacity = report["capacity_tokens"]
    size = "unbounded" if capacity is None else f"{capacity:,} tokens"
    compared = report.get("policies")
    policy = (
        f"{report['policy']} (compared: {', '.join(compared)})" if compared else report["policy"]
    )
    return (
        f"{', '.join(Path(t).name for t in report['traces'])} - {report['requests']:,} requests, "
        f"{policy}, capacity {size}"
    )


def _plot_over_time(axis: Any, report: dict[str, Any]) -> None:
    windows = report["windows"]["points"]
    width = report["windows"]["window_seconds"]
    starts = [point["start_seconds"] / 60 for point in windows]
    token = [point["token_hit_ratio"] if point["requests"] else None for point in windows]
    block = [point["block_hit_ratio"] if point["requests"] else None for point in windows]
    axis.plot(starts, token, label="token hit ratio", color=RUN_COLOUR, marker=".", ms=3)
    axis.plot(starts, block, label="block hit ratio", color="tab:green", alpha=0.6, lw=1)
    axis.axhline(report["token_hit_ratio"], color=RUN_COLOUR, ls=":", label="whole run (tokens)")
    ceiling = report.get("ceiling")
    if ceiling and report["capacity_tokens"] is not None:
        axis.axhline(ceiling["token_hit_ratio"], color="black", ls="--", label="unbounded ceiling")
    axis.set_xlabel("trace time (minutes)")
    axis.set_ylabel(f"hit ratio per {width:g} s window")
    axis.set_ylim(0, 1)
    axis.grid(alpha=0.3)
    axis.legend(loc="lower right", fontsize=8)
    axis.set_title("Hit ratio over time")


def _plot_fleet(axis: Any, report: dict[str, Any]) -> None:
    """Per routing, over time: the engines' share of prompt tokens, and with the store's."""
    fleet = report["fleet"]
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    for (name, run), color in zip(fleet["routings"].items(), colors * 4, strict=False):
        points = run["with_store"]["windows"]
        starts = [point["start_seconds"] / 60 for point in points]
        engine = [p["engine_share"] if p["requests"] else None for p in points]
        both = [p["engine_share"] + p["store_share"] if p["requests"] else None for p in points]
        axis.plot(starts, both, color=color, lw=1.2, label=f"{name}: engines + store")
        axis.plot(starts, engine, color=color, lw=1, ls="--", label=f"{name}: engine caches")
    axis.set_xlabel("trace time (minutes)")
    axis.set_ylabel(f"share of prompt tokens per {fleet['window_seconds']:g} s window")
    axis.set_ylim(0, 1)
    axis.grid(alpha=0.3)
    axis.legend(loc="upper left", fontsize=7, ncol=2)
    axis.set_title(
        f"A fleet of {fleet['engines']} engines ({fleet['engine_cache_tokens']:,} tokens of "
        "cache each) in front of the store: hits by tier"
    )


def _plot_fleet_curves(axis: Any, report: dict[str, Any]) -> None:
    """Per routing, by the store's capacity: what the store adds (solid), and the engines'
    own share (dashed)."""
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    for (name, points), color in zip(report["fleet"]["curves"].items(), colors * 4, strict=False):
        xs = [point["capacity_tokens"] for point in points]
        axis.plot(
            xs, [p["store_share"] for p in points], color=color, marker=".", label=f"{name}: store"
        )
        axis.plot(
            xs,
            [p["engine_share"] for p in points],
            color=color,
            ls="--",
            lw=1,
            label=f"{name}: engines",
        )
    axis.set_xscale("log")
    axis.set_xlabel("store capacity (tokens)")
    axis.set_ylabel("share of prompt tokens")
    axis.set_ylim(0, 1)
    axis.grid(alpha=0.3)
    axis.legend(loc="upper left", fontsize=7, ncol=2)
    axis.set_title("What the store adds on top of the engines' caches, by its capacity")


def _plot_curve(axis: Any, report: dict[str, Any]) -> None:
    mrc, belady = report["mrc"], report["belady"]
    xs = [point["capacity_tokens"] for point in mrc["points"]]
    axis.plot(
        xs,
        [point["token_hit_ratio"] for point in mrc["points"]],
        label=f"{report['policy'].upper()} ({mrc['method']})",
        color=RUN_COLOUR,
        marker="." if mrc["method"] != "lru-stack-distance" else None,
    )
    lru = report.get("lru")
    if report["policy"] != "lru" and lru:
        axis.plot(
            [point["capacity_tokens"] for point in lru["points"]],
            [point["token_hit_ratio"] for point in lru["points"]],
            label=f"LRU ({lru['method']})",
            color=LRU_COLOUR,
            marker="." if lru["method"] != "lru-stack-distance" else None,
        )
    axis.plot(
        [point["capacity_tokens"] for point in belady["points"]],
        [point["token_hit_ratio"] for point in belady["points"]],
        label="offline optimum (Belady)",
        color=BELADY_COLOUR,
        marker="o",
        ls="--",
    )
    axis.axhline(report["ceiling"]["token_hit_ratio"], color="black", ls=":", label="ceiling")
    if report["capacity_tokens"] is not None:
        axis.axvline(report["capacity_tokens"], color="black", ls="-.", label="this run's capacity")
    _capacity_axes(axis, "token hit ratio")
    per_token = mrc["kv_bytes_per_token"]
    top = axis.secondary_xaxis(
        "top", functions=(lambda t: t * per_token / GIB, lambda g: g * GIB / per_token)
    )
    top.set_xlabel(f"capacity (GiB at {per_token} bytes of KV per token)")
    axis.set_title("Hit ratio at every capacity (the miss-ratio curve, as hits)", pad=28)


def _plot_policies(axis: Any, report: dict[str, Any]) -> None:
    policies: dict[str, list[dict[str, Any]]] = report["policies"]
    rows = next(iter(policies.values()))
    curve = report.get("lru") or report["mrc"]
    if curve["method"] == "lru-stack-distance":  # the exact curve, at every listed capacity
        lru = [(point["capacity_tokens"], point["block_hit_ratio"]) for point in curve["points"]]
        marker = None
    else:  # LRU as the comparison measured it, at its capacities
        lru = [(row["capacity_tokens"], row["lru_block_hit_ratio"]) for row in rows]
        marker = "."
    colours = policy_colours(report)
    axis.plot(*zip(*lru, strict=True), label="LRU", color=colours["lru"], marker=marker)
    axis.plot(
        [row["capacity_tokens"] for row in rows],
        [row["belady_block_hit_ratio"] for row in rows],
        label="offline optimum (Belady)",
        color=BELADY_COLOUR,
        marker="o",
        ls="--",
    )
    for name, points in policies.items():
        if name == "lru":  # drawn above
            continue
        axis.plot(
            [point["capacity_tokens"] for point in points],
            [point["block_hit_ratio"] for point in points],
            label=name,
            color=colours[name],
            marker="s",
            ms=4,
        )
    axis.axhline(report["ceiling"]["block_hit_ratio"], color="black", ls=":", label="ceiling")
    _capacity_axes(axis, "block hit ratio")
    axis.set_title("Eviction policies against LRU and the offline optimum")


def _capacity_axes(axis: Any, ratio: str) -> None:
    """A hit ratio (0 to 1) against capacity in tokens on a log scale, gridded, with a legend."""
    axis.set_xscale("log")
    axis.set_xlabel("capacity (tokens)")
    axis.set_ylabel(ratio)
    axis.set_ylim(0, 1)
    axis.grid(alpha=0.3, which="both")
    axis.legend(loc="upper left", fontsize=8)
