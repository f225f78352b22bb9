"""A brute-force replay oracle for tests: shares no code with `cache_service` on purpose.

Requests are plain dicts, as a JSONL trace line reads once its timestamp is in seconds:
`timestamp`, `hash_ids`, `input_length`, `block_tokens`, and optionally `output_length`,
`retention` and `tenant`. A block is named by its tenant and the hash ids from the head of
the prompt up to it, so equal names mean equal content after equal prefixes.

Everything here is plain lists, dicts and linear scans, so that it is obviously right:
the replay's own code is fast and clever, and this is what it is checked against.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

NEVER = float("inf")
Request = Mapping[str, Any]
BlockName = tuple[str, tuple[int, ...]]


@dataclass(frozen=True)
class RequestHits:
    """What the cache gave one request."""

    hit_blocks: int
    hit_tokens: int


@dataclass(frozen=True)
class Totals:
    """Hit figures summed over requests."""

    hit_blocks: int
    hit_tokens: int
    requests_with_hit: int


def block_names(request: Request) -> list[BlockName]:
    """The request's blocks, head first: (tenant, the ids of the prefix up to the block)."""
    tenant = request.get("tenant") or ""
    ids = tuple(request["hash_ids"])
    return [(tenant, ids[: depth + 1]) for depth in range(len(ids))]


def token_hits(request: Request, hit_blocks: int) -> int:
    """Hit tokens as the trace counts them: never more than its input_length."""
    return min(hit_blocks * request["block_tokens"], request["input_length"])


def replay_order(requests: Sequence[Request]) -> list[Request]:
    """By timestamp; equal timestamps keep the order they were given in."""
    return sorted(requests, key=lambda request: request["timestamp"])


def totals(hits: Sequence[RequestHits]) -> Totals:
    """Sum per-request hits."""
    return Totals(
        hit_blocks=sum(h.hit_blocks for h in hits),
        hit_tokens=sum(h.hit_tokens for h in hits),
        requests_with_hit=sum(1 for h in hits if h.hit_blocks > 0),
    )


def replay_prefix_cache(
    requests: Sequence[Request],
    *,
    capacity_blocks: int | None,
    ttl_seconds: Mapping[str, float],
    default_retention: str = "chat",
) -> list[RequestHits]:
    """The prefix cache of the issue, simulated block by block (requests in replay order).

    Per request: look up (the longest prefix of blocks that are held and alive: now <
    expires_at, the largest use time + TTL of that use's class over the block's uses since
    it was stored); store the blocks that missed (only the first `capacity_blocks` of the
    request when it is larger than the cache); mark every kept block of the request used, tail
    first, so the head is the most recent; then evict down to exactly `capacity_blocks`: a
    block with no held child, expired ones first, else the least recently used.
    """
    expires_at: dict[BlockName, float] = {}  # every held block, alive or expired
    last_use: dict[BlockName, int] = {}  # a counter: larger is more recent
    uses = 0
    out: list[RequestHits] = []
    for request in requests:
        now = float(request["timestamp"])
        ttl = ttl_seconds[request.get("retention") or default_retention]
        names = block_names(request)

        hits = 0
        for name in names:
            if name in expires_at and now < expires_at[name]:
                hits += 1
            else:
                break

        kept = names if capacity_blocks is None else names[:capacity_blocks]
        for name in kept:
            if name not in expires_at:
                expires_at[name] = -NEVER  # stored now; the use below gives its expiry
        for name in reversed(kept):  # tail first: the head ends most recent
            uses += 1
            last_use[name] = uses
            expires_at[name] = max(expires_at[name], now + ttl)

        if capacity_blocks is not None:
            while len(expires_at) > capacity_blocks:
                victim = _eviction_victim(expires_at, last_use, now)
                del expires_at[victim]
                del last_use[victim]

        out.append(RequestHits(hit_blocks=hits, hit_tokens=token_hits(request, hits)))
    return out


def _has_held_child(name: BlockName, held: Mapping[BlockName, float]) -> bool:
    tenant, ids = name
    return any(
        other_tenant == tenant and len(other) == len(ids) + 1 and other[:-1] == ids
        for other_tenant, other in held
    )


def _eviction_victim(
    expires_at: Mapping[BlockName, float], last_use: Mapping[BlockName, int], now: float
) -> BlockName:
    leaves = [name for name in expires_at if not _has_held_child(name, expires_at)]
    expired = [name for name in leaves if expires_at[name] <= now]
    if expired:
        return min(expired, key=lambda name: expires_at[name])
    return min(leaves, key=lambda name: last_use[name])


def replay_block_lru(requests: Sequence[Request], *, capacity_blocks: int) -> list[RequestHits]:
    """Plain per-block LRU that knows nothing of prefixes, no TTLs (requests in replay order).

    A request looks up all of its blocks first (every held block is a hit, wherever it sits),
    then uses them all, tail first, so its head ends on top of the stack.
    """
    stack: list[BlockName] = []  # most recent first, never longer than the capacity
    out: list[RequestHits] = []
    for request in requests:
        names = block_names(request)
        hits = sum(1 for name in names if name in stack)
        for name in reversed(names):
            if name in stack:
                stack.remove(name)
            stack.insert(0, name)
        del stack[max(capacity_blocks, 0) :]
        out.append(RequestHits(hit_blocks=hits, hit_tokens=token_hits(request, hits)))
    return out


def replay_belady(requests: Sequence[Request], *, capacity_blocks: int) -> list[RequestHits]:
    """Belady's MIN with bypass over per-block hits, by looking ahead (requests in replay order).

    A request looks up all its blocks (a held block is a hit, prefix or not); then its missing
    blocks are offered tail first: while the cache has room a block goes in; once full, the
    held block needed farthest in the future (never counts as farthest; ties: the deeper block)
    is evicted for the newcomer, unless the newcomer itself is needed no sooner (then it is not
    stored).
    """
    names_of = [block_names(request) for request in requests]

    def next_use(name: BlockName, after: int) -> float:
        for later in range(after + 1, len(names_of)):
            if name in names_of[later]:
                return later
        return NEVER

    def rank(name: BlockName, now: int) -> tuple[float, int]:
        return (next_use(name, now), len(name[1]))  # farther first, then deeper first

    held: list[BlockName] = []
    out: list[RequestHits] = []
    for index, (request, names) in enumerate(zip(requests, names_of, strict=True)):
        hits = sum(1 for name in names if name in held)
        out.append(RequestHits(hit_blocks=hits, hit_tokens=token_hits(request, hits)))
        if capacity_blocks <= 0:
            continue
        for name in reversed(names):
            if name in held:
                continue
            if len(held) < capacity_blocks:
                held.append(name)
                continue
            victim = max(held, key=lambda other: rank(other, index))
            if rank(name, index) >= rank(victim, index):
                continue  # bypass: the newcomer is needed last of all
            held.remove(victim)
            held.append(name)
    return out
