"""OpenAPI details for routes that read their own bodies (so that 400/413/415 stay ours)."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import TypeAdapter
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaMode

from cache_service.core.errors import PROBLEM_JSON
from cache_service.core.framing import MEDIA_TYPE
from cache_service.service.api.schemas import (
    REQUEST_MODELS,
    ExplainResponse,
    PinResponse,
    Problem,
    PurgeResponse,
    UnpinResponse,
)
from cache_service.wire import answers, reports
from cache_service.wire.answers import (
    FetchHeader,
    LocalReadsResponse,
    LookupResponse,
    StoreResponse,
)
from cache_service.wire.reports import InfoResponse, StatsResponse

REF = "#/components/schemas/{model}"
# pydantic models, and the wire's plain dataclasses (whose schemas pydantic derives as well)
RESPONSE_MODELS: tuple[type, ...] = (
    LookupResponse,
    StoreResponse,
    FetchHeader,
    InfoResponse,
    StatsResponse,
    LocalReadsResponse,
    ExplainResponse,
    PinResponse,
    PurgeResponse,
    UnpinResponse,
    Problem,
)
FRAMES_DOC = (
    "Frame body: magic 'PCF1' | u32_le header length | JSON header | u32_le frame count | "
    "frames (u64_le length | bytes; length 2^64-1 = absent). See the docs: The HTTP API "
    "(docs/content/guides/http-api.md)."
)
_STATUS_MEANINGS = {
    400: "Malformed body",
    408: "The body did not arrive within body_timeout",
    401: "No API key, or an unknown one",
    403: "The key may not act for that tenant, or a quota would be passed",
    404: "A feature the service was not started with (the detail names its flag)",
    409: "Parent block (or prefix to pin) not stored",
    413: "Body, tokens or blocks over a limit",
    415: "Wrong Content-Type",
    422: "Invalid field (named in `errors`). Two refusals depend on the service's "
    "configuration (GET /v1/info), so the schema can only describe them: problem type "
    "block-size-mismatch (block_size is not this service's for the model) and "
    "unknown-retention (a retention class it does not configure).",
    429: "A key's rate quota is spent (Retry-After)",
    501: "The store this service runs on cannot do that (its backend's declared "
    "capabilities lack it); nothing was changed",
    503: "Writes backed up (Retry-After); reads are still served",
    507: "Full, and nothing can be evicted",
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(model=name)}


def json_body(model: str) -> dict[str, Any]:
    """openapi_extra for a JSON request body described by a request model."""
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(model)}}}
    }


def lookup_body(request: str = "LookupRequest", header: str = "LookupHeader") -> dict[str, Any]:
    """openapi_extra for a lookup-shaped body: JSON, or frames with the tokens in one frame."""
    frames = binary_body(header)["requestBody"]["content"]
    return {
        "requestBody": {
            "required": True,
            "description": f"JSON, or frames: {FRAMES_DOC} The header is a {header} and "
            "the one frame holds the tokens as uint32 little-endian.",
            "content": {"application/json": {"schema": _ref(request)}, **frames},
        }
    }


def binary_body(header_model: str) -> dict[str, Any]:
    """openapi_extra for a frame request body whose header is `header_model`."""
    schema = {"type": "string", "format": "binary", "contentMediaType": MEDIA_TYPE}
    description = f"{FRAMES_DOC} The header is a {header_model}; one frame per block."
    return {
        "requestBody": {
            "required": True,
            "description": description,
            "content": {MEDIA_TYPE: {"schema": schema}},
        }
    }


def responses(success: dict[str, Any], *errors: int) -> dict[int | str, dict[str, Any]]:
    """The `responses` of a route: its 200 media types and its problem+json errors."""
    content: dict[str, Any] = {}
    for media, what in success.items():
        name = what if isinstance(what, str) else what.__name__
        if media == MEDIA_TYPE:  # frames: binary, with the JSON header's model named
            schema = {"type": "string", "format": "binary", "contentMediaType": MEDIA_TYPE}
            content[media] = {"schema": schema, "x-frame-header": _ref(name)}
        else:
            content[media] = {"schema": _ref(name)}
    out: dict[int | str, dict[str, Any]] = {200: {"description": "Success", "content": content}}
    for status in errors:
        out[status] = problem_answer(status)
    return out


def problem_answer(status: int) -> dict[str, Any]:
    """The `responses` entry of a problem+json answer with `status`."""
    return {
        "description": _STATUS_MEANINGS[status],
        "content": {PROBLEM_JSON: {"schema": _ref("Problem")}},
    }


def _problems_for_every_refusal(schema: dict[str, Any]) -> None:
    """Declare every 4xx and 5xx answer a Problem: FastAPI adds its own 422 to a route with
    query parameters (HTTPValidationError), which the service never sends, as its handler
    answers validation errors with problem+json like any other refusal."""
    for operations in schema["paths"].values():
        for operation in operations.values():
            answers = operation.get("responses", {})
            for status, answer in answers.items():
                if status[0] in "45" and PROBLEM_JSON not in answer.get("content", {}):
                    answer["content"] = problem_answer(int(status))["content"]
    for unused in ("HTTPValidationError", "ValidationError"):  # FastAPI's, now unreferenced
        schema["components"]["schemas"].pop(unused, None)


def _document_key_refusals(schema: dict[str, Any]) -> None:
    """With API keys, every route that needs one may answer 401 (no key, or an unknown one),
    403 (its role does not allow the route) or 429 (its rate quota is spent)."""
    for operations in schema["paths"].values():
        for operation in operations.values():
            if operation.get("security") == []:  # the health checks
                continue
            answers = operation.setdefault("responses", {})
            for status in (401, 403, 429):
                answers.setdefault(str(status), problem_answer(status))


def _component_schemas() -> dict[str, Any]:
    """The JSON schemas of the request bodies (as read) and the answers (as written)."""
    pairs: list[tuple[type, JsonSchemaMode]] = [(m, "validation") for m in REQUEST_MODELS]
    pairs += [(m, "serialization") for m in RESPONSE_MODELS]
    inputs = [(model, mode, TypeAdapter(model).core_schema) for model, mode in pairs]
    _, defs = GenerateJsonSchema(ref_template=REF).generate_definitions(inputs)
    return {str(name): schema for name, schema in defs.items()}


def _require_every_answer_field(schemas: dict[str, Any]) -> None:
    """Mark every field of the wire's answers required: the service always writes them all
    (a field's default says what a reader assumes of an older service). pydantic 2.6, the
    lowest allowed, leaves a field with a default out of `required` even for what it writes."""
    wire_classes = [*vars(answers).values(), *vars(reports).values()]
    for answer in wire_classes:
        if isinstance(answer, type) and dataclasses.is_dataclass(answer):
            component = schemas.get(answer.__name__)
            if component is not None:
                component["required"] = list(component["properties"])


def install_openapi(app: FastAPI, *, bearer_auth: bool = False) -> None:
    """Add the request and response models to the schema's components (and, with keys, the
    bearer scheme every route but the health checks needs)."""

    def build() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        components = schema.setdefault("components", {})
        components.setdefault("schemas", {}).update(_component_schemas())
        _require_every_answer_field(components["schemas"])
        _problems_for_every_refusal(schema)
        if bearer_auth:
            components["securitySchemes"] = {
                "apiKey": {"type": "http", "scheme": "bearer", "description": "An API key."}
            }
            schema["security"] = [{"apiKey": []}]
            for path in ("/healthz", "/readyz"):
                for operation in schema["paths"].get(path, {}).values():
                    operation["security"] = []
            _document_key_refusals(schema)
        app.openapi_schema = schema
        return schema

    app.openapi = build  # type: ignore[method-assign]
