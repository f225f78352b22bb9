"""Request traces: the public Mooncake format and our own JSONL, read with line numbers.

`mooncake`: one JSON object per line with `timestamp` (milliseconds), `input_length`,
`output_length` and `hash_ids` (one prefix id per 512-token block; the last may be partial).

`jsonl` (ours): `timestamp` (seconds), either `tokens` (token ids) or `hash_ids` +
`input_length` + `block_tokens`, and optionally `output_length`, `retention`, `tenant`,
`model`, `salt`. With hash ids, `input_length` may exceed the tokens the ids cover (ids are
listed for the cacheable part only); the rest always counts as miss tokens.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cache_service.core.tokens import MAX_TOKEN_ID, TokenBytes, tokens_to_bytes

FORMATS = ("auto", "mooncake", "jsonl")
MOONCAKE_BLOCK_TOKENS = 512
DEFAULT_MODEL = "trace"
MAX_HASH_ID = 2**64 - 1


class TraceError(ValueError):
    """A line that is not a valid request; says where."""

    def __init__(self, path: str, line: int, message: str) -> None:
        super().__init__(f"{path}:{line}: {message}")
        self.path = path
        self.line = line
        self.message = message


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace, in the units the trace gave."""

    source: int  # index of the trace file: hash ids are only meaningful within one file
    line: int
    timestamp: float  # seconds from the trace's start
    input_length: int  # prompt tokens, as the trace counts them
    output_length: int
    hash_ids: tuple[int, ...] | None  # prefix ids, one per block of `block_tokens` tokens
    block_tokens: int  # tokens per hash id; 0 for a token trace
    tokens: TokenBytes | None  # uint32 LE token ids, for a token trace
    retention: str | None
    tenant: str
    model: str
    salt: str
    session: str = ""  # a conversation's or agent run's id, for sticky routing ("": none)


def detect_format(record: dict[str, Any]) -> str:
    """`jsonl` when a line has our fields (tokens or block_tokens), else `mooncake`."""
    return "jsonl" if "tokens" in record or "block_tokens" in record else "mooncake"


def _int(record: dict[str, Any], name: str, *, minimum: int = 0, default: int | None = None) -> int:
    value = record.get(name, default)
    if value is None:
        raise ValueError(f"`{name}` is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}")
    return value


def _str(record: dict[str, Any], name: str, default: str) -> str:
    value = record.get(name, default)
    if not isinstance(value, str):
        raise ValueError(f"`{name}` must be a string, got {value!r}")
    return value


def _timestamp(record: dict[str, Any], scale: float) -> float:
    value = record.get("timestamp")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"`timestamp` must be a number >= 0, got {value!r}")
    try:
        seconds = float(value) * scale
    except OverflowError:
        seconds = math.inf
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"`timestamp` must be a finite number >= 0, got {value!r}")
    return seconds


def _hash_ids(record: dict[str, Any]) -> tuple[int, ...]:
    ids = record.get("hash_ids")
    if not isinstance(ids, list) or not ids:
        raise ValueError("`hash_ids` must be a non-empty list of integers")
    for index, value in enumerate(ids):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_HASH_ID:
            raise ValueError(f"`hash_ids[{index}]` must be an integer in 0..2^64-1, got {value!r}")
    return tuple(ids)


def _check_covered(ids: tuple[int, ...], block_tokens: int, input_length: int, exact: bool) -> None:
    """The ids must not claim more blocks than the prompt has (nor fewer, for Mooncake)."""
    if input_length <= (len(ids) - 1) * block_tokens:
        raise ValueError(
            f"{len(ids)} hash ids of {block_tokens} tokens need input_length > "
            f"{(len(ids) - 1) * block_tokens}, got {input_length}"
        )
    if exact and input_length > len(ids) * block_tokens:
        raise ValueError(
            f"{len(ids)} hash ids of {block_tokens} tokens cover at most "
            f"{len(ids) * block_tokens} tokens, but input_length is {input_length}"
        )


def parse_record(record: Any, fmt: str, *, source: int, line: int) -> TraceRequest:
    """One request from a decoded line; ValueError says what is wrong."""
    if not isinstance(record, dict):
        raise ValueError("a line must be a JSON object")
    if fmt == "mooncake":
        ids = _hash_ids(record)
        input_length = _int(record, "input_length", minimum=1)
        _check_covered(ids, MOONCAKE_BLOCK_TOKENS, input_length, exact=True)
        return TraceRequest(
            source=source,
            line=line,
            timestamp=_timestamp(record, 0.001),
            input_length=input_length,
            output_length=_int(record, "output_length", default=0),
            hash_ids=ids,
            block_tokens=MOONCAKE_BLOCK_TOKENS,
            tokens=None,
            retention=None,
            tenant="",
            model=DEFAULT_MODEL,
            salt="",
        )
    retention = record.get("retention")
    if retention is not None and not isinstance(retention, str):
        raise ValueError(f"`retention` must be a string, got {retention!r}")
    timestamp = _timestamp(record, 1.0)
    output_length = _int(record, "output_length", default=0)
    tenant, model, salt = (
        _str(record, "tenant", ""),
        _str(record, "model", DEFAULT_MODEL),
        _str(record, "salt", ""),
    )
    token_bytes: TokenBytes | None = None
    prefix_ids: tuple[int, ...] | None = None
    block_tokens = 0
    if "tokens" in record:
        if "hash_ids" in record:
            raise ValueError("give either `tokens` or `hash_ids`, not both")
        tokens = record["tokens"]
        if not isinstance(tokens, list) or any(
            isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID
            for t in tokens
        ):
            raise ValueError(f"`tokens` must be a list of integers in 0..{MAX_TOKEN_ID}")
        input_length = _int(record, "input_length", default=len(tokens))
        if input_length < len(tokens):
            raise ValueError(f"input_length {input_length} is less than the {len(tokens)} tokens")
        token_bytes = tokens_to_bytes(tokens)
    else:
        prefix_ids = _hash_ids(record)
        block_tokens = _int(record, "block_tokens", minimum=1)
        input_length = _int(record, "input_length", minimum=1)
        _check_covered(prefix_ids, block_tokens, input_length, exact=False)
    return TraceRequest(
        source=source,
        line=line,
        timestamp=timestamp,
        input_length=input_length,
        output_length=output_length,
        hash_ids=prefix_ids,
        block_tokens=block_tokens,
        tokens=token_bytes,
        retention=retention,
        tenant=tenant,
        model=model,
        salt=salt,
        session=_str(record, "session", ""),
    )


def read_trace(
    path: str | Path, *, fmt: str = "auto", source: int = 0, strict: bool = False
) -> Iterator[TraceRequest | TraceError]:
    """Every request of a trace file in file order; a bad line yields (or, strict, raises)
    a TraceError naming its line."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown trace format {fmt!r} (known: {', '.join(FORMATS)})")
    chosen = None if fmt == "auto" else fmt
    with open(path, "rb") as lines:
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
                if chosen is None and isinstance(record, dict):
                    chosen = detect_format(record)
                yield parse_record(record, chosen or "jsonl", source=source, line=number)
            except (ValueError, RecursionError, OverflowError) as exc:  # UnicodeError too
                error = TraceError(str(path), number, str(exc))
                if strict:
                    raise error from None
                yield error
