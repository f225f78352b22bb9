"""A lookup's walk over the records Redis returned: every check of `codec.check_record`, in
one loop over the values as they came (length prefix, record, the start of the payload).

A 32k lookup verifies 512 records; as separate calls (cut the value, copy the record, check
it) that was about a microsecond a block more than this loop (py-spy, 2026-12-06).
"""

from __future__ import annotations

from collections.abc import Sequence

from cache_service.core.blocks import BlockKey
from cache_service.core.lifetimes import Lifetimes
from cache_service.core.store.parts.codec import (
    COLLISION,
    DAMAGED,
    DEPTH,
    DEPTH_AT,
    EXPIRES,
    EXPIRES_AT,
    HIT,
    MISSING,
    PARENT_END,
    RECORD_VERSION,
    RETENTION_LEN_AT,
    ROOT_AT,
    SUM_BYTES,
    TOKENS_AT,
    VERSION_AT,
    raw_alive,
    seal,
)
from cache_service.core.store.redis.values import LENGTH

CUT_SHORT = -1  # a verdict: the record runs past what was read (a long retention name)

Part = tuple[BlockKey, BlockKey, bytes, int]  # (key, parent, tokens, depth) of a link

_LENGTH_AT = LENGTH.size
_SUM_END = _LENGTH_AT + SUM_BYTES
_VERSION_AT = _LENGTH_AT + VERSION_AT
_DEPTH_AT = _LENGTH_AT + DEPTH_AT
_EXPIRES_AT = _LENGTH_AT + EXPIRES_AT
_ROOT_AT = _LENGTH_AT + ROOT_AT
_PARENT_END = _LENGTH_AT + PARENT_END
_RETENTION_LEN_AT = _LENGTH_AT + RETENTION_LEN_AT
_TOKENS_AT = _LENGTH_AT + TOKENS_AT


def walk_records(
    parts: Sequence[Part],
    values: Sequence[bytes | None],
    *,
    root: bytes,
    now: float,
    lifetimes: Lifetimes,
) -> tuple[int, int]:
    """(how many leading values are their part's record, alive and verified; the verdict on
    the next one: MISSING, COLLISION, DAMAGED or CUT_SHORT, or HIT when every value is)."""
    unpack_length = LENGTH.unpack_from
    unpack_depth = DEPTH.unpack_from
    unpack_expiry = EXPIRES.unpack_from
    shortest = lifetimes.shortest_bound
    for index, ((_key, parent, tokens, depth), value) in enumerate(zip(parts, values, strict=True)):
        if not value:
            return index, MISSING
        size = len(value)
        if size < _TOKENS_AT:  # shorter than asked for: the whole value, too short a record
            return index, DAMAGED
        end = _LENGTH_AT + unpack_length(value)[0]
        if end > size:
            return index, CUT_SHORT
        if value[_VERSION_AT] != RECORD_VERSION or value[_LENGTH_AT:_SUM_END] != seal(
            value[_SUM_END:end]
        ):
            return index, DAMAGED
        expires_at = unpack_expiry(value, _EXPIRES_AT)[0]
        if now >= expires_at:
            return index, MISSING
        if expires_at - now > shortest and not raw_alive(
            value[_LENGTH_AT:end], expires_at, now, lifetimes
        ):
            return index, MISSING  # stored while the clock ran ahead: read as expired
        if not (
            value[_ROOT_AT:_PARENT_END] == root + parent
            and unpack_depth(value, _DEPTH_AT)[0] == depth
            and value[_TOKENS_AT + value[_RETENTION_LEN_AT] : end] == tokens
        ):
            return index, COLLISION
    return len(values), HIT
