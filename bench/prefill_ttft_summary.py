"""The prefill TTFT bench's numbers from its samples: medians, break-even, bytes per token."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from cache_service.integrations.kv_layout import KVLayout

PUBLIC_BYTES_PER_TOKEN = 890  # the public report's figure: DeepSeek's, for its own model
Sample = dict[str, Any]


def kv_sizes(layout: KVLayout, stats: dict[str, Any]) -> dict[str, Any]:
    """Bytes per token: the layout's KV, a stored payload (with its header), the service's."""
    header = len(layout.header())
    payload_per_token = (layout.block_kv_bytes + header) / layout.block_size
    tokens = stats["blocks"] * layout.block_size  # every stored block is a full block
    return {
        "kv_bytes_per_token": layout.kv_bytes_per_token,
        "header_bytes": header,
        "payload_bytes_per_block": layout.block_kv_bytes + header,
        "payload_bytes_per_token": payload_per_token,
        "service_blocks": stats["blocks"],
        "service_payload_bytes": stats["payload_bytes"],
        "service_used_bytes": stats["used_bytes"],
        "service_payload_bytes_per_token": stats["payload_bytes"] / tokens if tokens else None,
        "service_used_bytes_per_token": stats["used_bytes"] / tokens if tokens else None,
        "public_bytes_per_token": PUBLIC_BYTES_PER_TOKEN,
        "ratio_to_public": payload_per_token / PUBLIC_BYTES_PER_TOKEN,
    }


def _median(samples: list[Sample], value: Callable[[Sample], float]) -> float:
    return statistics.median(value(sample) for sample in samples)


def _ttft(sample: Sample) -> float:
    return float(sample["first_token_seconds"])


def _fetch(sample: Sample) -> float:
    return float(sample["lookup_seconds"] + sample["load_seconds"])


def _pick(samples: list[Sample], kind: str, length: int, **match: Any) -> list[Sample]:
    return [
        s
        for s in samples
        if s["kind"] == kind and s["length"] == length and all(s[k] == v for k, v in match.items())
    ]


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    """Medians per (length, share), the break-even grid, per-token costs, and how much slower
    the rest computes after a loaded prefix than inside an uncached pass."""
    samples = result["samples"]
    uncached = {
        n: sorted(_ttft(s) for s in _pick(samples, "uncached", n)) for n in result["lengths"]
    }
    cells = [
        _cell(samples, n, share, uncached[n])
        for n in result["lengths"]
        for share in result["shares"]
    ]
    per_token = []
    for n in result["lengths"]:
        row = [c for c in cells if c["length"] == n]
        miss, top = row[0], row[-1]  # the largest share: its computed tokens are the last
        per_token.append(
            {
                "length": n,
                "miss_lookup_seconds": miss["lookup_seconds"],
                "fetch_seconds_per_token": top["fetch_seconds"] / top["cached_tokens"]
                if top["cached_tokens"]
                else None,
                "compute_seconds_per_token_mean": miss["uncached_seconds"] / n,
                "compute_seconds_per_token_last": top["compute_seconds"]
                / (n - top["cached_tokens"]),
                "last_tokens": n - top["cached_tokens"],
            }
        )
    # A cached prefix of exactly another length's prompt: the rest's compute against the same
    # positions inside the uncached pass (uncached(n) - uncached(k)).
    rest = [
        {
            "length": c["length"],
            "cached_tokens": c["cached_tokens"],
            "after_cache_seconds": c["compute_seconds"],
            "inside_uncached_seconds": c["uncached_seconds"]
            - statistics.median(uncached[c["cached_tokens"]]),
        }
        for c in cells
        if c["cached_tokens"] in uncached
    ]
    breakeven = [
        _breakeven(samples, n, uncached[n], [c for c in cells if c["length"] == n])
        for n in result["breakeven_lengths"]
    ]
    # Cores this process kept busy during its uncached passes of a second or more: below the
    # torch threads, something else on the machine took CPU from the measurement.
    busy = [
        s["cpu_seconds"] / s["first_token_seconds"]
        for s in samples
        if s["kind"] == "uncached" and s["first_token_seconds"] >= 1
    ]
    cores = {"median": statistics.median(busy), "min": min(busy)} if busy else None
    return {
        "cells": cells,
        "per_token": per_token,
        "rest": rest,
        "breakeven": breakeven,
        "busy_cores": cores,
    }


def _cell(
    samples: list[Sample], length: int, share: float, uncached: list[float]
) -> dict[str, Any]:
    runs = _pick(samples, "share", length, share=share)
    ttft = _median(runs, _ttft)
    return {
        "length": length,
        "share": share,
        "cached_tokens": runs[0]["cached_tokens"],
        "cached_share": runs[0]["cached_tokens"] / length,
        "samples": len(runs),
        "uncached_seconds": statistics.median(uncached),
        "uncached_range_seconds": [uncached[0], uncached[-1]],
        "first_token_seconds": ttft,
        "speedup": statistics.median(uncached) / ttft,
        "lookup_seconds": _median(runs, lambda s: s["lookup_seconds"]),
        "load_seconds": _median(runs, lambda s: s["load_seconds"]),
        "fetch_seconds": _median(runs, _fetch),
        "compute_seconds": _median(runs, lambda s: s["compute_seconds"]),
    }


def _breakeven(
    samples: list[Sample], length: int, uncached: list[float], cells: list[dict[str, Any]]
) -> dict[str, Any]:
    """k cached tokens end to end (fetch against uncached less the rest's compute) and the
    parts alone (fetch of those k against model.forward of them), at every cut measured; the
    break-even from every end-to-end point at this length (the grid's and the shares')."""
    unc = statistics.median(uncached)
    rows = []
    for k in sorted({s["cached_tokens"] for s in _pick(samples, "breakeven", length)}):
        ends = _pick(samples, "breakeven", length, cached_tokens=k)
        alone = _median(_pick(samples, "prefix_compute", length, prompt_tokens=k), _ttft)
        fetch_alone = _median(_pick(samples, "prefix_fetch", length, cached_tokens=k), _fetch)
        rest = _median(ends, lambda s: s["compute_seconds"])
        rows.append(
            {
                "cached_tokens": k,
                "share": k / length,
                "fetch_seconds": _median(ends, _fetch),
                "saved_seconds": unc - rest,  # uncached TTFT less the compute of the rest
                "first_token_seconds": _median(ends, _ttft),
                "uncached_seconds": unc,
                "rest_compute_seconds": rest,
                "fetch_alone_seconds": fetch_alone,
                "compute_alone_seconds": alone,
                "compute_over_fetch_alone": alone / fetch_alone,
            }
        )
    points = sorted(
        [(r["cached_tokens"], r["first_token_seconds"]) for r in rows]
        + [(c["cached_tokens"], c["first_token_seconds"]) for c in cells if c["cached_tokens"]]
    )
    # End to end, fetch >= uncached - rest is cached TTFT >= uncached TTFT.
    slower = [k for k, ttft in points if ttft >= unc]
    above = [k for k, _ in points if k > max(slower, default=0)]
    return {
        "length": length,
        "uncached_seconds": unc,
        "uncached_range_seconds": [uncached[0], uncached[-1]],
        "rows": rows,
        "end_to_end": [{"cached_tokens": k, "first_token_seconds": ttft} for k, ttft in points],
        "slower_end_to_end_at": slower,
        # Fetching stops paying between these cached token counts (None: not measured).
        "breakeven_between": [max(slower) if slower else None, above[0] if above else None],
        "slower_alone_at": [
            r["cached_tokens"]
            for r in rows
            if r["fetch_alone_seconds"] >= r["compute_alone_seconds"]
        ],
    }
