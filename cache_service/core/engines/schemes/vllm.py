"""vLLM's prefix-caching block hashes (V1 engine), all four `--prefix-caching-hash-algo`s.

Checked against vLLM's source: vllm/v1/core/kv_cache_utils.py (`init_none_hash`,
`resolve_none_hash_seed`, `hash_block_tokens`, `generate_block_hash_extra_keys`,
`to_event_extra_keys`, `maybe_convert_block_hash`) and vllm/utils/hashing.py (`sha256`,
`sha256_cbor`, `xxhash`, `xxhash_cbor`) of vLLM 0.32.0 as installed (.venv-vllm), and of the
stored snapshot at commit 001cabc1be16a59a70d720ed61a13b678c060a18 for the older form; the
functions are vllm.utils.hashing's since PR 27151, `sha256_cbor` so named since PR 23673.
Golden vectors from vLLM 0.32 itself in tests/engines/vllm_vectors.py, the older form's in
tests/engines/golden_vectors.py.

    H(x)      sha256:       SHA-256(pickle.dumps(x, protocol=5)), 32 bytes
              sha256_cbor:  SHA-256(cbor2.dumps(x, canonical=True)), 32 bytes
              xxhash:       XXH3-128(pickle.dumps(x, protocol=5)), 16 bytes (canonical,
                            big-endian digest, `xxhash.xxh3_128_digest`)
              xxhash_cbor:  XXH3-128(cbor2.dumps(x, canonical=True)), 16 bytes
    root      = H(seed) where seed is the *string* value of PYTHONHASHSEED ("0" and "00"
                differ; "random" is a fixed string to vLLM). With PYTHONHASHSEED unset,
                vLLM 0.32 uses the fixed seed "vllm-none-hash" for sha256 and sha256_cbor
                (DEFAULT_SEED here) but random bytes per process for xxhash and xxhash_cbor
                (vLLM keeps the seed of a non-cryptographic hash secret); releases before
                that change (vLLM PR 51875) drew random bytes for all four. Random roots
                cannot be reproduced: such a scheme needs the seed.
    block[0]  = H((root, tuple(tokens[0:B]), extra_keys[0]))
    block[i]  = H((block[i-1], tuple(tokens[iB:(i+1)B]), extra_keys[i]))
    extra_keys[i], "tagged" form (vLLM 0.32):
                (("lora", lora_name, lora_path)?, ("mm", identifier, offset)...,
                 ("cache_salt", salt) if i == 0?, ("prompt_embeds", sha256 digest)?)
              "untagged" form (older releases):
                (lora_name?, (identifier, offset)..., salt if i == 0?, digest?)
                with the absent ones left out; None (not an empty tuple) when there are
                none. The LoRA key is in every block, the cache salt only in block 0 (when
                truthy). Multimodal keys and prompt-embeds digests are not derived here:
                pass them in `extra_keys_by_block`, or take them from an event.

KV events publish each block's extra keys untagged in both forms (vLLM 0.32's
`to_event_extra_keys`): the LoRA name bare (its path dropped), an mm key as (identifier,
offset), the salt and the digest bare; msgpack turns tuples into lists. `tagged_event_keys`
turns them back into the tagged keys: a first str equal to the event's lora_name is the
LoRA (its path from the engine's configuration), a pair an mm key, any other str the salt,
bytes the digest.

A block's BlockHash is the digest bytes; its KV events carry them as is with
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0, and by default (=1) as
int.from_bytes(digest, "big") & (2**64 - 1), the digest's last 8 bytes big-endian (the
parent_block_hash too). Both fold to the same EngineBlockHash; the int form cannot be
extended (its 64 bits are not the digest the child is hashed from).

Pickle's output for these shapes (bytes, a tuple of ints, None or a tuple of str and
tuples) is the same from CPython 3.8 on. It depends on object identity where one str object
appears twice in a block's keys (the second is a memo reference), so sha256 and xxhash
lay equal strings out as vLLM's engine core has them, whatever objects the caller passed:
the tags as the interned code constants ("mm" twice in a block of two images is one
object in both), every other string equal to another key's as its own object (a LoRA name
equal to the salt: the engine core receives each request msgpack-decoded, every str its own
object; one character of Latin-1 is one cached object in both). An in-process engine
(VLLM_ENABLE_V1_MULTIPROCESSING=0) whose caller passed one str object as both LoRA name and
cache_salt hashes them as one object instead: `shared_strings_scheme` hashes a block that
way, and verification tries it on a block that otherwise fails (only the two layouts, all
shared or none, are tried). CBOR writes equal strings alike whatever their identity.
"""

from __future__ import annotations

import hashlib
import pickle
import sys
from collections import Counter
from collections.abc import Callable, Sequence

import cbor2
import xxhash

from cache_service.core.engines.schemes.scheme import (
    ChainState,
    EngineHashScheme,
    EventExtraKeys,
    ExtraKeys,
    LoraPathUnknown,
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


# extra_keys_form values: how a vLLM release hashes a block's extra keys.
TAGGED = "tagged"  # vLLM 0.32: ("lora", name, path), ("cache_salt", salt), ...
UNTAGGED = "untagged"  # older releases: the bare name, the bare salt, ...
EXTRA_KEYS_FORMS = (TAGGED, UNTAGGED)
DEFAULT_EXTRA_KEYS_FORM = TAGGED
# vLLM 0.32's seed when PYTHONHASHSEED is unset, for the cryptographic algorithms only
# (`DEFAULT_NONE_HASH_SEED`); xxhash and xxhash_cbor draw random bytes instead.
DEFAULT_SEED = "vllm-none-hash"
FIXED_DEFAULT_SEED = frozenset({"vllm-sha256", "vllm-sha256-cbor"})


def untagged_extra_keys(
    block_index: int, lora_name: str | None, lora_path: str | None, cache_salt: str | None
) -> ExtraKeys:
    """Older vLLM's extra keys of a text-only block: the LoRA name, then block 0's salt."""
    keys: list[object] = []
    if lora_name is not None:  # vLLM: any LoRA request adds its name (not its path)
        keys.append(lora_name)
    if block_index == 0 and cache_salt:  # vLLM: `start_token_idx == 0 and cache_salt`
        keys.append(cache_salt)
    return tuple(keys) if keys else None


def tagged_extra_keys(
    block_index: int, lora_name: str | None, lora_path: str | None, cache_salt: str | None
) -> ExtraKeys:
    """vLLM 0.32's extra keys of a text-only block: ("lora", name, path) in every block,
    then ("cache_salt", salt) in block 0. LoraPathUnknown without the adapter's path."""
    keys: list[object] = []
    if lora_name is not None:
        if lora_path is None:
            raise LoraPathUnknown(lora_name)
        keys.append(("lora", lora_name, lora_path))
    if block_index == 0 and cache_salt:
        keys.append(("cache_salt", cache_salt))
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


# vLLM's tags: code constants, so interned (one object per value in vLLM as here).
TAGS = frozenset({"lora", "mm", "cache_salt", "prompt_embeds"})


def _strings(value: object) -> list[str]:
    """Every str in `value` (a block's keys)."""
    if isinstance(value, tuple):
        return [text for item in value for text in _strings(item)]
    return [value] if type(value) is str else []


def repeated_strings(keys: ExtraKeys) -> frozenset[str]:
    """The strings that occur more than once in a block's keys: pickle writes the second of
    one object as a reference to the first, and two equal objects in full."""
    counts = Counter(_strings(keys))
    return frozenset(text for text, count in counts.items() if count > 1)


def _laid_out(value: object, shared: bool, repeated: frozenset[str], tag: bool) -> object:
    """`value` with each string in `repeated` as one object (`shared`), else tags interned
    and other strings each a new object."""
    if isinstance(value, tuple):
        return tuple(_laid_out(item, shared, repeated, i == 0) for i, item in enumerate(value))
    if type(value) is not str or value not in repeated:
        return value
    if shared or (tag and value in TAGS):
        return sys.intern(value)
    return (value + " ")[:-1]  # a new object of equal value


def lay_out_strings(keys: ExtraKeys, *, shared: bool = False) -> ExtraKeys:
    """Canonical `keys` with their repeated strings laid out for pickle as vLLM's engine
    core has them (tags one object, other strings each its own), or all `shared`."""
    if keys is None:  # a plain block (most): nothing to lay out, and no Counter to build
        return keys
    repeated = repeated_strings(keys)
    if not repeated:
        return keys
    return tuple(_laid_out(key, shared, repeated, False) for key in keys)


def tagged_event_keys(
    keys: EventExtraKeys, lora_name: str | None, lora_path: str | None
) -> ExtraKeys:
    """One block's keys as a vLLM 0.32 event publishes them (untagged, no LoRA path), tagged
    as the engine hashed them; LoraPathUnknown for a LoRA whose path is not given."""
    if keys is None:
        return None
    tagged: list[object] = []
    for position, key in enumerate(keys):
        if position == 0 and lora_name is not None and key == lora_name:
            if lora_path is None:
                raise LoraPathUnknown(lora_name)
            tagged.append(("lora", lora_name, lora_path))
        elif isinstance(key, list | tuple) and len(key) == 2:
            tagged.append(("mm", *(_as_tuples(item) for item in key)))
        elif isinstance(key, str):
            tagged.append(("cache_salt", key))
        elif isinstance(key, bytes | bytearray):
            tagged.append(("prompt_embeds", bytes(key)))
        else:
            raise ValueError(f"an extra key of no known kind: {key!r}")
    return tuple(tagged) if tagged else None


def untagged_event_keys(
    keys: EventExtraKeys, lora_name: str | None, lora_path: str | None
) -> ExtraKeys:
    """One block's keys as an older vLLM hashed them: as its events publish them."""
    return canonical_extra_keys(keys)


_FORMS = {
    TAGGED: (tagged_extra_keys, tagged_event_keys),
    UNTAGGED: (untagged_extra_keys, untagged_event_keys),
}


def resolve_seed(name: str, seed: str | int | None) -> str:
    """The seed vLLM roots `name`'s chains at: PYTHONHASHSEED's string when set, else vLLM
    0.32's fixed default for sha256 and sha256_cbor; ValueError for the xxhash ones."""
    if seed is not None:
        return str(seed)
    if name in FIXED_DEFAULT_SEED:
        return DEFAULT_SEED
    raise ValueError(
        f"{name} needs the engine's PYTHONHASHSEED: with it unset vLLM roots every "
        "xxhash chain at random bytes per process (0.32 keeps the seed of a "
        "non-cryptographic hash secret), so no block hash can be reproduced"
    )


def vllm_scheme(
    name: str,
    *,
    seed: str | int | None,
    extra_keys_form: str = DEFAULT_EXTRA_KEYS_FORM,
    shared_strings: bool = False,
) -> EngineHashScheme:
    """The vLLM scheme `name` (see ALGORITHMS) rooted at PYTHONHASHSEED=`seed` (see
    `resolve_seed` when None), hashing extra keys in `extra_keys_form`; with
    `shared_strings`, equal strings as one object (an in-process caller's, see above)."""
    if name not in ALGORITHMS:
        raise ValueError(f"not a vLLM scheme: {name!r}")
    if extra_keys_form not in _FORMS:
        raise ValueError(
            f"unknown extra_keys_form {extra_keys_form!r}; known: {', '.join(EXTRA_KEYS_FORMS)}"
        )
    seed_text = resolve_seed(name, seed)
    rule, event_keys = _FORMS[extra_keys_form]
    _, serialize, digest, size = ALGORITHMS[name]
    root = digest(serialize(seed_text))
    pickled = serialize is _pickle

    def step(parent: ChainState | None, tokens: Sequence[int], extra: ExtraKeys) -> ChainState:
        if not isinstance(parent, bytes):
            raise TypeError(f"a {name} parent is its {size}-byte digest")
        keys = None if extra is None else canonical_extra_keys(extra)
        if pickled and keys is not None:  # pickle tells one str object from two equal ones
            keys = lay_out_strings(keys, shared=shared_strings)
        return digest(serialize((parent, tuple(tokens), keys)))

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
        extra_keys_rule=rule,
        covers_extra_keys=True,
        event_keys=event_keys,
        extra_keys_form=extra_keys_form,
    )


def shared_strings_scheme(scheme: EngineHashScheme, extra: ExtraKeys) -> EngineHashScheme | None:
    """`scheme` hashing equal strings as one object, when that can hash the block keys
    `extra` otherwise: a pickle scheme of vLLM's and keys with a string twice; else None."""
    if scheme.name not in ALGORITHMS or ALGORITHMS[scheme.name][1] is not _pickle:
        return None
    if scheme.seed is None or scheme.extra_keys_form is None:
        return None
    if not repeated_strings(canonical_extra_keys(extra)):
        return None
    return vllm_scheme(
        scheme.name, seed=scheme.seed, extra_keys_form=scheme.extra_keys_form, shared_strings=True
    )
