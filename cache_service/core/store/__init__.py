"""Block stores: one protocol, swappable backends (memory reference model, LMDB)."""

from cache_service.core.store.base import BlockStore
from cache_service.core.store.memory import MemoryStore

__all__ = ["BlockStore", "MemoryStore"]
