"""PrefixCache over LmdbStore on a real folder, driven by a Hypothesis state machine and checked
against the independent model in model_cache.py after every step.

Rules: store, lookup (with or without payloads, touching or not), fetch payloads by key (also
another namespace's keys), advance the clock, sweep, evict (a small block capacity, or an
explicit enforce), pin and unpin, purge (a tenant, a namespace, a prompt's subtree), flush the
deferred touches, restart (flush, close, reopen the folder) and crash (abandon the cache and its
environment unflushed and open a second environment on the folder: what was committed must be
there, the touches still waiting may be lost, and the model loses exactly those).

Checked: every lookup returns exactly the longest alive prefix the model holds, with the exact
payload bytes; every fetch returns the exact bytes or None; no block is served past its expiry;
the store holds exactly the model's blocks with the model's expiries; pinned blocks are never
evicted; purged blocks are gone; every reported eviction is legal (a leaf, not pinned, "expired"
only for a dead block); the store stays prefix-closed and, after a write, within its capacity.
"""

from __future__ import annotations

import itertools
import math
import shutil
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import pytest
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

from cache_service.core.blocks import Namespace, StoreKey, store_key
from cache_service.core.cache import PrefixCache
from cache_service.core.capacity import CapacityLimits
from cache_service.core.config import CacheConfig
from cache_service.core.errors import NotStored
from cache_service.core.operators import Operators
from cache_service.core.retention import RetentionPolicy
from cache_service.core.store.lmdb.store import LmdbStore
from cache_service.core.touches import TouchOptions
from tests.reliability.model_cache import CacheModel, Entry, Hit
from tests.reliability.model_chains import Chain, JumpClock, Recorder, flat, prefixes

if TYPE_CHECKING:
    from cache_service.core.store.protocols import BlockStore

BLOCK = 2
TTLS = {"agent": 3.0, "chat": 7.0}  # the shipped classes' proportions, in seconds
LONGEST_TTL = max(TTLS.values())
RETENTION = RetentionPolicy(ttl_seconds=TTLS, default_class="chat")
START = 1_700_000_000.0
NAMESPACES = (
    Namespace(model="m"),  # the default tenant (no partition: its purge must spare the others)
    Namespace(model="m", tenant="t1"),  # the same model for a tenant: its own partition
    Namespace(model="m2", tenant="t1"),  # a second namespace of that tenant
)
TENANTS = sorted({namespace.tenant for namespace in NAMESPACES})

# Two-token blocks over a two-token alphabet, up to three blocks: prompts share prefixes often.
blocks = st.tuples(st.integers(0, 1), st.integers(0, 1))
prompts = st.lists(blocks, min_size=1, max_size=3).map(tuple)
namespaces = st.integers(0, len(NAMESPACES) - 1)
retentions = st.sampled_from(sorted(TTLS))


def payload(namespace: int, chain: Chain) -> bytes:
    """A block's payload names its namespace and whole prefix: a wrong one shows."""
    return repr((namespace, chain)).encode()


class LmdbModelMachine(RuleBasedStateMachine):
    """Subclassed per test run with `folders` and `raw_of` filled in."""

    folders: ClassVar[Callable[[], Path]]
    raw_of: ClassVar[Callable[[BlockStore], Any]]  # tests/conftest.py's raw access
    stats: ClassVar[Counter[str]]

    def __init__(self) -> None:
        super().__init__()
        self.folder = type(self).folders()
        self.folders_used = [self.folder]
        self.clock = JumpClock(START)
        self.events = Recorder()
        self.model = CacheModel(longest_ttl_seconds=LONGEST_TTL)
        self.capacity: int | None = None
        self.made_room = False  # the last evictions taken included one for room
        self.defer = False
        self.abandoned: list[BlockStore] = []
        self.store_keys: dict[Entry, StoreKey] = {}
        self.entries: dict[StoreKey, Entry] = {}
        self._open()
        type(self).stats["examples"] += 1

    def _open(self) -> None:
        # nosync: the crash modelled is a process crash, after which the OS still holds every
        # committed page; fsync per commit would only make the run slow.
        self.store: BlockStore = LmdbStore(
            self.folder,
            map_size_bytes=1 << 24,
            sync_mode="nosync",
            lifetimes=RETENTION.lifetimes(),
        )
        self.raw = type(self).raw_of(self.store)
        self.cache = PrefixCache(
            self.store,
            config=CacheConfig(
                default_block_size=BLOCK,
                retention=RETENTION,
            ),
            limits=CapacityLimits(capacity_blocks=self.capacity),
            # exact expiries: the model has no slack
            touches=TouchOptions(defer=self.defer, resolution_seconds=0.0),
            clock=self.clock,
            events=self.events,
        )
        self.operators = Operators.for_cache(self.cache)

    def teardown(self) -> None:
        self.store.close()
        for store in self.abandoned:  # only now: closing one drops this process's file locks
            store.close()
        for folder in self.folders_used:
            shutil.rmtree(folder, ignore_errors=True)

    # -- helpers --------------------------------------------------------------------------------

    def key_of(self, entry: Entry) -> StoreKey:
        """The store's key of a model entry (its tenant's partition and its chain key)."""
        if entry not in self.store_keys:
            namespace, chain = entry
            links = self.cache.chain(NAMESPACES[namespace], flat(chain))
            partition = self.cache.hasher.namespace_id(NAMESPACES[namespace]).partition
            key = store_key(partition, links[-1].key)
            self.store_keys[entry] = key
            self.entries[key] = entry
        return self.store_keys[entry]

    def apply_evictions(self) -> int:
        """Check each reported eviction is legal, then drop it from the model. Returns how
        many blocks went."""
        taken = self.events.take()
        now = self.clock()
        self.made_room = any(gone.reason == "capacity" for gone in taken)
        for gone in taken:
            entry = self.entries[gone.key]
            held = self.model.blocks[entry]
            assert not self.model.has_child(entry), f"evicted {entry}, which has a child"
            assert held.pins == 0, f"evicted the pinned block {entry}"
            if gone.reason == "expired":
                assert now >= held.expires_at, f"evicted the alive block {entry} as expired"
            else:
                assert gone.reason == "capacity", gone
                assert self.capacity is not None, "evicted for room in a cache without a limit"
            del self.model.blocks[entry]
        type(self).stats["evicted"] += len(taken)
        return len(taken)

    def check_within_capacity(self) -> None:
        """After a write or an enforce: at most the capacity (or the pinned blocks, if more),
        and no block evicted for room that was not needed (down to the capacity, not below)."""
        if self.capacity is not None:
            held = self.cache.capacity.usage().blocks
            assert held == len(self.model.blocks)
            assert held <= max(self.capacity, self.model.pinned_blocks())
            if self.made_room:
                assert held >= self.capacity, "evicted below the capacity"

    def held_entry(self, data: st.DataObject) -> Entry | None:
        """Mostly a block the model holds (None when it holds none): random prompts alone
        would rarely meet a stored one."""
        if not self.model.blocks or not data.draw(st.integers(0, 3), label="a held one"):
            return None
        return data.draw(st.sampled_from(sorted(self.model.blocks)), label="held")

    def near_held(self, data: st.DataObject, namespace: int, prompt: Chain) -> tuple[int, Chain]:
        """Mostly a held block's prompt, perhaps one block longer; else the one given."""
        held = self.held_entry(data)
        if held is None:
            return namespace, prompt
        longer = data.draw(st.lists(blocks, max_size=1).map(tuple), label="longer by")
        return held[0], held[1] + longer

    # -- rules ----------------------------------------------------------------------------------

    @initialize(capacity=st.none() | st.integers(2, 8), defer=st.booleans())
    def configure(self, capacity: int | None, defer: bool) -> None:
        self.capacity = capacity
        self.defer = defer
        self.store.close()
        self._open()

    @rule(data=st.data(), namespace=namespaces, prompt=prompts, retention=retentions)
    def store_prompt(
        self, data: st.DataObject, namespace: int, prompt: Chain, retention: str
    ) -> None:
        namespace, prompt = self.near_held(data, namespace, prompt)
        chains = prefixes(prompt)
        payloads = [payload(namespace, chain) for chain in chains]
        now = self.clock()
        outcome = self.cache.insert(NAMESPACES[namespace], flat(prompt), payloads,
                                    retention=retention)  # fmt: skip
        fitting = len(chains) if self.capacity is None else min(len(chains), self.capacity)
        refreshed = 0
        new: list[Entry] = []
        for chain in chains[:fitting]:
            entry = (namespace, chain)
            self.key_of(entry)
            if self.model.store(entry, now, TTLS[retention]):
                refreshed += 1
            else:
                new.append(entry)
        self.apply_evictions()
        kept = sum(entry in self.model.blocks for entry in new)
        assert (outcome.collisions, outcome.refreshed, outcome.stored) == (0, refreshed, kept)
        assert outcome.truncated == len(chains) - fitting + len(new) - kept
        self.check_within_capacity()

    @rule(
        data=st.data(),
        namespace=namespaces,
        prompt=prompts,
        retention=retentions,
        touch=st.booleans(),
        with_payloads=st.booleans(),
        times=st.integers(1, 3),
    )
    def lookup(
        self,
        *,
        data: st.DataObject,
        namespace: int,
        prompt: Chain,
        retention: str,
        touch: bool,
        with_payloads: bool,
        times: int,
    ) -> None:
        """The same lookup `times` over (a repeat is answered from the cache's memo of the
        prompts it verified a moment ago, which must agree too)."""
        namespace, prompt = self.near_held(data, namespace, prompt)
        now = self.clock()
        for _ in range(times):
            found = self.cache.match_prefix(NAMESPACES[namespace], flat(prompt),
                                            retention=retention, with_payloads=with_payloads,
                                            touch=touch)  # fmt: skip
            matched = self.model.longest_alive(namespace, prompt, now)
            assert found.matched_blocks == matched
            type(self).stats["hit_blocks"] += matched
            type(self).stats["lookups"] += 1
            if with_payloads:
                expected = tuple(payload(namespace, c) for c in prefixes(prompt)[:matched])
                assert found.payloads == expected
            if touch and matched:
                hit = Hit(namespace, tuple(prefixes(prompt)[:matched]), now, TTLS[retention])
                if self.defer:
                    self.model.pending.append(hit)
                    type(self).stats["deferred_touches"] += 1
                else:
                    self.model.touch(hit)

    @rule(data=st.data(), source=namespaces, asked=namespaces, prompt=prompts)
    def fetch(self, data: st.DataObject, source: int, asked: int, prompt: Chain) -> None:
        """Payloads by key: the exact bytes of an alive block of the asked namespace, else None
        (keys of another namespace, even of the same tenant, are not served)."""
        source, prompt = self.near_held(data, source, prompt)
        if data.draw(st.booleans(), label="asked its own namespace"):
            asked = source
        keys = self.cache.chain(NAMESPACES[source], flat(prompt)).keys
        got = self.cache.get_payloads(NAMESPACES[asked], keys)
        now = self.clock()
        expected = [
            payload(source, chain)
            if source == asked and self.model.alive((source, chain), now)
            else None
            for chain in prefixes(prompt)
        ]
        assert got == expected

    # Mostly short steps, so blocks live through several rules; and each TTL's edge exactly.
    @rule(seconds=st.sampled_from([0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 2.999, 3.0, 7.0, 10.0]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule()
    def sweep(self) -> None:
        now = self.clock()
        expired = sum(now >= held.expires_at for held in self.model.blocks.values())
        assert self.cache.capacity.sweep_expired() == expired
        assert self.apply_evictions() == expired

    @precondition(lambda self: self.capacity is not None)
    @rule()
    def enforce(self) -> None:
        self.cache.capacity.enforce()
        self.apply_evictions()
        self.check_within_capacity()

    @rule(data=st.data(), namespace=namespaces, prompt=prompts)
    def pin(self, data: st.DataObject, namespace: int, prompt: Chain) -> None:
        held = self.held_entry(data)
        if held is not None:
            namespace, prompt = held
        now = self.clock()
        entry = (namespace, prompt)
        if not all(self.model.alive((namespace, chain), now) for chain in prefixes(prompt)):
            with pytest.raises(NotStored):
                self.operators.pin(NAMESPACES[namespace], flat(prompt), by="model")
            return
        record, new = self.operators.pin(NAMESPACES[namespace], flat(prompt), by="model")
        assert new == self.model.pin(entry)
        assert record.blocks == len(prompt)
        type(self).stats["pins"] += new

    @rule(data=st.data(), namespace=namespaces, prompt=prompts)
    def unpin(self, data: st.DataObject, namespace: int, prompt: Chain) -> None:
        pick_a_pin = data.draw(st.integers(0, 3), label="a pinned one") > 0
        if self.model.pins and pick_a_pin:
            namespace, prompt = data.draw(st.sampled_from(sorted(self.model.pins)), label="pin")
        released = self.operators.unpin(NAMESPACES[namespace], flat(prompt))
        assert released == self.model.unpin((namespace, prompt), self.clock())
        type(self).stats["unpins"] += bool(released)

    @rule(data=st.data(), what=st.sampled_from(["tenant", "namespace", "prefix"]),
          namespace=namespaces, prompt=prompts)  # fmt: skip
    def purge(self, data: st.DataObject, what: str, namespace: int, prompt: Chain) -> None:
        held = self.held_entry(data)
        if held is not None:
            namespace, prompt = held
        chosen = NAMESPACES[namespace]
        if what == "tenant":
            result = self.operators.purge(chosen.tenant)
            doomed = {e for e in self.model.blocks if NAMESPACES[e[0]].tenant == chosen.tenant}
        elif what == "namespace":
            result = self.operators.purge(chosen.tenant, namespace=chosen)
            doomed = {e for e in self.model.blocks if e[0] == namespace}
        else:
            result = self.operators.purge(chosen.tenant, namespace=chosen, tokens=flat(prompt))
            doomed = {
                e for e in self.model.blocks if e[0] == namespace and e[1][: len(prompt)] == prompt
            }
        payload_bytes = sum(len(payload(*entry)) for entry in doomed)
        released = self.model.purge(doomed, self.clock())
        assert (result.blocks, result.payload_bytes, result.pins) == (
            len(doomed),
            payload_bytes,
            released,
        )
        type(self).stats["purged"] += len(doomed)

    @precondition(lambda self: self.defer)
    @rule()
    def flush(self) -> None:
        assert self.cache.touches.flush() == len(self.model.pending)
        type(self).stats["flushed_touches"] += len(self.model.pending)
        for hit in self.model.pending:
            self.model.touch(hit)
        self.model.pending.clear()

    @rule(crash=st.booleans())
    def reopen(self, crash: bool) -> None:
        """A clean restart, or a crash and a restart."""
        if crash:
            self.crash()
        else:
            self.restart()

    def restart(self) -> None:
        """A clean stop (flush, close) and a new cache over the reopened folder."""
        self.cache.touches.flush()
        for hit in self.model.pending:
            self.model.touch(hit)
        self.model.pending.clear()
        self.store.close()
        self._open()
        type(self).stats["restarts"] += 1

    def crash(self) -> None:
        """The process dies: its cache and environment are abandoned as they are (never
        closed, touches unflushed), and a new environment opens the files as the crash left
        them. py-lmdb refuses a second environment on one folder in one process, so the files
        are copied first: with no write transaction running, the copy is exactly the crash
        image (writemap is off, so every committed page is in the file)."""
        self.abandoned.append(self.store)
        image = type(self).folders()
        shutil.copytree(self.folder, image)
        self.folders_used.append(image)
        self.folder = image
        self.model.pending.clear()  # what a crash may lose, and all it may lose
        self._open()
        type(self).stats["crashes"] += 1

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def count_checked_state(self) -> None:
        type(self).stats["checked_states"] += 1

    @invariant()
    def store_holds_exactly_the_model(self) -> None:
        stored = self.raw.blocks()
        assert {self.entries.get(key) for key in stored} == set(self.model.blocks)
        for key, meta in stored.items():
            assert meta.expires_at == self.model.blocks[self.entries[key]].expires_at, key
            assert (meta.expires_at == math.inf) == (self.model.blocks[self.entries[key]].pins > 0)

    @invariant()
    def store_is_prefix_closed(self) -> None:
        stored = self.raw.blocks()
        for meta in stored.values():
            if meta.depth > 0:
                parent = stored.get(meta.parent_key)
                assert parent is not None, "a stored block's parent is stored"
                assert parent.expires_at >= meta.expires_at

    @invariant()
    def pins_are_the_models(self) -> None:
        listed = {
            (tenant, pin["model"], pin["key"], pin["blocks"])
            for tenant in TENANTS
            for pin in self.operators.pins(tenant)
        }
        expected = {
            (
                NAMESPACES[namespace].tenant,
                NAMESPACES[namespace].model,
                self.key_of((namespace, chain))[-16:].hex(),
                count,
            )
            for (namespace, chain), count in self.model.pins.items()
        }
        assert listed == expected


def test_prefix_cache_over_lmdb_agrees_with_the_model_through_restarts_and_crashes(
    tmp_path: Path,
    raw_of: Callable[[BlockStore], Any],
    scale: Callable[[int, int], int],
    report: Callable[..., None],
) -> None:
    runs = itertools.count()
    stats: Counter[str] = Counter()
    machine = type(
        "Machine",
        (LmdbModelMachine,),
        {
            "folders": staticmethod(lambda: tmp_path / f"run-{next(runs)}"),
            "raw_of": staticmethod(raw_of),
            "stats": stats,
        },
    )
    examples = scale(2000, 10000)
    started = time.perf_counter()
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=40,
            deadline=None,
            derandomize=True,  # the same examples on every run: a CI failure reproduces
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    seconds = time.perf_counter() - started
    report(
        max_examples=examples,
        examples_run=stats["examples"],
        checked_states=stats["checked_states"],
        restarts=stats["restarts"],
        crashes=stats["crashes"],
        lookups=stats["lookups"],
        hit_blocks=stats["hit_blocks"],
        pins=stats["pins"],
        unpins=stats["unpins"],
        deferred_touches=stats["deferred_touches"],
        flushed_touches=stats["flushed_touches"],
        purged_blocks=stats["purged"],
        evicted_blocks=stats["evicted"],
        seconds=f"{seconds:.1f}",
    )
