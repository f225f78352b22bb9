"""A fleet in front of the store: engines with their own prefix caches, a router, the store.

Each request goes to one of N engines (`routing`). The engine's own cache (vLLM's, see
engine_cache) serves the longest prefix it holds; the vLLM connector then asks the store for
the prompt, which counts as a use of the blocks the store holds, and loads what the store
holds beyond the engine's hit, by the connector's own rule for synchronous loads
(core.engines.groups: whole groups of lcm(engine block, store block) tokens, never the
prompt's last token; an asynchronous load may also take a last group that ends exactly at the
prompt's end, which the replay does not count); the rest is computed,
and the store keeps every block of the prompt it lacked. A run without a store (`store=None`)
is the fleet as it is today, for what the store adds on top of it.

Requests run one at a time, as in engine_cache: batching and preemption are not modelled.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace

from cache_service.core.engines.groups import BlockGroups
from cache_service.core.store.protocols import BlockStore
from cache_service.core.tokens import TokenBytes, tokens_in
from cache_service.tools.replay.block_units import request_namespace, request_tokens
from cache_service.tools.replay.engine import (
    EmbeddedOptions,
    ReplayError,
    VirtualClock,
    embedded_cache,
)
from cache_service.tools.replay.engine_cache import EngineCache, EngineCacheTooSmall, block_hashes
from cache_service.tools.replay.routing import ROUTINGS, make_router
from cache_service.tools.replay.traces import TraceRequest

DEFAULT_ENGINE_BLOCK_TOKENS = 16  # vLLM's default block size on GPUs
GIB = 2**30


@dataclass(frozen=True, slots=True)
class FleetOptions:
    """The engines in front of the store, and how requests are routed to them."""

    engines: int
    engine_cache_blocks: int  # each engine's pool, vLLM's null block included
    engine_block_tokens: int = DEFAULT_ENGINE_BLOCK_TOKENS
    routing: str = "round-robin"

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ReplayError(f"--engines must be at least 1, got {self.engines}")
        if self.engine_cache_blocks < 2:
            raise ReplayError(
                f"an engine's cache needs at least 2 blocks (one is vLLM's null block), got "
                f"{self.engine_cache_blocks}"
            )
        if self.engine_block_tokens < 1:
            raise ReplayError(
                f"--engine-block-size must be positive, got {self.engine_block_tokens}"
            )
        if self.routing not in ROUTINGS:
            raise ReplayError(f"unknown routing {self.routing!r} (known: {', '.join(ROUTINGS)})")


def engine_blocks_for_memory(kv_gib: float, kv_bytes_per_token: int, block_tokens: int) -> int:
    """An engine's cache in blocks from the memory it gives KV, as vLLM sizes its pool:
    floor(KV memory / (KV bytes per token x tokens per block)). KV bytes per token are
    2 (K and V) x layers x KV heads x head size x bytes per value, all layers together."""
    if kv_gib <= 0 or kv_bytes_per_token <= 0:
        raise ReplayError("--engine-kv-gib and --kv-bytes-per-token must be positive")
    return math.floor(kv_gib * GIB / (kv_bytes_per_token * block_tokens))


@dataclass(frozen=True, slots=True)
class TierHits:
    """Where one request's prompt tokens came from."""

    engine: int  # the engine the router picked
    prompt_tokens: int
    engine_tokens: int  # from that engine's own cache
    store_tokens: int  # loaded from the store, beyond the engine's hit
    store_tokens_held: int  # tokens' worth of blocks the store holds after the request

    @property
    def miss_tokens(self) -> int:
        """Prompt tokens computed."""
        return self.prompt_tokens - self.engine_tokens - self.store_tokens


OnTiers = Callable[[TraceRequest, TierHits], None]


def drive_fleet(
    requests: Sequence[TraceRequest],
    options: EmbeddedOptions,
    fleet: FleetOptions,
    store: BlockStore | None,
    on_tiers: OnTiers,
) -> None:
    """Serve every request by an engine and, behind them, the store (None: no store), in
    trace time; `on_tiers` hears each request before the next one starts."""
    units = options.units
    size = fleet.engine_block_tokens
    engines = [EngineCache(fleet.engine_cache_blocks, size) for _ in range(fleet.engines)]
    router = make_router(fleet.routing, engines)
    groups = BlockGroups(size, units.cache_tokens)
    clock = VirtualClock()
    cache = embedded_cache(options, store, clock) if store is not None else None
    payload = bytes(options.payload_bytes_per_token * units.cache_tokens)
    for request in requests:
        clock.now = request.timestamp
        tokens = request_tokens(request)
        prompt = _prompt(tokens, request.input_length)
        namespace = request_namespace(request)
        # A trace may count more prompt tokens than it gives (input_length past its ids or
        # tokens): the rest is computed, its blocks under hashes no other prompt repeats.
        prompt_tokens = max(tokens_in(prompt), request.input_length)
        # An engine keeps tenants' equal prompts together, as vLLM does; a salt parts them.
        hashes: list[Hashable] = list(block_hashes(prompt, size, replace(namespace, tenant="")))
        hashes += [
            ("untold", request.source, request.line, index)
            for index in range(len(hashes), prompt_tokens // size)
        ]
        chosen = router.pick(request, hashes, prompt_tokens)
        try:
            served = engines[chosen].serve(hashes, prompt_tokens, request.output_length)
        except EngineCacheTooSmall as exc:
            raise ReplayError(f"trace line {request.line}: {exc}") from None
        engine_tokens = served.hit_blocks * size
        store_tokens, held = 0, 0
        if cache is not None:
            found, _ = cache.lookup_and_fill(
                namespace,
                tokens,
                retention=request.retention or options.retention.default_class,
                payload=payload,
            )
            held_tokens = found.matched_blocks * units.cache_tokens
            loadable = groups.loadable_tokens(held_tokens, prompt_tokens)
            store_tokens = max(0, loadable - engine_tokens)
            held = cache.store.usage().blocks * units.cache_tokens
        computed = prompt_tokens - engine_tokens - store_tokens
        router.served(chosen, computed + request.output_length)
        on_tiers(request, TierHits(chosen, prompt_tokens, engine_tokens, store_tokens, held))


def _prompt(tokens: TokenBytes, input_length: int) -> TokenBytes:
    """The prompt an engine sees: a hash-id trace's last block may be partial."""
    if tokens_in(tokens) <= input_length:
        return tokens
    return TokenBytes(tokens[: input_length * 4])
