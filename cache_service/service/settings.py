"""Service configuration: command-line flags and CACHE_SERVICE_* environment variables.

Read only by the entry points (`cli`, `api.create_app`), which hand each part of the service
its group of `Settings.groups` (service/config.py: parsed once, as the settings are
validated); everything below them takes explicit values.
"""

from __future__ import annotations

import ipaddress
from dataclasses import fields
from functools import cached_property
from pathlib import Path
from typing import Any, TypeVar

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from cache_service.core.capacity import CapacityLimits
from cache_service.core.config import CacheConfig
from cache_service.core.eviction import DEFAULT_POLICY, make_policy
from cache_service.core.hashing import DEFAULT_SEED
from cache_service.core.lifetimes import show_retention_table
from cache_service.core.retention import DEFAULT_RETENTION, RetentionPolicy, parse_retention_table
from cache_service.core.store.lmdb.store import SYNC_MODES
from cache_service.core.store.registry import parse_store_url
from cache_service.core.touches import TouchOptions
from cache_service.core.units import parse_size
from cache_service.service.api_keys import KeyFileError, KeyRing, load_key_ring
from cache_service.service.config import (
    EVICTION_SETTINGS,
    POLICY_SETTINGS,
    AuthConfig,
    JobsConfig,
    RequestLimits,
    ServerConfig,
    ServiceConfig,
    StoreConfig,
)
from cache_service.service.kv_events.config import EngineConfig, KvEventsConfig
from cache_service.service.kv_events.hub import (
    DEFAULT_GRACE_SECONDS,
    DEFAULT_MAX_BLOCKS_PER_ENGINE,
    resolve_engines,
)

ENV_PREFIX = "CACHE_SERVICE_"
G = TypeVar("G", RequestLimits, ServerConfig, JobsConfig)
AUTH_MODES = ("none", "keys")


def is_loopback(host: str) -> bool:
    """Whether binding `host` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_model_block_sizes(text: str) -> dict[str, int]:
    """Parse 'llama-3-8b=16,qwen=32' into model -> block size."""
    table: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        model, sep, size = item.rpartition("=")
        if not sep or not model or not size.strip().isdigit() or int(size) <= 0:
            raise ValueError(f"not a model block size: {item!r} (use model=16)")
        table[model.strip()] = int(size)
    return table


class Settings(BaseSettings):
    """Everything `cache-service serve` can be told; field names are the flags' names."""

    # `model_block_size` is a flag's name: pydantic before 2.10 reserves the whole "model_"
    # namespace and warns on import, so only pydantic-settings' own prefix stays protected.
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="forbid", protected_namespaces=("settings_",)
    )

    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(8080, ge=0, le=65535, description="TCP port to bind.")
    workers: int = Field(
        1, ge=1, le=64, description="Worker processes sharing the one LMDB data folder."
    )
    data_dir: Path = Field(Path("./cache-data"), description="Folder of the LMDB store.")
    store: str | None = Field(
        None,
        description="The store, as a URL: lmdb:///abs/path, lmdb://relative/path, a plain "
        "folder (LMDB), or memory:// (one worker, gone on exit). Wins over --data-dir, "
        "which is its shorthand for a folder.",
    )
    eviction_policy: str = Field(
        DEFAULT_POLICY,
        description="Which evictable block goes first: adaptive (keeps reused prefixes "
        "longer, learning how much longer from its own evictions), lru or protected. A store "
        "made under another policy adopts this one on start (logged). Not used on Redis.",
    )
    capacity: int = Field(
        10 * 2**30,
        gt=0,
        description="Capacity in bytes of LMDB pages in use (units: 512MiB, 20GiB, 10GB).",
    )
    high_water: float = Field(0.95, gt=0, le=1, description="Evict once above this share.")
    low_water: float = Field(0.85, gt=0, le=1, description="Evict down to this share.")
    block_size: int = Field(64, ge=1, le=65536, description="Default tokens per block.")
    model_block_size: str = Field("", description="Per-model block sizes: 'model=16,other=32'.")
    retention: str = Field(
        show_retention_table(DEFAULT_RETENTION), description="Retention classes and TTLs."
    )
    default_retention: str = Field("chat", description="Class for requests that name none.")
    seed: str = Field(DEFAULT_SEED, description="Hash seed; every worker of a fleet must share it.")
    lmdb_sync: str = Field("full", description="LMDB durability: full, nometasync or nosync.")
    local_reads: bool = Field(
        False,
        description="Tell clients on this host where the LMDB files are (GET /v1/local-reads), "
        "so they read payloads straight from them, verified: for clients trusted with every "
        "tenant's data, as read access to the files is. LMDB stores only.",
    )
    max_body_size: int = Field(512 * 2**20, gt=0, description="Largest request body in bytes.")
    max_blocks_per_request: int = Field(
        8192, gt=0, description="Most payloads in one store, or keys in one fetch."
    )
    max_tokens_per_request: int = Field(1 << 20, gt=0, description="Most tokens in a request.")
    body_timeout: float = Field(
        30.0,
        gt=0,
        description="Seconds a request body may take to arrive, plus one per MiB it brings "
        "(a slower body gets 408).",
    )
    max_header_bytes: int = Field(
        16384, ge=1024, description="Largest request line plus headers (then 431)."
    )
    max_pending_writes: int = Field(
        16,
        ge=1,
        le=32,
        description="Store requests one worker takes at once; more get 503 with Retry-After.",
    )
    pin_quota_blocks: int = Field(
        65536, ge=0, description="Blocks a tenant's writer keys may hold pinned (admins: any)."
    )
    pinned_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Writers' pins may take at most this share of --capacity (and of a "
        "tenant's capacity quota); admins' pins are not limited.",
    )
    removal_log_entries: int = Field(
        1 << 18,
        ge=0,
        description="Recent removals remembered for /v1/explain (shared by all workers).",
    )
    sweep_interval: float = Field(30.0, gt=0, description="Seconds between expiry sweeps.")
    shutdown_timeout: float = Field(
        5.0,
        gt=0,
        description="On SIGTERM: seconds open requests get to finish (then they are answered "
        "503), and as long again for store calls still running before the store closes; the "
        "process exits within 2x this + 4 s (status 0; 1 if the stop overran).",
    )
    touch_flush_interval: float = Field(
        0.2, gt=0, description="Seconds between batched TTL/LRU refreshes of lookups."
    )
    ttl_slide_fraction: float = Field(
        0.01,
        ge=0,
        lt=1,
        description="A hit slides a prefix's TTL once it would gain more than this share "
        "of the class TTL (0: on every hit, to the second).",
    )
    auth: str = Field(
        "none",
        description="none: every request is trusted (a one-team sidecar on loopback); keys: "
        "every request needs an API key, which names its tenant and role.",
    )
    api_keys_file: Path | None = Field(
        None, description="TOML file of API keys (ids, tenants, roles and SHA-256 digests)."
    )
    api_keys: str = Field(
        "", description="More API keys, as id:tenant:role:sha256 separated by commas."
    )
    allow_unauthenticated: bool = Field(
        False,
        description="Allow --auth none, or the metrics port, on an address other than loopback.",
    )
    metrics_port: int | None = Field(
        None, ge=1, le=65535, description="Serve /metrics on this port too, without a key."
    )
    metrics_host: str = Field("127.0.0.1", description="Address of the metrics port.")
    usage_log: Path | None = Field(
        None, description="Append one JSON line per lookup here (for billing); off if unset."
    )
    usage_log_max_bytes: int = Field(
        100 * 2**20, gt=0, description="Rotate the usage log at this size (keeps 5 old files)."
    )
    kv_events: str = Field(
        "",
        description="Follow these engines' KV events (vLLM, SGLang): tcp://HOST:PORT[,...], "
        "one engine per endpoint, named HOST:PORT (data-parallel rank r on port + r); off if "
        "empty.",
    )
    kv_events_config: Path | None = Field(
        None,
        description="TOML file of the engines whose KV events to follow (name, endpoint, "
        "model, block size, hash scheme, seed, replay endpoint, data-parallel size).",
    )
    kv_events_model: str | None = Field(
        None, description="The model of the --kv-events engines (over the file's, if given)."
    )
    kv_events_block_size: int | None = Field(
        None,
        ge=1,
        description="Tokens per block of the engines (vLLM --block-size, SGLang --page-size); "
        "16 unless given here or in the file.",
    )
    kv_events_hash_scheme: str | None = Field(
        None,
        description="The engines' block hash: vllm-sha256 (vLLM's default), "
        "vllm-sha256-cbor, vllm-xxhash, vllm-xxhash-cbor, sglang or xxh3-64-1337; "
        "vllm-sha256 unless given here or in the file.",
    )
    kv_events_seed: str | None = Field(
        None,
        description="The engines' PYTHONHASHSEED, as set in their environment. Unset, "
        "vllm-sha256 and vllm-sha256-cbor take vLLM 0.32's fixed default, vllm-none-hash; "
        "the xxhash schemes need it (vLLM 0.32 roots them at random bytes per process).",
    )
    kv_events_extra_keys_form: str | None = Field(
        None,
        description="How the engines hash a block's extra keys (LoRA, cache_salt, "
        "multimodal): tagged (vLLM 0.32, the default) or untagged (older vLLM releases).",
    )
    kv_events_max_blocks: int = Field(
        DEFAULT_MAX_BLOCKS_PER_ENGINE,
        ge=1,
        description="Most entries (rank, group, block, medium) kept per engine's view; the "
        "least recently stored go first.",
    )
    kv_events_grace: float = Field(
        DEFAULT_GRACE_SECONDS,
        ge=0,
        description="Seconds an engine whose publisher went away (disconnected, or silent "
        "past the timeout) stays in routing answers, ranked after live engines and never "
        "best; then it is left out until it publishes again.",
    )
    kv_events_silence_timeout: float = Field(
        0.0,
        ge=0,
        description="Seconds without a message after which an engine's rank counts as down; "
        "0 (the default) never, since an idle engine publishes nothing (a vanished host is "
        "caught by ZMQ heartbeats instead).",
    )
    keep_freed_memory: int = Field(
        256 * 2**20,
        ge=0,
        description="Freed memory the service process keeps for the next request instead of "
        "returning it to the kernel (glibc only; 0: the allocator's defaults). Stores of tens "
        "of MB run about 1.5x faster; resident memory stays up to this much higher.",
    )
    log_level: str = Field("info", description="uvicorn log level.")
    access_log: bool = Field(
        False, description="Log every request (costs about 3% of lookup throughput)."
    )

    @field_validator(
        "capacity", "max_body_size", "usage_log_max_bytes", "keep_freed_memory", mode="before"
    )
    @classmethod
    def _parse_size(cls, value: Any) -> Any:
        return parse_size(value) if isinstance(value, str) else value

    @field_validator("model_block_size")
    @classmethod
    def _check_model_block_size(cls, value: str) -> str:
        parse_model_block_sizes(value)
        return value

    @field_validator("retention")
    @classmethod
    def _check_retention(cls, value: str) -> str:
        parse_retention_table(value)
        return value

    @field_validator("store")
    @classmethod
    def _check_store(cls, value: str | None) -> str | None:
        if value is not None:
            parse_store_url(value)
        return value

    @field_validator("eviction_policy")
    @classmethod
    def _check_eviction_policy(cls, value: str) -> str:
        make_policy(value)  # ValueError naming the known ones
        return value

    @field_validator("auth")
    @classmethod
    def _check_auth(cls, value: str) -> str:
        if value not in AUTH_MODES:
            raise ValueError(f"use one of {', '.join(AUTH_MODES)}")
        return value

    @field_validator("lmdb_sync")
    @classmethod
    def _check_sync(cls, value: str) -> str:
        if value not in SYNC_MODES:
            raise ValueError(f"use one of {', '.join(SYNC_MODES)}")
        return value

    @model_validator(mode="after")
    def _check_consistency(self) -> Settings:
        if self.low_water > self.high_water:
            raise ValueError("low_water must not be above high_water")
        # Parsed here, once: the default class must be in the retention table, and an
        # unusable engine list or key file is refused at start-up.
        groups = self.groups
        if self.workers > 1 and parse_store_url(groups.store.url)[0] == "memory":
            raise ValueError("a memory:// store lives in one process: use --workers 1")
        keys = groups.auth.ring
        if self.auth == "keys" and not len(keys):
            raise ValueError("--auth keys needs keys: --api-keys-file or --api-keys")
        if self.auth == "none" and len(keys):
            raise ValueError("keys are configured but --auth is none: add --auth keys")
        if self.auth == "none" and not is_loopback(self.host) and not self.allow_unauthenticated:
            raise ValueError(
                f"refusing to serve {self.host} without authentication: anyone who can reach "
                "it could read and write every block; use --auth keys, or "
                "--allow-unauthenticated if a network boundary protects it"
            )
        if (
            self.metrics_port is not None
            and not is_loopback(self.metrics_host)
            and not self.allow_unauthenticated
        ):
            raise ValueError(
                f"refusing to serve metrics on {self.metrics_host} without authentication: "
                "they show every tenant's hits and misses; use --allow-unauthenticated if a "
                "network boundary protects the metrics port"
            )
        return self

    @cached_property
    def groups(self) -> ServiceConfig:
        """These settings parsed into the typed groups each part of the service is handed
        (service/config.py). Built once, as the settings are validated (a copy made without
        validation keeps the groups of the settings it copied)."""
        retention = RetentionPolicy(
            ttl_seconds=parse_retention_table(self.retention), default_class=self.default_retention
        )
        engines = resolve_engines(
            endpoints=self.kv_events,
            config_file=self.kv_events_config,
            model=self.kv_events_model,
            block_size=self.kv_events_block_size,
            hash_scheme=self.kv_events_hash_scheme,
            seed=self.kv_events_seed,
            extra_keys_form=self.kv_events_extra_keys_form,
        )
        try:
            ring = load_key_ring(self.api_keys_file, self.api_keys)
        except KeyFileError as exc:
            raise ValueError(str(exc)) from None
        declared = type(self).model_fields
        return ServiceConfig(
            store=StoreConfig(
                url=self.store if self.store is not None else str(self.data_dir),
                folder=Path(self.data_dir),
                capacity_bytes=self.capacity,
                map_size_bytes=2 * self.capacity + 256 * 2**20,
                sync_mode=self.lmdb_sync,
                local_reads=self.local_reads,
                eviction_policy=self.eviction_policy,
                removal_log_entries=self.removal_log_entries,
                lifetimes=retention.lifetimes(),
                changed=frozenset(
                    name
                    for name in EVICTION_SETTINGS | POLICY_SETTINGS
                    if getattr(self, name) != declared[name].default
                ),
            ),
            seed=self.seed,
            cache=CacheConfig(
                default_block_size=self.block_size,
                model_block_sizes=parse_model_block_sizes(self.model_block_size),
                retention=retention,
            ),
            capacity=CapacityLimits(
                capacity_bytes=self.capacity,
                high_water=self.high_water,
                low_water=self.low_water,
                tenant_capacity_bytes=ring.tenant_capacity if self.auth == "keys" else {},
            ),
            touches=TouchOptions(defer=True, slide_fraction=self.ttl_slide_fraction),
            limits=self._picked(RequestLimits),
            auth=AuthConfig(mode=self.auth, ring=ring),
            engines=KvEventsConfig(
                engines=engines,
                max_blocks_per_engine=self.kv_events_max_blocks,
                grace_seconds=self.kv_events_grace,
                silence_timeout_seconds=self.kv_events_silence_timeout,
            ),
            server=self._picked(ServerConfig),
            jobs=self._picked(JobsConfig),
        )

    def _picked(self, group: type[G]) -> G:
        """A group whose fields are settings of the same names, taken from these."""
        return group(**{field.name: getattr(self, field.name) for field in fields(group)})

    # The groups' values by the names callers knew them by before the groups.

    def key_ring(self) -> KeyRing:
        """The configured API keys (read with --auth none too)."""
        return self.groups.auth.ring

    def kv_event_engines(self) -> tuple[EngineConfig, ...]:
        """The engines whose KV events to follow (none unless --kv-events or
        --kv-events-config is given)."""
        return self.groups.engines.engines

    def retention_policy(self) -> RetentionPolicy:
        """The configured retention classes."""
        return self.groups.cache.retention

    def model_block_sizes(self) -> dict[str, int]:
        """The per-model block size overrides."""
        return dict(self.groups.cache.model_block_sizes)

    def store_url(self) -> str:
        """The store to open: --store if given, else the --data-dir folder."""
        return self.groups.store.url

    def map_size_bytes(self) -> int:
        """LMDB's map: room for the capacity, eviction's slack and free pages not yet reused."""
        return self.groups.store.map_size_bytes


def settings_environment(settings: Settings) -> dict[str, str]:
    """The settings as CACHE_SERVICE_* variables, for worker processes to read back."""
    return {
        ENV_PREFIX + name.upper(): str(value)
        for name, value in settings.model_dump().items()
        if value is not None
    }
