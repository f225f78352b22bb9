"""SGLang's page hash, as its radix cache publishes it in KV events.

Checked against sgl-project/sglang python/sglang/srt/mem_cache/radix_cache.py
(`compute_node_hash_values`, `_record_store_event`; stored snapshot at commit
006b0e3d317f1cd4a7300e919a4eaa878b1947e7) and `get_hash_str` / `hash_str_to_int64` (in
mem_cache/hicache_storage.py there, later mem_cache/utils.py; the native C++ `get_hash`
that replaced the Python loop hashes the same bytes). Mooncake's conductor indexes SGLang
events with the same definition (strategy "sglang", algorithm "sha256_raw", projection
"first64_be"). Golden vectors in tests/engines/golden_vectors.py.

    page[0]   = SHA-256(tokens[0:P] as u32 little-endian each)
    page[i]   = SHA-256(page[i-1] (all 32 raw bytes) || tokens[iP:(i+1)P] as u32 LE)
    published = the digest's FIRST 8 bytes big-endian as a signed int64 (hash_str_to_int64
                of the hex digest's first 16 characters); parent_block_hash likewise, None
                for a page whose node hangs off the root.

P is SGLang's --page-size (default 1: one event per token). Only the tokens are hashed:
SGLang keeps LoRA and cache-salt namespaces apart in its radix tree (RadixKey.extra_key)
but not in the hash, so identical prompts in two namespaces publish the same hashes; the
chain has no seed. Older SGLang releases published Python's hash(tuple(page_tokens)), not
chained; that form is not implemented here. EAGLE's bigram keys are not supported.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from cache_service.core.engines.schemes.scheme import (
    ChainState,
    EngineHashScheme,
    ExtraKeys,
    PublishedHash,
)
from cache_service.core.tokens import tokens_to_bytes

NAME = "sglang"
DIGEST_SIZE = 32
_INT64_WRAP = 1 << 64
_INT64_MAX = (1 << 63) - 1


def _step(parent: ChainState | None, tokens: Sequence[int], extra: ExtraKeys) -> ChainState:
    if parent is not None and not isinstance(parent, bytes):
        raise TypeError("an sglang parent is its 32-byte SHA-256 digest")
    hasher = hashlib.sha256()
    if parent:  # SGLang: `if prior_hash:`, so the root child has no prefix
        hasher.update(parent)
    hasher.update(tokens_to_bytes(tokens))
    return hasher.digest()


def _publish(state: ChainState) -> PublishedHash:
    if not isinstance(state, bytes):
        raise TypeError("an sglang chain state is its 32-byte SHA-256 digest")
    value = int.from_bytes(state[:8], "big")
    return value - _INT64_WRAP if value > _INT64_MAX else value


def _recover(published: PublishedHash) -> ChainState | None:
    return None  # 64 of 256 bits: a later page cannot be hashed from it


def sglang_scheme() -> EngineHashScheme:
    """SGLang's chained SHA-256 page hash (seedless)."""
    return EngineHashScheme(
        name=NAME,
        seed=None,
        root=None,
        step=_step,
        publish=_publish,
        recover=_recover,
    )
