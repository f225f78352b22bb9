"""The XXH3-64 chain with seed 1337 of Dynamo's KV router (its sequence block hash).

Checked against ai-dynamo/dynamo: docs "KV Events & Hashing Consistency" (xxh3-64, seed
1337, tokens as u32 little-endian; known answer: tokens [1, 2, 3, 4] with block size 4
-> 14643705804678351452) and the kv router's `compute_block_hash_for_seq` and
`compute_seq_hash_for_block` / `compute_next_sequence_hash` (lib/llm/src/kv_router and
lib/kv-router in the stored snapshots). Golden vectors in tests/engines/golden_vectors.py.

    local[i]  = XXH3-64(tokens[iB:(i+1)B] as u32 little-endian each, seed=1337)
    seq[0]    = local[0]
    seq[i]    = XXH3-64(u64_le(seq[i-1]) || u64_le(local[i]), seed=1337)
    published = seq[i], an unsigned 64-bit integer (so the published hash is also the
                chain state: any event's parent can be extended)

Dynamo adds the sorted multimodal hashes (u64 LE each) after a block's tokens; that is not
implemented here, nor is any LoRA or salt (Dynamo's local hash covers tokens only).
Mooncake's conductor does not use this chain: its prefix index speaks vLLM's sha256 /
sha256_cbor and SGLang's scheme (and, earlier, XXH64 with seed 0 over the parent and
tokens), so "xxh3-64-1337" names Dynamo's router and publishers that hash like it.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

from cache_service.core.engines.schemes.scheme import (
    ChainState,
    EngineHashScheme,
    ExtraKeys,
    PublishedHash,
)
from cache_service.core.tokens import tokens_to_bytes

NAME = "xxh3-64-1337"
SEED = 1337
_U64_MAX = (1 << 64) - 1


def local_block_hash(tokens: Sequence[int]) -> int:
    """Dynamo's LocalBlockHash: the block's tokens alone, position-independent."""
    return int(xxhash.xxh3_64_intdigest(tokens_to_bytes(tokens), seed=SEED))


def _step(parent: ChainState | None, tokens: Sequence[int], extra: ExtraKeys) -> ChainState:
    local = local_block_hash(tokens)
    if parent is None:
        return local
    if not isinstance(parent, int) or isinstance(parent, bool) or not 0 <= parent <= _U64_MAX:
        raise TypeError("an xxh3-64-1337 parent is an unsigned 64-bit integer")
    return int(xxhash.xxh3_64_intdigest(struct.pack("<QQ", parent, local), seed=SEED))


def _publish(state: ChainState) -> PublishedHash:
    return state


def _recover(published: PublishedHash) -> ChainState | None:
    if isinstance(published, bool) or not isinstance(published, int):
        return None
    return published & _U64_MAX  # a signed decoding of the same 64 bits is the same hash


def xxh3_chain_scheme() -> EngineHashScheme:
    """Dynamo's XXH3-64 sequence-hash chain (seed 1337 fixed: no configured seed)."""
    return EngineHashScheme(
        name=NAME,
        seed=None,
        root=None,
        step=_step,
        publish=_publish,
        recover=_recover,
    )
