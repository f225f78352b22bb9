"""Chained block keys: seed + namespace -> root key -> key of block 0 -> key of block i.

Byte layout (version 1), reproducible from any language:

    root    = xxh3_128(b"PCNS" || u8(1) || field(seed) || field(model) || field(kv_layout)
                       || field(tenant) || field(salt))
    field(s)= u32_le(len(utf8(s))) || utf8(s)
    key[0]  = xxh3_128(root || tokens[0:B] as u32_le each)
    key[i]  = xxh3_128(key[i-1] || tokens[i*B:(i+1)*B] as u32_le each)

xxh3_128 is XXH3_128bits with seed 0; a digest is its canonical (big-endian) 16 bytes.
Only full blocks get keys: a trailing partial block is never cached.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from functools import lru_cache

import xxhash

from cache_service.core.blocks import BlockKey, Chain, ChainLink, Namespace, NamespaceId
from cache_service.core.tokens import TokenBytes, block_of, bytes_of_tokens, tokens_to_bytes

HASH_SCHEME = "xxh3-128-chained"
HASH_VERSION = 1
DEFAULT_SEED = "prompt-cache-v1"
NAMESPACE_TAG = b"PCNS"
PARTITION_TAG = b"PCTENANT"

HashFn = Callable[[bytes], bytes]


def _field(value: str) -> bytes:
    raw = value.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


def encode_namespace(seed: str, namespace: Namespace) -> bytes:
    """The unambiguous byte string the root key is hashed from."""
    return b"".join(
        (
            NAMESPACE_TAG,
            struct.pack("<B", HASH_VERSION),
            _field(seed),
            _field(namespace.model),
            _field(namespace.kv_layout),
            _field(namespace.tenant),
            _field(namespace.salt),
        )
    )


def tenant_partition(tenant: str) -> bytes:
    """The prefix of a tenant's keys in the store: none for the default tenant (""), else
    8 bytes of xxh3-64 over a tag and the name. Tenants are named by the operator, never by a
    request, and the key file is refused if two of its tenants' partitions clash."""
    if not tenant:
        return b""
    return bytes(xxhash.xxh3_64_digest(PARTITION_TAG + tenant.encode("utf-8")))


def decode_namespace(encoded: bytes) -> tuple[str, Namespace]:
    """(seed, namespace) from the bytes `encode_namespace` made; ValueError otherwise."""
    if not encoded.startswith(NAMESPACE_TAG) or len(encoded) < len(NAMESPACE_TAG) + 1:
        raise ValueError("not an encoded namespace")
    at = len(NAMESPACE_TAG) + 1
    fields = []
    for _ in range(5):
        try:
            (length,) = struct.unpack_from("<I", encoded, at)
        except struct.error as exc:  # cut short
            raise ValueError("a truncated encoded namespace") from exc
        if at + 4 + length > len(encoded):
            raise ValueError("a truncated encoded namespace")
        fields.append(encoded[at + 4 : at + 4 + length].decode("utf-8"))  # UnicodeDecodeError
        at += 4 + length
    seed, model, kv_layout, tenant, salt = fields
    return seed, Namespace(model=model, kv_layout=kv_layout, tenant=tenant, salt=salt)


xxh3_128: HashFn = xxhash.xxh3_128_digest  # seed 0, 16 canonical (big-endian) bytes


def seed_fingerprint(seed: str) -> str:
    """A short public fingerprint of the seed, so a fleet can spot a mismatched worker."""
    return str(xxhash.xxh3_64_hexdigest(b"PCSEED" + seed.encode("utf-8")))


class BlockHasher:
    """Computes chained block keys for a configured seed (never random per process)."""

    def __init__(self, *, seed: str = DEFAULT_SEED, hash_fn: HashFn = xxh3_128) -> None:
        self.seed = seed
        self._hash = hash_fn
        self._ids = lru_cache(maxsize=4096)(self._compute_id)

    @property
    def fingerprint(self) -> str:
        """The seed's public fingerprint."""
        return seed_fingerprint(self.seed)

    def _compute_id(self, namespace: Namespace) -> NamespaceId:
        encoded = encode_namespace(self.seed, namespace)
        return NamespaceId(
            root=BlockKey(self._hash(encoded)),
            encoded=encoded,
            partition=tenant_partition(namespace.tenant),
        )

    def namespace_id(self, namespace: Namespace) -> NamespaceId:
        """The namespace's root key with the bytes it was hashed from."""
        return self._ids(namespace)

    def root_of(self, encoded: bytes) -> BlockKey:
        """The root key the bytes of an encoded namespace hash to (checks a stored copy)."""
        return BlockKey(self._hash(encoded))

    def root(self, namespace: Namespace) -> BlockKey:
        """The parent key of block 0 in this namespace."""
        return self._ids(namespace).root

    def chain(self, namespace: Namespace, token_bytes: TokenBytes, *, block_size: int) -> Chain:
        """The chain of every full block of a prompt given as uint32 LE bytes."""
        root = self.root(namespace)
        return Chain(root, self._keys_after(root, token_bytes, block_size), token_bytes, block_size)

    def extend(
        self, parent: BlockKey, token_bytes: TokenBytes, *, block_size: int, start_depth: int
    ) -> list[ChainLink]:
        """The links of the full blocks that follow a known block: `parent` is its key (the
        namespace root when `start_depth` is 0) and `start_depth` the depth of the first new
        block. For a sender that knows only the new blocks and their parent (an engine's KV
        events); equal to the same blocks of `chain` over the whole prompt."""
        if start_depth < 0:
            raise ValueError("start_depth must be 0 or more")
        keys = self._keys_after(parent, token_bytes, block_size)
        parents = [parent, *keys][: len(keys)]
        return [
            ChainLink(key, up, block_of(token_bytes, i, block_size), start_depth + i)
            for i, (key, up) in enumerate(zip(keys, parents, strict=True))
        ]

    def _keys_after(self, parent: BlockKey, token_bytes: bytes, block_size: int) -> list[BlockKey]:
        """The chained keys of every full block of `token_bytes`, after `parent`."""
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        stride = bytes_of_tokens(block_size)
        end = len(token_bytes) // stride * stride
        hash_fn = self._hash
        keys: list[BlockKey] = []
        append = keys.append
        # The hot loop: one concatenation and one hash per block, nothing else.
        for offset in range(0, end, stride):
            parent = hash_fn(parent + token_bytes[offset : offset + stride])  # type: ignore[assignment]
            append(parent)
        return keys

    def keys(
        self, namespace: Namespace, tokens: Sequence[int], *, block_size: int
    ) -> list[BlockKey]:
        """The keys of every full block of a prompt given as token ids."""
        return self.chain(namespace, tokens_to_bytes(tokens), block_size=block_size).keys
