"""A store assembled from a backend and the parts written once over it.

    backend (records, payloads, indexes, small tables, transactions)
      -> parts: victims index (with the policy), expiry index, tenant accounts, pins,
         removal log and first-block hints, kept together by `Records`
      -> operations, the bases of `ComposedStore` (its methods are theirs, no wrapper):
         `DataPath` (match, insert, touch, payload reads, usage), `Evictions` (evict,
         evict_tenant, remove_subtree), `Controls` (operator controls), `Repairs`
         (drop_damaged: blocks that failed verification, with their subtrees)

A backend module adds only its backend and a thin class that hands it to `ComposedStore`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Generic, TypeVar

from cache_service.core.eviction import EvictionPolicy, make_policy
from cache_service.core.lifetimes import Lifetimes
from cache_service.core.store.parts.backend import Backend
from cache_service.core.store.parts.controls import Controls
from cache_service.core.store.parts.data_path import DataPath
from cache_service.core.store.parts.evictions import Evictions
from cache_service.core.store.parts.records import Records
from cache_service.core.store.parts.removals import DEFAULT_REMOVAL_LOG_ENTRIES, RemovalLog
from cache_service.core.store.parts.repairs import Repairs
from cache_service.core.store.parts.tenants import TenantAccounts
from cache_service.core.store.parts.txns import Transactions
from cache_service.core.store.parts.victims import VictimIndex
from cache_service.core.store.protocols import OnDisk, Remote

B = TypeVar("B", bound=Backend)


class ComposedStore(DataPath, Evictions, Controls, Repairs, Generic[B]):
    """A BlockStore (data path and operator controls) over one backend: its methods are
    those of the operations it is made of."""

    disk: OnDisk | None = None  # see store.protocols.Capabilities
    remote: Remote | None = None

    def __init__(
        self,
        backend: B,
        *,
        policy: EvictionPolicy | None = None,
        removal_log_entries: int = DEFAULT_REMOVAL_LOG_ENTRIES,
    ) -> None:
        self.backend = backend
        self.policy: EvictionPolicy = policy or make_policy()
        self.space = backend.space
        self._removal_log = RemovalLog(removal_log_entries)
        self.txns = Transactions(backend, self.policy)
        self.records = Records(
            VictimIndex(self.policy), TenantAccounts(self.space), self._removal_log
        )
        self.damage = backend.damage

    def batch(self) -> AbstractContextManager[None]:
        """Run several operations of this thread in one write transaction (see Transactions)."""
        return self.txns.batch()

    @property
    def lifetimes(self) -> Lifetimes:
        """How far from now each retention class's blocks may expire (see core.lifetimes):
        the backend's, given when it was opened."""
        return self.backend.lifetimes

    @property
    def removal_log_entries(self) -> int:
        """Recent removals remembered for explanations (0: none)."""
        return self._removal_log.entries

    def close(self) -> None:
        """Release the backend's resources."""
        self.backend.close()
