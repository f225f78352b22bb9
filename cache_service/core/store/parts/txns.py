"""A backend's transactions as the store's operations open them: inside a batch, every call of
the batching thread joins the batch's one write transaction."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from cache_service.core.eviction import EvictionPolicy
from cache_service.core.store.parts.backend import Backend, Txn


class Transactions:
    """Read and write transactions over a backend, with this thread's batch if one is open.

    The eviction policy learns inside write transactions (what was evicted, what came back):
    it is told when one begins, commits or aborts, so an aborted one (a full LMDB map, which
    the store retries) teaches it nothing."""

    def __init__(self, backend: Backend, policy: EvictionPolicy) -> None:
        self._backend = backend
        self._policy = policy
        self._batch = threading.local()
        self._writing = threading.RLock()
        self._depth = 0  # write transactions this thread has open (under the lock)

    @contextmanager
    def read(self, *, views: bool = False) -> Iterator[Txn]:
        """A read transaction (the batch's, inside a batch)."""
        batch: Txn | None = getattr(self._batch, "txn", None)
        if batch is not None:
            yield batch
            return
        with self._backend.read(views=views) as txn:
            yield txn

    @contextmanager
    def write(self) -> Iterator[Txn]:
        """A write transaction (the batch's, inside a batch)."""
        batch: Txn | None = getattr(self._batch, "txn", None)
        if batch is not None:
            yield batch
            return
        with self._policy_watching(), self._backend.write() as txn:
            yield txn

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Run this thread's store calls inside one write transaction (one commit).

        On LMDB all or nothing: an error anywhere aborts every call in the batch. The memory
        backend changes records in place and cannot roll back, so every operation refuses
        before it writes. Meant for the replay, whose store is private; a server keeps its
        transactions short instead.
        """
        if getattr(self._batch, "txn", None) is not None:
            yield
            return
        with self._policy_watching(), self._backend.write() as txn:
            self._batch.txn = txn
            try:
                yield
            finally:
                self._batch.txn = None

    @contextmanager
    def _policy_watching(self) -> Iterator[None]:
        """Around a write transaction's whole life, its commit included. Held under a lock:
        the backend lets one writer in at a time, but only once its transaction has begun,
        and another thread's begin must not come between this one's begin and commit."""
        with self._writing:
            self._depth += 1
            try:
                if self._depth > 1:  # a write inside this thread's own (the backend decides)
                    yield
                    return
                self._policy.begin()
                try:
                    yield
                except BaseException:
                    self._policy.abort()
                    raise
                self._policy.commit()
            finally:
                self._depth -= 1
