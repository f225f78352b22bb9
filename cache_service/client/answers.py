"""What the service answers: Usage, Match, StoreResult (and put_prefix's StoredBlocks), parsers.

A parser takes a 2xx `httpx.Response` and returns the typed answer, or raises
`ServiceError(502, ...)` for an answer it cannot use; `_problem_error` turns a non-2xx answer
into the `ServiceError` that carries its problem+json.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import orjson

from cache_service.core.errors import MalformedBody, ServiceError
from cache_service.core.framing import MEDIA_TYPE, decode_frames

_T = TypeVar("_T")

MAX_ERROR_TEXT_CHARS = 2000  # a non-JSON error body (an HTML page from a proxy) is cut here


Payload = bytes | memoryview  # bytes, or with copy=False a view into the answer


@dataclass(frozen=True, slots=True)
class Usage:
    """Token accounting of one lookup, as OpenAI-style APIs report prompt caching."""

    prompt_cache_hit_tokens: int
    prompt_cache_miss_tokens: int


@dataclass(frozen=True, slots=True)
class Match:
    """A lookup's answer: the longest cached prefix, and its payloads if fetched."""

    matched_blocks: int
    cached_tokens: int
    block_size: int  # 0 in a fail-open miss when the caller did not name one
    prompt_tokens: int
    keys: list[str]  # 32 lowercase hex characters each, as the API sends them
    usage: Usage
    payloads: list[Payload] | None = None


@dataclass(frozen=True, slots=True)
class StoreResult:
    """A store request's answer: what happened to each block sent."""

    model: str
    block_size: int  # 0 in a fail-open miss when the caller did not name one
    start_block: int
    requested_blocks: int
    stored_blocks: int  # newly stored with the bytes sent
    refreshed_blocks: int  # already stored (by anyone): kept as first written
    conflicts: int  # of the refreshed, how many hold other bytes than the ones sent
    truncated_blocks: int
    collisions: int
    keys: list[str]

    @property
    def identical_blocks(self) -> int:
        """Blocks already stored with the very bytes sent."""
        return self.refreshed_blocks - self.conflicts

    @property
    def as_sent(self) -> bool:
        """Whether the cache now holds every block sent, each with the bytes sent."""
        held = self.stored_blocks + self.refreshed_blocks
        return held == self.requested_blocks and not self.conflicts


class StoredBlocks(int):
    """put_prefix's answer: an int, the blocks newly stored; `.result` is the whole answer.

    An int so that `put_prefix(...) == 16` and sums of it keep working; a block another writer
    stored first with different bytes is not newly stored, and shows in `conflicts`.
    """

    result: StoreResult

    def __new__(cls, result: StoreResult) -> StoredBlocks:
        """Wrap a store answer."""
        self = super().__new__(cls, result.stored_blocks)
        self.result = result
        return self

    def __getnewargs__(self) -> tuple[StoreResult]:  # type: ignore[override]
        return (self.result,)  # copy and pickle rebuild it from the answer, not from the int

    def __repr__(self) -> str:
        result = self.result
        return (
            f"StoredBlocks({int(self)}, identical_blocks={result.identical_blocks}, "
            f"conflicts={result.conflicts}, requested_blocks={result.requested_blocks})"
        )

    @property
    def stored_blocks(self) -> int:
        """Blocks newly stored with the bytes sent (the int's value)."""
        return self.result.stored_blocks

    @property
    def identical_blocks(self) -> int:
        """Blocks already stored with the very bytes sent."""
        return self.result.identical_blocks

    @property
    def conflicts(self) -> int:
        """Blocks already stored with other bytes (another writer's), which the cache keeps."""
        return self.result.conflicts

    @property
    def as_sent(self) -> bool:
        """Whether the cache now holds every block sent, each with the bytes sent."""
        return self.result.as_sent


def _invalid_answer(detail: str) -> ServiceError:
    """A 2xx answer the client cannot use: a 502, as a gateway reports a bad upstream."""
    return ServiceError(
        502,
        {
            "type": "about:blank",
            "title": "Invalid answer from the service",
            "status": 502,
            "detail": detail,
        },
    )


def _problem_error(response: httpx.Response) -> ServiceError:
    """The ServiceError of a non-2xx answer: its problem+json, or its text as the detail."""
    body: Any = None
    if "json" in response.headers.get("content-type", ""):
        try:
            body = response.json()
        except ValueError:
            body = None
    if not isinstance(body, dict):
        body = {
            "type": "about:blank",
            "title": response.reason_phrase or "Error",
            "status": response.status_code,
            "detail": response.text[:MAX_ERROR_TEXT_CHARS],
        }
    return ServiceError(response.status_code, body)


def _is_frames(response: httpx.Response) -> bool:
    content_type: str = response.headers.get("content-type", "")
    return content_type.split(";", 1)[0].strip().lower() == MEDIA_TYPE


def _json_object(response: httpx.Response) -> dict[str, Any]:
    try:
        body = orjson.loads(response.content)
    except orjson.JSONDecodeError as exc:
        raise _invalid_answer(f"the answer is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _invalid_answer("the answer is not a JSON object")
    return body


def _frames(response: httpx.Response) -> tuple[dict[str, Any], list[memoryview | None]]:
    if not _is_frames(response):
        raise _invalid_answer(f"expected {MEDIA_TYPE}, got {response.headers.get('content-type')}")
    try:
        return decode_frames(response.content)
    except MalformedBody as exc:
        raise _invalid_answer(exc.detail) from None


def _field(body: dict[str, Any], name: str, kind: type[_T]) -> _T:
    value = body.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _invalid_answer(f"field {name!r} is missing or not of type {kind.__name__}")
    return value


def _strings(body: dict[str, Any], name: str) -> list[str]:
    value = _field(body, name, list)
    if not set(map(type, value)) <= {str}:  # one pass in C: answers carry hundreds of keys
        raise _invalid_answer(f"field {name!r} must be a list of strings")
    return value


def _payload(frame: memoryview, copy: bool) -> Payload:
    return bytes(frame) if copy else frame


def _parse_match(response: httpx.Response, *, fetch: bool, copy: bool = True) -> Match:
    payloads: list[Payload] | None = None
    if fetch:
        body, frames = _frames(response)
        if any(frame is None for frame in frames):
            raise _invalid_answer("a lookup answer has an absent frame")
        payloads = [_payload(frame, copy) for frame in frames if frame is not None]
    else:
        body = _json_object(response)
    usage = _field(body, "usage", dict)
    match = Match(
        matched_blocks=_field(body, "matched_blocks", int),
        cached_tokens=_field(body, "cached_tokens", int),
        block_size=_field(body, "block_size", int),
        prompt_tokens=_field(body, "prompt_tokens", int),
        keys=_strings(body, "keys"),
        usage=Usage(
            prompt_cache_hit_tokens=_field(usage, "prompt_cache_hit_tokens", int),
            prompt_cache_miss_tokens=_field(usage, "prompt_cache_miss_tokens", int),
        ),
        payloads=payloads,
    )
    if payloads is not None and len(payloads) != match.matched_blocks:
        raise _invalid_answer(f"{len(payloads)} frames for {match.matched_blocks} matched blocks")
    return match


def _missed_match(prompt_tokens: int, block_size: int | None, fetch: bool) -> Match:
    return Match(
        matched_blocks=0,
        cached_tokens=0,
        block_size=block_size or 0,
        prompt_tokens=prompt_tokens,
        keys=[],
        usage=Usage(prompt_cache_hit_tokens=0, prompt_cache_miss_tokens=prompt_tokens),
        payloads=[] if fetch else None,
    )


def _parse_store(response: httpx.Response) -> StoreResult:
    body = _json_object(response)
    return StoreResult(
        model=_field(body, "model", str),
        block_size=_field(body, "block_size", int),
        start_block=_field(body, "start_block", int),
        requested_blocks=_field(body, "requested_blocks", int),
        stored_blocks=_field(body, "stored_blocks", int),
        refreshed_blocks=_field(body, "refreshed_blocks", int),
        conflicts=_field(body, "conflicts", int),
        truncated_blocks=_field(body, "truncated_blocks", int),
        collisions=_field(body, "collisions", int),
        keys=_strings(body, "keys"),
    )


def _parse_blocks(
    response: httpx.Response, *, count: int, copy: bool = True
) -> list[Payload | None]:
    _, frames = _frames(response)
    if len(frames) != count:
        raise _invalid_answer(f"{len(frames)} frames for {count} requested keys")
    return [None if frame is None else _payload(frame, copy) for frame in frames]
