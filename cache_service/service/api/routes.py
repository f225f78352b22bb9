"""The HTTP routes: thin translations between HTTP and PrefixCache calls."""

from __future__ import annotations

import orjson
from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cache_service import __version__
from cache_service.core.blocks import KEY_BYTES, PrefixMatch, key_from_hex, key_hex
from cache_service.core.errors import InvalidField
from cache_service.core.framing import MEDIA_TYPE, FrameWriter, decode_frames, frame_header_length
from cache_service.core.hashing import HASH_SCHEME, HASH_VERSION
from cache_service.core.tokens import TokenBytes, as_token_bytes, tokens_in
from cache_service.service.api.auth import principal
from cache_service.service.api.bodies import (
    INLINE_BODY_BYTES,
    JSON,
    RawBody,
    check_count,
    check_token_room,
    namespace_of,
    parse_lookup,
    parse_object,
    read_limited_body,
    read_prompt_body,
    read_request_json,
    require_media_type,
    tokens_frame,
)
from cache_service.service.api.openapi import binary_body, json_body, lookup_body, responses
from cache_service.service.api.responses import FramesResponse, json_object
from cache_service.service.api.schemas import FetchRequest, LookupHeader, StoreHeader
from cache_service.service.api.state import ServiceState, service_state
from cache_service.service.api_keys import ApiKey
from cache_service.wire.answers import FetchHeader, LookupResponse, StoreResponse, Usage
from cache_service.wire.reports import (
    InfoBlockSizes,
    InfoHashing,
    InfoLimits,
    InfoResponse,
    InfoRetention,
    StatsDisk,
    StatsResponse,
    StatsTenant,
    StatsTokens,
)

router = APIRouter()


def lookup_answer(model: str, found: PrefixMatch) -> LookupResponse:
    """The answer of a lookup (also the frame header when payloads are fetched)."""
    return LookupResponse(
        model=model,
        block_size=found.block_size,
        prompt_tokens=found.prompt_tokens,
        matched_blocks=found.matched_blocks,
        cached_tokens=found.cached_tokens,
        keys=found.hex_keys,
        retention=found.retention,
        usage=Usage(
            prompt_cache_hit_tokens=found.cached_tokens,
            prompt_cache_miss_tokens=found.miss_tokens,
        ),
    )


@router.post(
    "/v1/lookup",
    summary="Longest cached prefix of a prompt",
    openapi_extra=lookup_body(),
    responses=responses(
        {JSON: LookupResponse, MEDIA_TYPE: LookupResponse},
        400,
        408,
        413,
        415,
        422,
    ),
)
async def lookup(request: Request) -> Response:
    """Find the longest stored, verified prefix; optionally return its payloads too."""
    state = service_state(request)
    caller = principal(request)
    raw, binary = await read_prompt_body(request, state.limits)
    if not binary and len(raw) >= INLINE_BODY_BYTES:  # parsing a long JSON array takes a while
        return await state.in_thread(lambda: _lookup(state, caller, *parse_lookup(raw, binary)))
    options, tokens = parse_lookup(raw, binary)
    if options.fetch:  # copies payloads: never on the event loop
        return await state.in_thread(_lookup, state, caller, options, tokens)
    return _lookup(state, caller, options, tokens)


def _lookup(
    state: ServiceState, caller: ApiKey, options: LookupHeader, tokens: TokenBytes
) -> Response:
    limit = state.limits.max_tokens_per_request
    check_count("tokens", tokens_in(tokens), limit, "max_tokens_per_request")
    frames = FrameWriter()
    found = state.cache.match_prefix(
        namespace_of(options, caller.tenant),
        tokens,
        retention=options.retention,
        block_size=options.block_size,
        with_payloads=options.fetch,
        sink=lambda _index, payload: frames.add(payload),
    )
    if state.usage_log is not None:
        state.usage_log.record(
            tenant=caller.tenant,
            key_id=caller.id,
            model=options.model,
            hit_tokens=found.cached_tokens,
            miss_tokens=found.miss_tokens,
        )
    answer = lookup_answer(options.model, found)
    if not options.fetch:
        return Response(orjson.dumps(answer), media_type=JSON)
    return FramesResponse(answer, frames)


@router.post(
    "/v1/blocks",
    summary="Store a prefix's blocks",
    openapi_extra=binary_body("StoreHeader"),
    responses=responses({JSON: StoreResponse}, 400, 408, 409, 413, 415, 422, 503, 507),
)
async def store_blocks(request: Request) -> Response:
    """Store payloads for blocks start_block.. of a prompt; the parent must be stored."""
    state = service_state(request)
    require_media_type(request, MEDIA_TYPE)
    raw = await read_limited_body(request, state.limits)
    check_token_room(frame_header_length(raw), state.limits.max_tokens_per_request)
    # The queue is of writes waiting for the store, not of uploads: a slow upload holds no
    # place, so a trickling client cannot shut others' writes out.
    tenant = principal(request).tenant
    return await state.writes.run(lambda: _store(state, tenant, raw))


def _store(state: ServiceState, tenant: str, raw: RawBody) -> Response:
    header, frames = decode_frames(raw)
    body = parse_object(StoreHeader, header)
    limits = state.limits
    first_payload = 0
    if body.tokens is None:  # binary tokens: the first frame
        if not frames:
            raise InvalidField("frames[0]", "without `tokens` in the header, frame 0 holds them")
        tokens, first_payload = tokens_frame(frames[0], "frames[0]"), 1
    else:
        tokens = as_token_bytes(body.tokens)
    check_count(
        "tokens", tokens_in(tokens), limits.max_tokens_per_request, "max_tokens_per_request"
    )
    payloads = frames[first_payload:]
    check_count("blocks", len(payloads), limits.max_blocks_per_request, "max_blocks_per_request")
    present: list[memoryview] = []
    for index, payload in enumerate(payloads, start=first_payload):
        if payload is None:
            raise InvalidField(f"frames[{index}]", "an absent frame cannot be stored")
        present.append(payload)
    outcome = state.cache.insert(
        namespace_of(body, tenant),
        tokens,
        present,
        start_block=body.start_block,
        retention=body.retention,
        block_size=body.block_size,
    )
    answer = StoreResponse(
        model=body.model,
        block_size=state.cache.config.block_size_for(body.model),
        start_block=body.start_block,
        requested_blocks=outcome.requested,
        stored_blocks=outcome.stored,
        refreshed_blocks=outcome.refreshed,
        conflicts=outcome.conflicts,
        truncated_blocks=outcome.truncated,
        collisions=outcome.collisions,
        keys=[key_hex(key) for key in outcome.keys],
    )
    return JSONResponse(json_object(answer))


@router.post(
    "/v1/blocks/fetch",
    summary="Fetch payloads by key",
    openapi_extra=json_body("FetchRequest"),
    response_class=Response,
    responses=responses({MEDIA_TYPE: FetchHeader}, 400, 408, 413, 415, 422),
)
async def fetch_blocks(request: Request) -> Response:
    """Payloads of blocks of the caller's namespace, checked against their checksums."""
    state = service_state(request)
    body = await read_request_json(request, state.limits, FetchRequest)
    limit = state.limits.max_blocks_per_request
    check_count("keys", len(body.keys), limit, "max_blocks_per_request")
    keys = [key_from_hex(text) for text in body.keys]
    frames = FrameWriter()
    found = 0

    def add(_index: int, payload: bytes | memoryview | None) -> None:
        nonlocal found
        frames.add(payload)
        found += payload is not None

    namespace = namespace_of(body, principal(request).tenant)
    await state.in_thread(state.cache.read_payloads, namespace, keys, add)
    return FramesResponse(FetchHeader(model=body.model, requested=len(keys), found=found), frames)


@router.get(
    "/v1/info",
    summary="Hashing scheme, block sizes and retention classes",
    responses=responses({JSON: InfoResponse}),
)
async def info(request: Request) -> Response:
    """What a worker must agree with to share this cache."""
    return Response(orjson.dumps(info_report(service_state(request))), media_type=JSON)


def info_report(state: ServiceState) -> InfoResponse:
    """The answer of GET /v1/info (the status page shows the same)."""
    cache, limits = state.cache, state.limits
    config = cache.config
    return InfoResponse(
        service="prompt-cache-service",
        version=__version__,
        hashing=InfoHashing(
            scheme=HASH_SCHEME,
            version=HASH_VERSION,
            seed_fingerprint=cache.hasher.fingerprint,
            token_encoding="uint32-le",
            key_bytes=KEY_BYTES,
        ),
        block_size=InfoBlockSizes(
            default=config.default_block_size, models=dict(config.model_block_sizes)
        ),
        retention=InfoRetention(
            classes=dict(config.retention.ttl_seconds), default=config.retention.default_class
        ),
        store=state.store_kind,
        capacity_bytes=cache.capacity.capacity_bytes,
        limits=InfoLimits(
            max_body_size=limits.max_body_size,
            max_blocks_per_request=limits.max_blocks_per_request,
            max_tokens_per_request=limits.max_tokens_per_request,
        ),
        frame_media_type=MEDIA_TYPE,
    )


@router.get(
    "/v1/stats",
    summary="Blocks, bytes, capacity, hits and misses",
    responses=responses({JSON: StatsResponse}),
)
async def stats(request: Request) -> Response:
    """The store's size, hit and miss tokens by retention class, and by tenant (admin)."""
    return Response(orjson.dumps(await stats_report(service_state(request))), media_type=JSON)


async def stats_report(state: ServiceState) -> StatsResponse:
    """The answer of GET /v1/stats; the status page shows this very report, so the two cannot
    disagree."""
    capacity = state.cache.capacity
    usage = await state.in_thread(capacity.usage)
    by_class = {}
    for name in state.cache.config.retention.classes:
        hits, misses = state.metrics.token_totals(name)
        by_class[name] = StatsTokens(hit_tokens=hits, miss_tokens=misses)
    by_tenant = {}
    for tenant in state.metrics.tenants:  # the key file's tenants (none with --auth none)
        hits, misses = state.metrics.tenant_token_totals(tenant)
        by_tenant[tenant] = StatsTenant(
            hit_tokens=hits,
            miss_tokens=misses,
            estimated_bytes=await state.in_thread(capacity.tenant_bytes, tenant),
            capacity_bytes=capacity.tenant_capacity_bytes.get(tenant),
        )
    room = await state.in_thread(capacity.disk)  # a statvfs; None for a store not on disk
    return StatsResponse(
        blocks=usage.blocks,
        payload_bytes=usage.payload_bytes,
        used_bytes=usage.used_bytes,
        capacity_bytes=capacity.capacity_bytes,
        disk=None
        if room is None
        else StatsDisk(
            free_bytes=room.free_bytes,
            file_bytes=room.file_bytes,
            limit_bytes=room.limit_bytes,
            shortfall_bytes=room.shortfall_bytes,
            full=room.full,
        ),
        pending_touches=state.cache.touches.pending,
        retention=by_class,
        tenants=by_tenant,
        # Per engine followed: where, how it hashes, and what its events brought (this
        # worker's subscriber); null when KV-event ingestion is off.
        kv_events=None if state.kv_events is None else state.kv_events.report(),
    )


@router.get("/healthz", summary="The process is up")
async def healthz() -> dict[str, str]:
    """Liveness: answers while the process runs."""
    return {"status": "ok"}


@router.get("/readyz", summary="The store is open and answering")
async def readyz(request: Request) -> Response:
    """Readiness: the store is open and a read succeeds."""
    state = service_state(request)  # 503 problem while starting or stopping
    await state.in_thread(state.cache.capacity.usage)  # a store error becomes a problem answer
    return JSONResponse({"status": "ready"})


@router.get("/metrics", summary="Prometheus metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    """Prometheus text exposition of the service's registry."""
    state = service_state(request)
    output = await state.in_thread(generate_latest, state.metrics.scrape_registry)
    return Response(output, media_type=CONTENT_TYPE_LATEST)
