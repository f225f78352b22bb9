"""Which tests each store backend must pass: the contract suite reads the backends' own
declared capabilities (cache_service/core/store/protocols.py) and two facilities of the
tests themselves. A test that depends on a behaviour carries `@pytest.mark.needs("name")`;
the `store` fixture (tests/conftest.py) runs it on every backend that declares the behaviour
(it must pass there), and on a backend that declares it lacks one, expects it to fail: a pass
there is reported as XPASS, a behaviour that works but is not declared. A test facility a
backend lacks skips the test, with the reason.
"""

from __future__ import annotations

import pytest

from cache_service.core.store.lmdb.store import LmdbStore
from cache_service.core.store.memory import MemoryStore
from cache_service.core.store.protocols import BEHAVIOURS, BlockStore, Capabilities
from cache_service.core.store.redis.store import RedisStore

DECLARED: dict[str, Capabilities] = {
    "memory": MemoryStore.capabilities,
    "lmdb": LmdbStore.capabilities,
    "redis": RedisStore.capabilities,
}
# What a test may do below the BlockStore protocol, which not every backend allows.
FACILITIES = {
    "byte_records": "records are bytes a test can damage",
    "backend_txn": "the store is composed over a Backend whose transactions a test can use",
}
FACILITY_LACKS: dict[str, dict[str, str]] = {
    "memory": {"byte_records": "the memory backend keeps objects, which cannot rot"},
    "lmdb": {},
    "redis": {
        "backend_txn": "RedisStore has no Backend (store.backend) nor subtrees.find to patch"
    },
}
CAPABILITIES = {**BEHAVIOURS, **FACILITIES}
BACKEND_OF: dict[type, str] = {MemoryStore: "memory", LmdbStore: "lmdb", RedisStore: "redis"}


def _needed(node: pytest.Item) -> list[str]:
    needed = [name for mark in node.iter_markers("needs") for name in mark.args]
    unknown = set(needed) - set(CAPABILITIES)
    if unknown:
        raise ValueError(f"needs{tuple(unknown)}: not one of {', '.join(CAPABILITIES)}")
    return list(dict.fromkeys(needed))


def lacking(backend: str, node: pytest.Item) -> list[str]:
    """The test facilities `backend` lacks that the test `node` needs, one reason each
    (empty: the test can run there)."""
    lacks = FACILITY_LACKS[backend]
    return [f"{lacks[name]} [{name}]" for name in _needed(node) if name in lacks]


def undeclared(backend: str, node: pytest.Item) -> list[str]:
    """The behaviours the test `node` needs that `backend` declares it lacks, one reason
    each (empty: the backend declares them all, and the test must pass there)."""
    declared = DECLARED[backend]
    return [
        f"{declared.why_not(name)} [{name}]"
        for name in _needed(node)
        if name in BEHAVIOURS and not declared.has(name)
    ]


def capable(store: BlockStore, capability: str) -> bool:
    """Whether a store's backend has a capability (a behaviour it declares, or a facility)."""
    if capability not in CAPABILITIES:
        raise ValueError(f"{capability!r} is not one of {', '.join(CAPABILITIES)}")
    backend = BACKEND_OF[type(store)]
    if capability in FACILITIES:
        return capability not in FACILITY_LACKS[backend]
    return DECLARED[backend].has(capability)


# Tests outside tests/store that take the `store` fixture, and what they depend on that the
# Redis store lacks (or a bug of it they meet). Their files are owned elsewhere: the marks are
# put on here, at collection (tests/conftest.py), until they are written on the tests.
def _needs(*names: str) -> pytest.MarkDecorator:
    return pytest.mark.needs(*names)


ELSEWHERE: dict[str, tuple[pytest.MarkDecorator, ...]] = {
    "tests/test_cache.py::test_block_is_alive_until_its_ttl_and_a_miss_at_expiry": (
        _needs("clock_expiry"),
    ),
    "tests/test_cache.py::test_a_hit_slides_expiry_to_now_plus_the_hitting_class_ttl": (
        _needs("record_upkeep", "clock_expiry"),
    ),
    "tests/test_cache.py::test_a_hit_keeps_the_later_of_two_expiries": (
        _needs("record_upkeep", "clock_expiry"),
    ),
    "tests/test_cache.py::test_a_hit_makes_a_block_survive_past_its_first_ttl": (
        _needs("clock_expiry"),
    ),
    "tests/test_cache.py::test_extending_a_prefix_keeps_every_ancestor_alive_as_long_as_its_descendants": (  # noqa: E501
        _needs("clock_expiry", "store_eviction"),
    ),
    "tests/test_cache.py::test_sweep_expired_deletes_only_expired_blocks_in_batches": (
        _needs("clock_expiry", "store_eviction"),
    ),
    "tests/test_cache.py::test_sweep_expired_never_leaves_an_orphan": (
        _needs("clock_expiry", "store_eviction"),
    ),
    "tests/test_cache.py::test_deferred_touches_apply_only_at_flush": (
        _needs("record_upkeep", "clock_expiry"),
    ),
    "tests/test_cache.py::test_capacity_blocks_evicts_down_to_exactly_the_capacity": (
        _needs("store_eviction"),
    ),
    "tests/test_cache.py::test_request_larger_than_the_cache_keeps_its_first_blocks": (
        _needs("store_eviction"),
    ),
    "tests/test_cache.py::test_capacity_blocks_evicts_least_recently_used_prompt_first": (
        _needs("store_eviction"),
    ),
    "tests/test_cache.py::test_capacity_bytes_stays_under_capacity_and_keeps_the_newest_prefix": (
        _needs("store_eviction"),
    ),
    "tests/test_cache.py::test_custom_retention_table_is_used": (_needs("clock_expiry"),),
    "tests/test_cache.py::test_storing_from_start_block_marks_the_prefix_used": (
        _needs("store_eviction"),
    ),
    "tests/test_cache.py::test_deferred_touches_rewrite_a_hot_prefix_at_most_once_per_resolution": (
        _needs("record_upkeep"),
    ),
    "tests/test_cache.py::test_deferred_touches_slide_a_ttl_only_past_the_slide_fraction": (
        _needs("record_upkeep", "clock_expiry"),
    ),
    "tests/test_cache.py::test_memo_of_a_verified_prompt_never_survives_a_colliding_rewrite_at_the_same_instant": (  # noqa: E501
        _needs("store_eviction"),
    ),
    "tests/test_cache.py::test_remove_block_takes_the_block_and_everything_under_it": (
        _needs("subtree_removal"),
    ),
    "tests/test_cache.py::test_remove_block_of_an_unknown_key_removes_nothing": (
        _needs("exact_usage"),
    ),
    "tests/test_metrics.py::test_capacity_evictions_before_the_ttl_are_counted": (
        _needs("store_eviction"),
    ),
    "tests/test_metrics.py::test_expired_blocks_are_counted_as_expired_not_before_their_ttl": (
        _needs("clock_expiry", "store_eviction"),
    ),
    "tests/test_metrics.py::test_removed_blocks_are_counted_as_removed": (
        _needs("subtree_removal"),
    ),
    "tests/test_metrics.py::test_store_collector_reports_usage_and_capacity_at_scrape_time": (
        _needs("exact_usage"),
    ),
    "tests/test_operators.py::test_a_pinned_prefix_survives_an_eviction_storm_and_eight_days": (
        _needs("pins", "clock_expiry", "store_eviction"),
    ),
    "tests/test_operators.py::test_unpinning_lets_a_prefix_expire_and_be_evicted_again": (
        _needs("pins", "clock_expiry", "store_eviction"),
    ),
    "tests/test_operators.py::test_overlapping_pins_are_released_independently": (
        _needs("pins", "clock_expiry"),
    ),
    "tests/test_operators.py::test_pins_name_the_block_that_is_not_stored_and_keep_to_the_quota": (
        _needs("pins"),
    ),
    "tests/test_operators.py::test_an_unpinned_prefix_expires_and_is_swept_like_any_other": (
        _needs("pins", "clock_expiry", "store_eviction"),
    ),
    "tests/test_operators.py::test_a_purge_under_a_pin_releases_the_blocks_above_it": (
        _needs("pins", "purge_under"),
    ),
    "tests/test_operators.py::test_a_purge_racing_a_store_leaves_no_block_pinned_for_ever": (
        _needs("pins", "subtree_removal", "backend_txn"),
    ),
    "tests/test_operators.py::test_purge_a_tenant_a_namespace_or_what_is_under_a_prefix": (
        _needs("pins", "purge_under"),
    ),
    "tests/test_operators.py::test_explain_names_why_a_lookup_stops": (
        _needs("store_eviction", "removal_log"),
    ),
    "tests/test_operators.py::test_explain_tells_expired_blocks_before_and_after_the_sweep": (
        _needs("clock_expiry", "removal_log"),
    ),
    "tests/test_operators.py::test_explain_finds_the_first_block_under_another_salt_or_block_size": (  # noqa: E501
        _needs("removal_log"),
    ),
    "tests/test_operators.py::test_a_tenant_over_its_quota_evicts_its_own_blocks_first": (
        _needs("pins", "tenant_bytes"),
    ),
    "tests/test_operators.py::test_a_prefix_can_be_pinned_by_its_keys": (_needs("pins"),),
    "tests/test_operators.py::test_only_as_high_a_role_may_release_a_pin": (_needs("pins"),),
    "tests/test_operators.py::test_a_higher_role_pinning_a_pinned_prefix_takes_the_pin_over": (
        _needs("pins"),
    ),
    "tests/test_operators.py::test_a_full_pinned_share_does_not_tell_how_much_others_pinned": (
        _needs("pins"),
    ),
    "tests/test_operators.py::test_explain_names_blocks_removed_on_request": (
        _needs("subtree_removal", "removal_log"),
    ),
    "tests/test_operators.py::test_explain_and_pins_survive_a_damaged_namespace_record": (
        _needs("pins", "backend_txn"),
    ),
}
