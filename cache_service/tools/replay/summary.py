"""The one-screen summary printed at the end of a replay."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cache_service.tools.replay.curves import capacity_for_share
from cache_service.tools.replay.policy_table import format_policy_comparison

GIB = 2**30
MAX_CURVE_ROWS = 6


def _ratio(figures: dict[str, Any]) -> str:
    return f"tokens {figures['token_hit_ratio']:.1%}, blocks {figures['block_hit_ratio']:.1%}"


def format_summary(report: dict[str, Any], written: Sequence[tuple[str, Path]] = ()) -> str:
    """Plain text, at most a screen; `written` names the files the run wrote, (what, path)."""
    capacity = report["capacity_tokens"]
    lines = [
        f"Replayed {report['requests']:,} requests from {len(report['traces'])} trace(s) in "
        f"{report['elapsed_seconds']:.1f} s ({report['requests_per_second']:,.0f} requests/s), "
        f"{report['mode']}, policy {report['policy']}, capacity "
        + ("unbounded" if capacity is None else f"{capacity:,} tokens"),
        f"Prompt tokens {report['prompt_tokens']:,}: hit {report['hit_tokens']:,}, "
        f"miss {report['miss_tokens']:,}; output tokens {report['output_tokens']:,}",
        f"Hit ratio: {_ratio(report)}; requests with a hit {report['requests_with_hit']:,}",
        f"Ceiling (unbounded capacity): {_ratio(report['ceiling'])}",
    ]
    if len(report["by_retention"]) > 1:
        lines.append(
            "By retention (token hit ratio): "
            + "; ".join(
                f"{k} {v['token_hit_ratio']:.1%}" for k, v in report["by_retention"].items()
            )
        )
    tenants = report.get("by_tenant") or {}
    if len(tenants) > 1:
        shown = list(tenants.items())[:6]
        lines.append(
            "By tenant (token hit ratio): "
            + "; ".join(f"{k or '(none)'} {v['token_hit_ratio']:.1%}" for k, v in shown)
            + (" ..." if len(tenants) > len(shown) else "")
        )
    cost = report["cost"]
    lines.append(
        f"Cost: ${cost['with_cache_usd']:,.2f} with the cache vs ${cost['without_cache_usd']:,.2f} "
        f"without: saves ${cost['saved_usd']:,.2f} ({cost['saved_share']:.1%}); "
        f"prefill compute saved {cost['prefill_flops_saved']:.3g} FLOPs"
    )
    mrc, belady = report.get("mrc"), report.get("belady")
    if mrc and belady:
        ceiling = report["ceiling"]["token_hit_ratio"]
        for share in (0.5, 0.9):
            tokens = capacity_for_share(mrc, ceiling, share)
            if tokens is not None:
                lines.append(
                    f"{report['policy'].upper()} reaches {share:.0%} of the token ceiling at "
                    f"{tokens:,} tokens ({tokens * mrc['kv_bytes_per_token'] / GIB:,.1f} GiB of KV)"
                )
        ours = {p["capacity_blocks"]: p for p in mrc["points"]}
        policy = report["policy"].upper()
        # Beside the policy's own curve, LRU's (unless the policy is LRU) and Belady's.
        columns = [(policy, ours)]
        if report["policy"] != "lru" and report.get("lru"):
            columns.append(("LRU", {p["capacity_blocks"]: p for p in report["lru"]["points"]}))
        points = belady["points"]
        requested = set(belady.get("requested_capacity_blocks", ()))
        sampled = points[:: max(1, -(-len(points) // MAX_CURVE_ROWS))]
        shown = [p for p in points if p in sampled or p["capacity_blocks"] in requested]
        lines.append(
            f"Hit ratio by capacity:  {'tokens':>11} {'blocks':>7}  "
            + "".join(f"{name + ' token':>12} {'block':>6}  " for name, _ in columns)
            + f"{'Belady token':>12} {'block':>6}"
        )
        for point in shown:
            cells = []
            for _, curve in columns:
                found = curve.get(point["capacity_blocks"])
                cells.append(
                    f"{found['token_hit_ratio']:12.1%} {found['block_hit_ratio']:6.1%}  "
                    if found is not None
                    else f"{'-':>12} {'-':>6}  "
                )
            lines.append(
                f"{'':23} {point['capacity_tokens']:>11,} {point['capacity_blocks']:>7,}  "
                + "".join(cells)
                + f"{point['token_hit_ratio']:12.1%} {point['block_hit_ratio']:6.1%}"
            )
    if report.get("policies"):
        lines.extend(format_policy_comparison(report))
    if report.get("fleet"):
        lines.extend(format_fleet(report["fleet"]))
    if report["skipped_lines"]:
        lines.append(f"Skipped {report['skipped_lines']:,} malformed lines (listed above)")
    lines.extend(f"Wrote {what}: {path}" for what, path in written)
    return "\n".join(lines)


def format_fleet(fleet: dict[str, Any]) -> list[str]:
    """The fleet's lines: prompt tokens by tier under each routing, with and without the
    store, and the bills."""
    store = fleet["store_capacity_tokens"]
    lines = [
        f"Fleet: {fleet['engines']} engines, each caching {fleet['engine_cache_tokens']:,} "
        f"tokens ({fleet['engine_cache_blocks']:,} blocks of {fleet['engine_block_tokens']}); "
        "store " + ("unbounded" if store is None else f"{store:,} tokens"),
        f"{'Routing':<14} {'engines':>8} {'store':>7} {'missed':>7}   {'engines alone':>13} "
        f"{'store adds':>10}   {'bill with store':>15} {'without':>10}",
    ]
    for name, run in fleet["routings"].items():
        stored, alone = run["with_store"], run["engines_only"]
        lines.append(
            f"{name:<14} {stored['engine_share']:8.1%} {stored['store_share']:7.1%} "
            f"{stored['miss_share']:7.1%}   {alone['engine_share']:13.1%} "
            f"{run['store_adds_share']:10.1%}   {_usd(stored['cost']['total_usd']):>15} "
            f"{_usd(alone['cost']['total_usd']):>10}"
        )
    for name, points in (fleet.get("curves") or {}).items():
        shown = points[:: max(1, -(-len(points) // MAX_CURVE_ROWS))]
        lines.append(
            f"The store adds, by its capacity ({name}): "
            + "; ".join(f"{p['capacity_tokens']:,} tokens {p['store_share']:.1%}" for p in shown)
        )
    return lines


def _usd(amount: float) -> str:
    return f"${amount:,.2f}"
