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
from cache_service.core.store.registry import OpenedStore
from cache_service.core.units import show_size
from cache_service.service.settings import Settings

log = logging.getLogger("cache_service")


def store_identity(settings: Settings) -> StoreIdentity:
    """The identity these settings record in the store they open; without the capacity and
    eviction settings on a store that evicts on its own (Redis), which does not use them."""
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
    if registry.capabilities_of(settings.store_url()).has("store_eviction"):
        return identity
    unused = EVICTION_SETTINGS | POLICY_SETTINGS
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
        lifetimes=settings.retention_policy().lifetimes(),
    )
    for note in identity.notes:
        log.info("%s", note)
    try:
        refuse_unsupported(opened, settings)
    except BaseException:
        opened.store.close()
        raise
    check_disk(opened, settings.capacity)
    if opened.store.remote is not None:
        # The worker processes of one machine still share files: the metrics port's
        # election and the per-key rate buckets, in the --data-dir folder (no data in it).
        folder = Path(settings.data_dir)
        folder.mkdir(parents=True, exist_ok=True)
        opened = replace(opened, folder=folder)
    return opened


# Settings that steer a store's own capacity and eviction (and LMDB's file): refused on a
# store without `store_eviction` (Redis, which evicts by its own maxmemory-policy).
EVICTION_SETTINGS = frozenset({"capacity", "high_water", "low_water", "lmdb_sync"})
# --eviction-policy is not used there either, but `lru` was its default until adaptive took
# over: a Redis deployment that names it keeps starting, with a warning.
POLICY_SETTINGS = frozenset({"eviction_policy"})


def refuse_unsupported(opened: OpenedStore, settings: Settings) -> None:
    """NotSupportedByStore for settings the store could not honour (never silently ignored),
    decided from its declared capabilities: the capacity and eviction settings when given to
    a store that evicts on its own (Redis), and tenant byte quotas to one that does not count
    a tenant's bytes."""
    capabilities = opened.store.capabilities
    name = capabilities.backend
    # Told apart from the defaults by value: worker processes get every setting passed on.
    fields = type(settings).model_fields
    if not capabilities.has("store_eviction"):
        steering = sorted(
            key for key in EVICTION_SETTINGS if getattr(settings, key) != fields[key].default
        )
        if steering:
            flags = ", ".join("--" + key.replace("_", "-") for key in steering)
            raise NotSupportedByStore(
                f"{flags} do not apply to the {name} store: "
                f"{capabilities.why_not('store_eviction')}; remove them"
            )
        for key in sorted(POLICY_SETTINGS):
            if getattr(settings, key) != fields[key].default:
                log.warning(
                    "--%s %s has no effect on the %s store: %s",
                    key.replace("_", "-"),
                    getattr(settings, key),
                    name,
                    capabilities.why_not("store_eviction"),
                )
    quotas = settings.key_ring().tenant_capacity if settings.auth == "keys" else {}
    if quotas and not capabilities.has("tenant_bytes"):
        raise NotSupportedByStore(
            "tenant capacity quotas (the key file's [tenants] capacity) are not enforced by the "
            f"{name} store ({capabilities.why_not('tenant_bytes')}): remove them for "
            f"{', '.join(sorted(quotas))}, or use LMDB"
        )


def store_capacity(opened: OpenedStore, settings: Settings) -> int:
    """The capacity the cache works within: Redis's maxmemory summed over its primaries
    when the store is on Redis (Redis evicts within it; --capacity does not apply), else
    --capacity."""
    remote = opened.store.remote
    if remote is not None:
        known = int(remote.memory_limit_bytes())
        if known > 0:
            return known
    return settings.capacity


def check_disk(opened: OpenedStore, capacity_bytes: int) -> None:
    """Warn when the disk under the store cannot hold its capacity or is full, and when a
    full disk kept the opening checks' record from being written."""
    disk = opened.store.disk
    if disk is None:  # not on a file system (memory://, Redis)
        return
    if disk.unrecorded is not None:
        log.warning("opened read-mostly, the settings record not updated: %s", disk.unrecorded)
    DiskWarning().check(measure_room(disk.folder, int(disk.file_bytes()), capacity_bytes))


def serving_line(settings: Settings, where: str, capacity_bytes: int) -> str:
    """The start-up line: which process serves which data, how much, to whom, where."""
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    return (
        f"process {os.getpid()} serves {where} (capacity {show_size(capacity_bytes)}, "
        f"auth {settings.auth}) on http://{host}:{settings.port}"
    )
