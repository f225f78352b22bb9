"""Lookups and writes, written once over a backend's transactions and the store's parts.

Invariants every operation keeps (with those of `parts.records`):
- prefix-closed: a stored block's parent is stored, and a block's expiry is never earlier
  than any stored descendant's;
- verified: a block is only reported when its stored namespace, depth, parent key and tokens
  equal the request's;
- damage is a miss: a record or payload that fails verification is read as absent, and its
  key noted in the damage log for `drop_damaged` (reads never write).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cache_service.core.blocks import (
    BlockKey,
    BlockMeta,
    ChainLink,
    InsertResult,
    MatchResult,
    NamespaceId,
    NewBlock,
    StoreKey,
    StoreUsage,
    Touch,
    store_key,
)
from cache_service.core.errors import MissingParent
from cache_service.core.eviction import Use
from cache_service.core.lifetimes import UNBOUNDED
from cache_service.core.store.parts.backend import PayloadSink, Txn
from cache_service.core.store.parts.codec import checksum
from cache_service.core.store.parts.damage import DamageLog
from cache_service.core.store.parts.generic import verified_payload
from cache_service.core.store.parts.records import Records
from cache_service.core.store.parts.removals import record_first_block
from cache_service.core.store.parts.txns import Transactions


def collect_payloads(
    read: Callable[[PayloadSink], int], count: int
) -> tuple[list[bytes | None], int]:
    """`get_payloads` from a store's `read_payloads` (given its sink): each payload copied
    out of its view, None where there is none; and the corrupt count."""
    out: list[bytes | None] = [None] * count

    def keep(index: int, payload: bytes | memoryview | None) -> None:
        out[index] = None if payload is None else bytes(payload)

    return out, read(keep)


class DataPath:
    """match, payload reads, insert and touch over transactions and block records."""

    txns: Transactions  # these three are set by ComposedStore, whose base this is
    records: Records
    damage: DamageLog

    def match(
        self,
        namespace: NamespaceId,
        links: Sequence[ChainLink],
        *,
        now: float,
        with_payloads: bool = False,
        sink: PayloadSink | None = None,
        known: tuple[int, bytes] | None = None,
        copied: bool = False,
    ) -> MatchResult:
        """Count the leading links that are stored, alive and verified; with payloads, each
        verified payload goes to `sink` (a view valid during the call, or with `copied` bytes
        of its own, copied before they are checked: one pass over the stored bytes) or into
        the result. `known` = (n, incarnation): the first n links were verified before and
        block n-1 had that incarnation; if it still has, they are not read again."""
        matched = collisions = corrupt = 0
        collected: list[bytes] = []

        def collect(_index: int, payload: bytes | memoryview | None) -> None:
            assert payload is not None
            collected.append(bytes(payload))

        keep = sink or collect
        with self.txns.read(views=with_payloads) as txn:
            part = namespace.partition
            encoded = txn.get_namespace(namespace.scope) if links else None
            if encoded is not None and encoded != namespace.encoded:  # another namespace's root
                return MatchResult(matched=0, collisions=1, payloads=() if with_payloads else None)
            if not with_payloads:
                start = 0
                # The memo rests on "a parent never expires before its child", which holds
                # while no write is ahead of the clock; while one is, a parent may be from the
                # future (read as absent) under a younger child: every block is read.
                if known and known[0] and txn.judging(now) is UNBOUNDED:
                    held = txn.incarnation(store_key(part, links[known[0] - 1].key), now)
                    if held == known[1]:
                        start = known[0]  # still the very copy verified before: it stands
                more, collisions = txn.count_hits(namespace, links, start, now)
                matched = start + more
                last = (
                    txn.incarnation(store_key(part, links[matched - 1].key), now)
                    if matched
                    else None
                )
                return MatchResult(matched=matched, collisions=collisions, incarnation=last)
            matched, collisions, corrupt = txn.read_hits(
                namespace, links, now, keep, copied=copied, damage=self.damage
            )
        return MatchResult(
            matched=matched,
            collisions=collisions,
            payloads=None if sink else tuple(collected),
            corrupt=corrupt,
        )

    def get_payloads(
        self, namespace: NamespaceId, keys: Sequence[BlockKey], *, now: float
    ) -> tuple[list[bytes | None], int]:
        """Payloads of alive blocks of one namespace; None where absent, foreign or corrupt."""
        return collect_payloads(
            lambda sink: self.read_payloads(namespace, keys, now=now, sink=sink), len(keys)
        )

    def read_payloads(
        self, namespace: NamespaceId, keys: Sequence[BlockKey], *, now: float, sink: PayloadSink
    ) -> int:
        """Hand each key's verified payload to `sink(index, view)` (None where absent,
        foreign or corrupt; the view is valid only during the call); returns the corrupt count."""
        corrupt = 0
        part = namespace.partition
        with self.txns.read(views=True) as txn:
            foreign = bool(keys) and txn.get_namespace(namespace.scope) != namespace.encoded
            lifetimes = txn.judging(now)
            for index, key in enumerate(keys):
                meta = None if foreign else txn.get(store_key(part, key))
                if (
                    meta is None
                    or not meta.is_alive(now, lifetimes)
                    or meta.namespace_root != namespace.root
                ):
                    sink(index, None)
                    continue
                payload = verified_payload(txn, meta, self.damage)
                corrupt += payload is None
                sink(index, payload)
        return corrupt

    def usage(self) -> StoreUsage:
        """Blocks, payload bytes and the space the backend really uses."""
        with self.txns.read() as txn:
            return txn.usage()

    def tenant_bytes(self, partition: bytes) -> int:
        """A tenant's estimated bytes (its blocks' payloads, records and index entries)."""
        with self.txns.read() as txn:
            return self.records.tenants.held(txn, partition) or 0

    # -- writes -------------------------------------------------------------------------------

    def insert(
        self,
        namespace: NamespaceId,
        blocks: Sequence[NewBlock],
        *,
        parent: ChainLink | None,
        now: float,
        retention: str,
        ttl_seconds: float,
    ) -> InsertResult:
        """Store consecutive blocks of one chain in one transaction; MissingParent if
        `parent` is not stored."""
        if not blocks:
            return InsertResult()
        expires_at = now + ttl_seconds
        stored: list[StoreKey] = []
        refreshed = conflicts = collisions = tenant_bytes = 0
        part = namespace.partition
        records, tenants = self.records, self.records.tenants
        policy = records.victims.policy
        with self.txns.write() as txn:
            held_namespace = txn.get_namespace(namespace.scope)
            if held_namespace is not None and held_namespace != namespace.encoded:
                # Another namespace hashed to the same root: it keeps it, this one stores nothing.
                return InsertResult(collisions=len(blocks))
            if parent is not None:  # before any write: a refused request changes nothing
                _check_parent(txn, namespace, parent, now)
            if held_namespace is None:
                txn.put_namespace(namespace.scope, namespace.encoded)
            first_seq = txn.next_seq(len(blocks))
            first_expiry, first_class = expires_at, retention
            unsaved: BlockMeta | None = None  # the last new block, not yet written
            for index, block in enumerate(blocks):
                # Tail first: the head of a request gets the newest use sequence.
                seq = first_seq + len(blocks) - 1 - index
                link = block.link
                key = store_key(part, link.key)
                # The unsaved block is not in the store yet, but a key equal to it (a hash
                # collision inside the chain) must meet it as any stored block.
                old = unsaved if unsaved is not None and unsaved.key == key else txn.get(key)
                if old is None and key in txn.damaged:
                    # Not written over (its lost children count would orphan its subtree):
                    # drop_damaged removes it with its subtree, and the next store succeeds.
                    break
                foreign = old is not None and old.namespace_root != namespace.root
                if old is not None and (foreign or not old.holds(link)):
                    collisions += 1
                    break
                sum_ = checksum(block.payload)
                if old is not None and old.is_alive(now, txn.judging(now)):
                    conflicts += sum_ != old.checksum or len(block.payload) != old.payload_size
                    refreshed += 1
                    before = records.position(old)
                    old.last_used_at = max(old.last_used_at, now)
                    old.eviction_rank = policy.rank(old, seq=seq, use=Use.REFRESHED)
                    old.expires_at, old.retention = _later_expiry(old, expires_at, retention)
                    records.save(txn, old, before)
                    new = old
                else:
                    held_until, held_class = expires_at, retention
                    if old is not None and old.children and old.expires_at > expires_at:
                        # It was from the future: its children may outlive this TTL, and no
                        # block expires before a descendant. The longest class covers them.
                        held_until, held_class = _inner_expiry(txn, now, expires_at, retention)
                    new = BlockMeta(
                        key=key,
                        namespace_root=namespace.root,
                        parent=link.parent,
                        depth=link.depth,
                        tokens=link.tokens,
                        payload_size=len(block.payload),
                        checksum=sum_,
                        created_at=now,
                        last_used_at=now,
                        expires_at=held_until,
                        retention=held_class,
                        children=old.children if old is not None else 0,
                        eviction_rank=seq,
                        indexed_expiry=old.indexed_expiry if old is not None else 0.0,
                        stored_seq=seq,
                    )
                    new.eviction_rank = policy.rank(new, seq=seq, use=Use.STORED)
                    txn.put_payload(key, block.payload)
                    txn.add_payload_bytes(new.payload_size - (old.payload_size if old else 0))
                    if part:  # only tenants' bytes are counted: the default tenant has no quota
                        tenant_bytes += tenants.delta(new, old)
                    if old is None and link.depth > 0:
                        if unsaved is not None and unsaved.key == new.parent_key:
                            unsaved.children += 1  # its parent came in this write: saved once
                        else:
                            records.add_child(txn, new.parent_key)
                    if unsaved is not None:
                        records.save(txn, unsaved, None, new=True)
                        unsaved = None
                    if old is None:
                        unsaved = new  # saved once its child, if any, is counted on it
                    else:  # an expired block replaced: its early expiry entry stays valid
                        records.save(txn, new, records.position(old))
                    if link.depth == 0:
                        record_first_block(txn, new)
                    stored.append(key)
                if index == 0:
                    first_expiry, first_class = new.expires_at, new.retention
            if unsaved is not None:
                records.save(txn, unsaved, None, new=True)
            tenants.add(txn, part, tenant_bytes)
            written = len(stored) + refreshed
            last = None
            if written:
                head = blocks[0].link
                if head.depth > 0:
                    _lift_expiry(txn, store_key(part, head.parent), first_expiry, first_class)
                last = txn.incarnation(store_key(part, blocks[written - 1].link.key), now)
        return InsertResult(
            stored=tuple(stored),
            refreshed=refreshed,
            conflicts=conflicts,
            collisions=collisions,
            last_incarnation=last,
        )

    def touch(
        self,
        touches: Sequence[Touch],
        *,
        resolution_seconds: float = 0.0,
        slide_fraction: float = 0.0,
    ) -> None:
        """Apply verified hits. A use is recorded on the hit's deepest block only (the policy
        passes a removed child's record to its parent, so by the time an ancestor can be
        evicted it ranks as if every hit had marked it). Expiry slides on the whole prefix,
        as it must stay alive as long as its deepest block.

        A hit is skipped when its deepest block was used less than `resolution_seconds`
        before; its expiry slides only when that moves it by more than the resolution and
        than `slide_fraction` of the class TTL. A hot prefix is then rewritten once a second,
        and a long one slid at most once per slide period, not per hit."""
        if not touches:
            return
        with self.txns.write() as txn:
            for hit in touches:
                if hit.keys:
                    self._touch_one(txn, hit, resolution_seconds, slide_fraction)

    def _touch_one(
        self, txn: Txn, hit: Touch, resolution_seconds: float, slide_fraction: float
    ) -> None:
        for key in reversed(hit.keys):  # the deepest block still stored: nearly always the last
            meta = txn.get(store_key(hit.partition, key))
            if meta is not None:
                break
        else:
            return  # all evicted since the lookup
        expires_at = hit.at + hit.ttl_seconds
        slack = max(resolution_seconds, hit.ttl_seconds * slide_fraction)
        slide = expires_at - meta.expires_at > slack or (
            slack == 0 and expires_at > meta.expires_at
        )
        if not slide and hit.at - meta.last_used_at < resolution_seconds:
            return
        before = self.records.position(meta)
        meta.last_used_at = max(meta.last_used_at, hit.at)
        meta.hits += hit.uses
        meta.eviction_rank = self.records.victims.policy.rank(
            meta, seq=txn.next_seq(1), use=Use.HIT
        )
        if slide:
            meta.expires_at, meta.retention = _later_expiry(meta, expires_at, hit.retention)
        self.records.save(txn, meta, before)
        if slide and meta.depth > 0:
            _lift_expiry(txn, meta.parent_key, meta.expires_at, meta.retention)


def _check_parent(txn: Txn, namespace: NamespaceId, parent: ChainLink, now: float) -> None:
    """MissingParent unless `parent` is stored, alive and verified."""
    held = txn.get(store_key(namespace.partition, parent.key))
    if (
        held is None
        or not held.is_alive(now, txn.judging(now))
        or held.namespace_root != namespace.root
        or not held.holds(parent)
    ):
        raise MissingParent(
            f"block {parent.depth} (the parent of block {parent.depth + 1}) is not "
            "stored: send it in the same request (lower start_block)",
            parent_block=parent.depth,
        )


def _lift_expiry(txn: Txn, key: StoreKey, expires_at: float, retention: str) -> None:
    """Raise the expiry of `key` and its ancestors to at least `expires_at`, so none
    expires before a descendant; stops at the first that already lives as long."""
    at: StoreKey | None = key
    while at is not None:
        at = txn.lift_expiry(at, expires_at, retention)


def _inner_expiry(txn: Txn, now: float, expires_at: float, retention: str) -> tuple[float, str]:
    """The expiry of a block whose children may have been stored as late as the longest
    class allows: the longest class's from now, unless `expires_at` is later."""
    lifetimes = txn.lifetimes
    longest = now + lifetimes.longest_ttl_seconds
    if longest > expires_at:
        return longest, lifetimes.longest_class
    return expires_at, retention


def _later_expiry(meta: BlockMeta, expires_at: float, retention: str) -> tuple[float, str]:
    """Keep the later expiry; the recorded class is the one that gave it."""
    if expires_at > meta.expires_at:
        return expires_at, retention
    return meta.expires_at, meta.retention
