"""A prompt's engine block hashes, walked segment by segment: memoized, and stopped where no
engine can match.

Hashing dominates a routing score (vLLM's sha256 pickles and SHA-256s every 16-token block:
2,048 of them for a 32k prompt), so `prompt_chain` avoids it two ways:

- **A memo of chain segments.** The prompt is cut into segments of `segment_blocks` full
  blocks. A running XXH3-128 over the prompt's token bytes (u32 little-endian) gives, at
  each segment's end, a 128-bit digest of the whole prefix; keyed with the scheme context
  (scheme name, seed, block size and, when the scheme hashes them, its extra-keys form, the
  LoRA name and adapter path and the cache salt) and the prefix's block count, it names the
  segment's blocks' hashes and the chain state of its last block. The chain state depends
  on exactly those inputs, so a hit is the same answer hashing would give (a 2**-128 digest
  collision would make one score wrong, never a payload: scores only order candidates). A
  repeated prompt costs one pass of XXH3 and a dict look-up per segment; a prompt
  extending an earlier one hashes only past the last shared segment. A memo is bounded by
  the blocks it holds, least recently used dropped first; one lock makes it safe to share
  between the threadpool's routes.
- **Stopping early.** Before hashing each segment, the last block so far is checked with
  `held_prefix` (whether any engine holds it, at all): no engine's prefix can reach past a
  block nobody holds, so the chain is cut before it and the rest of the prompt is never
  hashed. Cutting only shortens what is compared, never a count. One probe per segment,
  not per block: probing all 2,048 blocks of a full hit in an index of a million blocks
  cost 0.2 ms of cache misses; the price is hashing up to a segment past the held prefix.

A scheme's (name, seed, extra-keys form) is taken to determine it, as `scheme_named` builds
them. Ingestion
fills the memo too (memo_feed.py): the segments of prompts an engine stored, keyed the same.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import xxhash

from cache_service.core.engines.block_hashes import EngineBlockHash, normalize_block_hash
from cache_service.core.engines.schemes import EngineHashScheme
from cache_service.core.engines.schemes.scheme import ChainState
from cache_service.core.tokens import TokenBytes, bytes_of_tokens, tokens_to_bytes

DEFAULT_MAX_BLOCKS = 200_000
DEFAULT_SEGMENT_BLOCKS = 16
HeldPrefix = Callable[[Sequence[EngineBlockHash]], int]
MemoKey = tuple[tuple[object, ...], int, int]  # (scheme context, blocks in prefix, digest)


@dataclass(frozen=True, slots=True)
class Segment:
    """A memoized segment: its blocks' hashes (64-bit form) and its last block's state."""

    hashes: array[int]  # typecode "Q"
    state: ChainState


class ChainMemo:
    """Prefix digest -> segment of engine block hashes, LRU-bounded by blocks held."""

    def __init__(
        self,
        *,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        segment_blocks: int = DEFAULT_SEGMENT_BLOCKS,
    ) -> None:
        if max_blocks < 1 or segment_blocks < 1:
            raise ValueError("max_blocks and segment_blocks must be at least 1")
        self.max_blocks = max_blocks
        self.segment_blocks = segment_blocks
        self.hits = 0
        self.misses = 0
        self._blocks = 0
        self._segments: OrderedDict[MemoKey, Segment] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._segments)

    @property
    def blocks(self) -> int:
        """How many blocks' hashes the memo holds."""
        return self._blocks

    def get(self, key: MemoKey) -> Segment | None:
        """The segment memoized under `key` (now the most recently used), or None."""
        with self._lock:
            segment = self._segments.get(key)
            if segment is None:
                self.misses += 1
                return None
            self._segments.move_to_end(key)
            self.hits += 1
            return segment

    def put(self, key: MemoKey, segment: Segment) -> None:
        """Memoize a segment, dropping the least recently used past the bound."""
        with self._lock:
            old = self._segments.pop(key, None)
            if old is not None:
                self._blocks -= len(old.hashes)
            self._segments[key] = segment
            self._blocks += len(segment.hashes)
            while self._blocks > self.max_blocks and self._segments:
                _, dropped = self._segments.popitem(last=False)
                self._blocks -= len(dropped.hashes)

    def stats(self) -> dict[str, int]:
        """Segments and blocks held, and look-ups that hit or missed (a consistent snapshot)."""
        with self._lock:
            return {
                "segments": len(self._segments),
                "blocks": self._blocks,
                "hits": self.hits,
                "misses": self.misses,
            }

    def copy(self) -> ChainMemo:
        """An independent memo holding the same segments in the same order (no counts)."""
        other = ChainMemo(max_blocks=self.max_blocks, segment_blocks=self.segment_blocks)
        with self._lock:
            other._segments = self._segments.copy()
            other._blocks = self._blocks
        return other

    def clear(self) -> None:
        """Forget every segment."""
        with self._lock:
            self._segments.clear()
            self._blocks = 0


def scheme_context(
    scheme: EngineHashScheme,
    block_size: int,
    lora_name: str | None,
    lora_path: str | None,
    cache_salt: str | None,
) -> tuple[object, ...]:
    """What besides the tokens a chain depends on (the extra keys' form, LoRA and salt only
    if the scheme hashes them, so SGLang's and Dynamo's chains are shared across
    namespaces). `context_extras` reads (LoRA name, path, salt) back."""
    if scheme.covers_extra_keys:
        return (
            scheme.name,
            scheme.seed,
            block_size,
            scheme.extra_keys_form,
            lora_name,
            lora_path,
            cache_salt,
        )
    return (scheme.name, scheme.seed, block_size)


def context_extras(context: tuple[object, ...]) -> tuple[str | None, str | None, str | None]:
    """The (LoRA name, LoRA path, cache salt) a `scheme_context` was made with."""
    if len(context) < 7:
        return None, None, None
    name, path, salt = (value if isinstance(value, str) else None for value in context[4:7])
    return name, path, salt


def prompt_chain(
    scheme: EngineHashScheme,
    tokens: Sequence[int],
    *,
    block_size: int,
    lora_name: str | None = None,
    lora_path: str | None = None,
    cache_salt: str | None = None,
    memo: ChainMemo | None = None,
    held_prefix: HeldPrefix | None = None,
    segment_blocks: int = DEFAULT_SEGMENT_BLOCKS,
    token_bytes: TokenBytes | None = None,
) -> list[EngineBlockHash]:
    """The prompt's block hashes in 64-bit form, as `scheme.normalized` gives them, but cut
    at the first block `held_prefix` says nobody holds (when given) and reusing `memo`.
    `token_bytes`, the prompt's `tokens_to_bytes` when the caller has it, saves encoding the
    prompt again for each scheme."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    full = len(tokens) // block_size
    stride = bytes_of_tokens(block_size)
    per_segment = memo.segment_blocks if memo is not None else segment_blocks
    prefix: memoryview | None = None
    if memo is not None:
        try:
            data = tokens_to_bytes(tokens) if token_bytes is None else token_bytes
            prefix = memoryview(data)
        except ValueError:  # an id outside u32 has no byte form: hash without the memo
            memo = None
    context = scheme_context(scheme, block_size, lora_name, lora_path, cache_salt)
    running = xxhash.xxh3_128()
    # Bound once: a per-block attribute look-up is measurable at 2,048 blocks.
    step, root, rule, publish = scheme.step, scheme.root, scheme.extra_keys_rule, scheme.publish
    out: list[int] = []  # EngineBlockHash values; a memo hit extends it from an array
    state: ChainState | None = None
    start = 0
    while start < full:
        end = min(start + per_segment, full)
        key: MemoKey | None = None
        if memo is not None and prefix is not None:
            running.update(prefix[start * stride : end * stride])
            key = (context, end, running.intdigest())
            hit = memo.get(key)
            if hit is not None:
                out.extend(hit.hashes)
                state = hit.state
                start = end
                continue
        # About to hash: is the last block so far held by anyone?
        if (
            held_prefix is not None
            and out
            and not held_prefix(cast("list[EngineBlockHash]", out[-1:]))
        ):
            del out[-1]
            return cast("list[EngineBlockHash]", out)
        hashes: list[EngineBlockHash] = []
        for index in range(start, end):
            block = tokens[index * block_size : (index + 1) * block_size]
            # `scheme.extend` and `scheme.normal_form`, inlined
            state = step(
                root if state is None else state,
                block,
                rule(index, lora_name, lora_path, cache_salt),
            )
            hashes.append(normalize_block_hash(publish(state)))
        assert state is not None
        if memo is not None and key is not None:
            memo.put(key, Segment(array("Q", hashes), state))
        out += hashes
        start = end
    return cast("list[EngineBlockHash]", out)
