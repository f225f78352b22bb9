"""What a serving process checks and says as it opens its store: the settings the data was
made with (refused if one that defines the data differs, logged if one that steers it
changed), and one line saying what it serves."""

from __future__ import annotations

import logging
import os
from dataclasses import replace

from cache_service.core.disk import DiskWarning, measure_room
from cache_service.core.errors import NotSupportedByStore
from cache_service.core.eviction import make_policy
from cache_service.core.identity import StoreIdentity, identity_of
from cache_service.core.store import registry
from cache_service.core.store.registry import OpenedStore
from cache_service.core.units import show_size
from cache_service.service.config import (
    EVICTION_SETTINGS,
    POLICY_SETTINGS,
    ServerConfig,
    ServiceConfig,
)

log = logging.getLogger("cache_service")


def store_identity(config: ServiceConfig) -> StoreIdentity:
    """The identity these settings record in the store they open; without the capacity and
    eviction settings on a store that evicts on its own (Redis), which does not use them."""
    store, cache, capacity = config.store, config.cache, config.capacity
    identity = identity_of(
        seed=config.seed,
        default_block_size=cache.default_block_size,
        model_block_sizes=cache.model_block_sizes,
        retention_ttl_seconds=cache.retention.ttl_seconds,
        capacity_bytes=store.capacity_bytes,
        high_water=capacity.high_water,
        low_water=capacity.low_water,
        eviction_policy=store.eviction_policy,
    )
    if registry.capabilities_of(store.url).has("store_eviction"):
        return identity
    unused = EVICTION_SETTINGS | POLICY_SETTINGS
    return StoreIdentity({k: v for k, v in identity.values.items() if k not in unused})


def open_store(config: ServiceConfig) -> OpenedStore:
    """The store --store (or --data-dir) names, opened with what it keeps (its policy,
    removal log and the retention's lifetimes); SettingsMismatch if its data was made with
    other settings. Logs what changed since the last run."""
    identity = store_identity(config)
    store = config.store
    opened = registry.open_store(
        store.url,
        map_size_bytes=store.map_size_bytes,
        sync_mode=store.sync_mode,
        identity=identity,
        policy=make_policy(store.eviction_policy),
        removal_log_entries=store.removal_log_entries,
        lifetimes=store.lifetimes,
    )
    for note in identity.notes:
        log.info("%s", note)
    try:
        refuse_unsupported(opened, config)
    except BaseException:
        opened.store.close()
        raise
    check_disk(opened, store.capacity_bytes)
    if opened.store.remote is not None:
        # The worker processes of one machine still share files: the metrics port's
        # election and the per-key rate buckets, in the --data-dir folder (no data in it).
        store.folder.mkdir(parents=True, exist_ok=True)
        opened = replace(opened, folder=store.folder)
    return opened


def refuse_unsupported(opened: OpenedStore, config: ServiceConfig) -> None:
    """NotSupportedByStore for settings the store could not honour (never silently ignored),
    decided from its declared capabilities: the capacity and eviction settings when given to
    a store that evicts on its own (Redis), --local-reads to one whose files no other process
    reads, and tenant byte quotas to one that does not count
    a tenant's bytes."""
    capabilities = opened.store.capabilities
    name = capabilities.backend
    changed = config.store.changed
    if not capabilities.has("store_eviction"):
        steering = sorted(changed & EVICTION_SETTINGS)
        if steering:
            flags = ", ".join("--" + key.replace("_", "-") for key in steering)
            raise NotSupportedByStore(
                f"{flags} do not apply to the {name} store: "
                f"{capabilities.why_not('store_eviction')}; remove them"
            )
        if changed & POLICY_SETTINGS:
            log.warning(
                "--eviction-policy %s has no effect on the %s store: %s",
                config.store.eviction_policy,
                name,
                capabilities.why_not("store_eviction"),
            )
    if config.store.local_reads and not capabilities.has("local_reads"):
        raise NotSupportedByStore(
            f"--local-reads does not apply to the {name} store: "
            f"{capabilities.why_not('local_reads')}; remove it, or use LMDB"
        )
    quotas = config.capacity.tenant_capacity_bytes
    if quotas and not capabilities.has("tenant_bytes"):
        raise NotSupportedByStore(
            "tenant capacity quotas (the key file's [tenants] capacity) are not enforced by the "
            f"{name} store ({capabilities.why_not('tenant_bytes')}): remove them for "
            f"{', '.join(sorted(quotas))}, or use LMDB"
        )


def store_capacity(opened: OpenedStore, capacity_bytes: int) -> int:
    """The capacity the cache works within: Redis's maxmemory summed over its primaries
    when the store is on Redis (Redis evicts within it; --capacity does not apply), else
    --capacity."""
    remote = opened.store.remote
    if remote is not None:
        known = int(remote.memory_limit_bytes())
        if known > 0:
            return known
    return capacity_bytes


def check_disk(opened: OpenedStore, capacity_bytes: int) -> None:
    """Warn when the disk under the store cannot hold its capacity or is full, and when a
    full disk kept the opening checks' record from being written."""
    disk = opened.store.disk
    if disk is None:  # not on a file system (memory://, Redis)
        return
    if disk.unrecorded is not None:
        log.warning("opened read-mostly, the settings record not updated: %s", disk.unrecorded)
    DiskWarning().check(measure_room(disk.folder, int(disk.file_bytes()), capacity_bytes))


def serving_line(server: ServerConfig, auth: str, where: str, capacity_bytes: int) -> str:
    """The start-up line: which process serves which data, how much, to whom (`auth`, the
    --auth mode), where."""
    host = f"[{server.host}]" if ":" in server.host else server.host
    return (
        f"process {os.getpid()} serves {where} (capacity {show_size(capacity_bytes)}, "
        f"auth {auth}) on http://{host}:{server.port}"
    )
