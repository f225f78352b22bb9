"""StoreParts: what every operation of a composed store works over, declared once.

The operations (`DataPath`, `Evictions`, `Controls`, `Repairs`) are the bases of
`ComposedStore`, which sets these three attributes: a store's methods are the operations' own
methods, where a reader and a type checker find them.
"""

from __future__ import annotations

from cache_service.core.store.parts.damage import DamageLog
from cache_service.core.store.parts.records import Records
from cache_service.core.store.parts.txns import Transactions


class StoreParts:
    """The backend's transactions, the block records with their indexes, and the damage log."""

    txns: Transactions
    records: Records
    damage: DamageLog
