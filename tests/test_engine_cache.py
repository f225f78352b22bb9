"""The engine-cache model against vLLM's block-pool rules (tools/replay/engine_cache.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service.core.blocks import BlockKey
from cache_service.core.tokens import tokens_to_bytes
from cache_service.tools.replay.engine_cache import (
    EngineCache,
    EngineCacheTooSmall,
    block_hashes,
)

BLOCK = 4


def prompt(*labels: int) -> list[BlockKey]:
    """Chained hashes of a prompt made of blocks labelled `labels` (equal prefixes, equal
    hashes)."""
    return block_hashes(tokens_to_bytes([label for label in labels for _ in range(BLOCK)]), BLOCK)


def serve(cache: EngineCache, hashes: list[BlockKey], *, extra: int = 1, output: int = 0) -> int:
    """Serve a prompt of the hashes' blocks plus `extra` tokens; its hit blocks."""
    return cache.serve(hashes, len(hashes) * BLOCK + extra, output).hit_blocks


def test_hashes_chain_so_a_block_depends_on_everything_before_it() -> None:
    assert prompt(1, 2)[1] != prompt(3, 2)[1]
    assert prompt(1, 2, 3)[:2] == prompt(1, 2, 4)[:2]
    assert len(block_hashes(tokens_to_bytes([0] * (BLOCK * 3 - 1)), BLOCK)) == 2  # full only


def test_a_freed_prompt_is_hit_again_but_never_its_last_token() -> None:
    cache = EngineCache(num_blocks=32, block_tokens=BLOCK)
    hashes = prompt(1, 2, 3)
    assert serve(cache, hashes) == 0
    assert serve(cache, hashes) == 3  # 13 tokens: 12 hit, the 13th computed
    # A prompt that ends on a block boundary recomputes its last token, so its last block.
    assert serve(cache, hashes, extra=0) == 2


def test_the_least_recently_freed_block_goes_first_and_a_prompt_tail_before_its_head() -> None:
    cache = EngineCache(num_blocks=7, block_tokens=BLOCK)  # 6 usable
    a, b = prompt(1, 2, 3), prompt(4, 5)
    serve(cache, a, extra=0)  # 3 blocks, all cached
    serve(cache, b, extra=0)  # 2 more: 1 never-used block left
    # 2 blocks wanted: the never-used one, then the least recently freed: a's tail (block 3).
    serve(cache, prompt(6, 7), extra=0)
    assert cache.longest_hit(a, 13) == 2
    assert cache.longest_hit(b, 9) == 2


def test_a_hit_refreshes_its_blocks_to_the_tail() -> None:
    cache = EngineCache(num_blocks=5, block_tokens=BLOCK)  # 4 usable
    a, b = prompt(1, 2), prompt(3, 4)
    serve(cache, a, extra=0)
    serve(cache, b, extra=0)  # a is now the least recently freed
    assert serve(cache, a, extra=0) == 1  # its last block recomputed; both freed after b's
    serve(cache, prompt(5, 6), extra=0)  # 2 blocks: b's, not a's
    assert cache.longest_hit(a, 9) == 2
    assert cache.longest_hit(b, 9) == 0


def test_a_block_holding_output_tokens_is_cached_but_never_hit_by_a_later_prompt() -> None:
    cache = EngineCache(num_blocks=32, block_tokens=BLOCK)
    hashes = prompt(1, 2)
    result = cache.serve(hashes, 2 * BLOCK, 2 * BLOCK)  # 8 prompt tokens, 8 output: 4 blocks
    assert (result.hit_blocks, result.computed_blocks) == (0, 4)
    assert cache.cached_blocks() == 4
    assert serve(cache, prompt(1, 2, 9)) == 2


def test_a_request_larger_than_the_pool_is_refused_naming_both_sizes() -> None:
    cache = EngineCache(num_blocks=4, block_tokens=BLOCK)
    with pytest.raises(EngineCacheTooSmall, match="needs 4 blocks of 4; the engine has 3"):
        cache.serve(prompt(1, 2, 3), 3 * BLOCK, 4)


def test_hashes_must_be_the_prompts_full_blocks() -> None:
    cache = EngineCache(num_blocks=8, block_tokens=BLOCK)
    with pytest.raises(ValueError, match="2 hashes for 13 prompt tokens"):
        cache.serve(prompt(1, 2), 13, 0)


requests = st.lists(
    st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=6), st.integers(0, 9)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(requests=requests, num_blocks=st.integers(8, 40))
def test_hits_are_a_seen_prefix_and_an_unbounded_pool_hits_every_seen_prefix(
    requests: list[tuple[list[int], int]], num_blocks: int
) -> None:
    """A bounded engine never hits more than the prefix seen before (the ceiling); a pool
    larger than the whole trace hits exactly that (capped at prompt_tokens - 1)."""
    bounded = EngineCache(num_blocks=num_blocks, block_tokens=BLOCK)
    unbounded = EngineCache(num_blocks=10_000, block_tokens=BLOCK)
    seen: set[BlockKey] = set()
    for labels, output in requests:
        hashes = prompt(*labels)
        tokens = len(hashes) * BLOCK + 1
        ceiling = next((i for i, h in enumerate(hashes) if h not in seen), len(hashes))
        if -(-(tokens + output) // BLOCK) <= bounded.usable_blocks:
            assert bounded.serve(hashes, tokens, output).hit_blocks <= ceiling
        assert unbounded.serve(hashes, tokens, output).hit_blocks == ceiling
        seen.update(hashes)
