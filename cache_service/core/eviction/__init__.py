"""Eviction policies: which evictable (leaf) block goes first.

The store keeps its unpinned leaf blocks in an index ordered by each block's rank, lowest
first, and evicts from the front; a policy sets the rank at every use of a block. The
memory and LMDB stores, the service and the replay tool all use these same objects, so a
replay predicts the order the service evicts in. The Redis store leaves eviction to Redis.
"""

from __future__ import annotations

from cache_service.core.eviction.adaptive import AdaptivePolicy
from cache_service.core.eviction.base import EvictionPolicy, Use, inherit_use
from cache_service.core.eviction.lru import LruPolicy
from cache_service.core.eviction.protected import ProtectedPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LruPolicy,
    "protected": ProtectedPolicy,
    "adaptive": AdaptivePolicy,
}
# The policy the service, the replay and a store opened without one use: the one measured
# never more than 0.01 below LRU at any capacity (docs/content/concepts/eviction.md;
# tests/test_default_policy.py).
DEFAULT_POLICY = "adaptive"

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "AdaptivePolicy",
    "EvictionPolicy",
    "LruPolicy",
    "ProtectedPolicy",
    "Use",
    "inherit_use",
    "make_policy",
]


def make_policy(name: str = DEFAULT_POLICY) -> EvictionPolicy:
    """A new policy called `name`; ValueError for an unknown one."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r} (known: {', '.join(POLICIES)})"
        ) from None
