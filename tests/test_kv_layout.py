"""The KV block header (plain Python): what a block must match, and which field refuses it."""

from __future__ import annotations

import dataclasses
import struct

import pytest

from cache_service.integrations.kv_layout import BlockRefused, KVLayout

LAYOUT = KVLayout(
    model="m",
    digest="sha256:" + "ab" * 32,
    layers=2,
    kv_heads=3,
    head_size=4,
    dtype="float32",
    block_size=8,
)


def payload(layout: KVLayout) -> bytes:
    """A payload with `layout`'s header and the right number of (zero) KV bytes."""
    return layout.header() + bytes(layout.block_kv_bytes)


def test_a_block_of_the_same_layout_is_accepted_at_its_kv_offset() -> None:
    block = payload(LAYOUT)
    assert LAYOUT.check_header(block) == len(LAYOUT.header())
    assert LAYOUT.check_header(memoryview(block)) == len(LAYOUT.header())


def test_sizes_follow_the_shape() -> None:
    assert LAYOUT.kv_bytes_per_token == 2 * 2 * 3 * 4 * 4
    assert LAYOUT.block_kv_bytes == LAYOUT.kv_bytes_per_token * 8


@pytest.mark.parametrize(
    ("field", "other"),
    [
        ("model", "another-model"),
        ("digest", "sha256:" + "cd" * 32),
        ("layers", 3),
        ("kv_heads", 1),
        ("head_size", 8),
        ("dtype", "bfloat16"),
        ("block_size", 16),
    ],
)
def test_a_block_of_another_layout_is_refused_naming_the_field(field: str, other: object) -> None:
    stored = dataclasses.replace(LAYOUT, **{field: other})
    with pytest.raises(BlockRefused) as refused:
        LAYOUT.check_header(payload(stored))
    assert refused.value.field == field
    assert repr(other) in str(refused.value)


@pytest.mark.parametrize(
    "damage",
    [
        lambda block: block[:5],  # shorter than a header
        lambda block: b"XXXX" + block[4:],  # not our magic
        lambda block: block[:4] + struct.pack("<H", 2) + block[6:],  # a future format
        lambda block: block[:8] + b"{not json" + block[17:],  # header text damaged
        lambda block: block[:-1],  # one byte of KV missing
        lambda block: block + b"\0",  # one byte too many
    ],
)
def test_a_damaged_or_foreign_payload_is_refused_as_format(damage: object) -> None:
    with pytest.raises(BlockRefused) as refused:
        LAYOUT.check_header(damage(payload(LAYOUT)))  # type: ignore[operator]
    assert refused.value.field == "format"


def test_a_header_that_is_json_but_not_an_object_is_refused() -> None:
    text = b"[1]"
    block = struct.pack("<4sHH", b"PCKV", 1, len(text)) + text + bytes(LAYOUT.block_kv_bytes)
    with pytest.raises(BlockRefused, match="not a JSON object"):
        LAYOUT.check_header(block)


def test_the_namespace_name_carries_every_field_a_block_must_match_but_model_and_size() -> None:
    name = LAYOUT.namespace_name
    for part in ("float32", "layers=2", "kv_heads=3", "head_size=4", LAYOUT.digest):
        assert part in name
    assert len(name) <= 256  # the API's limit on kv_layout
    others = {
        dataclasses.replace(LAYOUT, **change).namespace_name
        for change in (
            {"digest": "sha256:00"},
            {"layers": 3},
            {"kv_heads": 1},
            {"head_size": 8},
            {"dtype": "float16"},
        )
    }
    assert name not in others and len(others) == 5


def test_a_layout_refuses_unknown_dtypes_and_empty_shapes() -> None:
    with pytest.raises(ValueError, match="dtype"):
        dataclasses.replace(LAYOUT, dtype="int8")
    with pytest.raises(ValueError, match="kv_heads"):
        dataclasses.replace(LAYOUT, kv_heads=0)


def test_a_header_nested_too_deep_for_json_is_refused_not_raised() -> None:
    text = b"[" * 60000
    block = struct.pack("<4sHH", b"PCKV", 1, len(text)) + text + bytes(LAYOUT.block_kv_bytes)
    with pytest.raises(BlockRefused) as refused:
        LAYOUT.check_header(block)
    assert refused.value.field == "format"
