"""What a serving process checks and says as it opens its store: the settings the data was
made with (refused if one that defines the data differs, logged if one that steers it
changed), and one line saying what it serves."""

from __future__ import annotations

import logging
import os

from cache_service.identity import StoreIdentity, identity_of, show_size
from cache_service.settings import Settings
from cache_service.store.base import BlockStore
from cache_service.store.lmdb import LmdbStore

log = logging.getLogger("cache_service")


def store_identity(settings: Settings) -> StoreIdentity:
    """The identity these settings record in the store they open."""
    return identity_of(
        seed=settings.seed,
        default_block_size=settings.block_size,
        model_block_sizes=settings.model_block_sizes(),
        retention_ttl_seconds=settings.retention_policy().ttl_seconds,
        capacity_bytes=settings.capacity,
        high_water=settings.high_water,
        low_water=settings.low_water,
    )


def open_store(settings: Settings) -> LmdbStore:
    """The LMDB store of the data folder; SettingsMismatch if its data was made with other
    settings. Logs what changed since the last run."""
    identity = store_identity(settings)
    store = LmdbStore(
        settings.data_dir,
        map_size_bytes=settings.map_size_bytes(),
        sync_mode=settings.lmdb_sync,
        identity=identity,
    )
    for note in identity.notes:
        log.info("%s", note)
    return store


def serving_line(settings: Settings, store: BlockStore) -> str:
    """The start-up line: which process serves which data, how much, to whom, where."""
    where = (
        f"data folder {store.path.resolve()}"
        if isinstance(store, LmdbStore)
        else f"a {type(store).__name__}"
    )
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    return (
        f"process {os.getpid()} serves {where} (capacity {show_size(settings.capacity)}, "
        f"auth {settings.auth}) on http://{host}:{settings.port}"
    )
