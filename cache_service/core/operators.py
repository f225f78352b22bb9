"""Operator controls over a cache's store: pin and unpin prefixes, purge, explain a miss."""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cache_service.core.blocks import (
    ROOM_REASONS,
    BlockKey,
    Chain,
    ChainLink,
    Namespace,
    PinLimits,
    PinRecord,
    PurgeResult,
    StoreKey,
    store_key,
)
from cache_service.core.cache import Clock, PrefixCache
from cache_service.core.capacity import Capacity
from cache_service.core.config import CacheConfig
from cache_service.core.errors import InvalidField, NotSupportedByStore
from cache_service.core.hashing import BlockHasher, decode_namespace, tenant_partition
from cache_service.core.store.parts.removals import HINT_TOKENS
from cache_service.core.store.protocols import BlockStore
from cache_service.core.tokens import TokenInput, as_token_bytes, bytes_of_tokens, tokens_in

EXPLANATIONS = {  # why a lookup stopped where it did -> the sentence that says so
    "complete": "every full block of the prompt is cached",
    "partial_block": "every full block is cached; the rest is shorter than a block",
    "never_stored": "the block is not stored, and the store has no record of removing it "
    "(never stored, or removed too long ago to be remembered)",
    "evicted": "the block was evicted to make room",
    "expired": "the block's retention ran out",
    "purged": "an operator purged the block",
    "removed": "the block, or one above it, was removed on request (an engine dropped it)",
    "other_namespace": "the prompt's first block is stored under another model, KV layout "
    "or salt of this tenant",
    "block_size_differs": "the prompt's first block is stored with another block size",
    "collision_rejected": "another block holds this block's key (a hash collision); it was "
    "not served",
    "stored_since": "the block was stored while this explanation was being made: look again",
    "corrupt": "the block's stored record or payload failed verification: it is not served, "
    "and it is dropped with the blocks stored under it",
    "damaged_namespace": "the prompt's first block may be stored under another namespace of "
    "this tenant, but the record naming that namespace is damaged (unreadable): it is not "
    "used",
}


@dataclass(frozen=True)
class Explanation:
    """Why a lookup of a prompt stops where it does."""

    block_size: int
    prompt_tokens: int
    matched_blocks: int
    reason: str
    first_unmatched_block: int | None
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def detail(self) -> str:
        """The reason in words."""
        return EXPLANATIONS[self.reason]


class Operators:
    """Pins, purges and explanations over one store, resolving requests as its cache does."""

    def __init__(
        self,
        store: BlockStore,
        *,
        hasher: BlockHasher,
        clock: Clock,
        config: CacheConfig,
        capacity: Capacity,
        drop_damaged: Callable[[], int] | None = None,
    ) -> None:
        self.store = store
        self.hasher = hasher
        self.clock = clock
        self.config = config
        self.capacity = capacity
        # The cache's drop of damaged blocks (counted in its events): a purge that met a
        # damaged record, which holds its ancestors back, drops it and finishes.
        self.drop_damaged = drop_damaged

    @classmethod
    def for_cache(cls, cache: PrefixCache) -> Operators:
        """The operators of a cache: its store, hasher, clock, configuration and capacity."""
        return cls(
            cache.store,
            hasher=cache.hasher,
            clock=cache.clock,
            config=cache.config,
            capacity=cache.capacity,
            drop_damaged=cache.drop_damaged,
        )

    def _require(self, behaviour: str, what: str) -> None:
        """NotSupportedByStore (501) when the store's declared capabilities lack `behaviour`."""
        capabilities = self.store.capabilities
        if not capabilities.has(behaviour):
            raise NotSupportedByStore(
                f"{what} is not supported by the {capabilities.backend} store: "
                f"{capabilities.why_not(behaviour)}"
            )

    def _chain(self, namespace: Namespace, tokens: TokenInput, block_size: int | None) -> Chain:
        size = self.config.block_size_for(namespace.model, block_size)
        return self.hasher.chain(namespace, as_token_bytes(tokens), block_size=size)

    def pin(
        self,
        namespace: Namespace,
        tokens: TokenInput | None = None,
        *,
        keys: Sequence[BlockKey] | None = None,
        block_size: int | None = None,
        by: str,
        rank: int = 0,
        limits: PinLimits | None = None,
    ) -> tuple[PinRecord, bool]:
        """Pin every full block of `tokens` (or the chain of `keys`, from block 0), as
        `by` of `rank`, within `limits`."""
        self._require("pins", "pinning")
        chain = self._prefix(namespace, tokens, keys, block_size)
        return self.store.pin(
            self.hasher.namespace_id(namespace),
            chain,
            now=self.clock(),
            by=by,
            rank=rank,
            limits=limits,
        )

    def pin_limits(
        self, tenant: str, *, pin_quota_blocks: int, pinned_share: float, tenants: int
    ) -> PinLimits:
        """The limits of a writer's pins: the tenant's pinned blocks; `pinned_share` of its
        capacity quota, or without one its even part (of `tenants`) of the cache's pinned
        share; and the cache's pinned share for all pins together (pins are never evicted,
        so they must not crowd out everything else, nor one tenant's pins everyone's)."""
        quota = self.capacity.tenant_capacity_bytes.get(tenant)
        capacity = self.capacity.capacity_bytes
        total = int(capacity * pinned_share) if capacity is not None else None
        own: int | None
        if quota is not None:
            own = int(quota * pinned_share)
        else:
            own = total // max(tenants, 1) if total is not None else None
        return PinLimits(blocks=pin_quota_blocks, tenant_bytes=own, total_bytes=total)

    def unpin(
        self,
        namespace: Namespace,
        tokens: TokenInput | None = None,
        *,
        keys: Sequence[BlockKey] | None = None,
        block_size: int | None = None,
        rank: int = 0,
    ) -> int:
        """Release the pin of exactly this prefix (Forbidden if a higher rank pinned it);
        its blocks then expire as if just used under the longest retention class. How many
        blocks the pin held (0: no such pin)."""
        self._require("pins", "unpinning")
        chain = self._prefix(namespace, tokens, keys, block_size)
        return self.store.unpin(
            self.hasher.namespace_id(namespace),
            chain[-1].key,
            now=self.clock(),
            ttl_seconds=self.config.longest_ttl_seconds,
            rank=rank,
        )

    def pins(self, tenant: str, *, reveal_salts: bool = False) -> list[dict[str, Any]]:
        """A tenant's pins, with the namespace each belongs to (its salt only when
        `reveal_salts`: a salt keeps users of one tenant apart, so only admins see them)."""
        self._require("pins", "listing pins")
        partition = tenant_partition(tenant)
        out = []
        for record in self.store.pins(partition):
            namespace = self._namespace_of(record.scope)
            out.append(
                {
                    "model": namespace.model if namespace else None,
                    "kv_layout": namespace.kv_layout if namespace else None,
                    "salt": namespace.salt if namespace and reveal_salts else None,
                    "salted": bool(namespace and namespace.salt),
                    "key": record.key.hex(),
                    "blocks": record.blocks,
                    "pinned_at": record.pinned_at,
                    "by": record.by,
                }
            )
        return out

    def purge(
        self,
        tenant: str,
        *,
        namespace: Namespace | None = None,
        tokens: TokenInput | None = None,
        block_size: int | None = None,
    ) -> PurgeResult:
        """Delete every block of a tenant; of one namespace; or, with tokens, the prompt's
        last full block and everything stored under it."""
        partition = tenant_partition(tenant)
        now = self.clock()
        if namespace is None:
            return self._purge_past_damage(lambda: self.store.purge(partition, now=now))
        root = self.hasher.namespace_id(namespace).root
        if tokens is None:
            return self._purge_past_damage(lambda: self.store.purge(partition, root=root, now=now))
        self._require("purge_under", "a purge under a prefix")
        chain = self._chain(namespace, tokens, block_size)
        if not len(chain):
            raise InvalidField("tokens", "a prefix purge needs at least one full block")
        return self._purge_past_damage(
            lambda: self.store.purge(
                partition,
                root=root,
                under=store_key(partition, chain[-1].key),
                now=now,
                ttl_seconds=self.config.longest_ttl_seconds,
            )
        )

    def _purge_past_damage(self, purge: Callable[[], PurgeResult]) -> PurgeResult:
        """Purge; if the purge met damaged records (which it cannot delete as blocks, and
        whose ancestors it therefore keeps), drop them and purge what they held back."""
        first = purge()
        if self.drop_damaged is None or not self.store.damage_pending():
            return first
        self.drop_damaged()
        again = purge()
        return PurgeResult(
            blocks=first.blocks + again.blocks,
            payload_bytes=first.payload_bytes + again.payload_bytes,
            pins=first.pins + again.pins,
        )

    def explain(
        self,
        namespace: Namespace,
        tokens: TokenInput,
        *,
        block_size: int | None = None,
        reveal_salts: bool = False,
    ) -> Explanation:
        """Why a lookup of `tokens` stops where it does (the lookup itself is not counted
        and marks nothing used). Another namespace of the tenant holding the first block is
        named by its model and layout; one under another salt is considered, and its salt
        named, only when `reveal_salts` (for admins: a salt is what keeps users of one
        tenant apart, so even that such a block exists is not for them to learn)."""
        size = self.config.block_size_for(namespace.model)
        links = self._chain(namespace, tokens, None)
        prompt_tokens = tokens_in(links.token_bytes)
        if block_size is not None and block_size != size:
            return Explanation(block_size, prompt_tokens, 0, "block_size_differs", 0,
                               {"service_block_size": size})  # fmt: skip
        namespace_id = self.hasher.namespace_id(namespace)
        now = self.clock()
        matched = self.store.match(namespace_id, links, now=now).matched
        if matched == len(links):
            reason = "complete" if prompt_tokens % size == 0 else "partial_block"
            return Explanation(size, prompt_tokens, matched, reason, None)
        state = self.store.inspect(namespace_id, links[matched], now=now)
        facts: dict[str, Any] = {}
        if state.status == "collision":
            reason = "collision_rejected"
        elif state.status == "corrupt":  # damaged, not yet dropped (dropped: the removal log)
            reason = "corrupt"
        elif state.status == "expired":
            reason = "expired"
            facts = {"expired_at": state.expires_at, "retention": state.retention}
        elif state.removal is not None:
            removal = state.removal
            evicted = removal.reason in ROOM_REASONS
            reason = "evicted" if evicted else removal.reason
            facts = {"removed_at": removal.at, "retention": removal.retention}
            if evicted:
                facts["cause"] = removal.reason  # room for everyone, or the tenant's quota
            if removal.reason == "expired":
                facts["expired_at"] = removal.expires_at
        elif state.status == "stored":  # stored between the match and the inspection
            reason = "stored_since"
        else:
            reason, facts = "never_stored", {}
            if matched == 0:
                reason, facts = self._first_block_elsewhere(
                    namespace, links, size, reveal_salts=reveal_salts
                )
        return Explanation(size, prompt_tokens, matched, reason, matched, facts)

    def _first_block_elsewhere(
        self, namespace: Namespace, links: Chain, size: int, *, reveal_salts: bool
    ) -> tuple[str, dict[str, Any]]:
        """Whether the prompt's first block is stored (alive, verified) under another
        namespace or block size of the same tenant."""
        own_root = self.hasher.namespace_id(namespace).root
        partition = tenant_partition(namespace.tenant)
        now = self.clock()
        # A first block's hint fingerprints its first 16 tokens, or all of a shorter block:
        # look under each length a configured block size gives.
        sizes = {size, *self.config.block_sizes()}
        lengths = sorted({HINT_TOKENS, *(min(HINT_TOKENS, s) for s in sizes)})
        homes = [
            home
            for length in lengths
            if tokens_in(links.token_bytes) >= length
            for home in self.store.first_block_homes(
                partition, links.token_bytes[: bytes_of_tokens(length)]
            )
        ]
        homes.sort(key=lambda home: home[0] != own_root)  # its own namespace first
        damaged = 0
        for root, block_size, encoded in homes:
            if (root, block_size) == (own_root, size) or encoded is None:
                continue
            decoded = _decoded_namespace(encoded)
            if decoded is None:
                damaged += 1
                continue
            seed, other = decoded
            if seed != self.hasher.seed or other.tenant != namespace.tenant:
                continue
            if not reveal_salts and other.salt != namespace.salt:
                continue  # a salt keeps users apart: that one exists is for admins alone
            other_links = self.hasher.chain(other, links.token_bytes, block_size=block_size)
            other_id = self.hasher.namespace_id(other)
            first = other_links[:1]
            if not first or not self.store.match(other_id, first, now=now).matched:
                continue  # the hint outlived the block's life (expired, not yet swept)
            if root == own_root:
                return "block_size_differs", {"stored_block_size": block_size}
            return "other_namespace", {
                "model": other.model,
                "kv_layout": other.kv_layout,
                "salt": other.salt if reveal_salts else None,
                "salt_differs": other.salt != namespace.salt,
                "block_size": block_size,
            }
        if damaged:
            return "damaged_namespace", {"damaged_records": damaged}
        return "never_stored", {}

    def _namespace_of(self, scope: StoreKey) -> Namespace | None:
        encoded = self.store.encoded_namespace(scope)
        decoded = _decoded_namespace(encoded) if encoded is not None else None
        return decoded[1] if decoded is not None else None

    def _prefix(
        self,
        namespace: Namespace,
        tokens: TokenInput | None,
        keys: Sequence[BlockKey] | None,
        block_size: int | None,
    ) -> Sequence[ChainLink]:
        """The prefix's links, from its tokens, or from its keys as the store holds them."""
        if keys is not None:
            if not keys:
                raise InvalidField("keys", "a pin needs at least one block")
            return self.store.links_of(self.hasher.namespace_id(namespace), keys, now=self.clock())
        if tokens is None:
            raise InvalidField("tokens", "give the prefix's tokens or its keys")
        chain = self._chain(namespace, tokens, block_size)
        if not len(chain):
            raise InvalidField("tokens", "a pin needs at least one full block of tokens")
        return chain


def _decoded_namespace(encoded: bytes) -> tuple[str, Namespace] | None:
    """(seed, namespace) from a stored namespace record; None for a damaged one (the
    namespaces table has no checksum: truncated or garbled bytes must not fail a request)."""
    try:
        return decode_namespace(bytes(encoded))
    except (ValueError, struct.error):  # UnicodeDecodeError is a ValueError
        return None
