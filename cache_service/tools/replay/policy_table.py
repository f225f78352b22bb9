"""The summary's table of policies against LRU and Belady, and its headline per policy."""

from __future__ import annotations

from typing import Any

from cache_service.tools.replay.policy_curves import SMALL_GAP, headline_capacities


def _percent(value: float | None, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.1%}"


def headline_figure(row: dict[str, Any]) -> str:
    """What a policy's row says at its capacity: the share of the LRU-to-Belady gap it
    closes, or, where LRU is within a point of Belady, that there is little or nothing to
    gain there (a share of such a gap would read as a verdict on the policy)."""
    at = f"at {row['capacity_tokens']:,} tokens"
    lru, best = row["lru_block_hit_ratio"], row["belady_block_hit_ratio"]
    if row["gap_closed"] is None:
        return f"{at}: nothing to gain, LRU already equals Belady ({best:.1%})"
    if best - lru < SMALL_GAP:
        return f"{at}: little to gain, LRU ({lru:.1%}) is within a point of Belady ({best:.1%})"
    return f"{at}: closes {row['gap_closed']:.1%} of the LRU-to-Belady gap"


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
        figures = [headline_figure(rows[c]) for c in capacities if c in rows]
        lines.append(f"Headline: {name} {'; '.join(figures)}")
    if shown:
        lines.append(f"(headline capacities: {rule})")
    return lines
