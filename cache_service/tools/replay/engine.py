"""The replay drivers: an embedded cache on a virtual clock, or a running service over HTTP."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cache_service.client import CacheClient
from cache_service.core.cache import PrefixCache
from cache_service.core.capacity import CapacityLimits
from cache_service.core.config import CacheConfig
from cache_service.core.errors import InvalidAnswer
from cache_service.core.eviction import DEFAULT_POLICY, make_policy
from cache_service.core.retention import RetentionPolicy
from cache_service.core.store.lmdb.store import LmdbStore
from cache_service.core.store.memory import MemoryStore
from cache_service.core.store.protocols import BlockStore
from cache_service.core.tokens import bytes_to_tokens
from cache_service.tools.replay.block_units import BlockUnits, request_namespace, request_tokens
from cache_service.tools.replay.stats import Outcome
from cache_service.tools.replay.traces import TraceRequest

OnOutcome = Callable[[Outcome, str], None]
REPLAY_MAP_SIZE_BYTES = 1 << 40  # address space only: the file grows as pages are used


class ReplayError(RuntimeError):
    """The replay cannot run as asked (say why)."""


class VirtualClock:
    """Time as the trace tells it: the replay sets `now` to each request's timestamp."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True, slots=True)
class EmbeddedOptions:
    """How the embedded cache is built."""

    units: BlockUnits
    retention: RetentionPolicy
    capacity_tokens: int | None = None
    policy: str = DEFAULT_POLICY
    payload_bytes_per_token: int = 0
    store: str = "lmdb"  # or "memory"
    workdir: Path | None = None


def replay_embedded(
    requests: Sequence[TraceRequest], options: EmbeddedOptions, on_outcome: OnOutcome
) -> None:
    """Drive every request through a private PrefixCache, in trace time."""
    with embedded_store(options) as store:
        drive_store(requests, options, store, on_outcome)


@contextmanager
def embedded_store(options: EmbeddedOptions) -> Iterator[BlockStore]:
    """A private store for one replay (its policy and the retention's lifetimes), removed
    after it."""
    with tempfile.TemporaryDirectory(prefix="replay-", dir=options.workdir) as folder:
        policy = make_policy(options.policy)
        lifetimes = options.retention.lifetimes()
        store: BlockStore
        if options.store == "memory":
            store = MemoryStore(policy=policy, lifetimes=lifetimes)
        else:  # a private cache in a temporary folder: durability is not wanted here
            store = LmdbStore(
                folder,
                map_size_bytes=REPLAY_MAP_SIZE_BYTES,
                sync_mode="nosync",
                policy=policy,
                lifetimes=lifetimes,
            )
        try:
            yield store
        finally:
            store.close()


def drive_store(
    requests: Sequence[TraceRequest],
    options: EmbeddedOptions,
    store: BlockStore,
    on_outcome: OnOutcome,
) -> None:
    """Drive every request through a PrefixCache over a store the caller opened (its policy
    too, and the retention's lifetimes), in trace time; `on_outcome` hears each request
    before the next one starts."""
    units = options.units
    clock = VirtualClock()
    cache = embedded_cache(options, store, clock)
    payload = bytes(options.payload_bytes_per_token * units.cache_tokens)
    for request in requests:
        clock.now = request.timestamp
        retention = request.retention or options.retention.default_class
        found, _ = cache.lookup_and_fill(
            request_namespace(request),
            request_tokens(request),
            retention=retention,
            payload=payload,
        )
        on_outcome(outcome_of(request, units, found.matched_blocks // units.ratio), retention)


def embedded_cache(options: EmbeddedOptions, store: BlockStore, clock: VirtualClock) -> PrefixCache:
    """A PrefixCache over `store` as a replay runs it: the replay's cache blocks, its
    capacity in blocks, trace time."""
    units = options.units
    capacity_blocks = None
    if options.capacity_tokens is not None:
        capacity_blocks = options.capacity_tokens // units.cache_tokens
    return PrefixCache(
        store,
        config=CacheConfig(default_block_size=units.cache_tokens, retention=options.retention),
        limits=CapacityLimits(capacity_blocks=capacity_blocks),
        clock=clock,
    )


def outcome_of(request: TraceRequest, units: BlockUnits, hit_blocks: int) -> Outcome:
    """A request's result in the trace's own units."""
    return Outcome(
        request=request,
        blocks=units.trace_blocks(request),
        hit_blocks=hit_blocks,
        hit_tokens=units.hit_tokens(request, hit_blocks),
    )


@dataclass(frozen=True, slots=True)
class HttpOptions:
    """Where and how fast to replay against a running service."""

    url: str
    units: BlockUnits
    default_retention: str | None = None
    speed: float | None = None  # x real time; None: as fast as the service answers
    payload_bytes_per_token: int = 0
    api_key: str | None = None
    timeout_seconds: float = 60.0


def replay_http(
    requests: Sequence[TraceRequest], options: HttpOptions, on_outcome: OnOutcome
) -> None:
    """Look up and store every request on a running service, in trace order."""
    units = options.units
    with CacheClient(
        options.url, api_key=options.api_key, timeout=options.timeout_seconds
    ) as client:
        try:
            info = client.info()
        except InvalidAnswer as exc:
            raise ReplayError(f"the service's /v1/info is not understood: {exc.detail}") from None
        block_sizes = {}
        for model in sorted({request.model for request in requests}):
            size = info.block_size_for(model)
            if units.trace_tokens % size:
                raise ReplayError(
                    f"the service cuts model {model!r} into blocks of {size} tokens, which do "
                    f"not divide the trace's {units.trace_tokens}-token blocks"
                )
            block_sizes[model] = size
        service_default = info.retention.default
        started = time.monotonic()
        first = requests[0].timestamp if requests else 0.0
        for request in requests:
            if options.speed:
                delay = started + (request.timestamp - first) / options.speed - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            size = block_sizes[request.model]
            namespace = request_namespace(request)
            # No tenants over HTTP yet (they will come from API keys): keep them apart by salt.
            salt = (
                f"tenant:{namespace.tenant}/{namespace.salt}"
                if namespace.tenant
                else namespace.salt
            )
            tokens = bytes_to_tokens(request_tokens(request))
            retention = request.retention or options.default_retention
            found = client.lookup(
                request.model, tokens, kv_layout=namespace.kv_layout, salt=salt, retention=retention
            )
            missing = len(tokens) // size - found.matched_blocks
            if missing > 0:
                payload = bytes(options.payload_bytes_per_token * size)
                client.put_prefix(
                    request.model,
                    tokens,
                    [payload] * missing,
                    kv_layout=namespace.kv_layout,
                    start_block=found.matched_blocks,
                    salt=salt,
                    retention=retention,
                )
            hit_blocks = found.cached_tokens // units.trace_tokens
            on_outcome(outcome_of(request, units, hit_blocks), retention or service_default)
