"""Operator controls on every backend: pins, purges and explanations of misses."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from cache_service.core.blocks import Namespace, PinLimits
from cache_service.core.cache import PrefixCache
from cache_service.core.capacity import CapacityLimits
from cache_service.core.config import CacheConfig
from cache_service.core.errors import Forbidden, InvalidField, NotStored, QuotaExceeded
from cache_service.core.hashing import BlockHasher
from cache_service.core.operators import EXPLANATIONS, Operators
from cache_service.core.retention import DEFAULT_LIFETIMES
from cache_service.core.store.parts import subtrees
from cache_service.core.store.protocols import BlockStore
from tests.store.capabilities import capable

if TYPE_CHECKING:
    from conftest import VirtualClock

DAY = 86400.0
NS = Namespace(model="m", tenant="team-a")
BLOCK = 4

# Caches with the default retention classes, whose removals are remembered for explanations.
pytestmark = pytest.mark.store_opened(lifetimes=DEFAULT_LIFETIMES, removal_log_entries=1000)


def blocks_of(*labels: int) -> list[int]:
    """One block per label, each block BLOCK copies of it."""
    return [label for label in labels for _ in range(BLOCK)]


def make(store: BlockStore, clock: VirtualClock, **kwargs: object) -> tuple[PrefixCache, Operators]:
    kwargs.setdefault("config", CacheConfig(default_block_size=BLOCK))
    cache = PrefixCache(store, clock=clock, **kwargs)  # type: ignore[arg-type]
    return cache, Operators.for_cache(cache)


def put(cache: PrefixCache, tokens: list[int], namespace: Namespace = NS, **kw: object) -> None:
    count = len(tokens) // cache.config.block_size_for(namespace.model)
    cache.insert(namespace, tokens, [b"kv%d" % i for i in range(count)], **kw)  # type: ignore[arg-type]


def matched(cache: PrefixCache, tokens: list[int], namespace: Namespace = NS) -> int:
    return cache.match_prefix(namespace, tokens, touch=False).matched_blocks


# -- pins --------------------------------------------------------------------------------------


def test_a_pinned_prefix_survives_an_eviction_storm_and_eight_days(
    store: BlockStore, clock: VirtualClock
) -> None:
    cache, ops = make(store, clock, limits=CapacityLimits(capacity_blocks=6))
    system = blocks_of(1, 2, 3)
    put(cache, system, retention="agent")
    record, new = ops.pin(NS, system, by="ops")
    assert (record.blocks, new) == (3, True)
    for label in range(100, 160):  # sixty other prompts through a six-block cache
        clock.advance(60)
        put(cache, blocks_of(label, label + 1))
    assert matched(cache, system) == 3
    clock.advance(8 * DAY)  # past every retention class
    while cache.capacity.sweep_expired():
        pass
    assert matched(cache, system) == 3
    assert cache.capacity.usage().blocks == 3  # everything else expired and was swept
    again, new = ops.pin(NS, system, by="ops")
    assert (again, new) == (record, False)  # pinning again changes nothing


def test_unpinning_lets_a_prefix_expire_and_be_evicted_again(
    store: BlockStore, clock: VirtualClock
) -> None:
    cache, ops = make(store, clock, limits=CapacityLimits(capacity_blocks=3))
    system = blocks_of(1, 2)
    put(cache, system)
    ops.pin(NS, system, by="ops")
    assert ops.unpin(NS, system) == 2
    assert ops.unpin(NS, system) == 0  # no such pin any more
    longest = cache.config.longest_ttl_seconds
    clock.advance(longest - 1)
    assert matched(cache, system) == 2
    clock.advance(2)
    assert matched(cache, system) == 0


def test_overlapping_pins_are_released_independently(
    store: BlockStore, clock: VirtualClock
) -> None:
    cache, ops = make(store, clock, limits=CapacityLimits(capacity_blocks=4))
    short, long = blocks_of(1, 2), blocks_of(1, 2, 3)
    put(cache, long)
    ops.pin(NS, short, by="a")
    ops.pin(NS, long, by="b")
    assert ops.unpin(NS, long) == 3
    for label in range(100, 120):
        put(cache, blocks_of(label))
    assert matched(cache, long) == 2  # the short pin still holds its two blocks


def test_pins_name_the_block_that_is_not_stored_and_keep_to_the_quota(
    store: BlockStore, clock: VirtualClock
) -> None:
    cache, ops = make(store, clock)
    put(cache, blocks_of(1, 2))
    with pytest.raises(NotStored, match="block 2 of the prefix is not stored"):
        ops.pin(NS, blocks_of(1, 2, 3), by="a")
    with pytest.raises(InvalidField):
        ops.pin(NS, [1, 2], by="a")  # no full block
    ops.pin(NS, blocks_of(1), by="a", limits=PinLimits(blocks=2))
    with pytest.raises(QuotaExceeded, match="pin quota of 2 blocks"):
        ops.pin(NS, blocks_of(1, 2), by="a", limits=PinLimits(blocks=2))
    block = store.space.estimate_bytes(len(b"kv0"), 4 * BLOCK)
    with pytest.raises(QuotaExceeded, match="pinned_share"):  # the bytes all pins may take
        ops.pin(NS, blocks_of(1, 2), by="a", limits=PinLimits(total_bytes=block + 1))
    with pytest.raises(QuotaExceeded, match="the tenant's pins hold"):
        ops.pin(NS, blocks_of(1, 2), by="a", limits=PinLimits(tenant_bytes=block + 1))
    assert [p["blocks"] for p in ops.pins("team-a")] == [1]
    assert ops.pins("team-b") == []


def test_a_prefix_can_be_pinned_by_its_keys(store: BlockStore, clock: VirtualClock) -> None:
    cache, ops = make(store, clock, limits=CapacityLimits(capacity_blocks=2))
    prompt = blocks_of(1, 2)
    put(cache, prompt)
    keys = list(cache.match_prefix(NS, prompt).keys)
    record, _ = ops.pin(NS, keys=keys, by="ops")
    assert record.blocks == 2
    assert ops.pins("team-a")[0]["key"] == keys[-1].hex()
    assert ops.pins("team-a")[0]["model"] == "m"
    with pytest.raises(NotStored, match=r"keys\[0\] is not block 0"):
        ops.pin(NS, keys=keys[1:], by="ops")
    with pytest.raises(NotStored):  # another tenant's view of the same keys: nothing stored
        ops.pin(Namespace(model="m", tenant="team-b"), keys=keys, by="ops")
    put(cache, blocks_of(7, 8))  # the cache is full of pins: nothing of this can stay
    assert matched(cache, prompt) == 2


def test_an_unpinned_prefix_expires_and_is_swept_like_any_other(
    store: BlockStore, clock: VirtualClock
) -> None:
    cache, ops = make(store, clock)
    prompt = blocks_of(1, 2)
    put(cache, prompt, retention="agent")
    ops.pin(NS, prompt, by="ops")
    clock.advance(4 * DAY)  # past the class TTL: the sweeper finds the entries, keeps them
    cache.capacity.sweep_expired()
    assert matched(cache, prompt) == 2
    ops.unpin(NS, prompt)
    clock.advance(cache.config.longest_ttl_seconds + 1)
    while cache.capacity.sweep_expired():
        pass
    assert cache.capacity.usage().blocks == 0  # swept: the expiry entries came back from "never"


def test_only_as_high_a_role_may_release_a_pin(store: BlockStore, clock: VirtualClock) -> None:
    cache, ops = make(store, clock)
    prompt = blocks_of(1)
    put(cache, prompt)
    ops.pin(NS, prompt, by="ops", rank=3)
    with pytest.raises(Forbidden, match="pinned by 'ops'"):
        ops.unpin(NS, prompt, rank=2)
    assert ops.unpin(NS, prompt, rank=3) == 1


@pytest.mark.needs("store_eviction")  # tests/store/test_purge.py has the generic part
def test_a_purge_under_a_pin_releases_the_blocks_above_it(
    store: BlockStore, clock: VirtualClock
) -> None:
    cache, ops = make(store, clock, limits=CapacityLimits(capacity_blocks=3))
    prompt = blocks_of(1, 2, 3)
    put(cache, prompt)
    ops.pin(NS, prompt, by="ops")
    assert ops.purge("team-a", namespace=NS, tokens=blocks_of(1, 2)).pins == 1
    assert ops.pins("team-a") == []
    for label in range(100, 110):  # block 0 is no longer pinned: it can be evicted
        put(cache, blocks_of(label))
    assert matched(cache, prompt) == 0


def test_a_higher_role_pinning_a_pinned_prefix_takes_the_pin_over(
    store: BlockStore, clock: VirtualClock
) -> None:
    cache, ops = make(store, clock)
    prompt = blocks_of(1, 2)
    put(cache, prompt)
    ops.pin(NS, prompt, by="a-writer", rank=2)
    record, new = ops.pin(NS, prompt, by="ops", rank=3)
    assert (record.by, record.rank, new) == ("ops", 3, False)
    with pytest.raises(Forbidden):
        ops.unpin(NS, prompt, rank=2)


def test_a_full_pinned_share_does_not_tell_how_much_others_pinned(
    store: BlockStore, clock: VirtualClock
) -> None:
    cache, ops = make(store, clock)
    other = Namespace(model="m", tenant="team-b")
    put(cache, blocks_of(1), namespace=other)
    ops.pin(other, blocks_of(1), by="b")
    put(cache, blocks_of(2))
    with pytest.raises(QuotaExceeded) as refused:
        ops.pin(NS, blocks_of(2), by="a", limits=PinLimits(total_bytes=10))
    assert "bytes" not in str(refused.value)
    assert refused.value.extensions == {"limit": "pinned_share"}


def test_a_purge_racing_a_store_leaves_no_block_pinned_for_ever(
    store: BlockStore, clock: VirtualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, ops = make(store, clock)
    prompt = blocks_of(1, 2)
    put(cache, prompt)
    ops.pin(NS, prompt, by="ops")
    scan = subtrees.find

    def scan_then_store(*args: Any, **kwargs: Any) -> list[subtrees.Target]:
        targets = scan(*args, **kwargs)
        put(cache, blocks_of(1, 9))  # a sibling under the pinned root lands mid-purge
        return targets

    monkeypatch.setattr(subtrees, "find", scan_then_store)
    result = ops.purge("team-a", namespace=NS)
    assert (result.blocks, result.pins) == (1, 1)  # the root stays: it has a new child
    assert ops.pins("team-a") == []
    clock.advance(400 * DAY)
    while cache.capacity.sweep_expired():
        pass
    assert cache.capacity.usage().blocks == 0  # the root was let go of, so it expired like the rest


# -- purge -------------------------------------------------------------------------------------


def test_purge_a_tenant_a_namespace_or_what_is_under_a_prefix(
    store: BlockStore, clock: VirtualClock
) -> None:
    cache, ops = make(store, clock)
    salted = Namespace(model="m", tenant="team-a", salt="s")
    other_tenant = Namespace(model="m", tenant="team-b")
    put(cache, blocks_of(1, 2, 3))
    put(cache, blocks_of(1, 2, 4))
    put(cache, blocks_of(1, 5))
    put(cache, blocks_of(1, 2), namespace=salted)
    put(cache, blocks_of(1, 2), namespace=other_tenant)
    ops.pin(NS, blocks_of(1, 2, 3), by="ops")

    under = ops.purge("team-a", namespace=NS, tokens=blocks_of(1, 2))  # [1,2] and below
    assert (under.blocks, under.pins) == (3, 1)
    assert under.payload_bytes == len(b"kv1") + 2 * len(b"kv2")
    assert matched(cache, blocks_of(1, 2, 3)) == 1
    assert matched(cache, blocks_of(1, 5)) == 2

    namespace = ops.purge("team-a", namespace=NS)
    assert namespace.blocks == 2
    assert matched(cache, blocks_of(1, 5)) == 0
    assert matched(cache, blocks_of(1, 2), salted) == 2

    tenant = ops.purge("team-a")
    assert tenant.blocks == 2
    assert matched(cache, blocks_of(1, 2), salted) == 0
    assert matched(cache, blocks_of(1, 2), other_tenant) == 2  # another tenant is untouched
    if capable(store, "exact_usage"):
        assert cache.capacity.usage().blocks == 2


# -- explanations ------------------------------------------------------------------------------


def test_explain_names_why_a_lookup_stops(store: BlockStore, clock: VirtualClock) -> None:
    cache, ops = make(store, clock, limits=CapacityLimits(capacity_blocks=3))
    put(cache, blocks_of(1, 2))
    assert ops.explain(NS, blocks_of(1, 2)).reason == "complete"
    assert ops.explain(NS, [*blocks_of(1, 2), 9]).reason == "partial_block"
    never = ops.explain(NS, blocks_of(1, 2, 3))
    assert (never.matched_blocks, never.first_unmatched_block, never.reason) == (
        2,
        2,
        "never_stored",
    )

    clock.advance(10)
    put(cache, blocks_of(7, 8))  # capacity 3: evicts the oldest leaf, block 1 of [1, 2]
    evicted = ops.explain(NS, blocks_of(1, 2))
    assert (evicted.reason, evicted.matched_blocks) == ("evicted", 1)
    assert evicted.facts["removed_at"] == clock()
    assert ops.explain(NS, blocks_of(1, 2), block_size=8).reason == "block_size_differs"


def test_explain_tells_expired_blocks_before_and_after_the_sweep(
    store: BlockStore, clock: VirtualClock
) -> None:
    cache, ops = make(store, clock)
    put(cache, blocks_of(1), retention="agent")
    clock.advance(3 * DAY + 1)
    before = ops.explain(NS, blocks_of(1))
    assert (before.reason, before.facts["retention"]) == ("expired", "agent")
    cache.capacity.sweep_expired()
    after = ops.explain(NS, blocks_of(1))
    assert after.reason == "expired"
    assert after.facts["expired_at"] == before.facts["expired_at"]
    assert after.facts["removed_at"] == clock()
    ops.purge("team-a")  # nothing left to purge; a purge of stored blocks is "purged":
    put(cache, blocks_of(2))
    ops.purge("team-a")
    assert ops.explain(NS, blocks_of(2)).reason == "purged"


def test_explain_finds_the_first_block_under_another_salt_or_block_size(
    store: BlockStore, clock: VirtualClock
) -> None:
    cache, ops = make(store, clock)
    prompt = list(range(100, 132))  # 32 tokens
    put(cache, prompt, namespace=Namespace(model="m", tenant="team-a", salt="lora-7"))
    # A salt keeps users of one tenant apart: only an admin's explanation looks across.
    assert ops.explain(NS, prompt).reason == "never_stored"
    other = ops.explain(NS, prompt, reveal_salts=True)
    assert other.reason == "other_namespace"
    assert (other.facts["salt"], other.facts["salt_differs"], other.facts["model"]) == (
        "lora-7",
        True,
        "m",
    )
    # Under the same salt, another model is named to anyone of the tenant.
    put(cache, prompt, namespace=Namespace(model="m2", tenant="team-a"))
    assert ops.explain(NS, prompt).facts["model"] == "m2"
    # Another tenant's identical prompt is not revealed.
    assert ops.explain(Namespace(model="m", tenant="team-b", salt="lora-7"), prompt).reason == (
        "never_stored"
    )
    # The same namespace under a block size the service used before.
    resized, resized_ops = make(
        store, clock, config=CacheConfig(default_block_size=BLOCK, model_block_sizes={"m": 16})
    )
    put(resized, prompt)
    assert ops.explain(NS, prompt).reason == "block_size_differs"  # its own namespace first
    assert ops.explain(NS, prompt).facts["stored_block_size"] == 16
    assert resized_ops.explain(NS, prompt).reason == "complete"


def test_explain_reports_a_rejected_collision(store: BlockStore, clock: VirtualClock) -> None:
    hasher = BlockHasher(hash_fn=lambda data: b"\1" * 16)
    cache, ops = make(store, clock, hasher=hasher)
    put(cache, blocks_of(1))
    assert ops.explain(NS, blocks_of(2)).reason == "collision_rejected"


# -- tenant quotas -----------------------------------------------------------------------------


def test_a_tenant_over_its_quota_evicts_its_own_blocks_first(
    store: BlockStore, clock: VirtualClock
) -> None:
    block_bytes = store.space.estimate_bytes(100, 4 * BLOCK)
    cache, ops = make(
        store, clock, limits=CapacityLimits(tenant_capacity_bytes={"team-a": 10 * block_bytes})
    )
    other = Namespace(model="m", tenant="team-b")
    for label in range(5):
        cache.insert(other, blocks_of(label), [b"b" * 100])
    for label in range(40):  # forty blocks through a ten-block quota
        clock.advance(1)
        cache.insert(NS, blocks_of(1000 + label), [b"a" * 100])
        partition = cache.hasher.namespace_id(NS).partition
        assert store.tenant_bytes(partition) <= 10 * block_bytes
    assert all(matched(cache, blocks_of(label), other) == 1 for label in range(5))
    assert matched(cache, blocks_of(1039)) == 1  # the newest stays
    assert matched(cache, blocks_of(1000)) == 0
    why = ops.explain(NS, blocks_of(1000))
    assert (why.reason, why.facts["cause"]) == ("evicted", "tenant_quota")
    pinned = blocks_of(1039)
    ops.pin(NS, pinned, by="ops")
    for label in range(40, 60):
        clock.advance(1)
        cache.insert(NS, blocks_of(1000 + label), [b"a" * 100])
    assert matched(cache, pinned) == 1  # a pin holds even against its own tenant's quota


def test_explain_names_blocks_removed_on_request(store: BlockStore, clock: VirtualClock) -> None:
    cache, ops = make(store, clock)
    put(cache, blocks_of(1, 2, 3))
    chain = cache.hasher.keys(NS, blocks_of(1, 2, 3), block_size=cache.config.block_size_for("m"))
    clock.advance(5)
    assert len(cache.remove_block(NS, chain[1])) == 2  # block 1 and the block under it
    removed = ops.explain(NS, blocks_of(1, 2, 3))
    assert (removed.reason, removed.matched_blocks) == ("removed", 1)
    assert removed.facts["removed_at"] == clock()
    assert "removed on request" in removed.detail


@pytest.mark.parametrize(
    "damage",
    [
        lambda encoded: encoded[: len(encoded) // 2],  # truncated: struct.error
        lambda encoded: encoded.replace(b"m2", b"\xff\xfe"),  # the model not UTF-8
        lambda encoded: b"junk",  # not a namespace record at all
    ],
)
def test_explain_and_pins_survive_a_damaged_namespace_record(
    store: BlockStore, clock: VirtualClock, damage: Callable[[bytes], bytes]
) -> None:
    cache, ops = make(store, clock)
    prompt = list(range(100, 132))
    other = Namespace(model="m2", tenant="team-a")
    put(cache, prompt, namespace=other)
    ops.pin(other, prompt, by="op")
    scope = cache.hasher.namespace_id(other).scope
    encoded = store.encoded_namespace(scope)
    assert encoded is not None
    with store.backend.write() as txn:  # type: ignore[attr-defined]
        txn.put_namespace(scope, damage(bytes(encoded)))
    explained = ops.explain(NS, prompt)  # another model with the same tokens
    assert (explained.reason, explained.facts) == ("damaged_namespace", {"damaged_records": 1})
    assert ops.explain(NS, prompt).detail == EXPLANATIONS["damaged_namespace"]
    assert [pin["model"] for pin in ops.pins("team-a")] == [None]  # unknown, not a 500
