"""What a serving process checks and says as it opens its store: the settings the data was
made with (refused if one that defines the data differs, logged if one that steers it
changed), and one line saying what it serves."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path

from cache_service.core.disk import DiskWarning, measure_room
from cache_service.core.errors import NotSupportedByStore
from cache_service.core.eviction import make_policy
from cache_service.core.identity import StoreIdentity, identity_of
from cache_service.core.store import registry
from cache_service.core.store.registry import OpenedStore, parse_store_url
from cache_service.core.units import show_size
from cache_service.service.settings import Settings

log = logging.getLogger("cache_service")

REDIS_SCHEMES = frozenset({"redis", "rediss"})


def store_identity(settings: Settings) -> StoreIdentity:
    """The identity these settings record in the store they open; on Redis without the
    LMDB store's capacity and eviction settings, which Redis does not use."""
    identity = identity_of(
        seed=settings.seed,
        default_block_size=settings.block_size,
        model_block_sizes=settings.model_block_sizes(),
        retention_ttl_seconds=settings.retention_policy().ttl_seconds,
        capacity_bytes=settings.capacity,
        high_water=settings.high_water,
        low_water=settings.low_water,
        eviction_policy=settings.eviction_policy,
    )
    if parse_store_url(settings.store_url())[0] not in REDIS_SCHEMES:
        return identity
    unused = LMDB_ONLY | IGNORED_ON_REDIS
    return StoreIdentity({k: v for k, v in identity.values.items() if k not in unused})


def open_store(settings: Settings) -> OpenedStore:
    """The store --store (or --data-dir) names; SettingsMismatch if its data was made with
    other settings. Logs what changed since the last run."""
    identity = store_identity(settings)
    opened = registry.open_store(
        settings.store_url(),
        map_size_bytes=settings.map_size_bytes(),
        sync_mode=settings.lmdb_sync,
        identity=identity,
        policy=make_policy(settings.eviction_policy),
        removal_log_entries=settings.removal_log_entries,
    )
    for note in identity.notes:
        log.info("%s", note)
    try:
        refuse_unsupported(opened, settings)
    except BaseException:
        opened.store.close()
        raise
    check_disk(opened, settings.capacity)
    if opened.kind == "redis":
        # The worker processes of one machine still share files: the metrics port's
        # election and the per-key rate buckets, in the --data-dir folder (no data in it).
        folder = Path(settings.data_dir)
        folder.mkdir(parents=True, exist_ok=True)
        opened = replace(opened, folder=folder)
    return opened


# Settings that steer the LMDB store's own capacity and eviction: on Redis, Redis does both.
LMDB_ONLY = frozenset({"capacity", "high_water", "low_water", "lmdb_sync"})
# --eviction-policy is not used on Redis either, but `lru` was its default until adaptive
# took over: a Redis deployment that names it keeps starting, with a warning.
IGNORED_ON_REDIS = frozenset({"eviction_policy"})


def refuse_unsupported(opened: OpenedStore, settings: Settings) -> None:
    """NotSupportedByStore for settings the store could not honour (never silently ignored):
    on Redis, the LMDB store's capacity and eviction settings when given, and tenant byte
    quotas (the Redis store does not count a tenant's bytes)."""
    if opened.kind != "redis":
        return
    # Told apart from the defaults by value: worker processes get every setting passed on.
    fields = type(settings).model_fields
    steering = sorted(name for name in LMDB_ONLY if getattr(settings, name) != fields[name].default)
    if steering:
        flags = ", ".join("--" + name.replace("_", "-") for name in steering)
        raise NotSupportedByStore(
            f"{flags} do not apply to the Redis store: its capacity is Redis's maxmemory and "
            "Redis evicts by its own maxmemory-policy; remove them"
        )
    for name in sorted(IGNORED_ON_REDIS):
        if getattr(settings, name) != fields[name].default:
            log.warning(
                "--%s %s has no effect on the Redis store: Redis evicts by its own "
                "maxmemory-policy",
                name.replace("_", "-"),
                getattr(settings, name),
            )
    quotas = settings.key_ring().tenant_capacity if settings.auth == "keys" else {}
    if quotas:
        raise NotSupportedByStore(
            "tenant capacity quotas (the key file's [tenants] capacity) are not enforced by the "
            f"Redis store: remove them for {', '.join(sorted(quotas))}, or use LMDB"
        )


def store_capacity(opened: OpenedStore, settings: Settings) -> int:
    """The capacity the cache works within: Redis's maxmemory summed over its primaries
    when the store is on Redis (Redis evicts within it; --capacity does not apply), else
    --capacity."""
    limit = getattr(opened.store, "memory_limit_bytes", None)
    if limit is not None:
        known = int(limit())
        if known > 0:
            return known
    return settings.capacity


def check_disk(opened: OpenedStore, capacity_bytes: int) -> None:
    """Warn when the disk under the store cannot hold its capacity or is full, and when a
    full disk kept the opening checks' record from being written."""
    backend = getattr(opened.store, "backend", None)
    unrecorded = getattr(backend, "unrecorded", None)
    if unrecorded is not None:
        log.warning("opened read-mostly, the settings record not updated: %s", unrecorded)
    folder = getattr(opened.store, "path", None)
    file_bytes = getattr(opened.store.space, "file_bytes", None)
    if folder is None or file_bytes is None:  # not on a disk (memory://)
        return
    DiskWarning().check(measure_room(Path(folder), int(file_bytes()), capacity_bytes))


def serving_line(settings: Settings, where: str, capacity_bytes: int) -> str:
    """The start-up line: which process serves which data, how much, to whom, where."""
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    return (
        f"process {os.getpid()} serves {where} (capacity {show_size(capacity_bytes)}, "
        f"auth {settings.auth}) on http://{host}:{settings.port}"
    )
