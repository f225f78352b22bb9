"""PrefixCache over LMDB, driven by Hypothesis and checked against a naive model.

The model is a dict from a block chain (the tuple of a prefix's blocks) to its expiry. Two
copies are kept:
- `held` mirrors the store: it drops whatever the cache reports evicted, so every lookup must
  match exactly its longest alive prefix, and the store must hold exactly its blocks;
- `pure` never drops a block evicted for capacity: until the first such eviction the lookup
  equals its longest alive prefix, afterwards it is only an upper bound.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from cache_service.core.blocks import BlockKey, Namespace
from cache_service.core.cache import PrefixCache
from cache_service.core.capacity import CapacityLimits
from cache_service.core.config import CacheConfig
from cache_service.core.retention import RetentionPolicy
from cache_service.core.store.lmdb.store import LmdbStore
from cache_service.core.store.protocols import BlockStore
from tests.reliability.model_chains import Chain, Recorder, flat

if TYPE_CHECKING:
    from conftest import RawAccess, VirtualClock

BLOCK = 2
NS = Namespace(model="model-under-test")
TTLS = {"short": 10.0, "long": 25.0}
RETENTION = RetentionPolicy(ttl_seconds=TTLS, default_class="long")

# Two-token blocks over a three-token alphabet: prompts share prefixes all the time.
blocks = st.tuples(st.integers(0, 2), st.integers(0, 2))
prompts = st.lists(blocks, min_size=1, max_size=4).map(tuple)
retentions = st.sampled_from(sorted(TTLS))


def payload(chain: Chain) -> bytes:
    """The payload of a chain's last block: names the whole prefix, so a wrong one shows."""
    return repr(chain).encode()


class CacheMachine(RuleBasedStateMachine):
    """Subclassed per test run with `open_store`, `raw_of` and `clock_type` filled in."""

    open_store: Callable[[], BlockStore]
    raw_of: Callable[[BlockStore], RawAccess]
    clock_type: type[VirtualClock]

    def __init__(self) -> None:
        super().__init__()
        self.store = type(self).open_store()
        self.raw = type(self).raw_of(self.store)
        self.clock = type(self).clock_type()
        self.events = Recorder()
        self.held: dict[Chain, float] = {}
        self.pure: dict[Chain, float] = {}
        self.keys: dict[BlockKey, Chain] = {}
        self.capacity: int | None = None
        self.evicted_for_capacity = False
        self.cache = self._make_cache()

    def _make_cache(self) -> PrefixCache:
        return PrefixCache(
            self.store,
            config=CacheConfig(
                default_block_size=BLOCK,
                retention=RETENTION,
            ),
            limits=CapacityLimits(capacity_blocks=self.capacity),
            clock=self.clock,
            events=self.events,
        )

    def teardown(self) -> None:
        self.store.close()

    # -- the model -------------------------------------------------------------------------

    def alive(self, model: dict[Chain, float], chain: Chain) -> bool:
        return chain in model and self.clock() < model[chain]

    def longest_alive(self, model: dict[Chain, float], prompt: Chain) -> int:
        length = 0
        while length < len(prompt) and self.alive(model, prompt[: length + 1]):
            length += 1
        return length

    def key_of(self, chain: Chain) -> BlockKey:
        return self.cache.chain(NS, flat(chain))[-1].key

    def stored_in_model(self, chain: Chain, expires_at: float) -> None:
        for model in (self.held, self.pure):
            if self.alive(model, chain):
                model[chain] = max(model[chain], expires_at)
            else:
                model[chain] = expires_at
        self.keys[self.key_of(chain)] = chain

    def apply_evictions(self) -> None:
        for gone in self.events.evicted:
            chain = self.keys[gone.key]
            assert not any(
                other[: len(chain)] == chain and len(other) > len(chain) for other in self.held
            ), "evicted a block that has a stored child"
            if gone.reason == "expired":
                assert not self.alive(self.held, chain), "evicted an alive block as expired"
                self.pure.pop(chain, None)
            else:
                self.evicted_for_capacity = True
            del self.held[chain]
        self.events.evicted.clear()

    # -- rules -----------------------------------------------------------------------------

    @initialize(capacity=st.none() | st.integers(min_value=2, max_value=10))
    def configure(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.cache = self._make_cache()

    @rule(prompt=prompts, retention=retentions)
    def insert(self, prompt: Chain, retention: str) -> None:
        chains = [prompt[: i + 1] for i in range(len(prompt))]
        outcome = self.cache.insert(
            NS, flat(prompt), [payload(c) for c in chains], retention=retention
        )
        assert outcome.collisions == 0
        kept = len(chains) - outcome.truncated
        if self.capacity is not None:
            assert kept == min(len(chains), self.capacity)
        else:
            assert kept == len(chains)
        assert outcome.refreshed == sum(self.alive(self.held, c) for c in chains[:kept])
        expires_at = self.clock() + TTLS[retention]
        for chain in chains[:kept]:
            self.stored_in_model(chain, expires_at)
        self.apply_evictions()

    @rule(prompt=prompts, retention=retentions, touch=st.booleans())
    def lookup(self, prompt: Chain, retention: str, touch: bool) -> None:
        found = self.cache.match_prefix(
            NS, flat(prompt), retention=retention, with_payloads=True, touch=touch
        )
        matched = found.matched_blocks
        assert matched == self.longest_alive(self.held, prompt)
        expected_pure = self.longest_alive(self.pure, prompt)
        if self.evicted_for_capacity:
            assert matched <= expected_pure
        else:
            assert matched == expected_pure
        assert found.payloads == tuple(payload(prompt[: i + 1]) for i in range(matched))
        if touch:
            expires_at = self.clock() + TTLS[retention]
            for i in range(matched):
                self.stored_in_model(prompt[: i + 1], expires_at)

    @rule(seconds=st.sampled_from([0.5, 1.0, 5.0, 9.999, 10.0, 15.0, 25.0, 40.0]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule()
    def sweep(self) -> None:
        expired = sum(not self.alive(self.held, chain) for chain in self.held)
        assert self.cache.capacity.sweep_expired() == expired
        self.apply_evictions()

    @precondition(lambda self: self.capacity is not None)
    @rule()
    def enforce_capacity(self) -> None:
        self.cache.capacity.enforce()
        self.apply_evictions()

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def store_holds_exactly_the_model(self) -> None:
        stored = self.raw.blocks()
        assert {self.keys[key] for key in stored} == set(self.held)
        for key, meta in stored.items():
            assert meta.expires_at == self.held[self.keys[key]]

    @invariant()
    def store_is_prefix_closed(self) -> None:
        stored = self.raw.blocks()
        for meta in stored.values():
            if meta.depth > 0:
                assert meta.parent in stored
                assert stored[meta.parent].expires_at >= meta.expires_at

    @invariant()
    def store_is_within_capacity(self) -> None:
        if self.capacity is not None:
            assert self.cache.capacity.usage().blocks <= self.capacity


def test_prefix_cache_over_lmdb_agrees_with_the_model(
    tmp_path: Path, clock: VirtualClock, raw_of: Callable[[BlockStore], RawAccess]
) -> None:
    runs = itertools.count()

    def open_store() -> BlockStore:
        return LmdbStore(
            tmp_path / f"run-{next(runs)}",
            map_size_bytes=1 << 30,
            lifetimes=RETENTION.lifetimes(),
        )

    machine = type(
        "LmdbCacheMachine",
        (CacheMachine,),
        {
            "open_store": staticmethod(open_store),
            "raw_of": staticmethod(raw_of),
            "clock_type": type(clock),
        },
    )
    run_state_machine_as_test(  # type: ignore[no-untyped-call]
        machine,
        settings=settings(
            max_examples=150,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
