"""One engine's own prefix cache, as vLLM's block pool keeps it (vLLM 0.32, the V1 engine, one
KV-cache group of full attention), for replays that put engines in front of the store.

What is modelled, from vllm/v1/core/block_pool.py and single_type_kv_cache_manager.py:
- a pool of `num_blocks` blocks, one of them vLLM's null block, never used;
- a request hits the longest run of its prompt's full-block hashes that is cached, at most
  `prompt_tokens - 1` tokens (the last prompt token is always computed, for its logits);
- its hit blocks leave the free queue while it runs; the rest it needs (prompt and output)
  come from the head of the free queue, and a cached block taken so loses its hash (evicted);
- every full block it computed is cached under its hash: the prompt's own, and blocks that
  hold output tokens under hashes no later prompt repeats (a trace gives no output tokens,
  and an engine's follow-up prompt is rebuilt from the trace, not from what it generated);
- when it ends its blocks are freed tail first: blocks without a hash (a partial last block)
  go to the head of the free queue (reused first), cached ones to the tail in that order, so
  the least recently freed goes first and a prompt's tail before its head.

Requests run one at a time (the real-engine check sends them so); batching and preemption,
which let running requests hold blocks side by side, are not modelled.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from cache_service.core.blocks import BlockKey, Namespace
from cache_service.core.hashing import BlockHasher
from cache_service.core.tokens import TokenBytes

_HASHER = BlockHasher()
_ENGINE = Namespace(model="replay-engine")  # one engine's hashes: only their equality counts


def block_hashes(
    token_bytes: TokenBytes, block_tokens: int, namespace: Namespace = _ENGINE
) -> list[BlockKey]:
    """An engine's chained hashes of a prompt's full blocks: the cache's own chain keys in a
    namespace of the model's, equal only for equal prefixes, as vLLM's are (the values are
    not vLLM's). Prompts in other namespaces (another model, another cache salt) share none."""
    return _HASHER.chain(namespace, token_bytes, block_size=block_tokens).keys


class EngineCacheTooSmall(ValueError):
    """A request needs more blocks than the engine's whole pool holds."""


@dataclass(frozen=True, slots=True)
class EngineServe:
    """What one request met in an engine's cache."""

    hit_blocks: int  # prompt blocks found cached
    computed_blocks: int  # blocks it took from the free queue (prompt rest and output)
    evicted: int  # cached blocks those took over


class EngineCache:
    """A vLLM engine's prefix cache of `num_blocks` blocks of `block_tokens` tokens."""

    def __init__(self, num_blocks: int, block_tokens: int) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (one is vLLM's null block), got {num_blocks}"
            )
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        self.block_tokens = block_tokens
        self.num_blocks = num_blocks
        self._hash: list[Hashable | None] = [None] * num_blocks
        self._refs = [0] * num_blocks
        # Head first: the next block handed out. Block 0 is the null block, never free.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._cached: dict[Hashable, dict[int, None]] = {}
        self._hashed = 0  # blocks that hold a hash
        self._output_ids = itertools.count()

    @property
    def usable_blocks(self) -> int:
        """Blocks a request can use: all but the null block."""
        return self.num_blocks - 1

    def cached_blocks(self) -> int:
        """Blocks that hold a hash (free or not)."""
        return self._hashed

    def longest_hit(self, hashes: Sequence[Hashable], prompt_tokens: int) -> int:
        """How many leading prompt blocks are cached, at most `prompt_tokens - 1` tokens'."""
        limit = min(len(hashes), max(prompt_tokens - 1, 0) // self.block_tokens)
        for index in range(limit):
            if hashes[index] not in self._cached:
                return index
        return limit

    def serve(
        self, hashes: Sequence[Hashable], prompt_tokens: int, output_tokens: int
    ) -> EngineServe:
        """Run one request to its end: hit, allocate, cache what it computed, free.

        `hashes` are the prompt's full blocks' chained hashes (`prompt_tokens //
        block_tokens` of them)."""
        size = self.block_tokens
        if len(hashes) != prompt_tokens // size:
            raise ValueError(
                f"{len(hashes)} hashes for {prompt_tokens} prompt tokens in blocks of {size}"
            )
        total_tokens = prompt_tokens + output_tokens
        needed = -(-total_tokens // size)
        if needed > self.usable_blocks:
            raise EngineCacheTooSmall(
                f"a request of {total_tokens} tokens needs {needed} blocks of {size}; the "
                f"engine has {self.usable_blocks}"
            )
        hit = self.longest_hit(hashes, prompt_tokens)
        blocks = [next(iter(self._cached[hashes[i]])) for i in range(hit)]
        for block in blocks:  # vLLM's touch: a hit block leaves the free queue while in use
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
        evicted = 0
        for _ in range(needed - hit):
            block, _ = self._free.popitem(last=False)
            evicted += self._uncache(block)
            self._refs[block] = 1
            blocks.append(block)
        full = total_tokens // size
        for index in range(hit, full):
            key = hashes[index] if index < len(hashes) else ("output", next(self._output_ids))
            self._hash[blocks[index]] = key
            self._hashed += 1
            self._cached.setdefault(key, {})[blocks[index]] = None
        self._free_tail_first(blocks)
        return EngineServe(hit_blocks=hit, computed_blocks=needed - hit, evicted=evicted)

    def _uncache(self, block: int) -> int:
        """Drop a block's hash as it is reused; 1 if it had one."""
        key = self._hash[block]
        if key is None:
            return 0
        holders = self._cached[key]
        del holders[block]
        if not holders:
            del self._cached[key]
        self._hash[block] = None
        self._hashed -= 1
        return 1

    def _free_tail_first(self, blocks: list[int]) -> None:
        """vLLM's free_blocks(reversed(blocks)): hashless blocks to the head, cached ones to
        the tail, tail blocks first."""
        first: list[int] = []
        last: list[int] = []
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                (first if self._hash[block] is None else last).append(block)
        for block in reversed(first):  # prepend_n keeps the list's order at the head
            self._free[block] = None
            self._free.move_to_end(block, last=False)
        for block in last:
            self._free[block] = None
