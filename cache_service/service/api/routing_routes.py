"""POST /v1/route: which engine holds the longest prefix of a prompt, and how much of it the
payload store could fill in. A thin translation: the scoring is core/engines/routing.py."""

from __future__ import annotations

import time
from typing import Annotated, Any

import orjson
from fastapi import APIRouter
from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from cache_service.core.blocks import Namespace
from cache_service.core.engines.routing import (
    EngineScores,
    EngineSpec,
    InstanceScore,
    RouteScorer,
    StoreScore,
    Unscored,
    score_store,
    select_engines,
)
from cache_service.core.tokens import as_token_bytes
from cache_service.service.api.auth import principal
from cache_service.service.api.bodies import JSON, namespace_of, read_request_json
from cache_service.service.api.openapi import problem_answer
from cache_service.service.api.schemas import Name, PromptOptions, Token
from cache_service.service.api.state import ServiceState, service_state
from cache_service.service.kv_events.config import EngineConfig
from cache_service.service.kv_events.liveness import EngineLiveness
from cache_service.wire.answers import (
    STORE_MEDIUM,
    RouteInstance,
    RouteResponse,
    RouteStore,
    RouteUnscored,
)

router = APIRouter()
INLINE_TOKENS = 4096  # longer prompts are hashed in a worker thread, off the event loop
MAX_INSTANCES = 1024

INSTANCES_DOC = (
    "Candidate instances (engine names as configured with --kv-events): only these are "
    "scored. An instance no engine of this model is configured as is refused with 422 "
    "unknown-instance (which exist depends on the service's configuration: GET /v1/stats, "
    "kv_events). Omit it to score every engine of the model."
)


class RouteRequest(PromptOptions):
    """POST /v1/route: a prompt, its namespace (for the payload store) and how the engines
    hash it (LoRA name, vLLM's cache_salt)."""

    tokens: list[Token] = Field(description="Token ids, unsigned 32-bit integers.")
    lora_name: Name | None = Field(None, description="The LoRA adapter the engines run it with.")
    cache_salt: Name | None = Field(
        None, description="vLLM's per-request cache_salt (hashed into the engines' block 0)."
    )
    instances: Annotated[list[Name], Field(max_length=MAX_INSTANCES)] | None = Field(
        None, description=INSTANCES_DOC
    )


def _request_body() -> dict[str, Any]:
    # Stated inline (routes read their own bodies, so FastAPI does not collect it as a
    # component); the integral-float rule of the other bodies holds here too.
    schema = RouteRequest.model_json_schema(mode="validation")
    return {"requestBody": {"required": True, "content": {JSON: {"schema": schema}}}}


@router.post(
    "/v1/route",
    summary="Which instance holds the longest prefix of a prompt",
    openapi_extra=_request_body(),
    response_class=Response,
    responses={
        200: {"model": RouteResponse, "description": "Success"},
        **{status: problem_answer(status) for status in (400, 408, 413, 415, 422)},
    },
)
async def route(request: Request) -> Response:
    """Per instance and medium: leading blocks held, cached tokens and tokens to prefill,
    best first; and the payload store's own prefix of the caller's namespace (read only:
    a routing question neither refreshes nor counts as a lookup)."""
    state = service_state(request)
    body = await read_request_json(request, state.limits, RouteRequest)
    namespace = namespace_of(body, principal(request).tenant)
    if len(body.tokens) >= INLINE_TOKENS:
        answer = await state.in_thread(_answer, state, body, namespace)
    else:
        answer = _answer(state, body, namespace)
    return Response(orjson.dumps(answer), media_type=JSON)


def _answer(state: ServiceState, body: RouteRequest, namespace: Namespace) -> RouteResponse:
    state.cache.config.resolve_retention(body.retention)  # an unknown class is a 422
    token_bytes = as_token_bytes(body.tokens)  # encoded once, for the store and the engines
    store = score_store(state.cache, namespace, token_bytes, block_size=body.block_size)
    hub = state.kv_events  # None unless the service follows engines' KV events
    configured = hub.engines_for(body.model) if hub is not None else []
    liveness = hub.liveness() if hub is not None else {}
    specs = [_spec(engine, liveness.get(engine.name)) for engine in configured]
    engines = select_engines(specs, body.instances)
    gone: list[Unscored] = []
    if hub is not None:
        now = time.monotonic()
        for spec in engines:
            alive = liveness[spec.name]
            if hub.gone(alive, now):
                gone.append(Unscored(spec.name, _gone_reason(alive, now, hub.grace_seconds)))
        engines = [spec for spec in engines if spec.name not in {u.instance for u in gone}]
    if hub is not None and engines:
        scores = RouteScorer(hub.views, memo=hub.chain_memo).score(
            body.tokens,
            engines,
            lora_name=body.lora_name,
            cache_salt=body.cache_salt,
            token_bytes=token_bytes,
        )
    else:
        scores = EngineScores(len(body.tokens), [], [], 0)
    scores.unscored.extend(gone)
    return route_answer(body.model, scores, store)


def _spec(engine: EngineConfig, liveness: EngineLiveness | None) -> EngineSpec:
    live = liveness is None or liveness.live
    return EngineSpec(
        engine.name,
        engine.hash_scheme,
        engine.seed,
        engine.block_size,
        live,
        extra_keys_form=engine.extra_keys_form,
        lora_modules=engine.lora_modules,
    )


def _gone_reason(liveness: EngineLiveness, now: float, grace: float) -> str:
    return (
        f"down ({liveness.reason}) for {liveness.down_for(now):.0f} s, past the "
        f"{grace:g} s grace: left out of routing until it publishes again"
    )


def route_answer(model: str, scores: EngineScores, store: StoreScore) -> RouteResponse:
    """The answer of POST /v1/route."""
    best: RouteInstance | None = None
    leader = scores.best
    if store.matched_blocks and (leader is None or store.cached_tokens > leader.cached_tokens):
        best = _store_row(store)
    elif leader is not None:
        best = _row(leader)
    return RouteResponse(
        model=model,
        prompt_tokens=scores.prompt_tokens,
        instances=[_row(score) for score in scores.instances],
        store=RouteStore(
            matched_blocks=store.matched_blocks,
            cached_tokens=store.cached_tokens,
            tokens_to_prefill=store.tokens_to_prefill,
            block_size=store.block_size,
        ),
        best=best,
        unscored=[RouteUnscored(instance=u.instance, reason=u.reason) for u in scores.unscored],
    )


def _row(score: InstanceScore) -> RouteInstance:
    return RouteInstance(
        instance=score.instance,
        medium=score.medium,
        matched_blocks=score.matched_blocks,
        cached_tokens=score.cached_tokens,
        tokens_to_prefill=score.tokens_to_prefill,
        block_size=score.block_size,
        data_parallel_rank=score.data_parallel_rank,
        stale=score.stale,
        live=score.live,
    )


def _store_row(store: StoreScore) -> RouteInstance:
    # The payload store as an instance of its own: any worker can load from it.
    return RouteInstance(
        instance=None,
        medium=STORE_MEDIUM,
        matched_blocks=store.matched_blocks,
        cached_tokens=store.cached_tokens,
        tokens_to_prefill=store.tokens_to_prefill,
        block_size=store.block_size,
        data_parallel_rank=None,
        stale=False,
        live=True,
    )
