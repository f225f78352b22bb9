"""PrefixCache over every store backend, with a virtual clock."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pytest

from cache_service.core.blocks import Evicted, Namespace
from cache_service.core.cache import InsertOutcome, PrefixCache
from cache_service.core.cache_observer import CacheObserver
from cache_service.core.capacity import CapacityLimits
from cache_service.core.config import CacheConfig
from cache_service.core.errors import (
    BlockSizeMismatch,
    InsufficientStorage,
    InvalidField,
    MissingParent,
    UnknownRetention,
)
from cache_service.core.hashing import BlockHasher, xxh3_128
from cache_service.core.retention import DEFAULT_LIFETIMES, RetentionPolicy
from cache_service.core.store.memory import MemoryStore
from cache_service.core.store.protocols import BlockStore
from cache_service.core.tokens import tokens_to_bytes
from cache_service.core.touches import TouchOptions

if TYPE_CHECKING:
    from conftest import RawAccess, VirtualClock

DAY = 86400.0
AGENT_TTL = 3 * DAY
CHAT_TTL = 7 * DAY
NS = Namespace(model="llama-3-8b")
BATCH_RETENTION = RetentionPolicy(
    ttl_seconds={"batch": 60.0, "chat": CHAT_TTL}, default_class="batch"
)

# The caches here use the default retention classes: their stores are opened with them.
pytestmark = pytest.mark.store_opened(lifetimes=DEFAULT_LIFETIMES)


class RecordingEvents(CacheObserver):
    """A CacheObserver implementation that keeps every call."""

    def __init__(self) -> None:
        self.lookups: list[tuple[str, int, int, bool]] = []
        self.inserts: list[tuple[int, int, int]] = []
        self.collisions: list[int] = []
        self.corrupt: list[int] = []
        self.evicted: list[Evicted] = []

    def on_lookup(
        self,
        *,
        retention: str,
        hit_tokens: int,
        miss_tokens: int,
        complete: bool,
        tenant: str = "",
    ) -> None:
        self.lookups.append((retention, hit_tokens, miss_tokens, complete))

    def on_insert(self, *, stored: int, refreshed: int, conflicts: int) -> None:
        self.inserts.append((stored, refreshed, conflicts))

    def on_collision(self, count: int) -> None:
        self.collisions.append(count)

    def on_corrupt(self, count: int) -> None:
        self.corrupt.append(count)

    def on_evicted(self, evicted: Sequence[Evicted], *, now: float) -> None:
        self.evicted.extend(evicted)


def make_cache(store: BlockStore, clock: VirtualClock, **kwargs: object) -> PrefixCache:
    kwargs.setdefault("config", CacheConfig(default_block_size=4))
    return PrefixCache(store, clock=clock, **kwargs)  # type: ignore[arg-type]


def blocks_of(*labels: int, size: int = 4) -> list[int]:
    """A prompt with one block per label, each block `size` copies of its label."""
    return [label for label in labels for _ in range(size)]


def payloads_for(tokens: Sequence[int], block_size: int = 4, size: int = 32) -> list[bytes]:
    count = len(tokens) // block_size
    return [bytes([i % 256]) * size for i in range(count)]


def store_prompt(
    cache: PrefixCache,
    tokens: Sequence[int],
    *,
    retention: str | None = None,
    namespace: Namespace = NS,
    payload_size: int = 32,
) -> InsertOutcome:
    size = cache.config.block_size_for(namespace.model)
    return cache.insert(
        namespace,
        tokens,
        payloads_for(tokens, size, payload_size),
        retention=retention,
    )


def assert_no_block_outlives_its_parent(raw: RawAccess) -> None:
    blocks = raw.blocks()
    for meta in blocks.values():
        if meta.depth > 0:
            assert meta.parent in blocks
            assert blocks[meta.parent].expires_at >= meta.expires_at


# -- the issue's example ---------------------------------------------------------------------


def test_issue_example_whole_prompt_and_shared_500_token_prefix(
    store: BlockStore, clock: VirtualClock
) -> None:
    cache = make_cache(store, clock, config=CacheConfig(default_block_size=64))
    rng = random.Random(1024)
    prompt = [rng.randrange(50_000) for _ in range(1024)]
    outcome = cache.insert(NS, prompt, [b"kv" * 100] * 16)
    assert outcome.stored == 16

    whole = cache.match_prefix(NS, prompt)
    assert (whole.matched_blocks, whole.cached_tokens, whole.miss_tokens) == (16, 1024, 0)

    other = prompt[:500] + [rng.randrange(50_000, 60_000) for _ in range(524)]
    shared = cache.match_prefix(NS, other)
    assert (shared.matched_blocks, shared.cached_tokens, shared.miss_tokens) == (7, 448, 576)
    assert shared.keys == whole.keys[:7]


def test_lookup_returns_longest_cached_prefix_and_its_payloads(
    store: BlockStore, clock: VirtualClock
) -> None:
    cache = make_cache(store, clock)
    prompt = blocks_of(1, 2, 3)
    payloads = [b"zero", b"one", b"two"]
    cache.insert(NS, prompt, payloads)
    found = cache.match_prefix(NS, [*blocks_of(1, 2, 3, 4), 9], with_payloads=True)
    assert found.matched_blocks == 3
    assert found.payloads == tuple(payloads)
    assert found.prompt_tokens == 17
    assert cache.get_payloads(NS, found.keys) == payloads


def test_a_miss_is_an_empty_match(store: BlockStore, clock: VirtualClock) -> None:
    cache = make_cache(store, clock)
    found = cache.match_prefix(NS, blocks_of(1, 2))
    assert (found.matched_blocks, found.cached_tokens, found.keys) == (0, 0, ())
    assert found.miss_tokens == 8


def test_tokens_may_be_given_as_uint32_bytes(store: BlockStore, clock: VirtualClock) -> None:
    cache = make_cache(store, clock)
    prompt = blocks_of(1, 2)
    cache.insert(NS, prompt, [b"a", b"b"])
    as_bytes = b"".join(t.to_bytes(4, "little") for t in prompt)
    assert cache.match_prefix(NS, as_bytes).matched_blocks == 2


def test_namespaces_do_not_share_blocks(store: BlockStore, clock: VirtualClock) -> None:
    cache = make_cache(store, clock)
    prompt = blocks_of(1, 2)
    cache.insert(NS, prompt, [b"a", b"b"])
    assert cache.match_prefix(Namespace(model="llama-3-8b", tenant="t2"), prompt).keys == ()
    assert cache.match_prefix(Namespace(model="llama-3-8b", salt="s"), prompt).keys == ()


# -- retention classes and TTL ---------------------------------------------------------------


@pytest.mark.parametrize(("retention", "ttl"), [("agent", AGENT_TTL), ("chat", CHAT_TTL)])
def test_block_is_alive_until_its_ttl_and_a_miss_at_expiry(
    store: BlockStore, clock: VirtualClock, retention: str, ttl: float
) -> None:
    cache = make_cache(store, clock)
    prompt = blocks_of(1, 2, 3)
    store_prompt(cache, prompt, retention=retention)
    clock.advance(ttl - 0.001)
    assert cache.match_prefix(NS, prompt, touch=False).matched_blocks == 3
    clock.advance(0.001)
    assert cache.match_prefix(NS, prompt, touch=False).matched_blocks == 0


def test_default_retention_is_chat(store: BlockStore, clock: VirtualClock) -> None:
    cache = make_cache(store, clock)
    prompt = blocks_of(1)
    store_prompt(cache, prompt)
    clock.advance(CHAT_TTL - 1)
    found = cache.match_prefix(NS, prompt, touch=False)
    assert (found.matched_blocks, found.retention) == (1, "chat")


def test_a_hit_slides_expiry_to_now_plus_the_hitting_class_ttl(
    store: BlockStore, raw: RawAccess, clock: VirtualClock
) -> None:
    cache = make_cache(store, clock)
    prompt = blocks_of(1, 2)
    store_prompt(cache, prompt, retention="agent")
    clock.advance(2 * DAY)
    found = cache.match_prefix(NS, prompt, retention="chat")
    metas = raw.blocks()
    assert [metas[k].expires_at for k in found.keys] == [clock() + CHAT_TTL] * 2
    assert [metas[k].retention for k in found.keys] == ["chat", "chat"]
    clock.advance(CHAT_TTL - 1)
    assert cache.match_prefix(NS, prompt, touch=False).matched_blocks == 2


def test_a_hit_keeps_the_later_of_two_expiries(
    store: BlockStore, raw: RawAccess, clock: VirtualClock
) -> None:
    cache = make_cache(store, clock)
    prompt = blocks_of(1, 2)
    start = clock()
    store_prompt(cache, prompt, retention="chat")
    clock.advance(1 * DAY)
    found = cache.match_prefix(NS, prompt, retention="agent")  # now + 3d < start + 7d
    metas = raw.blocks()
    assert [metas[k].expires_at for k in found.keys] == [start + CHAT_TTL] * 2
    assert [metas[k].retention for k in found.keys] == ["chat", "chat"]
    clock.advance(5 * DAY)
    cache.match_prefix(NS, prompt, retention="agent")  # now + 3d = start + 9d
    metas = raw.blocks()
    assert [metas[k].expires_at for k in found.keys] == [start + 9 * DAY] * 2
    assert [metas[k].retention for k in found.keys] == ["agent", "agent"]


def test_a_hit_makes_a_block_survive_past_its_first_ttl(
    store: BlockStore, clock: VirtualClock
) -> None:
    cache = make_cache(store, clock)
    prompt = blocks_of(1, 2)
    store_prompt(cache, prompt, retention="agent")
    for _ in range(5):
        clock.advance(AGENT_TTL - 1)
        assert cache.match_prefix(NS, prompt, retention="agent").matched_blocks == 2
    clock.advance(AGENT_TTL)
    assert cache.match_prefix(NS, prompt).matched_blocks == 0


@pytest.mark.parametrize(("first", "then"), [("chat", "agent"), ("agent", "chat")])
def test_extending_a_prefix_keeps_every_ancestor_alive_as_long_as_its_descendants(
    store: BlockStore, raw: RawAccess, clock: VirtualClock, first: str, then: str
) -> None:
    ttl = {"agent": AGENT_TTL, "chat": CHAT_TTL}
    cache = make_cache(store, clock)
    prefix = blocks_of(1, 2)
    start = clock()
    store_prompt(cache, prefix, retention=first)
    clock.advance(2 * DAY)
    longer = blocks_of(1, 2, 3, 4)
    cache.insert(NS, longer, [b"c", b"d"], start_block=2, retention=then)
    assert_no_block_outlives_its_parent(raw)
    metas = raw.blocks()
    keys = [link.key for link in cache.chain(NS, longer)]
    prefix_expiry = max(start + ttl[first], clock() + ttl[then])
    assert [metas[k].expires_at for k in keys] == [prefix_expiry] * 2 + [clock() + ttl[then]] * 2
    clock.advance(ttl[then] - 1)
    assert cache.match_prefix(NS, longer, touch=False).matched_blocks == 4


def test_hits_on_branches_keep_every_block_no_earlier_than_its_descendants(
    store: BlockStore, raw: RawAccess, clock: VirtualClock
) -> None:
    cache = make_cache(store, clock)
    rng = random.Random(7)
    prompts = [
        blocks_of(1, *(rng.randrange(3) for _ in range(rng.randrange(1, 5)))) for _ in range(30)
    ]
    for prompt in prompts:
        clock.advance(rng.uniform(0, DAY))
        retention = rng.choice(["agent", "chat"])
        if rng.random() < 0.5:
            store_prompt(cache, prompt, retention=retention)
        else:
            cache.match_prefix(NS, prompt, retention=retention)
        assert_no_block_outlives_its_parent(raw)


def test_sweep_expired_deletes_only_expired_blocks_in_batches(
    store: BlockStore, raw: RawAccess, clock: VirtualClock
) -> None:
    events = RecordingEvents()
    cache = make_cache(store, clock, events=events)
    store_prompt(cache, blocks_of(1, 2, 3, 4), retention="agent")
    store_prompt(cache, blocks_of(1, 2, 5), retention="agent")
    chat = blocks_of(6, 7)
    store_prompt(cache, chat, retention="chat")
    clock.advance(AGENT_TTL - 1)
    assert cache.capacity.sweep_expired() == 0
    clock.advance(1)
    assert cache.capacity.sweep_expired() == 5
    assert {e.reason for e in events.evicted} == {"expired"}
    assert {e.retention for e in events.evicted} == {"agent"}
    assert cache.match_prefix(NS, chat, touch=False).matched_blocks == 2
    assert cache.capacity.sweep_expired() == 0
    clock.advance(CHAT_TTL)
    assert cache.capacity.sweep_expired(max_blocks=1) == 1
    assert_no_block_outlives_its_parent(raw)
    assert cache.capacity.sweep_expired(max_blocks=1) == 1
    assert cache.capacity.usage().blocks == 0


def test_sweep_expired_never_leaves_an_orphan(
    store: BlockStore, raw: RawAccess, clock: VirtualClock
) -> None:
    events = RecordingEvents()
    cache = make_cache(store, clock, events=events)
    store_prompt(cache, blocks_of(1, 2, 3, 4), retention="agent")
    store_prompt(cache, blocks_of(1, 2, 5), retention="agent")
    parents = {meta.key: meta.parent for meta in raw.blocks().values() if meta.depth > 0}
    clock.advance(AGENT_TTL)
    while cache.capacity.sweep_expired(max_blocks=1):
        assert_no_block_outlives_its_parent(raw)
    order = [e.key for e in events.evicted]
    assert len(order) == 5
    for child, parent in parents.items():
        assert order.index(child) < order.index(parent)


def test_deferred_touches_apply_only_at_flush(
    store: BlockStore, raw: RawAccess, clock: VirtualClock
) -> None:
    cache = make_cache(store, clock, touches=TouchOptions(defer=True, resolution_seconds=0.0))
    prompt = blocks_of(1, 2)
    store_prompt(cache, prompt, retention="agent")
    before = raw.blocks()
    clock.advance(DAY)
    found = cache.match_prefix(NS, prompt, retention="chat")
    cache.match_prefix(NS, prompt, retention="agent")
    assert cache.touches.pending == 2
    assert raw.blocks() == before
    hit_at = clock()
    clock.advance(60)
    assert cache.touches.flush() == 2
    assert cache.touches.pending == 0
    metas = raw.blocks()
    assert [metas[k].expires_at for k in found.keys] == [hit_at + CHAT_TTL] * 2
    # A use is recorded on the deepest block it reached (its ancestors take it over later).
    assert [metas[k].hits for k in found.keys] == [0, 2]
    assert metas[found.keys[-1]].last_used_at == hit_at
    assert cache.touches.flush() == 0


def test_lookup_with_touch_false_changes_nothing(
    store: BlockStore, raw: RawAccess, clock: VirtualClock
) -> None:
    cache = make_cache(store, clock)
    store_prompt(cache, blocks_of(1, 2))
    before = raw.blocks()
    clock.advance(DAY)
    assert cache.match_prefix(NS, blocks_of(1, 2), touch=False).matched_blocks == 2
    assert raw.blocks() == before


# -- capacity --------------------------------------------------------------------------------


def test_capacity_blocks_evicts_down_to_exactly_the_capacity(
    store: BlockStore, clock: VirtualClock
) -> None:
    events = RecordingEvents()
    cache = make_cache(store, clock, limits=CapacityLimits(capacity_blocks=10), events=events)
    for label in range(8):
        clock.advance(1)
        store_prompt(cache, blocks_of(100 + label, label, label))
        assert cache.capacity.usage().blocks == min(3 * (label + 1), 10)
    assert {e.reason for e in events.evicted} == {"capacity"}
    last = blocks_of(107, 7, 7)
    assert cache.match_prefix(NS, last).matched_blocks == 3


def test_request_larger_than_the_cache_keeps_its_first_blocks(
    store: BlockStore, clock: VirtualClock
) -> None:
    cache = make_cache(store, clock, limits=CapacityLimits(capacity_blocks=4))
    store_prompt(cache, blocks_of(9, 9))
    clock.advance(1)
    prompt = blocks_of(1, 2, 3, 4, 5, 6)
    outcome = store_prompt(cache, prompt)
    assert (outcome.requested, outcome.stored, outcome.truncated) == (6, 4, 2)
    assert cache.capacity.usage().blocks == 4
    assert cache.match_prefix(NS, prompt).matched_blocks == 4
    assert cache.match_prefix(NS, blocks_of(9, 9)).matched_blocks == 0


def test_capacity_blocks_evicts_least_recently_used_prompt_first(
    store: BlockStore, clock: VirtualClock
) -> None:
    cache = make_cache(store, clock, limits=CapacityLimits(capacity_blocks=6))
    first, second, third = blocks_of(1, 1), blocks_of(2, 2), blocks_of(3, 3)
    store_prompt(cache, first)
    clock.advance(1)
    store_prompt(cache, second)
    clock.advance(1)
    store_prompt(cache, third)
    clock.advance(1)
    cache.match_prefix(NS, first)
    clock.advance(1)
    store_prompt(cache, blocks_of(4, 4))
    assert cache.match_prefix(NS, first, touch=False).matched_blocks == 2
    assert cache.match_prefix(NS, second, touch=False).matched_blocks == 0
    assert cache.match_prefix(NS, third, touch=False).matched_blocks == 2


def test_capacity_bytes_stays_under_capacity_and_keeps_the_newest_prefix(
    store: BlockStore, clock: VirtualClock
) -> None:
    events = RecordingEvents()
    capacity = 2 << 20
    cache = make_cache(
        store,
        clock,
        config=CacheConfig(default_block_size=64),
        limits=CapacityLimits(capacity_bytes=capacity),
        events=events,
    )
    payload_size = 16 << 10
    one_block = store.space.estimate_bytes(payload_size, 64 * 4)
    low_water = capacity * cache.capacity.low_water
    rng = random.Random(3)
    evictions_seen = 0
    for _ in range(120):
        clock.advance(1)
        prompt = [rng.randrange(8) for _ in range(64)] + [
            rng.randrange(10**6) for _ in range(64 * 3)
        ]
        events.evicted.clear()
        outcome = store_prompt(cache, prompt, payload_size=payload_size)
        usage = cache.capacity.usage()
        assert usage.used_bytes <= capacity
        assert outcome.stored + outcome.refreshed == 4
        assert cache.match_prefix(NS, prompt, touch=False).matched_blocks == 4
        if events.evicted:
            evictions_seen += 1
            assert usage.used_bytes >= low_water - one_block
    assert evictions_seen > 0


def test_a_block_larger_than_the_whole_cache_is_refused(
    store: BlockStore, clock: VirtualClock
) -> None:
    cache = make_cache(store, clock, limits=CapacityLimits(capacity_bytes=10_000))
    with pytest.raises(InsufficientStorage):
        cache.insert(NS, blocks_of(1), [b"x" * 20_000])
    assert cache.capacity.usage().blocks == 0


def test_capacity_settings_are_validated(store: BlockStore, clock: VirtualClock) -> None:
    with pytest.raises(ValueError, match="not both"):
        make_cache(store, clock, limits=CapacityLimits(capacity_bytes=1000, capacity_blocks=10))
    with pytest.raises(ValueError, match="low_water"):
        make_cache(
            store, clock, limits=CapacityLimits(capacity_bytes=1000, low_water=0.9, high_water=0.8)
        )
    with pytest.raises(ValueError, match="low_water"):
        make_cache(store, clock, limits=CapacityLimits(capacity_bytes=1000, low_water=0.0))


# -- request validation ----------------------------------------------------------------------


def test_block_size_mismatch_is_raised_with_the_servers_size(
    store: BlockStore, clock: VirtualClock
) -> None:
    cache = make_cache(store, clock, config=CacheConfig(default_block_size=64))
    with pytest.raises(BlockSizeMismatch) as caught:
        cache.match_prefix(NS, list(range(128)), block_size=16)
    assert caught.value.extensions["expected"] == 64
    assert caught.value.field == "block_size"
    with pytest.raises(BlockSizeMismatch):
        cache.insert(NS, list(range(128)), [b"a"], block_size=32)
    assert cache.match_prefix(NS, list(range(128)), block_size=64).matched_blocks == 0


def test_unknown_retention_is_raised_naming_the_configured_classes(
    store: BlockStore, clock: VirtualClock
) -> None:
    cache = make_cache(store, clock)
    with pytest.raises(UnknownRetention, match="agent, chat"):
        cache.match_prefix(NS, blocks_of(1), retention="batch")
    with pytest.raises(UnknownRetention):
        cache.insert(NS, blocks_of(1), [b"a"], retention="batch")
    assert cache.capacity.usage().blocks == 0


@pytest.mark.store_opened(lifetimes=BATCH_RETENTION.lifetimes())
def test_custom_retention_table_is_used(store: BlockStore, clock: VirtualClock) -> None:
    retention = BATCH_RETENTION
    cache = make_cache(store, clock, config=CacheConfig(default_block_size=4, retention=retention))
    store_prompt(cache, blocks_of(1))
    clock.advance(60)
    assert cache.match_prefix(NS, blocks_of(1)).matched_blocks == 0


def test_a_store_not_opened_with_the_retentions_lifetimes_is_refused_naming_both() -> None:
    with pytest.raises(ValueError, match=r"lifetimes none .* classes are agent=3d, chat=7d"):
        PrefixCache(MemoryStore())
    with pytest.raises(ValueError, match=r"agent=3d, chat=7d, .* are batch=1m, chat=7d"):
        PrefixCache(
            MemoryStore(lifetimes=DEFAULT_LIFETIMES), config=CacheConfig(retention=BATCH_RETENTION)
        )


def test_per_model_block_size_override(store: BlockStore, clock: VirtualClock) -> None:
    cache = make_cache(
        store, clock, config=CacheConfig(default_block_size=4, model_block_sizes={"big": 16})
    )
    big = Namespace(model="big")
    assert cache.config.block_size_for("big") == 16
    assert cache.config.block_size_for("llama-3-8b") == 4
    prompt = list(range(40))
    assert len(cache.chain(big, prompt)) == 2
    assert len(cache.chain(NS, prompt)) == 10
    cache.insert(big, prompt, [b"a", b"b"])
    found = cache.match_prefix(big, prompt)
    assert (found.block_size, found.matched_blocks, found.cached_tokens) == (16, 2, 32)
    with pytest.raises(BlockSizeMismatch):
        cache.match_prefix(big, prompt, block_size=4)


def test_insert_from_a_start_block_needs_the_parent_stored(
    store: BlockStore, clock: VirtualClock
) -> None:
    cache = make_cache(store, clock)
    prompt = blocks_of(1, 2, 3, 4)
    with pytest.raises(MissingParent):
        cache.insert(NS, prompt, [b"c", b"d"], start_block=2)
    cache.insert(NS, prompt, [b"a", b"b"])
    outcome = cache.insert(NS, prompt, [b"c", b"d"], start_block=2)
    assert outcome.stored == 2
    assert cache.match_prefix(NS, prompt).matched_blocks == 4


@pytest.mark.parametrize(
    ("start_block", "payload_count", "field"),
    [(-1, 1, "start_block"), (5, 0, "start_block"), (0, 5, "payloads"), (3, 2, "payloads")],
)
def test_insert_rejects_blocks_beyond_the_prompt(
    store: BlockStore, clock: VirtualClock, start_block: int, payload_count: int, field: str
) -> None:
    cache = make_cache(store, clock)
    with pytest.raises(InvalidField) as caught:
        cache.insert(NS, blocks_of(1, 2, 3, 4), [b"p"] * payload_count, start_block=start_block)
    assert caught.value.field == field


@pytest.mark.parametrize("tokens", [[1, -1, 2, 3], [2**32, 0, 0, 0], b"\0\0\0"])
def test_invalid_tokens_raise_invalid_field(
    store: BlockStore, clock: VirtualClock, tokens: list[int] | bytes
) -> None:
    cache = make_cache(store, clock)
    with pytest.raises(InvalidField) as caught:
        cache.match_prefix(NS, tokens)
    assert caught.value.field == "tokens"


def test_events_report_lookups_inserts_and_corruption(
    store: BlockStore, raw: RawAccess, clock: VirtualClock
) -> None:
    events = RecordingEvents()
    cache = make_cache(store, clock, events=events)
    prompt = blocks_of(1, 2)
    cache.insert(NS, prompt, [b"a", b"b"])
    cache.insert(NS, prompt, [b"a", b"other"])
    assert events.inserts == [(2, 0, 0), (0, 2, 1)]
    cache.match_prefix(NS, [*prompt, 7], retention="agent")
    cache.match_prefix(NS, blocks_of(1, 3))
    assert events.lookups == [("agent", 8, 1, True), ("chat", 4, 4, False)]
    key = cache.chain(NS, prompt)[1].key
    raw.overwrite_payload(key, b"X")
    assert cache.get_payloads(NS, [key]) == [None]
    assert events.corrupt == [1]
    # Without deferred touches the damaged block is dropped at once (reason "corrupt").
    assert [(e.key, e.reason) for e in events.evicted] == [(key, "corrupt")]
    assert cache.match_prefix(NS, prompt, with_payloads=True).matched_blocks == 1
    assert events.corrupt == [1]  # gone, not damaged: a plain miss
    cache.insert(NS, prompt, [b"a", b"b"])
    assert cache.match_prefix(NS, prompt, with_payloads=True).payloads == (b"a", b"b")


# -- collisions ------------------------------------------------------------------------------


def constant_hash_cache(
    store: BlockStore, clock: VirtualClock, events: RecordingEvents
) -> PrefixCache:
    """Every key, the namespace root included, is the same 16 zero bytes."""
    hasher = BlockHasher(hash_fn=lambda data: b"\0" * 16)
    return make_cache(
        store, clock, config=CacheConfig(default_block_size=2), hasher=hasher, events=events
    )


def test_constant_hash_never_matches_more_blocks_than_were_stored(
    store: BlockStore, clock: VirtualClock
) -> None:
    # Under a constant hash, block 1 of [0, 0 | 0, 0] has the same key and parent key as the
    # stored block 0 and the same tokens: only the depth tells them apart.
    events = RecordingEvents()
    cache = constant_hash_cache(store, clock, events)
    cache.insert(NS, [0, 0], [b"block-0"])
    found = cache.match_prefix(NS, [0, 0, 0, 0], with_payloads=True)
    assert found.matched_blocks == 1, "a one-block prompt was stored, two blocks hit"
    assert found.payloads == (b"block-0",)


def test_constant_hash_does_not_pass_a_new_block_off_as_a_refresh(
    store: BlockStore, clock: VirtualClock
) -> None:
    events = RecordingEvents()
    cache = constant_hash_cache(store, clock, events)
    outcome = cache.insert(NS, [0, 0, 0, 0], [b"block-0", b"block-1"])
    assert (outcome.stored, outcome.refreshed, outcome.collisions) == (1, 0, 1)
    assert events.collisions == [1]


def test_constant_hash_keeps_namespaces_apart(store: BlockStore, clock: VirtualClock) -> None:
    # Two salts of one tenant share its partition: under a colliding key the first writer
    # wins, and neither ever sees the other's block. (Across tenants, see test_tenants.py.)
    events = RecordingEvents()
    cache = constant_hash_cache(store, clock, events)
    salt_a = Namespace(model="llama-3-8b", tenant="t", salt="a")
    salt_b = Namespace(model="llama-3-8b", tenant="t", salt="b")
    cache.insert(salt_a, [5, 5], [b"a-secret"])
    found = cache.match_prefix(salt_b, [5, 5], with_payloads=True)
    assert (found.matched_blocks, found.payloads) == (0, ())
    outcome = cache.insert(salt_b, [5, 5], [b"b-secret"])
    assert (outcome.stored, outcome.collisions) == (0, 1)
    assert cache.match_prefix(salt_a, [5, 5], with_payloads=True).payloads == (b"a-secret",)
    assert cache.get_payloads(salt_b, [cache.chain(salt_b, [5, 5])[0].key]) == [None]
    assert sum(events.collisions) == 2


def test_constant_hash_gives_no_wrong_hits_and_reports_collisions(
    store: BlockStore, clock: VirtualClock
) -> None:
    events = RecordingEvents()
    cache = constant_hash_cache(store, clock, events)
    rng = random.Random(11)

    def payload(prefix: Sequence[int]) -> bytes:
        return bytes(prefix)  # unique per prefix: a served payload names the prefix it holds

    claimed: set[tuple[int, ...]] = set()
    for _ in range(300):
        prompt = [rng.randrange(2) for _ in range(2 * rng.randrange(1, 5))]
        if rng.random() < 0.5:
            blocks = len(prompt) // 2
            outcome = cache.insert(
                NS, prompt, [payload(prompt[: 2 * (i + 1)]) for i in range(blocks)]
            )
            for end in range(1, outcome.stored + outcome.refreshed + 1):
                claimed.add(tuple(prompt[: 2 * end]))
        else:
            found = cache.match_prefix(NS, prompt, with_payloads=True)
            assert found.payloads is not None
            for index, served in enumerate(found.payloads):
                prefix = tuple(prompt[: 2 * (index + 1)])
                assert prefix in claimed, f"a wrong hit on {prefix}: never stored"
                assert served == payload(prefix), (
                    f"a wrong hit on {prefix}: served the payload of {tuple(served)}"
                )
    assert sum(events.collisions) > 0


def test_capacity_in_blocks_filled_by_the_prefix_stores_nothing_more(
    store: BlockStore, clock: VirtualClock
) -> None:
    cache = PrefixCache(
        store,
        config=CacheConfig(default_block_size=2),
        limits=CapacityLimits(capacity_blocks=2),
        clock=clock,
    )
    namespace = Namespace("m")
    prompt = [1, 2, 3, 4, 5, 6]
    assert cache.insert(namespace, prompt[:4], [b"a", b"b"]).stored == 2
    outcome = cache.insert(namespace, prompt, [b"c"], start_block=2)
    assert (outcome.stored, outcome.truncated) == (0, 1)
    assert cache.match_prefix(namespace, prompt).matched_blocks == 2


def test_storing_from_start_block_marks_the_prefix_used(
    store: BlockStore, clock: VirtualClock
) -> None:
    cache = PrefixCache(
        store,
        config=CacheConfig(default_block_size=2),
        limits=CapacityLimits(capacity_blocks=6),
        clock=clock,
    )
    namespace = Namespace("m")
    p = [1, 2, 3, 4, 5, 6, 7, 8]
    q = [9, 10, 11, 12]
    cache.insert(namespace, p[:4], [b"p0", b"p1"])
    clock.advance(1)
    cache.insert(namespace, q, [b"q0", b"q1"])
    clock.advance(1)
    # Continuing P uses its first two blocks: Q is now the least recently used prefix.
    cache.insert(namespace, p[:8], [b"p2", b"p3"], start_block=2)
    clock.advance(1)
    cache.insert(namespace, [20, 21], [b"r0"])
    assert cache.match_prefix(namespace, p, touch=False).matched_blocks == 4
    assert cache.match_prefix(namespace, q, touch=False).matched_blocks == 1


def test_deferred_touches_rewrite_a_hot_prefix_at_most_once_per_resolution(
    store: BlockStore, raw: RawAccess, clock: VirtualClock
) -> None:
    cache = make_cache(store, clock, touches=TouchOptions(defer=True, resolution_seconds=1.0))
    prompt = blocks_of(1, 2)
    store_prompt(cache, prompt, retention="chat")
    cache.match_prefix(NS, prompt, retention="chat")
    cache.touches.flush()
    written = raw.blocks()
    clock.advance(0.5)  # within the resolution: nothing is rewritten
    cache.match_prefix(NS, prompt, retention="chat")
    cache.touches.flush()
    assert raw.blocks() == written
    clock.advance(1.0)  # past it: the prefix is used (and its TTL slides) again
    found = cache.match_prefix(NS, prompt, retention="chat")
    cache.touches.flush()
    metas = raw.blocks()
    assert metas[found.keys[-1]].last_used_at == clock()
    assert [metas[k].expires_at for k in found.keys] == [clock() + CHAT_TTL] * 2


def test_deferred_touches_slide_a_ttl_only_past_the_slide_fraction(
    store: BlockStore, raw: RawAccess, clock: VirtualClock
) -> None:
    cache = make_cache(store, clock, touches=TouchOptions(defer=True, slide_fraction=0.01))
    prompt = blocks_of(1, 2, 3)
    store_prompt(cache, prompt, retention="chat")
    stored_until = [meta.expires_at for meta in raw.blocks().values()]
    clock.advance(CHAT_TTL * 0.005)  # half the slide period: used, not slid
    found = cache.match_prefix(NS, prompt, retention="chat")
    cache.touches.flush()
    metas = raw.blocks()
    assert [meta.expires_at for meta in metas.values()] == stored_until
    assert metas[found.keys[-1]].last_used_at == clock()
    clock.advance(CHAT_TTL * 0.01)  # past it: the whole prefix slides
    cache.match_prefix(NS, prompt, retention="chat")
    cache.touches.flush()
    assert [raw.blocks()[k].expires_at for k in found.keys] == [clock() + CHAT_TTL] * 3
    assert_no_block_outlives_its_parent(raw)


def test_memo_of_a_verified_prompt_never_survives_a_colliding_rewrite_at_the_same_instant(
    store: BlockStore, clock: VirtualClock
) -> None:
    # A crafted collision: prompt B's block hashes to prompt A's key. A is memoised, evicted,
    # and B stored under the same key within the same clock tick: A must miss.
    a, b, other = [1] * 4, [2] * 4, [3] * 4

    def colliding(data: bytes) -> bytes:
        suffix = tokens_to_bytes(b)
        if data.endswith(suffix):
            data = data[: -len(suffix)] + tokens_to_bytes(a)
        return xxh3_128(data)

    cache = PrefixCache(
        store,
        config=CacheConfig(default_block_size=4),
        limits=CapacityLimits(capacity_blocks=1),
        hasher=BlockHasher(hash_fn=colliding),
        clock=clock,
    )
    cache.insert(NS, a, [b"kv of a"])
    assert cache.match_prefix(NS, a).matched_blocks == 1  # verified, and memoised
    cache.insert(NS, other, [b"kv of other"])  # capacity 1: a's block is evicted
    assert cache.insert(NS, b, [b"kv of b"]).stored == 1  # b takes a's key
    assert cache.match_prefix(NS, a).matched_blocks == 0


# -- removal on request ----------------------------------------------------------------------


def test_remove_block_takes_the_block_and_everything_under_it(
    store: BlockStore, clock: VirtualClock, raw: RawAccess
) -> None:
    events = RecordingEvents()
    cache = make_cache(store, clock, events=events)
    store_prompt(cache, blocks_of(1, 2, 3, 4))
    store_prompt(cache, blocks_of(1, 2, 5))  # a branch under block 1
    keys = cache.match_prefix(NS, blocks_of(1, 2, 3, 4)).keys  # remembered by the memo too

    removed = cache.remove_block(NS, keys[1])

    assert len(removed) == 4  # blocks 2, 3, 4 of the first prompt and 5 of the branch
    assert [e.reason for e in events.evicted] == ["removed"] * 4
    assert cache.match_prefix(NS, blocks_of(1, 2, 3, 4)).matched_blocks == 1
    assert cache.match_prefix(NS, blocks_of(1, 2, 5)).matched_blocks == 1
    assert len(raw.blocks()) == 1
    assert_no_block_outlives_its_parent(raw)


def test_remove_block_of_an_unknown_key_removes_nothing(
    store: BlockStore, clock: VirtualClock
) -> None:
    events = RecordingEvents()
    cache = make_cache(store, clock, events=events)
    store_prompt(cache, blocks_of(1, 2))
    other = cache.chain(NS, blocks_of(7)).keys[0]
    assert cache.remove_block(NS, other) == []
    assert events.evicted == []
    assert cache.capacity.usage().blocks == 2
