"""Capacity curves for a replay: LRU at every capacity, and the offline optimum at a few."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cache_service.tools.replay.accesses import Accesses
from cache_service.tools.replay.belady import belady_hits, next_uses
from cache_service.tools.replay.mrc import MissRatioCurve, lru_curve

CURVE_POINTS = 48  # log-spaced capacities in the report (the curve itself is exact everywhere)
BELADY_FRACTIONS = (1 / 1024, 1 / 256, 1 / 64, 1 / 16, 1 / 4, 1)  # of the distinct blocks
# Round capacities (tokens) always reported, so runs of different traces line up.
ROUND_CAPACITY_TOKENS = (10**5, 3 * 10**5, 10**6, 3 * 10**6, 10**7, 3 * 10**7, 10**8)


@dataclass(frozen=True, slots=True)
class CurvePlan:
    """What to compute: extra capacities (tokens), bytes per token, and how LRU is measured."""

    extra_capacity_tokens: Sequence[int]
    kv_bytes_per_token: int
    stack_distance: bool  # False: TTLs or another policy matter, so replay once per capacity


def capacity_points(distinct: int, extra_blocks: Sequence[int]) -> list[int]:
    """Log-spaced capacities from 1 block to every distinct block, plus the extra ones."""
    points = {max(distinct, 1)}
    for step in range(CURVE_POINTS):
        points.add(max(1, round(distinct ** (step / (CURVE_POINTS - 1)))))
    points.update(block for block in extra_blocks if block > 0)
    return sorted(points)


@dataclass(frozen=True, slots=True)
class Scale:
    """What turns hit counts at a capacity into a report point."""

    block_tokens: int
    total_blocks: int
    total_tokens: int
    kv_bytes_per_token: int

    @classmethod
    def of(cls, accesses: Accesses, kv_bytes_per_token: int) -> Scale:
        """The scale of a replay's accesses."""
        return cls(
            block_tokens=accesses.block_tokens,
            total_blocks=sum(len(blocks) for blocks in accesses.blocks),
            total_tokens=sum(accesses.input_lengths),
            kv_bytes_per_token=kv_bytes_per_token,
        )

    def point(self, capacity_blocks: int, hits: tuple[int, int]) -> dict[str, Any]:
        """The report point of a capacity and its (hit blocks, hit tokens) there."""
        tokens = capacity_blocks * self.block_tokens
        return {
            "capacity_blocks": capacity_blocks,
            "capacity_tokens": tokens,
            "capacity_bytes": tokens * self.kv_bytes_per_token,
            "block_hit_ratio": round(hits[0] / self.total_blocks, 6) if self.total_blocks else 0.0,
            "token_hit_ratio": round(hits[1] / self.total_tokens, 6) if self.total_tokens else 0.0,
        }


def belady_capacities(accesses: Accesses, extra_capacity_tokens: Sequence[int]) -> list[int]:
    """The capacities (blocks) every replayed curve and Belady are measured at: shares of the
    distinct blocks, round token counts below the whole working set, and the extra ones."""
    whole = accesses.distinct * accesses.block_tokens
    rounds = [tokens for tokens in ROUND_CAPACITY_TOKENS if tokens < whole]
    extra = [tokens // accesses.block_tokens for tokens in (*extra_capacity_tokens, *rounds)]
    return sorted(
        {max(1, int(accesses.distinct * f)) for f in BELADY_FRACTIONS} | {b for b in extra if b > 0}
    )


def belady_section(accesses: Accesses, plan: CurvePlan) -> dict[str, Any]:
    """The report's `belady` section: the offline optimum at `belady_capacities`."""
    scale = Scale.of(accesses, plan.kv_bytes_per_token)
    upcoming = next_uses(accesses)
    requested = [tokens // accesses.block_tokens for tokens in plan.extra_capacity_tokens]
    return {
        "method": "belady-min-with-bypass, per-block hits",
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "points": [
            scale.point(c, belady_hits(accesses, c, upcoming))
            for c in belady_capacities(accesses, plan.extra_capacity_tokens)
        ],
        # The capacities the user asked for (--capacities, --capacity-tokens): always summarised.
        "requested_capacity_blocks": sorted({b for b in requested if b > 0}),
    }


def curve_section(
    accesses: Accesses,
    plan: CurvePlan,
    replay_at: Callable[[int], tuple[int, int]] | None = None,
    lru: MissRatioCurve | None = None,
) -> dict[str, Any]:
    """A policy's capacity curve (the report's `mrc` or `lru` section).

    With `plan.stack_distance`, LRU's exact curve at log-spaced capacities (`lru` if the
    caller already has it, else computed here); otherwise `replay_at(capacity_tokens) -> (hit
    blocks, hit tokens)`, one replay at each of `belady_capacities`.
    """
    scale = Scale.of(accesses, plan.kv_bytes_per_token)
    capacities = belady_capacities(accesses, plan.extra_capacity_tokens)
    section: dict[str, Any] = {"kv_bytes_per_token": plan.kv_bytes_per_token}
    if plan.stack_distance:
        curve = lru if lru is not None else lru_curve(accesses)
        section["method"] = "lru-stack-distance"
        section["points"] = [
            scale.point(c, curve.at(c)) for c in capacity_points(accesses.distinct, capacities)
        ]
    else:
        assert replay_at is not None
        section["method"] = "replay-per-capacity"
        section["points"] = [
            scale.point(c, replay_at(c * accesses.block_tokens)) for c in capacities
        ]
    return section


def capacity_for_share(mrc: dict[str, Any], ceiling_ratio: float, share: float) -> int | None:
    """The smallest listed capacity (tokens) whose token hit ratio reaches share x ceiling."""
    for point in mrc["points"]:
        if point["token_hit_ratio"] >= share * ceiling_ratio:
            return int(point["capacity_tokens"])
    return None
