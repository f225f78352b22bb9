"""The summary's table of policies against LRU and Belady, and its headline per policy."""

from __future__ import annotations

from typing import Any

from cache_service.tools.replay.policy_curves import headline_capacities


def _percent(value: float | None, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.1%}"


def _gap(value: float | None) -> str:
    return "none (Belady = LRU there)" if value is None else f"{value:.1%}"


def format_policy_comparison(report: dict[str, Any]) -> list[str]:
    """Lines of text: a row per capacity (block hit ratios, gap closed), then the headlines."""
    policies: dict[str, list[dict[str, Any]]] = report["policies"]
    # LRU has its own column; a policy named "lru" would repeat it.
    shown = [name for name in policies if name != "lru"]
    widths = {name: max(len(name), 7) for name in shown}
    first = next(iter(policies.values()))
    lines = [
        "Policies against LRU and Belady (block hit ratio; gap closed = "
        "(policy - LRU) / (Belady - LRU)):",
        f"{'tokens':>13} {'blocks':>8} {'LRU':>7} "
        + "".join(f"{name:>{widths[name]}} " for name in shown)
        + f"{'Belady':>7}"
        + "".join(f"  {'gap ' + name:>{widths[name] + 4}}" for name in shown),
    ]
    for index, row in enumerate(first):
        lines.append(
            f"{row['capacity_tokens']:>13,} {row['capacity_blocks']:>8,} "
            f"{_percent(row['lru_block_hit_ratio'], 7)} "
            + "".join(
                _percent(policies[name][index]["block_hit_ratio"], widths[name]) + " "
                for name in shown
            )
            + _percent(row["belady_block_hit_ratio"], 7)
            + "".join(
                "  " + _percent(policies[name][index]["gap_closed"], widths[name] + 4)
                for name in shown
            )
        )
    capacities, rule = headline_capacities(report["belady"])
    for name in shown:
        rows = {row["capacity_blocks"]: row for row in policies[name]}
        figures = [
            f"{_gap(rows[c]['gap_closed'])} at {rows[c]['capacity_tokens']:,} tokens"
            for c in capacities
            if c in rows
        ]
        lines.append(f"Headline: {name} closes {'; '.join(figures)} of the LRU-to-Belady gap")
    if shown:
        lines.append(f"(headline capacities: {rule})")
    return lines
