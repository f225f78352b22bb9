"""The offline optimum: Belady's MIN with bypass over per-block hits, at given capacities.

No online policy can hit more blocks than this at the same capacity. A request looks up all
its blocks first (a block hits if it is held, prefix or not), then its missing blocks are
offered tail first; a block is admitted only if some held block is needed later than it, and
the one needed last is evicted (ties: the deeper block goes).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from cache_service.tools.replay.accesses import Accesses

NEVER = 1 << 62


def next_uses(accesses: Accesses) -> list[list[int]]:
    """For each block of each request, the index of the next request that uses it."""
    upcoming: dict[int, int] = {}
    out: list[list[int]] = [[] for _ in accesses.blocks]
    for request in range(len(accesses.blocks) - 1, -1, -1):
        blocks = accesses.blocks[request]
        out[request] = [upcoming.get(block, NEVER) for block in blocks]
        for block in blocks:
            upcoming[block] = request
    return out


def belady_hits(
    accesses: Accesses, capacity_blocks: int, upcoming: Sequence[Sequence[int]]
) -> tuple[int, int]:
    """(hit blocks, hit tokens) of the offline optimum at one capacity."""
    held: dict[int, int] = {}  # block -> next use
    depth_of: dict[int, int] = {}
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, block): farthest first
    hit_blocks = hit_tokens = 0
    for request, blocks in enumerate(accesses.blocks):
        nexts = upcoming[request]
        hits = 0
        for depth, (block, nxt) in enumerate(zip(blocks, nexts, strict=True)):
            depth_of[block] = depth
            if block in held:
                hits += 1
                held[block] = nxt
                heapq.heappush(heap, (-nxt, -depth, block))
        hit_blocks += hits
        hit_tokens += accesses.token_hits(request, hits)
        if capacity_blocks <= 0:
            continue
        for depth in range(len(blocks) - 1, -1, -1):
            block, nxt = blocks[depth], nexts[depth]
            if block in held:
                continue
            if len(held) < capacity_blocks:
                held[block] = nxt
                heapq.heappush(heap, (-nxt, -depth, block))
                continue
            while True:  # the valid entry needed farthest in the future
                far_next, far_depth, victim = heap[0]
                if held.get(victim) == -far_next and depth_of[victim] == -far_depth:
                    break
                heapq.heappop(heap)
            if (nxt, depth) >= (-far_next, -far_depth):
                continue  # bypass: the newcomer is needed last of all
            heapq.heappop(heap)
            del held[victim]
            held[block] = nxt
            heapq.heappush(heap, (-nxt, -depth, block))
    return hit_blocks, hit_tokens
