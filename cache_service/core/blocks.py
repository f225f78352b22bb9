"""Plain data shared by every layer: keys, namespaces, stored blocks and matches (stdlib only)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NewType, overload

from cache_service.core.lifetimes import UNBOUNDED, Lifetimes
from cache_service.core.tokens import TokenBytes, bytes_of_tokens

BlockKey = NewType("BlockKey", bytes)
"""A 16-byte chained xxh3-128 block key (see `hashing`)."""

StoreKey = NewType("StoreKey", bytes)
"""A block's key in the store: its tenant's partition (see `NamespaceId.partition`, empty
for the default tenant), then its 16-byte `BlockKey`."""

KEY_BYTES = 16
PARTITION_BYTES = 8  # a tenant's prefix on its stored keys (none for the default tenant)


def store_key(partition: bytes, key: BlockKey) -> StoreKey:
    """The store's key of block `key` of the tenant whose partition is `partition`."""
    return StoreKey(partition + key)


def key_hex(key: BlockKey) -> str:
    """Render a key as 32 lowercase hex characters, as the HTTP API does."""
    return key.hex()


def key_from_hex(text: str) -> BlockKey:
    """Parse 32 hex characters into a key; raises ValueError on anything else."""
    if len(text) != 2 * KEY_BYTES:
        raise ValueError(f"a block key is {2 * KEY_BYTES} hex characters, got {len(text)}")
    return BlockKey(bytes.fromhex(text))


@dataclass(frozen=True, slots=True)
class Namespace:
    """What seeds a prompt's key chain: equal prefixes share keys only within one namespace."""

    model: str
    kv_layout: str = ""
    tenant: str = ""
    salt: str = ""


@dataclass(frozen=True, slots=True)
class NamespaceId:
    """A namespace as the store sees it: its root key and the exact bytes hashed into it.

    The store keeps the bytes per root, so two namespaces whose roots collide never share.
    """

    root: BlockKey
    encoded: bytes
    # The tenant's partition of the store: every key the store holds for this namespace is
    # prefixed with it, so no key of one tenant, however crafted, can reach another's block.
    partition: bytes = b""

    @property
    def scope(self) -> StoreKey:
        """The namespace's key in the store: its partition, then its root."""
        return store_key(self.partition, self.root)


@dataclass(frozen=True, slots=True)
class ChainLink:
    """One full block of a prompt: its key, its parent's key and its tokens (uint32 LE bytes)."""

    key: BlockKey
    parent: BlockKey
    tokens: bytes
    depth: int


class Chain(Sequence[ChainLink]):
    """A prompt's chain links, made on demand: lookups usually read only the matched ones."""

    __slots__ = ("_block_size", "_hex", "_stride", "_tokens", "keys", "root")

    def __init__(
        self, root: BlockKey, keys: list[BlockKey], token_bytes: TokenBytes, block_size: int
    ):
        self.root = root
        self.keys = keys
        self._tokens = token_bytes
        self._block_size = block_size
        self._stride = bytes_of_tokens(block_size)
        self._hex: list[str] | None = None

    def hex_keys(self, count: int) -> list[str]:
        """The first `count` keys as hex, each computed once per chain (a memoized chain is
        reused), and only as far as a match reached."""
        if self._hex is None:
            self._hex = []
        known = len(self._hex)
        if count > known:
            self._hex += [key.hex() for key in self.keys[known:count]]
        return self._hex[:count]

    def __len__(self) -> int:
        return len(self.keys)

    @overload
    def __getitem__(self, index: int) -> ChainLink: ...

    @overload
    def __getitem__(self, index: slice) -> list[ChainLink]: ...

    def __getitem__(self, index: int | slice) -> ChainLink | list[ChainLink]:
        if isinstance(index, slice):
            return [self._link(i) for i in range(*index.indices(len(self.keys)))]
        if index < 0:
            index += len(self.keys)
        if not 0 <= index < len(self.keys):
            raise IndexError(index)
        return self._link(index)

    def parts(self, start: int = 0) -> Iterator[tuple[BlockKey, BlockKey, bytes, int]]:
        """(key, parent, tokens, depth) of the blocks from `start`, without link objects."""
        stride, tokens, keys = self._stride, self._tokens, self.keys
        parent = keys[start - 1] if start else self.root
        for depth in range(start, len(keys)):
            key = keys[depth]
            yield key, parent, tokens[depth * stride : (depth + 1) * stride], depth
            parent = key

    @property
    def stride(self) -> int:
        """Bytes of tokens per block."""
        return self._stride

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def token_bytes(self) -> TokenBytes:
        """The prompt's tokens (uint32 LE), full blocks and any partial tail."""
        return self._tokens

    def _link(self, depth: int) -> ChainLink:
        start = depth * self._stride
        return ChainLink(
            key=self.keys[depth],
            parent=self.keys[depth - 1] if depth else self.root,
            tokens=self._tokens[start : start + self._stride],
            depth=depth,
        )


def link_parts(
    links: Sequence[ChainLink], start: int = 0
) -> Iterator[tuple[BlockKey, BlockKey, bytes, int]]:
    """(key, parent, tokens, depth) of each link from `start`; cheap for a Chain."""
    if isinstance(links, Chain):
        return links.parts(start)
    return ((link.key, link.parent, link.tokens, link.depth) for link in links[start:])


@dataclass(frozen=True, slots=True)
class NewBlock:
    """A block to store: its place in the chain and its KV payload."""

    link: ChainLink
    payload: bytes | memoryview


@dataclass(slots=True)
class BlockMeta:
    """Everything the store keeps about a block except its payload bytes."""

    key: StoreKey  # the partition + the block's hash
    namespace_root: BlockKey
    parent: BlockKey  # the parent's hash (the namespace root for block 0)
    depth: int
    tokens: bytes
    payload_size: int
    checksum: int
    created_at: float
    last_used_at: float
    expires_at: float
    retention: str
    children: int = 0
    eviction_rank: int = 0
    hits: int = 0
    # Where the expiry index lists the block: at most expires_at (sliding a block's expiry
    # leaves its entry early; the sweeper moves an entry it finds early to its real time).
    indexed_expiry: float = 0.0
    # A number no other write of any block ever gets (drawn from the use sequence when the
    # block is stored): it tells a stored copy from any later copy under the same key.
    stored_seq: int = 0

    @property
    def pinned(self) -> bool:
        """Pinned blocks never expire (their expiry is infinite) and are never evicted."""
        return self.expires_at == math.inf

    @property
    def partition(self) -> bytes:
        """The block's tenant partition (empty for the default tenant)."""
        return self.key[:-KEY_BYTES]

    @property
    def parent_key(self) -> StoreKey:
        """The parent's key in the store (this block's partition + its parent's hash)."""
        return store_key(self.partition, self.parent)

    def is_alive(self, now: float, lifetimes: Lifetimes = UNBOUNDED) -> bool:
        """A block is alive while now < expires_at and, unless pinned, its expiry is within
        its class's TTL from now (else it was stored while the clock ran ahead: `lifetimes`)."""
        return lifetimes.alive(self.expires_at, self.retention, now)

    def holds(self, link: ChainLink) -> bool:
        """Whether this stored block really is `link` (not a hash collision).

        With the parent's own verification this pins the whole prefix: a block's content
        never changes while it has children, and the depth stops a block that is its own
        parent (possible only under a collision) from matching twice.
        """
        return (
            self.depth == link.depth and self.parent == link.parent and self.tokens == link.tokens
        )


@dataclass(frozen=True, slots=True)
class Touch:
    """A verified hit on a prefix of blocks at one moment under one retention class."""

    keys: tuple[BlockKey, ...]
    at: float
    retention: str
    ttl_seconds: float
    uses: int = 1  # hits this touch stands for (equal touches are merged before a flush)
    partition: bytes = b""  # of the namespace hit; the store prefixes `keys` with it


# Why a block left the store: its TTL ran out, room for everyone, an operator's purge, room
# for its tenant's quota, or a request to remove it (with the blocks under it). The removal log
# stores a reason by its index here: a new reason goes at the end.
# "corrupt": a block whose record or payload failed verification, dropped with its subtree.
REMOVAL_REASONS = ("expired", "capacity", "purged", "tenant_quota", "removed", "corrupt")
# The reasons that take a block before its TTL to make room.
ROOM_REASONS = frozenset({"capacity", "tenant_quota"})


@dataclass(frozen=True, slots=True)
class Evicted:
    """A block the store removed, and why."""

    key: StoreKey
    reason: str  # one of REMOVAL_REASONS
    retention: str
    expires_at: float
    payload_size: int


@dataclass(frozen=True, slots=True)
class InsertResult:
    """What an insert did: blocks newly stored, refreshed, or refused."""

    stored: tuple[StoreKey, ...] = ()  # keys in the store (with the partition)
    refreshed: int = 0
    conflicts: int = 0  # same block, different payload bytes: the first writer won
    collisions: int = 0  # same key, different parent or tokens: refused
    last_incarnation: bytes | None = None  # of the last block written (see store.match)


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The store's answer to a verified prefix walk."""

    matched: int
    collisions: int = 0
    payloads: tuple[bytes, ...] | None = None
    corrupt: int = 0
    incarnation: bytes | None = None  # identifies the last matched block's stored copy


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The cache's answer to a lookup: the longest verified, alive prefix."""

    block_size: int
    prompt_tokens: int
    keys: tuple[BlockKey, ...] = ()
    payloads: tuple[bytes, ...] | None = None
    retention: str = ""
    key_texts: list[str] | None = None  # the keys as hex, when the chain had them at hand

    @property
    def hex_keys(self) -> list[str]:
        """The matched keys as 32 lowercase hex characters each."""
        return self.key_texts if self.key_texts is not None else [k.hex() for k in self.keys]

    @property
    def matched_blocks(self) -> int:
        """How many leading blocks hit."""
        return len(self.keys)

    @property
    def cached_tokens(self) -> int:
        """Tokens covered by the matched blocks."""
        return self.matched_blocks * self.block_size

    @property
    def miss_tokens(self) -> int:
        """Prompt tokens not covered by the match."""
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True, slots=True)
class Removal:
    """Why and when a block left the store, as the bounded removal log remembers it."""

    reason: str  # one of REMOVAL_REASONS
    at: float
    retention: str
    expires_at: float


@dataclass(frozen=True, slots=True)
class BlockState:
    """What the store can tell about one block of a chain that did not match."""

    status: str  # "absent", "expired", "collision", "corrupt", or "stored" (since the lookup)
    expires_at: float | None = None  # of an expired block still stored
    retention: str | None = None
    removal: Removal | None = None  # of an absent block, if the log still has it


@dataclass(frozen=True, slots=True)
class PinRecord:
    """A pinned prefix: its namespace scope, deepest key, length, and who pinned it when."""

    scope: StoreKey
    key: BlockKey
    blocks: int
    pinned_at: float
    by: str
    bytes: int = 0  # the pinned blocks' estimated size when pinned
    rank: int = 0  # the pinner's rank: only as high a rank may release the pin


@dataclass(frozen=True, slots=True)
class PinLimits:
    """What a pin may not pass: the tenant's pinned blocks and bytes, and all tenants' bytes
    (None: no limit)."""

    blocks: int | None = None
    tenant_bytes: int | None = None
    total_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class PurgeResult:
    """What a purge removed."""

    blocks: int = 0
    payload_bytes: int = 0
    pins: int = 0


@dataclass(frozen=True, slots=True)
class StoreUsage:
    """How much the store holds, measured the way its backend measures space."""

    blocks: int
    payload_bytes: int
    used_bytes: int
