"""Reading request bodies: size limits as bytes arrive, media types, validation to 4xx, and
the shapes the routes share (a lookup-shaped body, the namespace a body names)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request

from cache_service.core.blocks import Namespace
from cache_service.core.errors import (
    InvalidField,
    MalformedBody,
    PayloadTooLarge,
    RequestTimeout,
    UnsupportedMediaType,
)
from cache_service.core.framing import MEDIA_TYPE, decode_frames, frame_header_length
from cache_service.core.tokens import TokenBytes, as_token_bytes
from cache_service.service.api.direct_body import SCOPE_KEY, DirectBody
from cache_service.service.api.schemas import LookupHeader, LookupRequest, NamespaceFields
from cache_service.service.config import RequestLimits

Model = TypeVar("Model", bound=BaseModel)
RawBody = bytes | bytearray  # a body as read: a large one is the buffer it was read into
MIN_BODY_RATE = 2**20  # bytes a second a body must keep up beyond body_timeout
MAX_REPORTED_ERRORS = 20
JSON = "application/json"
INLINE_BODY_BYTES = 256 * 1024  # larger bodies are parsed and hashed in a worker thread
# A token in JSON takes at most 10 digits, a comma and some white space; with room for the
# other fields, a body larger than this cannot be within the token limit: refuse it unparsed.
JSON_BYTES_PER_TOKEN = 24
JSON_FIELDS_ALLOWANCE_BYTES = 64 * 1024


def media_type(request: Request) -> str:
    """The request's media type, lowercased, without parameters."""
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def require_media_type(request: Request, *accepted: str) -> None:
    """UnsupportedMediaType unless the body is one of `accepted` (JSON also as +json)."""
    found = media_type(request)
    if found in accepted or (JSON in accepted and found.endswith("+json")):
        return
    raise UnsupportedMediaType(
        f"Content-Type {found or '(none)'!r} is not accepted here; send {' or '.join(accepted)}",
        accepted=list(accepted),
    )


async def read_body(request: Request, *, limit_bytes: int, timeout_seconds: float) -> RawBody:
    """The whole body, refused with 413 as soon as it passes `limit_bytes` (with or without
    a Content-Length), and with 408 if it has not all arrived within `timeout_seconds` plus
    a second per MiB received (the connection is then closed, so a client trickling bytes
    cannot hold a worker)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
        raise _too_large(limit_bytes)
    direct = request.scope.get(SCOPE_KEY)
    chunks: list[bytes] = []
    received = 0
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        async with asyncio.timeout(timeout_seconds) as deadline:
            if isinstance(direct, DirectBody):
                return await _read_direct(request, direct, deadline, started + timeout_seconds)
            async for chunk in request.stream():
                received += len(chunk)
                if received > limit_bytes:
                    raise _too_large(limit_bytes)
                chunks.append(chunk)
                # A large body earns time as it comes: a second per MiB beyond the timeout,
                # so only a body slower than 1 MiB/s (a trickle) runs out of it.
                deadline.reschedule(started + timeout_seconds + received / MIN_BODY_RATE)
    except ClientDisconnect:
        raise MalformedBody("the client disconnected before sending the whole body") from None
    except TimeoutError:
        if isinstance(direct, DirectBody):
            received = direct.filled
        raise RequestTimeout(
            f"the body did not arrive within {timeout_seconds:g} s plus a second per MiB "
            f"({received} bytes came; body_timeout)",
            limit="body_timeout",
            limit_seconds=timeout_seconds,
        ) from None
    return b"".join(chunks)


async def _read_direct(
    request: Request, direct: DirectBody, deadline: asyncio.Timeout, due: float
) -> RawBody:
    """A body of known length read into one buffer by the protocol (direct_body.py); the
    length was checked against the limit, and it earns time as it comes like any other."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        if not direct.active:
            received: bytes = message.get("body", b"")
            if not message.get("more_body", False):
                return received  # it had all come: nothing to take over
            direct.begin(received)
        deadline.reschedule(due + direct.filled / MIN_BODY_RATE)
        if not message.get("more_body", False):
            return direct.body()


def _too_large(limit_bytes: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"the body is larger than the limit of {limit_bytes} bytes (max_body_size)",
        limit="max_body_size",
        limit_bytes=limit_bytes,
    )


def field_name(location: tuple[int | str, ...]) -> str:
    """Render a pydantic error location as `tokens[3]` or `usage.hits`."""
    name = ""
    for part in location:
        if isinstance(part, int):
            name += f"[{part}]"
        else:
            name += f".{part}" if name else str(part)
    return name or "body"


def validation_problem(
    errors: Sequence[Mapping[str, Any]], *, prefix: tuple[int | str, ...] = ()
) -> MalformedBody | InvalidField:
    """Map pydantic errors to MalformedBody (not JSON at all) or InvalidField (names fields)."""
    if any(err["type"] == "json_invalid" for err in errors):
        message = next(err["msg"] for err in errors if err["type"] == "json_invalid")
        return MalformedBody(f"the body is not valid JSON: {message}")
    if any(err["type"] == "model_type" and not err["loc"] for err in errors):
        return MalformedBody("the body must be a JSON object")
    reported = [
        {"field": field_name((*prefix, *err["loc"])), "message": str(err["msg"])}
        for err in errors[:MAX_REPORTED_ERRORS]
    ]
    first = reported[0]
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return InvalidField(
        first["field"], f"{first['message']}{more}", errors=reported, error_count=len(errors)
    )


def parse_json(model: type[Model], raw: RawBody) -> Model:
    """Validate a JSON body against `model`, raising the service's 4xx errors."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
    # The slow path, only for bodies that write an integer as 116.0 (see integral_floats_as_ints).
    if not any(_is_integral_float_refusal(err) for err in errors):
        raise validation_problem(errors) from None
    try:
        data = json.loads(raw)  # stdlib json: big integers too (both stop at 4300 digits)
    except ValueError:  # should pydantic's parser ever admit what json does not
        raise validation_problem(errors) from None
    return parse_object(model, data)


def parse_object(model: type[Model], data: dict[str, Any]) -> Model:
    """Validate an already decoded object (a JSON body or a frame header) against `model`."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
    if not integral_floats_as_ints(data, errors):
        raise validation_problem(errors) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_problem(exc.errors(include_url=False)) from None


def _is_integral_float_refusal(error: Mapping[str, Any]) -> bool:
    value = error["input"]
    return error["type"] == "int_type" and isinstance(value, float) and value.is_integer()


def integral_floats_as_ints(data: Any, errors: Sequence[Mapping[str, Any]]) -> bool:
    """Rewrite, in place, every float with no fraction that an integer field refused as that
    integer; whether any was. JSON Schema (so the OpenAPI schema) counts 116.0 as the integer
    116, so the service must too; the strict models stay the fast path for plain integers."""
    rewritten = False
    for error in errors:
        if not (_is_integral_float_refusal(error) and error["loc"]):
            continue
        *path, last = error["loc"]
        container = data
        try:
            for part in path:
                container = container[part]
            if container[last] == error["input"]:
                container[last] = int(error["input"])
                rewritten = True
        except (KeyError, IndexError, TypeError):  # not where the error says: leave it refused
            continue
    return rewritten


def tokens_frame(frame: memoryview | None, field: str) -> TokenBytes:
    """Token ids sent as a frame of uint32 little-endian (any 32-bit value is a valid id)."""
    return as_token_bytes(frame, field)


def check_token_room(json_bytes: int, max_tokens: int) -> None:
    """PayloadTooLarge, before parsing, for JSON too long to hold at most `max_tokens` tokens."""
    bound = max_tokens * JSON_BYTES_PER_TOKEN + JSON_FIELDS_ALLOWANCE_BYTES
    if json_bytes > bound:
        raise PayloadTooLarge(
            f"tokens: {json_bytes} bytes of JSON are more than {max_tokens} tokens can take "
            f"({JSON_BYTES_PER_TOKEN} bytes each plus {JSON_FIELDS_ALLOWANCE_BYTES}; "
            "max_tokens_per_request)",
            field="tokens",
            limit="max_tokens_per_request",
            limit_value=max_tokens,
        )


def check_count(field: str, count: int, limit: int, setting: str) -> None:
    """PayloadTooLarge if a request carries more items than a configured limit."""
    if count > limit:
        raise PayloadTooLarge(
            f"{field}: {count} is over the limit of {limit} ({setting})",
            field=field,
            limit=setting,
            limit_value=limit,
        )


def namespace_of(body: NamespaceFields, tenant: str) -> Namespace:
    """The namespace a request names, in the tenant its key acts for."""
    # The tenant comes from the API key, never from the body.
    return Namespace(model=body.model, kv_layout=body.kv_layout, tenant=tenant, salt=body.salt)


async def read_limited_body(request: Request, limits: RequestLimits) -> RawBody:
    """The body within the service's size and time limits."""
    return await read_body(
        request, limit_bytes=limits.max_body_size, timeout_seconds=limits.body_timeout
    )


async def read_prompt_body(request: Request, limits: RequestLimits) -> tuple[RawBody, bool]:
    """A lookup-shaped body (JSON, or frames) within the limits, and whether it is frames."""
    require_media_type(request, JSON, MEDIA_TYPE)
    binary = media_type(request) == MEDIA_TYPE
    raw = await read_limited_body(request, limits)
    check_token_room(
        frame_header_length(raw) if binary else len(raw), limits.max_tokens_per_request
    )
    return raw, binary


async def read_request_json(request: Request, limits: RequestLimits, model: type[Model]) -> Model:
    """A JSON body of `model` within the service's body and token limits; a long one is
    parsed in a worker thread, never on the event loop."""
    require_media_type(request, JSON)
    raw = await read_limited_body(request, limits)
    limit = limits.max_tokens_per_request
    check_token_room(len(raw), limit)
    if len(raw) >= INLINE_BODY_BYTES:
        body = await run_in_threadpool(parse_json, model, raw)
    else:
        body = parse_json(model, raw)
    tokens = getattr(body, "tokens", None)
    if tokens is not None:
        check_count("tokens", len(tokens), limit, "max_tokens_per_request")
    return body


def parse_lookup(
    raw: RawBody,
    binary: bool,
    json_model: type[LookupRequest] = LookupRequest,
    header_model: type[LookupHeader] = LookupHeader,
) -> tuple[LookupHeader, TokenBytes]:
    """The options and tokens of a lookup-shaped body (JSON, or a frame body)."""
    if not binary:
        body = parse_json(json_model, raw)
        return body, as_token_bytes(body.tokens)
    header, frames = decode_frames(raw)
    if len(frames) != 1:
        raise InvalidField("frames", f"a lookup carries one frame (its tokens), not {len(frames)}")
    return parse_object(header_model, header), tokens_frame(frames[0], "frames[0]")
