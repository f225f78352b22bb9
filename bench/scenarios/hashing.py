"""Block keys for 128k tokens: ours against a bare chained xxh3-128 loop and one xxh3 call."""

from __future__ import annotations

import xxhash

from bench.peers.harness import time_calls
from bench.report import Row, compare, latency_row
from bench.scenarios.context import Context
from cache_service.core.blocks import Namespace
from cache_service.core.hashing import BlockHasher
from cache_service.core.tokens import tokens_to_bytes

TOKENS = 131072
BLOCK = 64


def run(ctx: Context) -> list[Row]:
    """Three timings of the same 512 KiB of tokens."""
    token_bytes = tokens_to_bytes(range(TOKENS))
    stride = BLOCK * 4
    hasher = BlockHasher()
    namespace = Namespace("bench")

    def floor() -> bytes:
        parent = b"\0" * 16
        view = memoryview(token_bytes)
        for offset in range(0, len(token_bytes), stride):
            parent = xxhash.xxh3_128_digest(parent + view[offset : offset + stride])
        return parent

    reps = ctx.reps(200, 2000)
    case = f"128k tokens, {BLOCK}-token blocks"

    def ours_chain() -> object:
        return hasher.chain(namespace, token_bytes, block_size=BLOCK)

    ours = latency_row(
        "hashing", case, "ours: BlockHasher.chain", "in-process",
        time_calls(ours_chain, repetitions=reps),
    )  # fmt: skip
    bare = latency_row(
        "hashing", case, "floor: chained xxh3 loop", "in-process",
        time_calls(floor, repetitions=reps),
    )  # fmt: skip
    once = latency_row(
        "hashing", "128k tokens, one call", "xxh3-128 of all bytes", "in-process",
        time_calls(lambda: xxhash.xxh3_128_digest(token_bytes), repetitions=reps),
    )  # fmt: skip
    compare(ours, bare)
    ours.note = "target: within 1.3x of the floor and under 0.5 ms"
    return [ours, bare, once]
