"""How a trace's blocks map onto the cache's: synthesized tokens, namespaces, block units."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from cache_service.core.blocks import Namespace
from cache_service.core.tokens import TokenBytes, tokens_in
from cache_service.tools.replay.traces import TraceRequest

DEFAULT_TOKEN_BLOCK_SIZE = 64
_TAIL_CACHE: dict[int, bytes] = {}


def _tail(block_tokens: int) -> bytes:
    """The fixed tokens after a block's two id tokens (0, 1, 2, ... as uint32 LE)."""
    tail = _TAIL_CACHE.get(block_tokens)
    if tail is None:
        tail = struct.pack(f"<{max(block_tokens - 2, 0)}I", *range(max(block_tokens - 2, 0)))
        _TAIL_CACHE[block_tokens] = tail
    return tail


@lru_cache(maxsize=65536)
def hash_id_block(hash_id: int, block_tokens: int) -> bytes:
    """The synthesized uint32 LE tokens of one trace block: distinct ids give distinct blocks.

    Tokens 0 and 1 hold the id's low and high 32 bits, the rest are a fixed ramp, so any id
    up to 2^64-1 is one full block of `block_tokens` tokens.
    """
    if block_tokens == 1:
        if hash_id > 0xFFFFFFFF:
            raise ValueError(f"hash id {hash_id} needs blocks of at least 2 tokens")
        return struct.pack("<I", hash_id)
    return struct.pack("<II", hash_id & 0xFFFFFFFF, hash_id >> 32) + _tail(block_tokens)


def request_tokens(request: TraceRequest) -> TokenBytes:
    """The request's prompt as uint32 LE tokens (synthesized for a hash-id trace)."""
    if request.tokens is not None:
        return request.tokens
    assert request.hash_ids is not None
    return TokenBytes(b"".join(hash_id_block(i, request.block_tokens) for i in request.hash_ids))


def request_namespace(request: TraceRequest) -> Namespace:
    """Hash ids mean something only within their file: each file gets its own layout."""
    layout = f"trace-ids:{request.source}" if request.hash_ids is not None else ""
    return Namespace(
        model=request.model, kv_layout=layout, tenant=request.tenant, salt=request.salt
    )


@dataclass(frozen=True, slots=True)
class BlockUnits:
    """The replay's block arithmetic: trace blocks of `trace_tokens`, cache blocks of
    `cache_tokens`; a trace block is `trace_tokens // cache_tokens` cache blocks."""

    trace_tokens: int
    cache_tokens: int

    @property
    def ratio(self) -> int:
        """Cache blocks per trace block."""
        return self.trace_tokens // self.cache_tokens

    def trace_blocks(self, request: TraceRequest) -> int:
        """The request's cacheable blocks in trace units."""
        if request.hash_ids is not None:
            return len(request.hash_ids)
        assert request.tokens is not None
        return tokens_in(request.tokens) // self.trace_tokens

    def hit_tokens(self, request: TraceRequest, hit_trace_blocks: int) -> int:
        """Hit tokens as the trace counts them: never more than its input_length."""
        return min(hit_trace_blocks * self.trace_tokens, request.input_length)


def plan_units(requests: Sequence[TraceRequest], block_size: int | None) -> BlockUnits:
    """One block unit for the whole replay; ValueError when the traces disagree."""
    sizes = {r.block_tokens for r in requests if r.hash_ids is not None}
    has_tokens = any(r.tokens is not None for r in requests)
    if len(sizes) > 1:
        raise ValueError(f"the traces mix block sizes {sorted(sizes)}: replay them separately")
    if sizes:
        trace_tokens = sizes.pop()
        cache_tokens = block_size or trace_tokens
        if trace_tokens % cache_tokens:
            raise ValueError(
                f"--block-size {cache_tokens} does not divide the trace's "
                f"{trace_tokens}-token blocks"
            )
        if has_tokens and cache_tokens != trace_tokens:
            raise ValueError(
                "a trace with both tokens and hash ids needs --block-size equal to its block_tokens"
            )
        return BlockUnits(trace_tokens=trace_tokens, cache_tokens=cache_tokens)
    size = block_size or DEFAULT_TOKEN_BLOCK_SIZE
    return BlockUnits(trace_tokens=size, cache_tokens=size)
