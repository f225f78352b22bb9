"""The one-screen summary printed at the end of a replay."""

from __future__ import annotations

from typing import Any

from cache_service.replay.curves import capacity_for_share

GIB = 2**30
MAX_CURVE_ROWS = 6


def _ratio(figures: dict[str, Any]) -> str:
    return f"tokens {figures['token_hit_ratio']:.1%}, blocks {figures['block_hit_ratio']:.1%}"


def format_summary(report: dict[str, Any]) -> str:
    """Plain text, at most a screen."""
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
            "By retention: "
            + "; ".join(
                f"{k} {v['token_hit_ratio']:.1%}" for k, v in report["by_retention"].items()
            )
        )
    tenants = report.get("by_tenant") or {}
    if len(tenants) > 1:
        shown = list(tenants.items())[:6]
        lines.append(
            "By tenant: "
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
                    f"{report['policy'].upper()} reaches {share:.0%} of the ceiling at "
                    f"{tokens:,} tokens ({tokens * mrc['kv_bytes_per_token'] / GIB:,.1f} GiB of KV)"
                )
        lru = {p["capacity_blocks"]: p["token_hit_ratio"] for p in mrc["points"]}
        points = belady["points"]
        shown = points[:: max(1, -(-len(points) // MAX_CURVE_ROWS))]
        policy = report["policy"].upper()
        lines.append(f"Token hit ratio by capacity: {'tokens':>15}  {policy:>6}  Belady")
        for point in shown:
            ours = lru.get(point["capacity_blocks"])
            lines.append(
                f"{'':28} {point['capacity_tokens']:>15,}  "
                + (f"{ours:6.1%}" if ours is not None else "     -")
                + f"  {point['token_hit_ratio']:6.1%}"
            )
    if report["skipped_lines"]:
        lines.append(f"Skipped {report['skipped_lines']:,} malformed lines (listed above)")
    return "\n".join(lines)
