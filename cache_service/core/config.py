"""CacheConfig: what a request's model and retention name resolve to (block size, class, TTL).

The cache and the operator controls both resolve requests against it, so a model is cut into
blocks of one size and a class has one TTL wherever the request lands.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from cache_service.core.errors import BlockSizeMismatch, UnknownRetention
from cache_service.core.retention import RetentionPolicy

DEFAULT_BLOCK_SIZE = 64


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Block sizes by model (with a default) and the retention classes."""

    default_block_size: int = DEFAULT_BLOCK_SIZE
    model_block_sizes: Mapping[str, int] = field(default_factory=dict)
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)

    def block_size_for(self, model: str, expected: int | None = None) -> int:
        """The block size of a model; BlockSizeMismatch if the caller expects another."""
        size = self.model_block_sizes.get(model, self.default_block_size)
        if expected is not None and expected != size:
            raise BlockSizeMismatch(
                "block_size",
                f"the service cuts model {model!r} into blocks of {size} tokens, not {expected}",
                expected=size,
            )
        return size

    def block_sizes(self) -> set[int]:
        """Every block size a model may be cut into here."""
        return {self.default_block_size, *self.model_block_sizes.values()}

    def resolve_retention(self, name: str | None) -> tuple[str, float]:
        """The retention class and TTL for a request; UnknownRetention if not configured."""
        try:
            return self.retention.resolve(name)
        except KeyError:
            known = ", ".join(self.retention.classes)
            raise UnknownRetention(
                "retention", f"unknown retention class {name!r}; configured: {known}"
            ) from None

    @property
    def longest_ttl_seconds(self) -> float:
        """The TTL of the longest-lived retention class."""
        return max(self.retention.ttl_seconds.values())
