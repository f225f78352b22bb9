"""The binary frame format: round trips, and every defect raises MalformedBody."""

from __future__ import annotations

import contextlib
import io
import struct
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cache_service.core.errors import MalformedBody, RequestError
from cache_service.core.framing import (
    ABSENT,
    MAGIC,
    MEDIA_TYPE,
    FrameWriter,
    decode_frames,
    encode_frames,
    join_frames,
    read_frames,
)

MIB = 1 << 20


def encode(header: dict[str, object], payloads: list[bytes | None]) -> bytes:
    return join_frames(encode_frames(header, payloads))


def as_bytes(payloads: list[memoryview | None] | list[bytes | None]) -> list[bytes | None]:
    return [None if p is None else bytes(p) for p in payloads]


def read_stream(body: bytes) -> tuple[dict[str, object], list[bytes | None]]:
    """read_frames over a stream of `body`, as the client reads an answer."""
    return read_frames(io.BytesIO(body).read)


DECODERS = pytest.mark.parametrize("decode", [decode_frames, read_stream], ids=["buffer", "stream"])
Decoder = Callable[[bytes], tuple[dict[str, object], list[memoryview | None] | list[bytes | None]]]


def test_round_trip_with_no_payloads() -> None:
    header, payloads = decode_frames(encode({"model": "m"}, []))
    assert header == {"model": "m"}
    assert payloads == []


def test_round_trip_keeps_empty_and_absent_payloads_apart() -> None:
    header, payloads = decode_frames(encode({"n": 3}, [b"", None, b"x"]))
    assert header == {"n": 3}
    assert as_bytes(payloads) == [b"", None, b"x"]


def test_round_trip_of_multi_mib_payloads() -> None:
    big = bytes(range(256)) * (3 * MIB // 256) + b"tail"
    other = b"\xab" * (2 * MIB)
    header, payloads = decode_frames(encode({"keys": ["a", "b"]}, [big, None, other, b""]))
    assert header == {"keys": ["a", "b"]}
    assert as_bytes(payloads) == [big, None, other, b""]


def test_encode_does_not_copy_payloads() -> None:
    payload = memoryview(b"\x01" * 1000)
    chunks = encode_frames({}, [payload])
    assert any(chunk is payload for chunk in chunks)


def test_decode_accepts_a_memoryview_body() -> None:
    _, payloads = decode_frames(memoryview(encode({}, [b"abc"])))
    assert as_bytes(payloads) == [b"abc"]


def test_layout_is_the_documented_one() -> None:
    body = encode({"a": 1}, [b"xy", None])
    head = b'{"a":1}'
    assert body == (
        MAGIC
        + struct.pack("<I", len(head))
        + head
        + struct.pack("<I", 2)
        + struct.pack("<Q", 2)
        + b"xy"
        + struct.pack("<Q", ABSENT)
    )
    assert MEDIA_TYPE == "application/vnd.prompt-cache.frames"


def test_header_may_hold_unicode() -> None:
    header, _ = decode_frames(encode({"tenant": "équipe-東京"}, []))
    assert header == {"tenant": "équipe-東京"}


@given(
    header=st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=8), max_size=4),
    payloads=st.lists(st.none() | st.binary(max_size=64), max_size=8),
)
def test_round_trip_property(header: dict[str, object], payloads: list[bytes | None]) -> None:
    for decode in (decode_frames, read_stream):
        decoded_header, decoded = decode(encode(header, payloads))
        assert decoded_header == header
        assert as_bytes(decoded) == payloads


def test_stream_reading_gives_each_payload_bytes_of_its_own() -> None:
    _, payloads = read_stream(encode({}, [b"a" * 10, None, b""]))
    assert [type(p) for p in payloads] == [bytes, type(None), bytes]


# -- defects ---------------------------------------------------------------------------------

GOOD = encode({"model": "m"}, [b"payload-one", None, b"", b"payload-two"])


@DECODERS
@pytest.mark.parametrize("length", range(len(GOOD)))
def test_every_truncation_raises_malformed_body(decode: Decoder, length: int) -> None:
    with pytest.raises(MalformedBody):
        decode(GOOD[:length])


@DECODERS
@pytest.mark.parametrize("extra", [b"\0", b"garbage", struct.pack("<Q", 0)])
def test_bytes_after_the_last_frame_raise_malformed_body(decode: Decoder, extra: bytes) -> None:
    with pytest.raises(MalformedBody, match="after the last frame"):
        decode(GOOD + extra)


def _body(head: bytes, tail: bytes = struct.pack("<I", 0)) -> bytes:
    return MAGIC + struct.pack("<I", len(head)) + head + tail


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"PCF", id="short-magic"),
        pytest.param(b"PCF2" + GOOD[4:], id="wrong-magic"),
        pytest.param(b"pcf1" + GOOD[4:], id="lowercase-magic"),
        pytest.param(MAGIC + struct.pack("<I", 2**32 - 1) + b"{}", id="header-length-too-big"),
        pytest.param(_body(b"{not json"), id="header-not-json"),
        pytest.param(_body(b"\xff\xfe\xfd"), id="header-not-utf8"),
        pytest.param(_body(b"[1, 2]"), id="header-array"),
        pytest.param(_body(b'"text"'), id="header-string"),
        pytest.param(_body(b"null"), id="header-null"),
        pytest.param(_body(b""), id="header-empty"),
        pytest.param(_body(b"{}", struct.pack("<I", 1)), id="count-without-frames"),
        pytest.param(_body(b"{}", struct.pack("<I", 2**32 - 1)), id="huge-count"),
        pytest.param(
            _body(b"{}", struct.pack("<I", 1) + struct.pack("<Q", 10) + b"short"),
            id="frame-shorter-than-length",
        ),
        pytest.param(
            _body(b"{}", struct.pack("<I", 1) + struct.pack("<Q", ABSENT - 1)),
            id="frame-length-near-2**64",
        ),
        pytest.param(
            _body(b"{}", struct.pack("<I", 1) + struct.pack("<Q", 0) + struct.pack("<Q", 0)),
            id="more-frames-than-count",
        ),
        pytest.param(_body(b"{}", b"\0\0"), id="count-truncated"),
    ],
)
@DECODERS
def test_garbage_raises_malformed_body(decode: Decoder, body: bytes) -> None:
    with pytest.raises(MalformedBody):
        decode(body)


@DECODERS
def test_deeply_nested_header_raises_malformed_body_not_recursion_error(decode: Decoder) -> None:
    head = b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(MalformedBody):
        decode(_body(head))


@given(garbage=st.binary(max_size=64))
def test_random_bytes_either_decode_or_raise_malformed_body(garbage: bytes) -> None:
    for body in (garbage, MAGIC + garbage):
        for decode in (decode_frames, read_stream):
            with contextlib.suppress(MalformedBody):
                decode(body)


def test_malformed_body_is_a_400_request_error() -> None:
    error = MalformedBody("x")
    assert isinstance(error, RequestError)
    assert error.status == 400


def test_frame_writer_chunks_join_to_the_encoded_body() -> None:
    large = FrameWriter.LARGE_BYTES
    payloads = [b"a" * 100, None, b"", b"b" * large, b"c" * 3_000_000, b"d" * (large - 1)]
    payloads += [bytes([n]) * 70_000 for n in range(80)]  # small frames over several chunks
    writer = FrameWriter()
    for payload in payloads:
        writer.add(None if payload is None else memoryview(payload))
    header: dict[str, object] = {"model": "m"}
    chunks = writer.body_chunks()
    assert writer.head(header) + b"".join(chunks) == encode(header, payloads)
    assert writer.size == sum(len(chunk) for chunk in chunks)
    assert max(len(chunk) for chunk in chunks) < FrameWriter.CHUNK_BYTES + large
    assert b"b" * large in chunks  # a large payload is a chunk of its own


def test_frame_writer_without_frames_has_no_chunks() -> None:
    writer = FrameWriter()
    assert (writer.body_chunks(), writer.size) == ([], 0)
    assert writer.head({}) == encode({}, [])
