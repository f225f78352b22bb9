"""An engine's block hash, in the one form the indexes keep.

Engines publish a block's hash either as raw digest bytes (vLLM's BlockHash, 32 bytes of
SHA-256 or 16 of XXH3-128) or as a 64-bit integer (vLLM with
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, its default, which keeps the digest's last 8 bytes,
big-endian: `int.from_bytes(digest, "big") & (2**64 - 1)` in vLLM's
`maybe_convert_block_hash`, vllm/v1/core/kv_cache_utils.py; SGLang, a signed int64; Dynamo,
an unsigned one). Both are folded into that integer, so a digest and its integer form name
the same block; 2**-64 chance collisions only make a routing score optimistic, never a
served payload wrong (payloads are verified by our own keys).

SGLang's int64 is the FIRST 8 bytes of its SHA-256 digest, so an SGLang digest must be
published (schemes/sglang.py) before it is folded here, never folded as bytes.
"""

from __future__ import annotations

from typing import NewType

EngineBlockHash = NewType("EngineBlockHash", int)  # unsigned 64-bit

U64_MASK = (1 << 64) - 1


def normalize_block_hash(value: int | bytes | bytearray | memoryview) -> EngineBlockHash:
    """The 64-bit form of a hash as published: an integer (signed or not) as its low 64 bits,
    digest bytes as their last 8 bytes read big-endian (vLLM's own conversion)."""
    if isinstance(value, bool):  # bool is an int: never a hash
        raise TypeError("a block hash is an integer or bytes, not a bool")
    if isinstance(value, int):
        return EngineBlockHash(value & U64_MASK)
    if isinstance(value, bytes | bytearray | memoryview):
        tail = bytes(value)[-8:]
        if not tail:
            raise ValueError("an empty block hash")
        return EngineBlockHash(int.from_bytes(tail, "big"))
    raise TypeError(f"a block hash is an integer or bytes, not {type(value).__name__}")
