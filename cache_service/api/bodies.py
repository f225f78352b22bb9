"""Reading request bodies: size limits as bytes arrive, media types, and validation to 4xx."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from cache_service.errors import (
    InvalidField,
    MalformedBody,
    PayloadTooLarge,
    RequestTimeout,
    UnsupportedMediaType,
)

Model = TypeVar("Model", bound=BaseModel)
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


async def read_body(request: Request, *, limit_bytes: int, timeout_seconds: float) -> bytes:
    """The whole body, refused with 413 as soon as it passes `limit_bytes` (with or without
    a Content-Length), and with 408 if it has not all arrived within `timeout_seconds` plus
    a second per MiB received (the connection is then closed, so a client trickling bytes
    cannot hold a worker)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
        raise _too_large(limit_bytes)
    chunks: list[bytes] = []
    received = 0
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        async with asyncio.timeout(timeout_seconds) as deadline:
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
        raise RequestTimeout(
            f"the body did not arrive within {timeout_seconds:g} s plus a second per MiB "
            f"({received} bytes came; body_timeout)",
            limit="body_timeout",
            limit_seconds=timeout_seconds,
        ) from None
    return b"".join(chunks)


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


def parse_json(model: type[Model], raw: bytes) -> Model:
    """Validate a JSON body against `model`, raising the service's 4xx errors."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_problem(exc.errors(include_url=False)) from None


def parse_object(model: type[Model], data: dict[str, Any]) -> Model:
    """Validate an already decoded object (a frame header) against `model`."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_problem(exc.errors(include_url=False)) from None


def tokens_frame(frame: memoryview | None, field: str) -> bytes:
    """Token ids sent as a frame of uint32 little-endian (any 32-bit value is a valid id)."""
    if frame is None or len(frame) % 4:
        raise InvalidField(field, "binary tokens are uint32 little-endian: 4 bytes a token")
    return bytes(frame)


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
