"""The LRU miss-ratio curve for every capacity in one pass (stack distances).

A request looks up all its blocks before storing any, so a block's distance is the number of
distinct blocks used since its last use, up to the start of the request. With every request's
blocks used tail first (head most recent), a leaf-first prefix LRU holds exactly the top
`capacity` blocks of that stack, so a block hits at capacity C exactly when its distance < C.
This holds for LRU without TTL expiry, pins or admission control.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from cache_service.tools.replay.accesses import Accesses


class _Fenwick:
    """Prefix sums over positions 1..n with point updates."""

    def __init__(self, size: int) -> None:
        self.tree = [0] * (size + 1)

    def add(self, position: int, delta: int) -> None:
        tree = self.tree
        while position < len(tree):
            tree[position] += delta
            position += position & -position

    def prefix(self, position: int) -> int:
        tree = self.tree
        total = 0
        while position > 0:
            total += tree[position]
            position -= position & -position
        return total


@dataclass(frozen=True, slots=True)
class MissRatioCurve:
    """Hit blocks and hit tokens for every capacity (in blocks), from one pass."""

    hit_blocks_below: list[int]  # [c]: blocks with distance < c, i.e. hits at capacity c
    hit_tokens_below: list[int]
    total_blocks: int
    total_tokens: int

    def at(self, capacity_blocks: int) -> tuple[int, int]:
        """(hit blocks, hit tokens) at a capacity."""
        index = min(max(capacity_blocks, 0), len(self.hit_blocks_below) - 1)
        return self.hit_blocks_below[index], self.hit_tokens_below[index]


def lru_curve(accesses: Accesses) -> MissRatioCurve:
    """Stack distances of every block use, folded into hits per capacity."""
    steps = sum(len(blocks) for blocks in accesses.blocks)
    marks = _Fenwick(steps)
    last_use: dict[int, int] = {}
    block_hits = [0] * (accesses.distinct + 2)
    token_hits = [0] * (accesses.distinct + 2)
    clock = 0
    for request, blocks in enumerate(accesses.blocks):
        # Distances as the lookup sees them, before this request touches anything.
        seen_before = marks.prefix(clock)
        distances = sorted(
            seen_before - marks.prefix(last_use[block]) for block in blocks if block in last_use
        )
        previous = 0
        for rank, distance in enumerate(distances, start=1):
            tokens = accesses.token_hits(request, rank)
            block_hits[distance + 1] += 1
            token_hits[distance + 1] += tokens - previous
            previous = tokens
        for block in reversed(blocks):  # tail first: the head ends most recent
            clock += 1
            old = last_use.get(block)
            if old is not None:
                marks.add(old, -1)
            marks.add(clock, 1)
            last_use[block] = clock
    return MissRatioCurve(
        hit_blocks_below=list(accumulate(block_hits)),
        hit_tokens_below=list(accumulate(token_hits)),
        total_blocks=steps,
        total_tokens=sum(accesses.input_lengths),
    )
