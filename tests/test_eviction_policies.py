"""The eviction policies: their ranks, what they learn from evictions, and the order a real
store (memory and LMDB) evicts in under each."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import VirtualClock, raw_access

from cache_service.core.blocks import BlockMeta, Namespace, StoreKey, Touch
from cache_service.core.cache import PrefixCache
from cache_service.core.capacity import CapacityLimits
from cache_service.core.config import CacheConfig
from cache_service.core.eviction import (
    POLICIES,
    AdaptivePolicy,
    LruPolicy,
    ProtectedPolicy,
    Use,
    make_policy,
)
from cache_service.core.eviction.adaptive import RUNGS
from cache_service.core.eviction.protected import GHOST_FLOOR
from cache_service.core.operators import Operators
from cache_service.core.retention import DEFAULT_LIFETIMES
from cache_service.core.store.lmdb.store import LmdbStore
from cache_service.core.store.memory import MemoryStore
from cache_service.core.store.protocols import BlockStore
from cache_service.core.tokens import tokens_to_bytes
from tests.store.chains import LMDB_MAP_SIZE_BYTES, T0, chain, put


def raw_blocks(store: BlockStore) -> list[BlockMeta]:
    """Every block record the store holds, read below its protocol."""
    return list(raw_access(store).blocks().values())


def meta(label: int, *, rank: int = 0, hits: int = 0) -> BlockMeta:
    """A block record with only what policies read."""
    return BlockMeta(
        key=StoreKey(label.to_bytes(16, "big")),
        namespace_root=b"\0" * 16,  # type: ignore[arg-type]
        parent=b"\0" * 16,  # type: ignore[arg-type]
        depth=1,
        tokens=b"",
        payload_size=0,
        checksum=0,
        created_at=0.0,
        last_used_at=0.0,
        expires_at=1e12,
        retention="chat",
        eviction_rank=rank,
        hits=hits,
    )


def test_lru_ranks_by_the_use_sequence_alone() -> None:
    policy = LruPolicy()
    for use in Use:
        assert policy.rank(meta(1, hits=5), seq=42, use=use) == 42


def test_protected_is_lru_until_the_store_first_evicts() -> None:
    policy = ProtectedPolicy()
    assert policy.rank(meta(1, hits=3), seq=100, use=Use.HIT) == 100
    assert policy.horizon(100) == 0


def test_protected_gives_a_reused_block_one_eviction_horizon_more() -> None:
    policy = ProtectedPolicy()
    policy.rank(meta(0), seq=99, use=Use.STORED)
    policy.evicted(meta(9, rank=60), held_blocks=10)  # eviction reaches back to use 60
    assert policy.horizon(100) == 40
    assert policy.rank(meta(1), seq=100, use=Use.STORED) == 100  # new: as LRU
    assert policy.rank(meta(2), seq=100, use=Use.HIT) == 140
    assert policy.rank(meta(3), seq=100, use=Use.REFRESHED) == 140
    assert policy.rank(meta(4, hits=1), seq=100, use=Use.STORED) == 140
    # The frontier never moves back, and a horizon is never negative.
    policy.evicted(meta(8, rank=10), held_blocks=10)
    assert policy.horizon(100) == 40
    assert policy.horizon(50) == 0
    # A use never lowers a rank; a protected block evicted does not move the frontier past
    # the newest use (its rank runs ahead of the sequence).
    assert policy.rank(meta(5, rank=500), seq=101, use=Use.HIT) == 500
    policy.evicted(meta(6, rank=10**6), held_blocks=10)
    assert policy.horizon(120) == 120 - 101


def test_a_block_stored_again_after_its_eviction_counts_as_reused_once() -> None:
    policy = ProtectedPolicy()
    policy.rank(meta(0), seq=99, use=Use.STORED)
    policy.evicted(meta(7, rank=50), held_blocks=10)
    assert policy.rank(meta(7), seq=100, use=Use.STORED) == 150
    assert policy.rank(meta(7), seq=101, use=Use.STORED) == 101  # the ghost let it go


def test_the_ghost_holds_twice_the_blocks_held_and_at_least_the_floor() -> None:
    policy = ProtectedPolicy()
    policy.rank(meta(0), seq=10**5, use=Use.STORED)
    for label in range(3 * GHOST_FLOOR):
        policy.evicted(meta(label, rank=label), held_blocks=10)
    assert policy.ghost_size() == GHOST_FLOOR
    for label in range(3 * GHOST_FLOOR, 3 * GHOST_FLOOR + 5000):
        policy.evicted(meta(label, rank=label), held_blocks=2000)
    assert policy.ghost_size() == 4000
    # The oldest went first: the most recent evictions are still remembered.
    last = 3 * GHOST_FLOOR + 4999
    assert policy.rank(meta(last), seq=10**6, use=Use.STORED) > 10**6


def churn(policy: AdaptivePolicy, *, turnovers: int, hit_back: float, new_back: float) -> None:
    """Evict blocks (half had been hit) and store blocks again from the ghost at the given
    rates per eviction, for a number of cache turnovers of 100 blocks."""
    label = 0
    for _ in range(turnovers):
        evicted = []
        for index in range(100):
            label += 1
            block = meta(label, rank=label, hits=index % 2)
            policy.evicted(block, held_blocks=100)
            evicted.append(block)
        back = [b for b in evicted if b.hits][: int(hit_back * 50)]
        back += [b for b in evicted if not b.hits][: int(new_back * 50)]
        for block in back:
            policy.rank(meta(int.from_bytes(block.key, "big")), seq=label, use=Use.STORED)
        for _ in range(100 - len(back)):  # the rest of the turnover: new blocks
            label += 1
            policy.rank(meta(10**9 + label), seq=label, use=Use.STORED)


def test_adaptive_starts_as_lru() -> None:
    policy = AdaptivePolicy()
    policy.rank(meta(0), seq=99, use=Use.STORED)
    policy.evicted(meta(9, rank=60), held_blocks=10)
    assert policy.multiple == 0.0
    assert policy.rank(meta(1), seq=100, use=Use.HIT) == 100


def test_adaptive_protects_more_while_hit_blocks_come_back_more_often() -> None:
    policy = AdaptivePolicy()
    churn(policy, turnovers=4, hit_back=0.6, new_back=0.1)
    assert policy.multiple >= RUNGS[3]
    seq = 10**6
    expected = seq + int(policy.multiple * policy.horizon(seq))
    assert policy.horizon(seq) > 0
    assert policy.rank(meta(1), seq=seq, use=Use.HIT) == expected


def test_adaptive_goes_back_to_lru_when_new_blocks_come_back_more_often() -> None:
    policy = AdaptivePolicy()
    churn(policy, turnovers=4, hit_back=0.6, new_back=0.1)
    raised = policy.multiple
    churn(policy, turnovers=12, hit_back=0.1, new_back=0.6)
    assert raised > 0
    assert policy.multiple == 0.0


def test_adaptive_does_not_move_on_noise() -> None:
    policy = AdaptivePolicy()
    churn(policy, turnovers=10, hit_back=0.04, new_back=0.02)  # 2 against 1 per turnover
    assert policy.multiple == 0.0


def test_policies_are_made_by_name_and_unknown_names_are_refused() -> None:
    assert list(POLICIES) == ["lru", "protected", "adaptive"]
    assert isinstance(make_policy("adaptive"), AdaptivePolicy)
    with pytest.raises(ValueError, match="unknown eviction policy 'lfu' \\(known: lru, "):
        make_policy("lfu")


@pytest.fixture(params=["memory", "lmdb"])
def open_store(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Callable[..., BlockStore]]:
    """A factory of real stores under a given policy (and what else they are opened with)."""
    stores: list[BlockStore] = []

    def factory(policy_name: str, **opened_with: Any) -> BlockStore:
        policy = make_policy(policy_name)
        if request.param == "memory":
            store: BlockStore = MemoryStore(policy=policy, **opened_with)
        else:
            folder = tmp_path / f"{policy_name}-{len(stores)}"
            store = LmdbStore(
                folder, map_size_bytes=LMDB_MAP_SIZE_BYTES, policy=policy, **opened_with
            )
        stores.append(store)
        return store

    yield factory
    for store in stores:
        store.close()


@pytest.mark.parametrize("policy_name", ["lru", "protected"])
def test_a_store_keeps_a_reused_prefix_under_protected_and_not_under_lru(
    open_store: Callable[[str], BlockStore], policy_name: str
) -> None:
    store = open_store(policy_name)
    hot, cold, filler, late = chain([1, 2]), chain([3, 4]), chain([5, 6]), chain([7, 8])
    put(store, hot, now=T0)
    put(store, cold, now=T0 + 1)
    keys = tuple(link.key for link in hot)
    store.touch([Touch(keys=keys, at=T0 + 2, retention="chat", ttl_seconds=3600)])
    put(store, filler, now=T0 + 3)
    # The first eviction sets the horizon: filler's tail went last, so it reaches back far.
    first = store.evict(now=T0 + 4, max_blocks=2)
    assert [e.key for e in first] == [cold[1].key, cold[0].key]
    # A second hit ranks `hot` a horizon ahead under `protected`; under LRU it is older
    # than what is stored next.
    store.touch([Touch(keys=keys, at=T0 + 5, retention="chat", ttl_seconds=3600)])
    put(store, late, now=T0 + 6)
    put(store, chain([9, 10]), now=T0 + 7)
    gone = {e.key for e in store.evict(now=T0 + 8, max_blocks=4)}
    hot_kept = not gone & set(keys)
    assert hot_kept == (policy_name == "protected")


@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_every_policy_keeps_pins_quotas_and_prefix_closure_under_churn(
    open_store: Callable[..., BlockStore], policy_name: str
) -> None:
    """Random traffic of two tenants with shared and private prefixes through a small cache:
    the pinned prompt stays whole, the tenant stays within its quota, the cache within its
    capacity, and every stored block's parent is stored."""
    store = open_store(policy_name, lifetimes=DEFAULT_LIFETIMES)
    clock = VirtualClock()
    block = 4
    quota = 12 * store.space.estimate_bytes(8, 4 * block)
    cache = PrefixCache(
        store,
        config=CacheConfig(default_block_size=block),
        limits=CapacityLimits(capacity_blocks=60, tenant_capacity_bytes={"small": quota}),
        clock=clock,
    )
    shared = Namespace(model="m")
    small = Namespace(model="m", tenant="small")
    pinned = tokens_to_bytes(range(9000, 9000 + 5 * block))
    cache.insert(shared, pinned, [b"p" * 8] * 5)
    Operators.for_cache(cache).pin(shared, pinned, by="test")
    rng = random.Random(policy_name)
    for step in range(400):
        clock.advance(rng.choice((0.5, 2.0, 30.0)))
        namespace = small if rng.random() < 0.3 else shared
        head = rng.randrange(6)  # a few system prompts, each extended by private turns
        tail = [rng.randrange(10**6) for _ in range(rng.randrange(0, 4) * block)]
        tokens = tokens_to_bytes([head] * (3 * block) + tail)
        cache.lookup_and_fill(namespace, tokens, payload=b"x" * 8)
        assert cache.match_prefix(shared, pinned, touch=False).matched_blocks == 5, step
        assert store.usage().blocks <= 60
        assert store.tenant_bytes(cache.hasher.namespace_id(small).partition) <= quota
    held = {meta.key: meta for meta in raw_blocks(store)}
    for meta in held.values():
        if meta.depth > 0:
            assert meta.parent_key in held, "a stored block lost its parent"
    assert store.usage().blocks >= 50  # it was full, not emptied


def test_what_an_aborted_transaction_taught_a_policy_is_undone() -> None:
    policy = AdaptivePolicy()
    policy.rank(meta(0), seq=1000, use=Use.STORED)
    for label in range(1, 2000):
        policy.evicted(meta(label, rank=label % 900, hits=label % 2), held_blocks=600)
    before = (policy._state(), list(policy._ghost._keys.items()))
    policy.begin()
    policy.rank(meta(1990), seq=1001, use=Use.STORED)  # back from the ghost
    assert meta(1990).key not in policy._ghost._keys
    for label in range(5000, 7000):  # trims the ghost's oldest entries too
        policy.evicted(meta(label, rank=999, hits=1), held_blocks=600)
    policy.abort()
    # Everything as it was; a key taken from the middle returns at the newest end.
    assert policy._state() == before[0]
    assert dict(policy._ghost._keys) == dict(before[1])
    policy.begin()
    policy.evicted(meta(9999, rank=999), held_blocks=600)
    policy.commit()
    assert list(policy._ghost._keys)[-1] == meta(9999).key  # a commit keeps it


@pytest.mark.parametrize("policy_name", ["protected", "adaptive"])
def test_an_lmdb_transaction_that_aborts_leaves_the_policy_as_it_was(
    tmp_path: Path, policy_name: str
) -> None:
    policy = make_policy(policy_name)
    store = LmdbStore(tmp_path / "data", map_size_bytes=LMDB_MAP_SIZE_BYTES, policy=policy)
    try:
        for label in range(40):
            put(store, chain([label, label + 1000]), now=T0 + label)
        store.evict(now=T0 + 50, max_blocks=10)
        assert isinstance(policy, ProtectedPolicy)
        saved = (policy._state(), dict(policy._ghost._keys))
        with pytest.raises(RuntimeError), store.batch():
            put(store, chain([0, 1000]), now=T0 + 60)  # back from the ghost
            store.evict(now=T0 + 60, max_blocks=10)
            raise RuntimeError("the transaction aborts")
        assert (policy._state(), dict(policy._ghost._keys)) == saved
        assert store.usage().blocks == 70  # and the store is as it was
    finally:
        store.close()


def test_adaptive_survives_a_kind_of_block_that_stops_being_evicted() -> None:
    # Its count halves every turnover towards zero without reaching it: no rate from it.
    policy = AdaptivePolicy()
    policy.rank(meta(0), seq=10**6, use=Use.STORED)
    policy.evicted(meta(1, rank=1, hits=1), held_blocks=10)
    for label in range(2, 9000):  # 900 turnovers: the count squared underflows to 0.0
        policy.evicted(meta(label, rank=label), held_blocks=10)
        policy.rank(meta(10**9 + label), seq=10**6 + label, use=Use.STORED)
    assert policy.multiple == 0.0
