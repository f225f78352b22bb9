"""PrefixCache: longest-prefix lookup, insert, touch, eviction and expiry over a BlockStore."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cache_service.core.blocks import (
    BlockKey,
    Chain,
    Evicted,
    Namespace,
    NamespaceId,
    NewBlock,
    PrefixMatch,
    Touch,
)
from cache_service.core.cache_observer import CacheObserver
from cache_service.core.capacity import Capacity, CapacityLimits
from cache_service.core.config import CacheConfig
from cache_service.core.errors import InsufficientStorage, InvalidField, StoreFull
from cache_service.core.hashing import BlockHasher
from cache_service.core.recent import RecentMatch, RecentMatches
from cache_service.core.retention import RetentionPolicy
from cache_service.core.store.protocols import BlockStore
from cache_service.core.tokens import TokenInput, as_token_bytes, tokens_in
from cache_service.core.touches import TouchBuffer, TouchOptions

Clock = Callable[[], float]
PayloadSink = Callable[[int, bytes | memoryview | None], None]

STORE_FULL_RETRIES = 3


def check_lifetimes(store: BlockStore, retention: RetentionPolicy) -> None:
    """ValueError unless `store` judges lifetimes by `retention`'s table (see PrefixCache)."""
    wanted = retention.lifetimes()
    if store.lifetimes != wanted:
        raise ValueError(
            f"the store was opened with lifetimes {store.lifetimes.describe()}, but the "
            f"cache's retention classes are {wanted.describe()}: open the store with "
            "lifetimes=retention.lifetimes()"
        )


@dataclass(frozen=True, slots=True)
class InsertOutcome:
    """What a store request did."""

    keys: tuple[BlockKey, ...]  # keys of the blocks the caller sent, in order
    requested: int  # blocks the caller sent
    stored: int  # blocks newly stored and still held after capacity enforcement
    refreshed: int  # blocks that were already stored (refreshed, first writer kept)
    conflicts: int  # of those, how many had different payload bytes
    truncated: int  # blocks not stored because the request is larger than the cache
    collisions: int  # blocks refused because another block holds their key


class PrefixCache:
    """A prefix cache of KV blocks: chained keys matched in one BlockStore. Its collaborators:
    `config` (block sizes, retention), `capacity` (its `limits`; eviction, expiry, usage),
    `touches` (hits on their way to the store, as `TouchOptions` say) and `events` (what it
    reports).

    The store must have been opened with the retention's lifetimes
    (`lifetimes=config.retention.lifetimes()`): it reads a block whose expiry is further than
    its class's TTL from now as expired (stored while the clock ran ahead), and gives an
    inner or unpinned block the longest class's TTL. A store that judges by another table,
    or by none, is refused (ValueError naming both): the cache never changes a store it is
    given."""

    def __init__(
        self,
        store: BlockStore,
        *,
        config: CacheConfig | None = None,
        limits: CapacityLimits | None = None,
        touches: TouchOptions | None = None,
        hasher: BlockHasher | None = None,
        clock: Clock = time.time,
        events: CacheObserver | None = None,
    ) -> None:
        self.config = config or CacheConfig()
        check_lifetimes(store, self.config.retention)
        self.store = store
        self.hasher = hasher or BlockHasher()
        self.clock = clock
        self.events = events or CacheObserver()
        self.capacity = Capacity(store, limits, clock=clock, events=self.events)
        self.touches = TouchBuffer(store, touches)
        self._recent = RecentMatches()

    # -- hashing --------------------------------------------------------------------------------

    def chain(
        self, namespace: Namespace, tokens: TokenInput, *, block_size: int | None = None
    ) -> Chain:
        """The chain links of every full block of a prompt."""
        size = self.config.block_size_for(namespace.model, block_size)
        return self.hasher.chain(namespace, as_token_bytes(tokens), block_size=size)

    # -- lookups ------------------------------------------------------------------------------

    def match_prefix(
        self,
        namespace: Namespace,
        tokens: TokenInput,
        *,
        retention: str | None = None,
        block_size: int | None = None,
        with_payloads: bool = False,
        touch: bool = True,
        sink: PayloadSink | None = None,
    ) -> PrefixMatch:
        """The longest stored, alive and verified prefix of a prompt (a miss is empty); with
        payloads, each goes to `sink(index, view)` if given, else into the match."""
        retention_class, ttl = self.config.resolve_retention(retention)
        size = self.config.block_size_for(namespace.model, block_size)
        token_bytes = as_token_bytes(tokens)
        scope = self.hasher.namespace_id(namespace).scope
        recent = None if with_payloads else self._recent.get(scope, size, token_bytes)
        links = (
            recent.chain if recent else self.hasher.chain(namespace, token_bytes, block_size=size)
        )
        found = self._match_links(
            namespace,
            links,
            block_size=size,
            prompt_tokens=tokens_in(token_bytes),
            retention=retention_class,
            with_payloads=with_payloads,
            sink=sink,
            known=(recent.matched, recent.incarnation) if recent else None,
        )
        if touch and found.keys:
            self._touch_match(namespace, found, ttl)
        self._repair_now()
        return found

    def _touch_match(self, namespace: Namespace, found: PrefixMatch, ttl_seconds: float) -> None:
        """Record the verified hit a lookup found, under its retention class."""
        self.touch(
            found.keys,
            at=self.clock(),
            retention=found.retention,
            ttl_seconds=ttl_seconds,
            partition=self.hasher.namespace_id(namespace).partition,
        )

    def _mend_namespace(self, namespace_id: NamespaceId) -> bool:
        """Whether the namespace record stored for this scope was damaged, and is now
        replaced. A namespace's root is the hash of its encoded bytes: a stored copy that
        hashes to another root is damaged (it locked its namespace out, every block of it
        read as a collision), while a genuine other namespace whose root collides with this
        one hashes to it, and keeps it."""
        held = self.store.encoded_namespace(namespace_id.scope)
        if held is None or held == namespace_id.encoded:
            return False
        if self.hasher.root_of(held) == namespace_id.root:
            return False  # a real collision: the first namespace keeps the root
        if not self.store.replace_namespace(namespace_id.scope, held, namespace_id.encoded):
            return False
        self.events.on_corrupt_records(1)
        return True

    def _match_links(
        self,
        namespace: Namespace,
        links: Chain,
        *,
        block_size: int,
        prompt_tokens: int,
        retention: str,
        with_payloads: bool = False,
        sink: PayloadSink | None = None,
        known: tuple[int, bytes] | None = None,
    ) -> PrefixMatch:
        namespace_id = self.hasher.namespace_id(namespace)
        result = self.store.match(
            namespace_id, links, now=self.clock(), with_payloads=with_payloads, sink=sink,
            known=known,
        )  # fmt: skip
        if result.collisions and not result.matched and self._mend_namespace(namespace_id):
            result = self.store.match(
                namespace_id, links, now=self.clock(), with_payloads=with_payloads, sink=sink,
            )  # fmt: skip
        # A memo that held already (same depth, same copy) stays as it is: putting it again
        # would hash the whole prompt once more for its key.
        if result.incarnation is not None and known != (result.matched, result.incarnation):
            self._recent.put(
                namespace_id.scope,
                block_size,
                RecentMatch(links, result.matched, result.incarnation),
            )
        found = PrefixMatch(
            block_size=block_size,
            prompt_tokens=prompt_tokens,
            keys=tuple(links.keys[: result.matched]),
            payloads=result.payloads,
            retention=retention,
            key_texts=links.hex_keys(result.matched),
        )
        if result.collisions:
            self.events.on_collision(result.collisions)
        if result.corrupt:
            self.events.on_corrupt(result.corrupt)
        self.events.on_lookup(
            retention=retention,
            hit_tokens=found.cached_tokens,
            miss_tokens=found.miss_tokens,
            complete=result.matched == len(links),
            tenant=namespace.tenant,
        )
        return found

    def lookup_and_fill(
        self,
        namespace: Namespace,
        tokens: TokenInput,
        *,
        retention: str | None = None,
        payload: bytes = b"",
    ) -> tuple[PrefixMatch, InsertOutcome]:
        """Serve one request as a worker does through the service: look up (the hit is a use
        of its prefix, as a lookup's touch is), then store the blocks that missed (each with
        `payload`). The service's order, with the hit applied at once (a service applies it
        at its next touch flush)."""
        retention_class, ttl = self.config.resolve_retention(retention)
        size = self.config.block_size_for(namespace.model)
        token_bytes = as_token_bytes(tokens)
        links = self.hasher.chain(namespace, token_bytes, block_size=size)
        with self.store.batch():  # one transaction: a replay commits once per request
            found = self._match_links(
                namespace,
                links,
                block_size=size,
                prompt_tokens=tokens_in(token_bytes),
                retention=retention_class,
            )
            if found.keys:
                self._touch_match(namespace, found, ttl)
            outcome = self._store_links(
                namespace,
                links,
                [payload] * (len(links) - found.matched_blocks),
                start_block=found.matched_blocks,
                retention=retention_class,
                ttl_seconds=ttl,
            )
        self._repair_now()
        return found, outcome

    def touch(
        self,
        keys: Sequence[BlockKey],
        *,
        at: float,
        retention: str,
        ttl_seconds: float,
        partition: bytes = b"",
    ) -> None:
        """Record a verified hit on a prefix (of the tenant `partition`); applied now or at
        the next flush."""
        hit = Touch(
            keys=tuple(keys),
            at=at,
            retention=retention,
            ttl_seconds=ttl_seconds,
            partition=partition,
        )
        self.touches.add(hit)

    def read_payloads(
        self, namespace: Namespace, keys: Sequence[BlockKey], sink: PayloadSink
    ) -> None:
        """Hand each block's checked payload to `sink(index, view)`, None for one that is gone."""
        namespace_id = self.hasher.namespace_id(namespace)
        corrupt = self.store.read_payloads(namespace_id, keys, now=self.clock(), sink=sink)
        if corrupt:
            self.events.on_corrupt(corrupt)
        self._repair_now()

    def get_payloads(self, namespace: Namespace, keys: Sequence[BlockKey]) -> list[bytes | None]:
        """Checked payloads of blocks of one namespace; None for a block that is gone."""
        namespace_id = self.hasher.namespace_id(namespace)
        payloads, corrupt = self.store.get_payloads(namespace_id, keys, now=self.clock())
        if corrupt:
            self.events.on_corrupt(corrupt)
        self._repair_now()
        return payloads

    # -- writes -------------------------------------------------------------------------------

    def insert(
        self,
        namespace: Namespace,
        tokens: TokenInput,
        payloads: Sequence[bytes | memoryview],
        *,
        start_block: int = 0,
        retention: str | None = None,
        block_size: int | None = None,
    ) -> InsertOutcome:
        """Store blocks start_block.. of a prompt; their parent must be stored or sent."""
        retention_class, ttl = self.config.resolve_retention(retention)
        links = self.chain(namespace, tokens, block_size=block_size)
        try:
            return self._store_links(
                namespace,
                links,
                payloads,
                start_block=start_block,
                retention=retention_class,
                ttl_seconds=ttl,
            )
        finally:  # a damaged parent refuses the insert (MissingParent): drop it all the same
            self._repair_now()

    def _store_links(
        self,
        namespace: Namespace,
        links: Chain,
        payloads: Sequence[bytes | memoryview],
        *,
        start_block: int,
        retention: str,
        ttl_seconds: float,
    ) -> InsertOutcome:
        if start_block < 0 or start_block > len(links):
            raise InvalidField(
                "start_block", f"must be between 0 and {len(links)} (the prompt's full blocks)"
            )
        if start_block + len(payloads) > len(links):
            raise InvalidField(
                "payloads",
                f"{len(payloads)} payloads from block {start_block} exceed the prompt's "
                f"{len(links)} full blocks",
            )
        blocks = [NewBlock(links[start_block + i], p) for i, p in enumerate(payloads)]
        if not blocks:
            return InsertOutcome((), 0, 0, 0, 0, 0, 0)
        fitting = self.capacity.fit(blocks, start_block)
        keys = tuple(block.link.key for block in blocks)
        if blocks and not fitting:
            if self.capacity.capacity_blocks is not None:  # the prefix before start_block fills it
                return InsertOutcome(keys, len(blocks), 0, 0, 0, len(blocks), 0)
            raise InsufficientStorage(
                "the first block alone is larger than the cache's capacity",
                capacity_bytes=self.capacity.capacity_bytes,
            )
        parent = links[start_block - 1] if start_block > 0 else None
        namespace_id = self.hasher.namespace_id(namespace)
        result = None
        for _ in range(STORE_FULL_RETRIES):
            now = self.clock()
            try:
                result = self.store.insert(
                    namespace_id,
                    fitting,
                    parent=parent,
                    now=now,
                    retention=retention,
                    ttl_seconds=ttl_seconds,
                )
                break
            except StoreFull:
                if not self.capacity.make_room(
                    sum(self.capacity.estimate(b) for b in fitting), now
                ):
                    break
        if result is None:
            raise InsufficientStorage("the store is full and nothing in it can be evicted")
        nothing_written = not (result.stored or result.refreshed)
        if result.collisions and nothing_written and self._mend_namespace(namespace_id):
            return self._store_links(namespace, links, payloads, start_block=start_block,
                                     retention=retention, ttl_seconds=ttl_seconds)  # fmt: skip
        evicted = {e.key for e in self.capacity.enforce(set(result.stored))}
        evicted |= {e.key for e in self.capacity.enforce_tenant(
            namespace.tenant, protected=frozenset(result.stored))}  # fmt: skip
        kept = set(result.stored) - evicted
        # The request's own blocks go only when they alone overflow the cache: truncated too.
        own_evicted = len(result.stored) - len(kept)
        if result.last_incarnation is not None and not own_evicted and start_block == 0:
            # Written from block 0, every block was checked against this prompt's tokens (an
            # insert from a later block checks only its parent): the next lookup of the same
            # prompt then needs one read, as after a lookup.
            written = len(result.stored) + result.refreshed
            self._recent.put(
                namespace_id.scope,
                links.block_size,
                RecentMatch(links, written, result.last_incarnation),
            )
        if result.collisions:
            self.events.on_collision(result.collisions)
        self.events.on_insert(
            stored=len(kept), refreshed=result.refreshed, conflicts=result.conflicts
        )
        return InsertOutcome(
            keys=keys,
            requested=len(blocks),
            stored=len(kept),
            refreshed=result.refreshed,
            conflicts=result.conflicts,
            truncated=len(blocks) - len(fitting) + own_evicted,
            collisions=result.collisions,
        )

    # -- removal on request -------------------------------------------------------------------

    def remove_block(self, namespace: Namespace, key: BlockKey) -> list[Evicted]:
        """Remove the block of chain key `key` and every block stored under it (an engine
        dropped it); each is reported to the events as "removed". Unknown key: nothing."""
        now = self.clock()
        removed = self.store.remove_subtree(self.hasher.namespace_id(namespace), key, now=now)
        if removed:
            self.events.on_evicted(removed, now=now)
        self._repair_now()
        return removed

    # -- damage -------------------------------------------------------------------------------

    @property
    def damage_pending(self) -> int:
        """Damaged blocks reads found, waiting for `drop_damaged`."""
        return self.store.damage_pending()

    def drop_damaged(self) -> int:
        """Remove the blocks reads found damaged (a record or payload that failed
        verification) with their subtrees: each damaged record is counted, and every removed
        block is reported as "corrupt". A server runs this with its touch flush; without
        deferred touches it runs at once. Returns how many blocks went."""
        now = self.clock()
        dropped = self.store.drop_damaged(now=now, ttl_seconds=self.config.longest_ttl_seconds)
        if dropped.records:
            self.events.on_corrupt_records(dropped.records)
        if dropped.removed:
            self.events.on_evicted(dropped.removed, now=now)
        return len(dropped.removed)

    def _repair_now(self) -> None:
        """Without deferred touches (a replay), damage a call found is dropped at once."""
        if not self.touches.options.defer and self.store.damage_pending():
            self.drop_damaged()
