"""The Redis store's lookup loop (store/redis/record_walk.py) agrees with the record codec's
`check_record` on every value Redis could return: intact, expired, of another block, and with
any one byte of its length prefix, record or payload flipped. No Redis is needed: the values
are packed as the store writes them and cut as a lookup's GETRANGE reads them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cache_service.core.blocks import BlockMeta, ChainLink, store_key
from cache_service.core.lifetimes import UNBOUNDED
from cache_service.core.store.parts.codec import (
    COLLISION,
    DAMAGED,
    HIT,
    MISSING,
    TOKENS_AT,
    check_record,
    checksum,
)
from cache_service.core.store.redis.record_walk import CUT_SHORT, walk_records
from cache_service.core.store.redis.values import LENGTH, RETENTION_SLACK, pack_value, split_value
from tests.store.chains import NSID, T0, TTL, chain

LINKS = chain([5, 6, 7])
PAYLOAD = bytes(range(200))


def value_of(
    link: ChainLink, *, retention: str = "chat", expires_at: float = T0 + TTL, **changes: object
) -> bytes:
    """A block's whole value, as the store writes it (with `changes` to its record)."""
    meta = BlockMeta(
        key=store_key(b"", link.key),
        namespace_root=NSID.root,
        parent=link.parent,
        depth=link.depth,
        tokens=link.tokens,
        payload_size=len(PAYLOAD),
        checksum=checksum(PAYLOAD),
        created_at=T0,
        last_used_at=T0,
        expires_at=expires_at,
        retention=retention,
        stored_seq=link.depth + 1,
    )
    return pack_value(replace(meta, **changes), PAYLOAD)  # type: ignore[arg-type]


def read(value: bytes, link: ChainLink) -> bytes:
    """What a lookup's GETRANGE returns of the value."""
    return value[: LENGTH.size + TOKENS_AT + RETENTION_SLACK + len(link.tokens)]


def parts_of(links: list[ChainLink]) -> list[tuple[bytes, bytes, bytes, int]]:
    return [(link.key, link.parent, link.tokens, link.depth) for link in links]


def codec_verdict(value: bytes, link: ChainLink, now: float = T0) -> int:
    """check_record on the record of a whole value (b"" for one cut short: damaged)."""
    split = split_value(value)
    record = split[0] if split is not None else b""
    return check_record(
        record, root_and_parent=NSID.root + link.parent, tokens=link.tokens, depth=link.depth,
        now=now,
    )  # fmt: skip


def walk(values: list[bytes | None], now: float = T0) -> tuple[int, int]:
    return walk_records(
        parts_of(LINKS[: len(values)]), values, root=NSID.root, now=now, lifetimes=UNBOUNDED
    )


def test_intact_records_all_verify() -> None:
    values: list[bytes | None] = [read(value_of(link), link) for link in LINKS]
    assert walk(values) == (3, HIT)


def test_the_walk_stops_at_a_missing_expired_or_foreign_block() -> None:
    good = [read(value_of(link), link) for link in LINKS]
    assert walk([good[0], None, good[2]]) == (1, MISSING)
    assert walk([good[0], b"", good[2]]) == (1, MISSING)
    assert walk(good, now=T0 + TTL) == (0, MISSING)  # expired
    swapped: list[bytes | None] = [good[0], good[2], good[1]]  # another block's record
    assert walk(swapped) == (1, COLLISION)


@pytest.mark.parametrize(
    ("field", "wrong"),
    [("depth", 7), ("parent", b"p" * 16), ("tokens", b"t" * 16), ("namespace_root", b"n" * 16)],
)
def test_a_sound_record_that_differs_in_one_field_is_a_collision(field: str, wrong: object) -> None:
    first = read(value_of(LINKS[0]), LINKS[0])
    other = value_of(LINKS[1], **{field: wrong})
    assert codec_verdict(other, LINKS[1]) == COLLISION
    assert walk([first, read(other, LINKS[1])]) == (1, COLLISION)


def test_a_long_retention_name_is_cut_short_for_a_second_read() -> None:
    long_class = "r" * (RETENTION_SLACK + 1)
    values: list[bytes | None] = [
        read(value_of(link, retention=long_class), link) for link in LINKS
    ]
    assert walk(values) == (0, CUT_SHORT)
    whole: list[bytes | None] = [value_of(link, retention=long_class) for link in LINKS]
    assert walk(whole) == (3, HIT)


@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_every_flipped_byte_gets_the_codecs_verdict(mask: int) -> None:
    link = LINKS[1]
    value = value_of(link)
    first = read(value_of(LINKS[0]), LINKS[0])
    for offset in range(len(value)):
        damaged = bytearray(value)
        damaged[offset] ^= mask
        whole = bytes(damaged)
        got = walk([first, read(whole, link)])
        expected = codec_verdict(whole, link)
        if got[1] == CUT_SHORT:
            # Only a length prefix that now runs past the read asks for a second read; the
            # store then reads up to the record's end and judges it with the codec itself.
            assert offset < LENGTH.size, offset
        else:
            assert got == (1 + (expected == HIT), expected if expected != HIT else HIT), offset
        assert expected in {HIT, DAMAGED} or offset < LENGTH.size, (offset, expected)
