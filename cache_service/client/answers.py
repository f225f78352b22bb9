"""What the service answers: Usage, Match, StoreResult (and put_prefix's StoredBlocks),
ServiceInfo, parsers.

The answers are the service's own declarations (`cache_service.wire.answers` and `.reports`),
read by `cache_service.wire.reader`; Match adds the payloads a fetch brings. A parser takes a
2xx `httpx.Response` and returns the typed answer, or raises `InvalidAnswer` (a
`ServiceError(502, ...)`) for an answer it cannot use; a non-2xx answer is
`cache_service.client.problems`' to turn into its exception.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx
import orjson

from cache_service.core.errors import InvalidAnswer, MalformedBody
from cache_service.core.framing import MEDIA_TYPE, decode_frames, is_frames_type
from cache_service.wire import answers, reports
from cache_service.wire.reader import UnreadableAnswer, read_fields

Payload = bytes | memoryview  # bytes, or with copy=False a view into the answer


Usage = answers.Usage
StoreResult = answers.StoreResponse  # with identical_blocks and as_sent
ServiceInfo = reports.InfoResponse  # with block_size_for(model)


@dataclass(frozen=True, slots=True, kw_only=True)
class Match(answers.LookupResponse):
    """A lookup's answer: the longest cached prefix, and its payloads if fetched."""

    payloads: list[Payload] | None = None


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


def _is_frames(response: httpx.Response) -> bool:
    return is_frames_type(response.headers.get("content-type"))


def _json_object(response: httpx.Response) -> dict[str, Any]:
    try:
        body = orjson.loads(response.content)
    except orjson.JSONDecodeError as exc:
        raise InvalidAnswer(f"the answer is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidAnswer("the answer is not a JSON object")
    return body


def _frames(
    response: httpx.Response,
) -> tuple[dict[str, Any], Sequence[bytes | memoryview | None]]:
    if not _is_frames(response):
        raise InvalidAnswer(f"expected {MEDIA_TYPE}, got {response.headers.get('content-type')}")
    read = response.extensions.get("frames")  # the stdlib transport parsed them as it read
    try:
        if isinstance(read, MalformedBody):
            raise read
        return read if read is not None else decode_frames(response.content)
    except MalformedBody as exc:
        raise InvalidAnswer(exc.detail) from None


def _read_fields(kind: type[Any], body: object) -> dict[str, Any]:
    """The fields of answer `kind` in `body`, or the 502 naming the one it cannot use."""
    try:
        return read_fields(kind, body)
    except UnreadableAnswer as exc:
        raise InvalidAnswer(str(exc)) from None


def _payload(frame: bytes | memoryview, copy: bool) -> Payload:
    return bytes(frame) if copy and not isinstance(frame, bytes) else frame


def _parse_match(response: httpx.Response, *, fetch: bool, copy: bool = True) -> Match:
    payloads: list[Payload] | None = None
    if fetch:
        body, frames = _frames(response)
        if any(frame is None for frame in frames):
            raise InvalidAnswer("a lookup answer has an absent frame")
        payloads = [_payload(frame, copy) for frame in frames if frame is not None]
    else:
        body = _json_object(response)
    match = Match(**_read_fields(answers.LookupResponse, body), payloads=payloads)
    if payloads is not None and len(payloads) != match.matched_blocks:
        raise InvalidAnswer(f"{len(payloads)} frames for {match.matched_blocks} matched blocks")
    return match


def _missed_match(
    model: str, prompt_tokens: int, block_size: int | None, retention: str | None, fetch: bool
) -> Match:
    miss = Match.miss(
        model=model,
        prompt_tokens=prompt_tokens,
        block_size=block_size or 0,
        retention=retention or "",
    )
    return replace(miss, payloads=[]) if fetch else miss


def _parse_store(response: httpx.Response) -> StoreResult:
    return StoreResult(**_read_fields(answers.StoreResponse, _json_object(response)))


def _parse_local_reads(response: httpx.Response) -> answers.LocalReadsResponse:
    body = _json_object(response)
    return answers.LocalReadsResponse(**_read_fields(answers.LocalReadsResponse, body))


def _parse_info(response: httpx.Response) -> ServiceInfo:
    return ServiceInfo(**_read_fields(reports.InfoResponse, _json_object(response)))


def _parse_blocks(
    response: httpx.Response, *, count: int, copy: bool = True
) -> list[Payload | None]:
    header, frames = _frames(response)
    _read_fields(answers.FetchHeader, header)  # held to its declaration, though not kept
    if len(frames) != count:
        raise InvalidAnswer(f"{len(frames)} frames for {count} requested keys")
    return [None if frame is None else _payload(frame, copy) for frame in frames]
