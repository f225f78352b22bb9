"""The binary frame format that carries KV payloads, for store requests and fetch answers.

    body    = magic "PCF1" | u32_le H | H bytes: UTF-8 JSON object (the header)
              | u32_le N | N frames
    frame   = u64_le L | L bytes of payload        (L = 2^64-1: absent, no bytes follow)

All integers are little-endian. A zero-length frame is a real, empty payload (an index-only
block); an absent frame is a block the service does not have. Nothing may follow the last
frame. Media type: application/vnd.prompt-cache.frames.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from cache_service.core.errors import MalformedBody

MAGIC = b"PCF1"
MEDIA_TYPE = "application/vnd.prompt-cache.frames"
ABSENT = 2**64 - 1
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_LARGEST_READ = 2**63 - 1  # a read of more is refused by Python itself; no body is that long


def encode_frames(
    header: dict[str, Any], payloads: Sequence[bytes | memoryview | None]
) -> list[bytes | memoryview]:
    """The body as a list of chunks (payloads are not copied); join or stream them."""
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    chunks: list[bytes | memoryview] = [
        MAGIC + _U32.pack(len(head)) + head + _U32.pack(len(payloads))
    ]
    for payload in payloads:
        if payload is None:
            chunks.append(_U64.pack(ABSENT))
        else:
            chunks.append(_U64.pack(len(payload)))
            chunks.append(payload)
    return chunks


class FrameWriter:
    """Frames appended as they are read, so each payload is copied once (from the store); the
    header, known only at the end, is made separately by `head`.

    The frames go into chunks rather than one buffer: a buffer of tens of MB came from fresh
    mmap'd memory on every answer (glibc maps anything above 32 MiB), and faulting those pages
    in cost three times the copy itself (2.95 MB blocks, 16 to an answer). Small frames share
    chunks of about CHUNK_BYTES; a payload of LARGE_BYTES or more is copied into bytes of its
    own, one allocation of the right size rather than a buffer grown and moved.
    """

    CHUNK_BYTES = 4 << 20
    LARGE_BYTES = 1 << 20

    def __init__(self) -> None:
        self._chunks: list[bytes | bytearray] = []
        self._open = bytearray()  # the chunk small frames are appended to
        self.size = 0
        self.count = 0

    def add(self, payload: bytes | memoryview | None) -> None:
        """Append one frame (None: absent)."""
        length = ABSENT if payload is None else len(payload)
        self._open += _U64.pack(length)
        self.size += 8
        self.count += 1
        if payload is None:
            return
        self.size += length
        if length >= self.LARGE_BYTES:
            self._close()
            self._chunks.append(bytes(payload))
            return
        self._open += payload
        if len(self._open) >= self.CHUNK_BYTES:
            self._close()

    def body_chunks(self) -> list[bytes | bytearray]:
        """Every frame, in chunks to send in order (call once, after the last `add`)."""
        self._close()
        return self._chunks

    def _close(self) -> None:
        if self._open:
            self._chunks.append(self._open)
            self._open = bytearray()

    def head(self, header: dict[str, Any]) -> bytes:
        """The bytes that precede the frames: magic, the JSON header and the frame count."""
        encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
        return MAGIC + _U32.pack(len(encoded)) + encoded + _U32.pack(self.count)


def join_frames(chunks: Iterable[bytes | memoryview]) -> bytes:
    """One bytes object from `encode_frames` chunks."""
    return b"".join(chunks)


def is_frames_type(content_type: str | None) -> bool:
    """Whether a Content-Type header names the frame media type (parameters ignored)."""
    return (content_type or "").split(";", 1)[0].strip().lower() == MEDIA_TYPE


def frame_header_length(body: bytes | bytearray | memoryview) -> int:
    """The length of a frame body's JSON header; 0 when the body cannot hold what it declares
    (`decode_frames` then says what is malformed)."""
    if len(body) < 8:
        return 0
    declared = int(_U32.unpack_from(body, 4)[0])
    return declared if 8 + declared <= len(body) else 0


def decode_frames(
    body: bytes | bytearray | memoryview,
) -> tuple[dict[str, Any], list[memoryview | None]]:
    """Parse a frame body into its header and payload views; MalformedBody on any defect."""
    view = memoryview(body)
    if len(view) < 8 or bytes(view[:4]) != MAGIC:
        raise MalformedBody("the body does not start with the frame magic 'PCF1'")
    (head_len,) = _U32.unpack_from(view, 4)
    offset = 8 + head_len
    if offset + 4 > len(view):
        raise MalformedBody("the body ends inside the frame header")
    header = _header(bytes(view[8:offset]))
    (count,) = _U32.unpack_from(view, offset)
    offset += 4
    payloads: list[memoryview | None] = []
    for index in range(count):
        if offset + 8 > len(view):
            raise MalformedBody(f"the body ends before frame {index} of {count}")
        (length,) = _U64.unpack_from(view, offset)
        offset += 8
        if length == ABSENT:
            payloads.append(None)
            continue
        if offset + length > len(view):
            raise MalformedBody(f"frame {index} says {length} bytes but the body ends first")
        payloads.append(view[offset : offset + length])
        offset += length
    if offset != len(view):
        raise MalformedBody(f"{len(view) - offset} unexpected bytes after the last frame")
    return header, payloads


def read_frames(read: Callable[[int], bytes]) -> tuple[dict[str, Any], list[bytes | None]]:
    """Parse a frame body from a stream, each payload read into bytes of its own (one copy, no
    buffer the size of the whole body); `read(n)` returns at most n bytes, fewer only at the
    end. MalformedBody on any defect, bytes after the last frame included."""
    start = read(8)
    if len(start) < 8 or start[:4] != MAGIC:
        raise MalformedBody("the body does not start with the frame magic 'PCF1'")
    (head_len,) = _U32.unpack_from(start, 4)
    head = read(head_len + 4)
    if len(head) < head_len + 4:
        raise MalformedBody("the body ends inside the frame header")
    header = _header(head[:head_len])
    (count,) = _U32.unpack_from(head, head_len)
    payloads: list[bytes | None] = []
    for index in range(count):
        prefix = read(8)
        if len(prefix) < 8:
            raise MalformedBody(f"the body ends before frame {index} of {count}")
        (length,) = _U64.unpack_from(prefix)
        if length == ABSENT:
            payloads.append(None)
            continue
        payload = read(length) if length <= _LARGEST_READ else b""
        if len(payload) < length:
            raise MalformedBody(f"frame {index} says {length} bytes but the body ends first")
        payloads.append(payload)
    if read(1):
        raise MalformedBody("unexpected bytes after the last frame")
    return header, payloads


def _header(raw: bytes) -> dict[str, Any]:
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # also integers of more than 4,300 digits
        raise MalformedBody(f"the frame header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise MalformedBody("the frame header must be a JSON object")
    return header
