"""What a KV block must match to be loaded, and the header every stored block carries.

A payload is `header | keys and values`:

    offset  size  field
    0       4     magic b"PCKV"
    4       2     format version (1), little-endian
    6       2     header length H, little-endian
    8       H     the layout as compact JSON, keys sorted (model, digest, layers, kv_heads,
                  head_size, dtype, block_size)
    8+H     ...   for each layer in order: its keys, then its values, each
                  [kv_heads, block_size, head_size] elements of dtype, C order, little-endian

The namespace's `kv_layout` string (`KVLayout.namespace_name`) carries every field but the
model's name (the namespace's `model`) and the block size (the namespace's `block_size`), so
blocks of another layout live under other keys and are never even found; the header is the
second line of defence, for a writer that named its namespace wrongly.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

MAGIC = b"PCKV"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sHH")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


class BlockRefused(ValueError):
    """A payload that does not match the running model; `field` names the first difference."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"{field}: {detail}")
        self.field = field


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The model and block shape a KV block was computed for; every field must match."""

    model: str  # the namespace's model name
    digest: str  # of the weights: "sha256:<hex>" of the checkpoint file or of the parameters
    layers: int
    kv_heads: int
    head_size: int
    dtype: str  # torch's name without "torch.", e.g. "float32"
    block_size: int  # tokens per block

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        for name in ("layers", "kv_heads", "head_size", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")

    @property
    def namespace_name(self) -> str:
        """The namespace's kv_layout: every field a block must match but model and block size."""
        return (
            f"hf-kv1;{self.dtype};layers={self.layers};kv_heads={self.kv_heads};"
            f"head_size={self.head_size};{self.digest}"
        )

    @property
    def block_kv_bytes(self) -> int:
        """Bytes of keys and values in one block (without the header)."""
        per_token = 2 * self.layers * self.kv_heads * self.head_size * DTYPE_BYTES[self.dtype]
        return per_token * self.block_size

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one token takes across every layer."""
        return self.block_kv_bytes // self.block_size

    def header(self) -> bytes:
        """The payload's header: magic, version, length and this layout as JSON."""
        return pack_header(asdict(self))

    def check_header(self, payload: bytes | memoryview) -> int:
        """The offset of the payload's keys and values; BlockRefused unless it is this layout's."""
        expected = {field.name: getattr(self, field.name) for field in fields(self)}
        return check_header(payload, expected, kv_bytes=self.block_kv_bytes)


def pack_header(layout: Mapping[str, Any]) -> bytes:
    """A payload header: magic, version, length and the layout's fields as sorted JSON."""
    text = json.dumps(layout, sort_keys=True, separators=(",", ":")).encode()
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(text)) + text


def check_header(payload: bytes | memoryview, expected: Mapping[str, Any], *, kv_bytes: int) -> int:
    """The offset of the payload's keys and values; BlockRefused by the first field of
    `expected` the header differs in, or as `format` (not a header, or not kv_bytes of KV)."""
    view = memoryview(payload)
    if len(view) < _PREFIX.size:
        raise BlockRefused("format", f"{len(view)} bytes is shorter than a header")
    magic, version, length = _PREFIX.unpack_from(view)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise BlockRefused("format", f"magic {magic!r} version {version} is not PCKV 1")
    try:
        stored = json.loads(bytes(view[_PREFIX.size : _PREFIX.size + length]))
    except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep
        raise BlockRefused("format", f"header is not JSON: {exc!r:.200}") from None
    if not isinstance(stored, dict):
        raise BlockRefused("format", "header is not a JSON object")
    for name, want in expected.items():
        got = stored.get(name)
        if got != want:
            raise BlockRefused(name, f"block has {got!r}, the model {want!r}")
    offset = _PREFIX.size + int(length)
    if len(view) - offset != kv_bytes:
        raise BlockRefused(
            "format", f"{len(view) - offset} bytes of KV, the layout needs {kv_bytes}"
        )
    return offset
