"""Chains, payloads and checks shared by the store contract tests (tests/store/test_*.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from cache_service.core.blocks import (
    ChainLink,
    InsertResult,
    Namespace,
    NewBlock,
)
from cache_service.core.hashing import BlockHasher
from cache_service.core.store.protocols import BlockStore
from cache_service.core.tokens import tokens_to_bytes
from tests.store.capabilities import capable

if TYPE_CHECKING:
    from conftest import RawAccess

LMDB_MAP_SIZE_BYTES = 1 << 30
BLOCK = 4
T0 = 1_000_000.0
TTL = 3600.0
NS = Namespace(model="contract-model")
OTHER_NS = Namespace(model="contract-model", tenant="someone-else")
HASHER = BlockHasher()
NSID = HASHER.namespace_id(NS)
OTHER_NSID = HASHER.namespace_id(OTHER_NS)


def chain(labels: Sequence[int], namespace: Namespace = NS) -> list[ChainLink]:
    """A prompt of one block per label, each block four copies of its label."""
    tokens = [label for label in labels for _ in range(BLOCK)]
    return HASHER.chain(namespace, tokens_to_bytes(tokens), block_size=BLOCK)


def payload_of(link: ChainLink, size: int = 24) -> bytes:
    """A payload unique to the block."""
    return (link.key * (size // 16 + 1))[:size]


def put(
    store: BlockStore,
    links: Sequence[ChainLink],
    *,
    now: float = T0,
    start: int = 0,
    ttl_seconds: float = TTL,
    retention: str = "chat",
    payloads: Sequence[bytes | memoryview] | None = None,
    namespace: Namespace = NS,
) -> InsertResult:
    """Insert links[start:] (their parent is links[start - 1])."""
    todo = links[start:]
    blocks = [
        NewBlock(link, payloads[i] if payloads is not None else payload_of(link))
        for i, link in enumerate(todo)
    ]
    return store.insert(
        HASHER.namespace_id(namespace),
        blocks,
        parent=links[start - 1] if start else None,
        now=now,
        retention=retention,
        ttl_seconds=ttl_seconds,
    )


def assert_holds(
    store: BlockStore, raw: RawAccess, *, blocks: int, payload_bytes: int | None = None
) -> None:
    """The store holds `blocks` blocks (and `payload_bytes` of payloads): read below the
    protocol on every backend, and from usage() where it counts exactly."""
    metas = raw.blocks()
    assert len(metas) == blocks
    if payload_bytes is not None:
        assert sum(meta.payload_size for meta in metas.values()) == payload_bytes
    if capable(store, "exact_usage"):
        usage = store.usage()
        assert usage.blocks == blocks
        if payload_bytes is not None:
            assert usage.payload_bytes == payload_bytes


def matched(store: BlockStore, links: Sequence[ChainLink], now: float = T0) -> int:
    """How many leading links of NS match."""
    return store.match(NSID, links, now=now).matched


def assert_prefix_closed(raw: RawAccess) -> None:
    """Every stored block's parent is stored, counts it as a child and outlives it (the
    last two where records are kept up: on Redis a block's record is written once)."""
    blocks = raw.blocks()
    for meta in blocks.values():
        if meta.depth > 0:
            assert meta.parent in blocks, "a stored block lost its parent"
        if not raw.records_kept_up:
            continue
        if meta.depth > 0:
            assert blocks[meta.parent].expires_at >= meta.expires_at
        children = sum(
            1 for other in blocks.values() if other.depth > 0 and other.parent == meta.key
        )
        assert meta.children == children
