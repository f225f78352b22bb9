"""Operator routes: explain a miss, pin and unpin prefixes, list pins, purge."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cache_service.core.blocks import BlockKey, Namespace, key_from_hex
from cache_service.core.errors import Forbidden, InvalidField
from cache_service.core.tokens import tokens_in
from cache_service.service.api.auth import principal
from cache_service.service.api.bodies import (
    JSON,
    check_count,
    namespace_of,
    parse_lookup,
    read_prompt_body,
    read_request_json,
)
from cache_service.service.api.openapi import json_body, lookup_body, problem_answer, responses
from cache_service.service.api.schemas import (
    ExplainHeader,
    ExplainRequest,
    ExplainResponse,
    PinRequest,
    PinResponse,
    PurgeRequest,
    PurgeResponse,
    UnpinResponse,
)
from cache_service.service.api.state import ServiceState, service_state
from cache_service.service.api_keys import ApiKey, Role

router = APIRouter()


def tenant_for(caller: ApiKey, requested: str | None) -> str:
    """The tenant a request acts for: the key's own, or any one for an admin key."""
    if requested is None or requested == caller.tenant:
        return caller.tenant
    if caller.role < Role.ADMIN:
        raise Forbidden(
            f"key {caller.id!r} acts for tenant {caller.tenant!r} only; naming another "
            "tenant needs an admin key"
        )
    return requested


@router.post(
    "/v1/explain",
    summary="Why a lookup stops where it does",
    openapi_extra=lookup_body("ExplainRequest", "ExplainHeader"),
    responses=responses({JSON: ExplainResponse}, 400, 408, 413, 415, 422),
)
async def explain(request: Request) -> Response:
    """The same body as a lookup; answers the first unmatched block and the reason."""
    state = service_state(request)
    raw, binary = await read_prompt_body(request, state.limits)
    options, tokens = await state.in_thread(
        parse_lookup, raw, binary, ExplainRequest, ExplainHeader
    )
    assert isinstance(options, ExplainHeader)
    caller = principal(request)
    namespace = namespace_of(options, tenant_for(caller, options.tenant))
    limit = state.limits.max_tokens_per_request
    check_count("tokens", tokens_in(tokens), limit, "max_tokens_per_request")
    found = await state.in_thread(
        lambda: state.operators.explain(
            namespace,
            tokens,
            block_size=options.block_size,
            reveal_salts=caller.role >= Role.ADMIN,
        )
    )
    return JSONResponse(
        {
            "model": options.model,
            "block_size": found.block_size,
            "prompt_tokens": found.prompt_tokens,
            "matched_blocks": found.matched_blocks,
            "cached_tokens": found.matched_blocks * found.block_size,
            "first_unmatched_block": found.first_unmatched_block,
            "reason": found.reason,
            "detail": found.detail,
            "facts": found.facts,
        }
    )


@dataclass(frozen=True)
class _PinCall:
    """A parsed pin or unpin request: who asks, for which namespace, which prefix."""

    state: ServiceState
    caller: ApiKey
    body: PinRequest
    namespace: Namespace
    keys: list[BlockKey] | None


async def _pin_request(request: Request) -> _PinCall:
    state = service_state(request)
    body = await read_request_json(request, state.limits, PinRequest)
    if (body.tokens is None) == (body.keys is None):
        raise InvalidField("tokens", "give the prefix's `tokens` or its `keys`, not both")
    caller = principal(request)
    keys = [key_from_hex(k) for k in body.keys] if body.keys is not None else None
    namespace = namespace_of(body, tenant_for(caller, body.tenant))
    return _PinCall(state, caller, body, namespace, keys)


@router.post(
    "/v1/pin",
    summary="Pin a prefix: never evicted nor expired until unpinned",
    openapi_extra=json_body("PinRequest"),
    responses=responses({JSON: PinResponse}, 400, 403, 408, 409, 413, 415, 422, 501, 503, 507),
)
async def pin(request: Request) -> Response:
    """Pin every full block of `tokens` (or the blocks of `keys`); a writer's pins count
    against its tenant's pin quota."""
    call = await _pin_request(request)
    state, caller = call.state, call.caller
    limits = None
    if caller.role < Role.ADMIN:  # admins pin without limits; writers within their tenant's
        limits = state.operators.pin_limits(
            call.namespace.tenant,
            pin_quota_blocks=state.limits.pin_quota_blocks,
            pinned_share=state.limits.pinned_share,
            tenants=len(state.metrics.tenants),
        )
    record, new = await state.in_thread(
        lambda: state.operators.pin(
            call.namespace, call.body.tokens, keys=call.keys, block_size=call.body.block_size,
            by=caller.id, rank=int(caller.role), limits=limits,
        )
    )  # fmt: skip
    return JSONResponse(
        {"model": call.body.model, "key": record.key.hex(), "pinned_blocks": record.blocks,
         "new": new}
    )  # fmt: skip


@router.post(
    "/v1/unpin",
    summary="Release a pin",
    openapi_extra=json_body("PinRequest"),
    responses=responses({JSON: UnpinResponse}, 400, 403, 408, 409, 413, 415, 422, 501, 503, 507),
)
async def unpin(request: Request) -> Response:
    """Release the pin of exactly this prefix; its blocks then expire as if just used under
    the longest retention class, unless another pin holds them."""
    call = await _pin_request(request)
    released = await call.state.in_thread(
        lambda: call.state.operators.unpin(
            call.namespace, call.body.tokens, keys=call.keys, block_size=call.body.block_size,
            rank=int(call.caller.role),
        )
    )  # fmt: skip
    return JSONResponse({"model": call.body.model, "released_blocks": released})


@router.get(
    "/v1/pins",
    summary="A tenant's pins",
    responses={501: problem_answer(501)},
)
async def pins(request: Request, tenant: str | None = None) -> dict[str, Any]:
    """The caller's tenant's pins (an admin key may ask for any tenant's)."""
    state = service_state(request)
    caller = principal(request)
    chosen = tenant_for(caller, tenant)
    found = await state.in_thread(
        lambda: state.operators.pins(chosen, reveal_salts=caller.role >= Role.ADMIN)
    )
    return {"tenant": chosen, "pins": found}


@router.post(
    "/v1/purge",
    summary="Delete a tenant's blocks, a namespace's, or those under a prefix",
    openapi_extra=json_body("PurgeRequest"),
    responses=responses({JSON: PurgeResponse}, 400, 403, 408, 413, 415, 422, 501, 503, 507),
)
async def purge(request: Request) -> Response:
    """Remove blocks for good (durable once answered) and say how many and how many bytes."""
    state = service_state(request)
    body = await read_request_json(request, state.limits, PurgeRequest)
    tenant = tenant_for(principal(request), body.tenant)
    namespace = None
    if body.model is not None:
        namespace = Namespace(
            model=body.model, kv_layout=body.kv_layout or "", tenant=tenant, salt=body.salt or ""
        )
    elif body.kv_layout is not None or body.salt is not None or body.tokens is not None:
        raise InvalidField("model", "a namespace or prefix purge names its model")
    # On a full disk a purge may need the disk reserve to start: it frees room, for good.
    result = await state.in_thread(
        state.cache.capacity.on_full_disk,
        lambda: state.operators.purge(
            tenant, namespace=namespace, tokens=body.tokens, block_size=body.block_size
        ),
    )
    return JSONResponse(
        {
            "tenant": tenant,
            "blocks": result.blocks,
            "bytes": result.payload_bytes,
            "pins": result.pins,
        }
    )
