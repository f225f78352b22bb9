"""The store's algorithms, written once over backend transactions.

Invariants every operation keeps:
- prefix-closed: a stored block's parent is stored (blocks are evicted leaf first, and a
  block's expiry is never earlier than any stored descendant's);
- verified: a block is only reported when its stored parent key and tokens equal the request's;
- `children` counts a block's stored children; only blocks with none are in the victims index.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager

import xxhash

from cache_service.blocks import (
    BlockKey,
    BlockMeta,
    ChainLink,
    Evicted,
    InsertResult,
    MatchResult,
    NamespaceId,
    NewBlock,
    StoreUsage,
    Touch,
    link_parts,
)
from cache_service.errors import MissingParent
from cache_service.eviction import EvictionPolicy, LruPolicy
from cache_service.store.base import EXPIRY, VICTIMS, BlockTxn
from cache_service.store.codec import COLLISION, HIT

PayloadSink = Callable[[int, "bytes | memoryview | None"], None]
SCAN_FIRST = 4  # most scans need one entry: start small, widen when entries are skipped
SCAN_MOST = 1024
_Indexed = bytes | None  # the victims sort key while the block is a leaf


def checksum(payload: bytes | memoryview) -> int:
    """The payload checksum kept with every block (xxh3-64)."""
    return int(xxhash.xxh3_64_intdigest(payload))


def expiry_sort_key(expires_at: float) -> bytes:
    """Non-negative floats sort as their big-endian IEEE bytes."""
    return struct.pack(">d", max(expires_at, 0.0))


class TxnStore:
    """BlockStore operations over a backend that supplies read and write transactions."""

    def __init__(self, *, policy: EvictionPolicy | None = None) -> None:
        self.policy: EvictionPolicy = policy or LruPolicy()
        self._batch = threading.local()

    def _begin_read(self, *, views: bool = False) -> AbstractContextManager[BlockTxn]:
        """A read transaction; with `views`, payload reads may return views into the store
        that stay valid until the transaction ends (no copy)."""
        raise NotImplementedError

    def _begin_write(self) -> AbstractContextManager[BlockTxn]:
        raise NotImplementedError

    @contextmanager
    def _read(self, *, views: bool = False) -> Iterator[BlockTxn]:
        batch: BlockTxn | None = getattr(self._batch, "txn", None)
        if batch is not None:
            yield batch
            return
        with self._begin_read(views=views) as txn:
            yield txn

    @contextmanager
    def _write(self) -> Iterator[BlockTxn]:
        batch: BlockTxn | None = getattr(self._batch, "txn", None)
        if batch is not None:
            yield batch
            return
        with self._begin_write() as txn:
            yield txn

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Run this thread's store calls inside one write transaction (one commit).

        All or nothing: an error anywhere aborts every call in the batch. Meant for the
        replay, whose store is private; a server keeps its transactions short instead.
        """
        if getattr(self._batch, "txn", None) is not None:
            yield
            return
        with self._begin_write() as txn:
            self._batch.txn = txn
            try:
                yield
            finally:
                self._batch.txn = None

    # -- index upkeep -------------------------------------------------------------------------

    def _victim_key(self, meta: BlockMeta) -> bytes:
        return struct.pack(">Q", self.policy.priority(meta))

    def _indexed(self, meta: BlockMeta) -> _Indexed:
        """Where a block stands in the victims index now; taken before changing it."""
        return self._victim_key(meta) if meta.children == 0 else None

    def _save(self, txn: BlockTxn, meta: BlockMeta, before: _Indexed, *, new: bool = False) -> None:
        """Write `meta`, moving its victims entry from `before`; a new block joins the expiry
        index. Later expiry changes leave that entry early on purpose: sliding a block's TTL
        on every hit then costs no index write, and the sweeper re-files early entries."""
        victim = self._victim_key(meta) if meta.children == 0 else None
        if before != victim:
            if before is not None:
                txn.index_remove(VICTIMS, before, meta.key)
            if victim is not None:
                txn.index_add(VICTIMS, victim, meta.key)
        if new:
            meta.indexed_expiry = meta.expires_at
            txn.index_add(EXPIRY, expiry_sort_key(meta.expires_at), meta.key)
        txn.put(meta)

    def _refile_expiry(self, txn: BlockTxn, meta: BlockMeta) -> None:
        """Move an early expiry entry to the block's real expiry."""
        txn.index_remove(EXPIRY, expiry_sort_key(meta.indexed_expiry), meta.key)
        meta.indexed_expiry = meta.expires_at
        txn.index_add(EXPIRY, expiry_sort_key(meta.expires_at), meta.key)
        txn.put(meta)

    def _drop(self, txn: BlockTxn, meta: BlockMeta) -> bool:
        """Delete a leaf block; True when that made its parent a leaf."""
        txn.index_remove(VICTIMS, self._victim_key(meta), meta.key)
        txn.index_remove(EXPIRY, expiry_sort_key(meta.indexed_expiry), meta.key)
        txn.delete(meta.key)
        txn.add_payload_bytes(-meta.payload_size)
        if meta.depth == 0:
            return False
        parent = txn.get(meta.parent)
        if parent is None:
            return False
        before = self._indexed(parent)
        parent.children = max(parent.children - 1, 0)
        self._save(txn, parent, before)
        return parent.children == 0

    # -- reads --------------------------------------------------------------------------------

    def match(
        self,
        namespace: NamespaceId,
        links: Sequence[ChainLink],
        *,
        now: float,
        with_payloads: bool = False,
        sink: PayloadSink | None = None,
        known: tuple[int, bytes] | None = None,
    ) -> MatchResult:
        """Count the leading links that are stored, alive and verified; with payloads, each
        verified payload goes to `sink` (a view valid during the call) or into the result."""
        matched = collisions = corrupt = 0
        collected: list[bytes] = []

        def collect(_index: int, payload: bytes | memoryview | None) -> None:
            assert payload is not None
            collected.append(bytes(payload))

        keep = sink or collect
        with self._read(views=with_payloads) as txn:
            encoded = txn.get_namespace(namespace.root) if links else None
            if encoded is not None and encoded != namespace.encoded:  # another namespace's root
                return MatchResult(matched=0, collisions=1, payloads=() if with_payloads else None)
            root = namespace.root
            if not with_payloads:
                start = 0
                if known and known[0] and txn.incarnation(links[known[0] - 1].key, now) == known[1]:
                    start = known[0]  # still the very copy verified before: its prefix stands
                more, collisions = txn.count_hits(root, links, start, now)
                matched = start + more
                last = txn.incarnation(links[matched - 1].key, now) if matched else None
                return MatchResult(matched=matched, collisions=collisions, incarnation=last)
            for key, parent, tokens, depth in link_parts(links):
                status = txn.check(key, root + parent, tokens, depth, now)
                if status != HIT:
                    collisions += status == COLLISION
                    break
                meta = txn.get(key)
                payload = _verified_payload(txn, meta) if meta is not None else None
                if payload is None:
                    corrupt += 1
                    break
                keep(matched, payload)
                matched += 1
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
        out: list[bytes | None] = [None] * len(keys)

        def keep(index: int, payload: bytes | memoryview | None) -> None:
            out[index] = None if payload is None else bytes(payload)

        return out, self.read_payloads(namespace, keys, now=now, sink=keep)

    def read_payloads(
        self, namespace: NamespaceId, keys: Sequence[BlockKey], *, now: float, sink: PayloadSink
    ) -> int:
        """Hand each key's verified payload to `sink(index, view)` (None where absent,
        foreign or corrupt; the view is valid only during the call); returns the corrupt count."""
        corrupt = 0
        with self._read(views=True) as txn:
            foreign = bool(keys) and txn.get_namespace(namespace.root) != namespace.encoded
            for index, key in enumerate(keys):
                meta = None if foreign else txn.get(key)
                if meta is None or not meta.is_alive(now) or meta.namespace_root != namespace.root:
                    sink(index, None)
                    continue
                payload = _verified_payload(txn, meta)
                corrupt += payload is None
                sink(index, payload)
        return corrupt

    def usage(self) -> StoreUsage:
        """Blocks, payload bytes and the space the backend really uses."""
        with self._read() as txn:
            return txn.usage()

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
        """Store consecutive blocks of one chain in one transaction."""
        if not blocks:
            return InsertResult()
        expires_at = now + ttl_seconds
        stored: list[BlockKey] = []
        refreshed = conflicts = collisions = 0
        with self._write() as txn:
            known = txn.get_namespace(namespace.root)
            if known is None:
                txn.put_namespace(namespace.root, namespace.encoded)
            elif known != namespace.encoded:
                # Another namespace hashed to the same root: it keeps it, this one stores nothing.
                return InsertResult(collisions=len(blocks))
            if parent is not None:
                held = txn.get(parent.key)
                if (
                    held is None
                    or not held.is_alive(now)
                    or held.namespace_root != namespace.root
                    or not held.holds(parent)
                ):
                    raise MissingParent(
                        f"block {parent.depth} (the parent of block {parent.depth + 1}) is not "
                        "stored: send it in the same request (lower start_block)",
                        parent_block=parent.depth,
                    )
            first_seq = txn.next_seq(len(blocks))
            first_expiry = expires_at
            for index, block in enumerate(blocks):
                # Tail first: the head of a request gets the newest use sequence.
                seq = first_seq + len(blocks) - 1 - index
                link = block.link
                old = txn.get(link.key)
                foreign = old is not None and old.namespace_root != namespace.root
                if old is not None and (foreign or not old.holds(link)):
                    collisions += 1
                    break
                sum_ = checksum(block.payload)
                if old is not None and old.is_alive(now):
                    conflicts += sum_ != old.checksum or len(block.payload) != old.payload_size
                    refreshed += 1
                    before = self._indexed(old)
                    old.last_used_at = max(old.last_used_at, now)
                    old.lru_seq = seq
                    old.expires_at, old.retention = _later_expiry(old, expires_at, retention)
                    self._save(txn, old, before)
                    new = old
                else:
                    new = BlockMeta(
                        key=link.key,
                        namespace_root=namespace.root,
                        parent=link.parent,
                        depth=link.depth,
                        tokens=link.tokens,
                        payload_size=len(block.payload),
                        checksum=sum_,
                        created_at=now,
                        last_used_at=now,
                        expires_at=expires_at,
                        retention=retention,
                        children=old.children if old is not None else 0,
                        lru_seq=seq,
                        indexed_expiry=old.indexed_expiry if old is not None else 0.0,
                    )
                    txn.put_payload(link.key, block.payload)
                    txn.add_payload_bytes(new.payload_size - (old.payload_size if old else 0))
                    if old is None:
                        self._save(txn, new, None, new=True)
                    else:  # an expired block replaced: its early expiry entry stays valid
                        self._save(txn, new, self._indexed(old))
                    if old is None and link.depth > 0:
                        self._add_child(txn, link.parent)
                    stored.append(link.key)
                if index == 0:
                    first_expiry = new.expires_at
            if stored or refreshed:
                self._touch_ancestors(txn, blocks[0].link, now, first_expiry, retention)
        return InsertResult(
            stored=tuple(stored),
            refreshed=refreshed,
            conflicts=conflicts,
            collisions=collisions,
            prefix_touched=bool(stored or refreshed),
        )

    def _add_child(self, txn: BlockTxn, parent_key: BlockKey) -> None:
        parent = txn.get(parent_key)
        if parent is not None:
            before = self._indexed(parent)
            parent.children += 1
            self._save(txn, parent, before)

    def _touch_ancestors(
        self, txn: BlockTxn, link: ChainLink, now: float, expires_at: float, retention: str
    ) -> None:
        """Storing a block uses its whole prefix: mark the ancestors used, head newest, and
        lift their expiry to at least the block's, so none expires before a descendant."""
        if link.depth == 0:
            return
        first_seq = txn.next_seq(link.depth)
        key, depth = link.parent, link.depth - 1
        while depth >= 0:
            meta = txn.get(key)
            if meta is None:
                return
            before = self._indexed(meta)
            meta.last_used_at = max(meta.last_used_at, now)
            meta.lru_seq = first_seq + link.depth - 1 - depth
            meta.expires_at, meta.retention = _later_expiry(meta, expires_at, retention)
            self._save(txn, meta, before)
            key, depth = meta.parent, meta.depth - 1

    def touch(self, touches: Sequence[Touch], *, resolution_seconds: float = 0.0) -> None:
        """Apply verified hits: mark used (tail first) and slide expiry. A hit whose every
        block was used less than `resolution_seconds` before it, and whose expiry would move
        less than that, is skipped: a hot prefix is then rewritten once a second, not per hit."""
        if not touches:
            return
        with self._write() as txn:
            for hit in touches:
                if resolution_seconds > 0 and hit.keys:
                    # Ancestors are used at least as recently, and expire no earlier, than
                    # the deepest block: if it needs no refresh, none of them does.
                    deepest = txn.get(hit.keys[-1])
                    if deepest is not None and _fresh(deepest, hit, resolution_seconds):
                        continue
                self._touch_one(txn, hit)

    def _touch_one(self, txn: BlockTxn, hit: Touch) -> None:
        # Sequence numbers for every key, tail first (a gap where blocks are gone is harmless).
        last_seq = txn.next_seq(len(hit.keys)) + len(hit.keys) - 1
        expires_at = hit.at + hit.ttl_seconds
        for index, key in enumerate(hit.keys):
            seq = last_seq - index
            done = txn.touch_in_place(key, hit, seq, expires_at)
            if done is None:
                return  # evicted since the lookup; its descendants are gone too
            if done:
                continue
            # A leaf (its victims entry moves) or a change of class: the general path.
            meta = txn.get(key)
            assert meta is not None
            before = self._indexed(meta)
            meta.last_used_at = max(meta.last_used_at, hit.at)
            meta.lru_seq = seq
            meta.hits += hit.uses
            meta.expires_at, meta.retention = _later_expiry(meta, expires_at, hit.retention)
            self._save(txn, meta, before)

    def evict(
        self,
        *,
        now: float,
        max_blocks: int,
        target_used_bytes: int | None = None,
        target_blocks: int | None = None,
        expired_only: bool = False,
        protected: frozenset[BlockKey] = frozenset(),
    ) -> list[Evicted]:
        """Remove leaf blocks, expired first, then in policy order, until a target is met."""
        evicted: list[Evicted] = []
        with self._write() as txn:
            # Each eviction removes exactly one block: a block target is a count, known now.
            if target_blocks is not None:
                max_blocks = min(max_blocks, max(txn.usage().blocks - target_blocks, 0))

            def satisfied() -> bool:
                if len(evicted) >= max_blocks:
                    return True
                if target_used_bytes is None:
                    return False
                return txn.usage().used_bytes <= target_used_bytes

            self._evict_from(
                txn,
                EXPIRY,
                upto=expiry_sort_key(now),
                reason="expired",
                evicted=evicted,
                satisfied=satisfied,
                protected=protected,
                now=now,
            )
            if not expired_only:
                self._evict_from(
                    txn,
                    VICTIMS,
                    upto=None,
                    reason="capacity",
                    evicted=evicted,
                    satisfied=satisfied,
                    protected=protected,
                )
        return evicted

    def _evict_from(
        self,
        txn: BlockTxn,
        index: str,
        *,
        upto: bytes | None,
        reason: str,
        evicted: list[Evicted],
        satisfied: Callable[[], bool],
        protected: frozenset[BlockKey],
        now: float | None = None,
    ) -> None:
        """Drop leaves from the front of `index`; with `now`, expired ancestors follow at once."""
        while not satisfied():
            progressed = False
            for meta in self._candidates(txn, index, upto, protected, now):
                victim: BlockMeta | None = meta
                while victim is not None:
                    new_leaf = self._drop(txn, victim)
                    evicted.append(
                        Evicted(
                            victim.key, reason, victim.retention, victim.expires_at,
                            victim.payload_size,
                        )
                    )  # fmt: skip
                    progressed = True
                    if satisfied():
                        return
                    victim = self._expired_parent(txn, victim, now, protected) if new_leaf else None
                if new_leaf and now is None:
                    break  # the parent may now come first in policy order: scan again
            if not progressed:
                return

    @staticmethod
    def _expired_parent(
        txn: BlockTxn, child: BlockMeta, now: float | None, protected: frozenset[BlockKey]
    ) -> BlockMeta | None:
        """The dropped child's parent when it is now an expired leaf: swept next, so a long
        chain is swept in one pass instead of one index scan per block."""
        if now is None:
            return None
        parent = txn.get(child.parent)
        if parent is None or parent.children or parent.is_alive(now) or parent.key in protected:
            return None
        return parent

    def _candidates(
        self,
        txn: BlockTxn,
        index: str,
        upto: bytes | None,
        protected: frozenset[BlockKey],
        now: float | None,
    ) -> Iterator[BlockMeta]:
        """Leaf blocks from the front of an index; rescans after each batch it yields from."""
        after: bytes | None = None
        limit = SCAN_FIRST
        while True:
            entries = list(txn.index_scan(index, after=after, upto=upto, limit=limit))
            found = False
            for _, key in entries:
                meta = txn.get(key)
                if meta is None or key in protected:
                    continue
                if index == EXPIRY and now is not None and meta.is_alive(now):
                    self._refile_expiry(txn, meta)  # listed early: its TTL slid since
                    continue
                if meta.children:
                    continue
                found = True
                yield meta
            if found or len(entries) < limit:
                return
            after = entries[-1][0] + entries[-1][1]
            limit = min(limit * 4, SCAN_MOST)


def count_hits_by_check(
    txn: BlockTxn, root: BlockKey, links: Sequence[ChainLink], start: int, now: float
) -> tuple[int, int]:
    """count_hits through `check`, for backends with no faster way."""
    matched = 0
    for key, parent, tokens, depth in link_parts(links, start):
        status = txn.check(key, root + parent, tokens, depth, now)
        if status != HIT:
            return matched, int(status == COLLISION)
        matched += 1
    return matched, 0


def _fresh(meta: BlockMeta, hit: Touch, resolution_seconds: float) -> bool:
    """Whether `hit` would move the block's last use and expiry by less than the resolution."""
    return (
        hit.at - meta.last_used_at < resolution_seconds
        and hit.at + hit.ttl_seconds - meta.expires_at < resolution_seconds
    )


def _later_expiry(meta: BlockMeta, expires_at: float, retention: str) -> tuple[float, str]:
    """Keep the later expiry; the recorded class is the one that gave it."""
    if expires_at > meta.expires_at:
        return expires_at, retention
    return meta.expires_at, meta.retention


def _verified_payload(txn: BlockTxn, meta: BlockMeta) -> bytes | memoryview | None:
    payload = txn.get_payload(meta.key)
    if payload is None or len(payload) != meta.payload_size or checksum(payload) != meta.checksum:
        return None
    return payload
