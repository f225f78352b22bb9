"""vLLM's prefix-caching block hashes (V1 engine), all four `--prefix-caching-hash-algo`s.

Checked against vLLM's source: vllm/v1/core/kv_cache_utils.py (`init_none_hash`,
`hash_block_tokens`, `generate_block_hash_extra_keys`, `maybe_convert_block_hash`; the
stored snapshot at commit 001cabc1be16a59a70d720ed61a13b678c060a18) and vllm/utils/hashing.py
(`sha256`, `sha256_cbor`, `xxhash`, `xxhash_cbor`; the releases since v0.11, where
`sha256_cbor_64bit` was renamed `sha256_cbor` (PR 23673) and the functions moved to
vllm.utils.hashing (PR 27151)). Golden vectors in tests/engines/golden_vectors.py.

    H(x)      sha256:       SHA-256(pickle.dumps(x, protocol=5)), 32 bytes
              sha256_cbor:  SHA-256(cbor2.dumps(x, canonical=True)), 32 bytes
              xxhash:       XXH3-128(pickle.dumps(x, protocol=5)), 16 bytes (canonical,
                            big-endian digest, `xxhash.xxh3_128_digest`)
              xxhash_cbor:  XXH3-128(cbor2.dumps(x, canonical=True)), 16 bytes
    root      = H(seed) where seed is the *string* value of PYTHONHASHSEED ("0" and "00"
                differ; "random" is a fixed string to vLLM). With PYTHONHASHSEED unset vLLM
                draws 32 random bytes per process: nothing can reproduce its hashes then.
    block[0]  = H((root, tuple(tokens[0:B]), extra_keys[0]))
    block[i]  = H((block[i-1], tuple(tokens[iB:(i+1)B]), extra_keys[i]))
    extra_keys[i] = tuple(lora_name?, mm keys..., cache_salt if i == 0?, prompt-embeds
                digest?) with the absent ones left out; None (not an empty tuple) when
                there are none. The LoRA name is in every block, the cache salt only in
                block 0. Multimodal keys ((identifier, offset) per item) and prompt-embeds
                digests are not derived here: pass them in `extra_keys_by_block` (newer
                vLLM events carry each block's extra keys).

A block's BlockHash is the digest bytes; its KV events carry them as is with
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0, and by default (=1) as
int.from_bytes(digest, "big") & (2**64 - 1), the digest's last 8 bytes big-endian (the
parent_block_hash too). Both fold to the same EngineBlockHash; the int form cannot be
extended (its 64 bits are not the digest the child is hashed from).

Pickle's output for these shapes (bytes, a tuple of ints, None or a tuple of str) is the
same from CPython 3.8 on; it depends on object identity only when two extra keys are the
same str object (a memo reference), which vLLM's distinct LoRA name and salt never are.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence

import cbor2
import xxhash

from cache_service.core.engines.schemes.scheme import (
    ChainState,
    EngineHashScheme,
    ExtraKeys,
    PublishedHash,
)

Digest = Callable[[bytes], bytes]
Serialize = Callable[[object], bytes]


def _pickle(value: object) -> bytes:
    return pickle.dumps(value, protocol=5)  # vLLM: pickle.HIGHEST_PROTOCOL, 5 since 3.8


def _cbor(value: object) -> bytes:
    return cbor2.dumps(value, canonical=True)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    return bytes(xxhash.xxh3_128_digest(data))


# Our name -> (vLLM's --prefix-caching-hash-algo, serializer, digest, digest length).
ALGORITHMS: dict[str, tuple[str, Serialize, Digest, int]] = {
    "vllm-sha256-cbor": ("sha256_cbor", _cbor, _sha256, 32),
    "vllm-xxhash-cbor": ("xxhash_cbor", _cbor, _xxh3_128, 16),
    "vllm-sha256": ("sha256", _pickle, _sha256, 32),
    "vllm-xxhash": ("xxhash", _pickle, _xxh3_128, 16),
}


def vllm_extra_keys(block_index: int, lora_name: str | None, cache_salt: str | None) -> ExtraKeys:
    """vLLM's extra keys of a text-only block: the LoRA name, then block 0's cache salt."""
    keys: list[object] = []
    if lora_name is not None:  # vLLM: any LoRA request adds its name
        keys.append(lora_name)
    if block_index == 0 and cache_salt:  # vLLM: `start_token_idx == 0 and cache_salt`
        keys.append(cache_salt)
    return tuple(keys) if keys else None


def _as_tuples(value: object) -> object:
    """Lists (as msgpack decodes an event's tuples) back into tuples: pickle tells them
    apart; CBOR encodes both as an array."""
    if isinstance(value, list | tuple):
        return tuple(_as_tuples(item) for item in value)
    return value


def canonical_extra_keys(extra_keys: Sequence[object] | None) -> ExtraKeys:
    """One block's extra keys as vLLM hashes them: a tuple, or None when empty."""
    if extra_keys is None:
        return None
    keys = tuple(_as_tuples(item) for item in extra_keys)
    return keys if keys else None


def vllm_scheme(name: str, *, seed: str | int | None) -> EngineHashScheme:
    """The vLLM scheme `name` (see ALGORITHMS) rooted at PYTHONHASHSEED=`seed`."""
    if name not in ALGORITHMS:
        raise ValueError(f"not a vLLM scheme: {name!r}")
    if seed is None:
        raise ValueError(
            f"{name} needs the engine's PYTHONHASHSEED: without it vLLM roots every chain "
            "at 32 random bytes per process and no block hash can be reproduced"
        )
    seed_text = str(seed)
    _, serialize, digest, size = ALGORITHMS[name]
    root = digest(serialize(seed_text))

    def step(parent: ChainState | None, tokens: Sequence[int], extra: ExtraKeys) -> ChainState:
        if not isinstance(parent, bytes):
            raise TypeError(f"a {name} parent is its {size}-byte digest")
        return digest(serialize((parent, tuple(tokens), canonical_extra_keys(extra))))

    def publish(state: ChainState) -> PublishedHash:
        return state  # the digest bytes; the int form is normalize_block_hash's fold

    def recover(published: PublishedHash) -> ChainState | None:
        if isinstance(published, bytes | bytearray) and len(published) == size:
            return bytes(published)
        return None  # the 64-bit int form keeps too little of the digest

    return EngineHashScheme(
        name=name,
        seed=seed_text,
        root=root,
        step=step,
        publish=publish,
        recover=recover,
        extra_keys_rule=vllm_extra_keys,
        covers_extra_keys=True,
    )
