"""Tenants never meet: keys, lookups, fetches, explanations and first-writer-wins stay
within a tenant."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_service.core.blocks import Namespace
from cache_service.core.cache import PrefixCache
from cache_service.core.config import CacheConfig
from cache_service.core.hashing import BlockHasher
from cache_service.core.operators import Operators
from cache_service.core.retention import DEFAULT_LIFETIMES
from cache_service.core.store.lmdb.store import LmdbStore
from cache_service.core.store.memory import MemoryStore
from cache_service.core.store.protocols import BlockStore

if TYPE_CHECKING:
    from conftest import VirtualClock

BLOCK = 4


def constant_hash(_data: bytes) -> bytes:
    """Every block of every namespace gets the same key: only verification and partitions
    keep anything apart."""
    return b"\x01" * 16


def payload_of(namespace: Namespace, block: int) -> bytes:
    """A payload that says whose it is."""
    return f"{namespace.tenant}|{namespace.salt}|{namespace.model}|{block}".encode()


@pytest.mark.store_opened(lifetimes=DEFAULT_LIFETIMES)
def test_a_colliding_key_of_one_tenant_never_displaces_or_denies_anothers(
    store: BlockStore, clock: VirtualClock
) -> None:
    cache = PrefixCache(
        store,
        config=CacheConfig(default_block_size=BLOCK),
        hasher=BlockHasher(hash_fn=constant_hash),
        clock=clock,
    )
    a, b = Namespace("m", tenant="a"), Namespace("m", tenant="b")
    tokens = [7] * BLOCK
    # Same key; tenant a writes first. Tenant b's block is its own, not a refused collision.
    assert cache.insert(a, tokens, [payload_of(a, 0)]).stored == 1
    outcome = cache.insert(b, tokens, [payload_of(b, 0)])
    assert (outcome.stored, outcome.collisions, outcome.refreshed) == (1, 0, 0)
    for namespace in (a, b):
        found = cache.match_prefix(namespace, tokens, with_payloads=True)
        assert found.payloads == (payload_of(namespace, 0),)
        assert cache.get_payloads(namespace, list(found.keys)) == [payload_of(namespace, 0)]
    # Within one tenant, the first writer of a key still wins against a colliding block.
    assert cache.insert(a, [8] * BLOCK, [b"other"]).collisions == 1


# Namespaces whose fields concatenate alike ("a" + "bc" and "ab" + "c"), across tenants.
NAMESPACES = [
    Namespace("m", tenant="a", salt="bc"),
    Namespace("m", tenant="ab", salt="c"),
    Namespace("m", tenant="a", salt="b"),
    Namespace("m", tenant="b", salt="a"),
    Namespace("m", tenant="", salt="abc"),
    Namespace("mab", tenant="c"),
]
prompts = st.lists(st.integers(0, 2), min_size=BLOCK, max_size=4 * BLOCK)
operations = st.lists(
    st.tuples(st.sampled_from(["store", "lookup"]), st.integers(0, len(NAMESPACES) - 1), prompts),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations=operations, constant=st.booleans(), backend=st.sampled_from(["memory", "lmdb"]))
def test_no_tenant_hits_fetches_or_learns_of_anothers_blocks(
    operations: list[tuple[str, int, list[int]]], constant: bool, backend: str
) -> None:
    with tempfile.TemporaryDirectory() as folder:
        store: BlockStore = (
            MemoryStore(lifetimes=DEFAULT_LIFETIMES)
            if backend == "memory"
            else LmdbStore(
                Path(folder),
                map_size_bytes=64 * 2**20,
                sync_mode="nosync",
                lifetimes=DEFAULT_LIFETIMES,
            )
        )
        hasher = BlockHasher(hash_fn=constant_hash) if constant else BlockHasher()
        cache = PrefixCache(
            store, config=CacheConfig(default_block_size=BLOCK), hasher=hasher, clock=lambda: 1000.0
        )
        stored: dict[int, set[tuple[int, ...]]] = {i: set() for i in range(len(NAMESPACES))}
        try:
            for action, which, tokens in operations:
                namespace = NAMESPACES[which]
                blocks = len(tokens) // BLOCK
                if action == "store":
                    payloads = [payload_of(namespace, i) for i in range(blocks)]
                    outcome = cache.insert(namespace, tokens, payloads)
                    kept = outcome.stored + outcome.refreshed
                    for depth in range(1, kept + 1):
                        stored[which].add(tuple(tokens[: depth * BLOCK]))
                    continue
                # An explanation names only this tenant's own namespaces.
                why = Operators.for_cache(cache).explain(namespace, tokens)
                if why.reason == "other_namespace":
                    assert any(
                        (n.tenant, n.model, n.salt)
                        == (namespace.tenant, why.facts["model"], why.facts["salt"])
                        for n in NAMESPACES
                    )
                found = cache.match_prefix(namespace, tokens, with_payloads=True)
                # Every matched prefix was stored by this very namespace...
                for depth in range(1, found.matched_blocks + 1):
                    assert tuple(tokens[: depth * BLOCK]) in stored[which]
                # ...and every payload served is this namespace's own.
                assert found.payloads == tuple(
                    payload_of(namespace, i) for i in range(found.matched_blocks)
                )
                for other, other_namespace in enumerate(NAMESPACES):
                    if other != which:  # another's keys fetch nothing of ours, and vice versa
                        owner = payload_of(other_namespace, 0).rsplit(b"|", 1)[0]
                        fetched = cache.get_payloads(other_namespace, list(found.keys))
                        assert all(p is None or p.rsplit(b"|", 1)[0] == owner for p in fetched)
        finally:
            if isinstance(store, LmdbStore):
                store.close()
