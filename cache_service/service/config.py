"""The service's settings parsed once into typed groups, each handed to the part that needs
it: how the store is opened, what the cache is built with, the requests' limits, the keys,
the KV-event engines, the server and the background jobs.

`Settings` (settings.py) is the face of the flags and the CACHE_SERVICE_* variables; it
builds these groups once, as it is validated (`Settings.groups`), so that the key file and
the engines file are read once, a file that cannot be used refuses the start with the
settings' own message, and nothing below the entry points parses a setting again. A field
keeps its flag's name where the answers or messages the service sends name the flag.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cache_service.core.capacity import CapacityLimits
from cache_service.core.config import CacheConfig
from cache_service.core.lifetimes import Lifetimes
from cache_service.core.touches import TouchOptions
from cache_service.service.api_keys import KeyRing
from cache_service.service.kv_events.config import KvEventsConfig

# Settings that steer a store's own capacity and eviction (and LMDB's file): refused on a
# store without `store_eviction` (Redis, which evicts by its own maxmemory-policy).
EVICTION_SETTINGS = frozenset({"capacity", "high_water", "low_water", "lmdb_sync"})
# --eviction-policy is not used there either, but `lru` was its default until adaptive took
# over: a Redis deployment that names it keeps starting, with a warning.
POLICY_SETTINGS = frozenset({"eviction_policy"})


@dataclass(frozen=True)
class StoreConfig:
    """How the service opens its store, and what the store is told for as long as it is
    open."""

    url: str  # --store, else the --data-dir folder
    folder: Path  # --data-dir: beside a remote store, the files worker processes share
    capacity_bytes: int  # --capacity: what the store is sized for and records
    map_size_bytes: int  # LMDB's map: the capacity, eviction's slack and unreused pages
    sync_mode: str  # --lmdb-sync
    local_reads: bool  # --local-reads: same-host clients read the LMDB files themselves
    eviction_policy: str
    removal_log_entries: int
    lifetimes: Lifetimes  # the retention classes' TTLs, which bound a block's expiry
    # Which of EVICTION_SETTINGS and POLICY_SETTINGS differ from their defaults (told apart
    # by value: worker processes get every setting passed on).
    changed: frozenset[str]


@dataclass(frozen=True)
class RequestLimits:
    """What one request may bring, and the store requests one worker takes at once; named
    as the flags are, which the problem answers name."""

    max_body_size: int  # bytes
    body_timeout: float  # seconds for a body to arrive, plus one per MiB it brings
    max_blocks_per_request: int
    max_tokens_per_request: int
    max_pending_writes: int
    pin_quota_blocks: int  # a tenant's writer keys' pinned blocks
    pinned_share: float  # of the capacity (and a tenant's quota), for writers' pins


@dataclass(frozen=True)
class AuthConfig:
    """--auth, and the keys configured."""

    mode: str  # "none" or "keys"
    ring: KeyRing  # the key file's and --api-keys' keys (even with --auth none)

    @property
    def keys(self) -> KeyRing | None:
        """The keys requests are checked against; None with --auth none (all trusted)."""
        return self.ring if self.mode == "keys" else None


@dataclass(frozen=True)
class ServerConfig:
    """The server around the app: where it listens, its processes, logs and stop."""

    host: str
    port: int
    workers: int
    log_level: str
    access_log: bool
    shutdown_timeout: float  # seconds for open requests, and as long again for the store
    max_header_bytes: int
    keep_freed_memory: int  # bytes; 0: glibc's defaults
    metrics_host: str
    metrics_port: int | None  # /metrics on a port of its own, without a key


@dataclass(frozen=True)
class JobsConfig:
    """What runs beside the requests: the touch flush, the sweeper, the usage log."""

    touch_flush_interval: float  # seconds
    sweep_interval: float  # seconds
    usage_log: Path | None  # off if None
    usage_log_max_bytes: int


@dataclass(frozen=True)
class ServiceConfig:
    """Every group: what one service process runs with."""

    store: StoreConfig
    seed: str  # the hash seed every worker of a fleet shares
    cache: CacheConfig  # block sizes, retention classes
    # The capacity and water marks (a Redis store's maxmemory replaces the capacity once it
    # is open), and the key file's tenant quotas.
    capacity: CapacityLimits
    touches: TouchOptions  # deferred to the flush, sliding TTLs by --ttl-slide-fraction
    limits: RequestLimits
    auth: AuthConfig
    engines: KvEventsConfig
    server: ServerConfig
    jobs: JobsConfig
