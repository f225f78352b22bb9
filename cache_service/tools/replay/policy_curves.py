"""Eviction policies side by side: each at Belady's capacities, against LRU and Belady.

A policy other than LRU has no one-pass curve, so it is replayed once per capacity; only
Belady's capacities are used (a handful, including the ones the user asked for), not every
point of LRU's curve, because a replay of a large trace takes seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from cache_service.tools.replay.curves import Scale
from cache_service.tools.replay.mrc import MissRatioCurve

Hits = tuple[int, int]  # (hit blocks, hit tokens)
# (policy, capacity in tokens) -> hits of a replay at that capacity
ReplayAt = Callable[[str, int], Hits]

HEADLINE_REQUESTED = "the capacities asked for with --capacities or --capacity-tokens"
HEADLINE_LARGEST = (
    "the largest capacity below the whole working set of {blocks:,} blocks, where nothing "
    "is evicted and every policy ties with Belady"
)
# Belady's lead over LRU (block hit ratio) under which the share of it a policy closes says
# nothing: LRU already hits within a point of the optimum there, so no policy has anything
# worth gaining, and a share of a sliver (0.0% or 100% of a few blocks) reads as a verdict.
SMALL_GAP = 0.01


def gap_closed(policy: float, lru: float, belady: float) -> float | None:
    """(policy - LRU) / (Belady - LRU); None when Belady gains nothing over LRU."""
    if belady == lru:
        return None
    return round((policy - lru) / (belady - lru), 6)


def compare_policies(
    names: Sequence[str],
    belady: dict[str, Any],
    scale: Scale,
    *,
    replay_at: ReplayAt,
    lru_exact: MissRatioCurve | None,
) -> dict[str, list[dict[str, Any]]]:
    """The report's `policies` section: per policy, a row per Belady capacity.

    LRU comes from `lru_exact` (stack distances) when given, else from replays; ratios are
    block hit ratios as reported (6 digits), so the gap closed matches the table.
    """
    capacities = [point["capacity_blocks"] for point in belady["points"]]
    optimum = {point["capacity_blocks"]: point for point in belady["points"]}

    def measured(name: str, capacity_blocks: int) -> dict[str, Any]:
        if name == "lru" and lru_exact is not None:
            return scale.point(capacity_blocks, lru_exact.at(capacity_blocks))
        return scale.point(capacity_blocks, replay_at(name, capacity_blocks * scale.block_tokens))

    lru = {capacity: measured("lru", capacity) for capacity in capacities}
    section: dict[str, list[dict[str, Any]]] = {}
    for name in names:
        rows = []
        for capacity in capacities:
            ours = lru[capacity] if name == "lru" else measured(name, capacity)
            baseline = lru[capacity]["block_hit_ratio"]
            best = optimum[capacity]["block_hit_ratio"]
            rows.append(
                {
                    "capacity_blocks": capacity,
                    "capacity_tokens": ours["capacity_tokens"],
                    "block_hit_ratio": ours["block_hit_ratio"],
                    "token_hit_ratio": ours["token_hit_ratio"],
                    "lru_block_hit_ratio": baseline,
                    "belady_block_hit_ratio": best,
                    "gap_closed": gap_closed(ours["block_hit_ratio"], baseline, best),
                }
            )
        section[name] = rows
    return section


def headline_capacities(belady: dict[str, Any]) -> tuple[list[int], str]:
    """The capacities (blocks) whose gap closed is the headline, and the rule that chose them.

    The ones the user asked for, if any; else the largest below the whole working set (where
    nothing is evicted, so every policy ties with Belady and there is no gap).
    """
    requested = list(belady.get("requested_capacity_blocks") or ())
    if requested:
        return requested, HEADLINE_REQUESTED
    capacities = [point["capacity_blocks"] for point in belady["points"]]
    whole = max(capacities)
    below = [capacity for capacity in capacities if capacity < whole]
    return [max(below or capacities)], HEADLINE_LARGEST.format(blocks=whole)
