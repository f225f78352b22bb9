"""Decoding KV-event batches in every encoding vLLM and SGLang released (see
tests/kv_events/publisher.py for the field lists, restated from their sources)."""

from __future__ import annotations

import contextlib
import hashlib

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cache_service.core.engines.block_hashes import normalize_block_hash
from cache_service.core.engines.decoding import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    MalformedEvent,
    decode_batch,
    decode_event,
)
from tests.kv_events.publisher import WIRES, cleared, encode_batch, removed, stored

DIGEST = hashlib.sha256(b"block").digest()
FULL_STORED = stored(
    [DIGEST, 7],
    parent_block_hash=3,
    token_ids=[1, 2, 3, 4],
    block_size=2,
    lora_id=5,
    medium="CPU",
    lora_name="adapter",
    extra_keys=[["adapter", "salt"], None],
    group_idx=1,
    kv_cache_spec_kind="full_attention",
    kv_cache_spec_sliding_window=None,
)


@pytest.mark.parametrize("wire", WIRES.values(), ids=WIRES.keys())
def test_every_wire_decodes_a_store_a_removal_and_a_clear(wire: object) -> None:
    payload = encode_batch(
        wire,  # type: ignore[arg-type]
        [FULL_STORED, removed([7], medium="CPU", group_idx=1), cleared()],
        ts=12.5,
        rank=1,
    )
    batch = decode_batch(payload)
    assert batch.ts == 12.5
    assert batch.data_parallel_rank == (1 if wire.rank or wire.batch == "map" else None)  # type: ignore[attr-defined]
    store, removal, clear = batch.events
    assert isinstance(store, BlockStored)
    assert store.block_hashes == (normalize_block_hash(DIGEST), 7)
    assert store.parent_block_hash == 3
    assert store.token_ids == (1, 2, 3, 4)
    assert store.block_size == 2
    assert store.lora_id == 5
    assert isinstance(removal, BlockRemoved)
    assert removal.block_hashes == (7,)
    assert isinstance(clear, AllBlocksCleared)
    assert batch.unknown == 0
    assert batch.malformed == ()


def test_short_positional_forms_leave_later_fields_none() -> None:
    batch = decode_batch(encode_batch(WIRES["vllm-0.9.0"], [FULL_STORED, removed([7])]))
    store, removal = batch.events
    assert isinstance(store, BlockStored) and isinstance(removal, BlockRemoved)
    assert store.medium is None and store.lora_name is None and store.extra_keys is None
    assert store.group_idx is None and store.kv_cache_spec_kind is None
    assert removal.medium is None and removal.group_idx is None
    assert batch.data_parallel_rank is None


def test_each_appended_field_is_read_from_its_release_on() -> None:
    def first(wire: str) -> BlockStored:
        event = decode_batch(encode_batch(WIRES[wire], [FULL_STORED])).events[0]
        assert isinstance(event, BlockStored)
        return event

    assert first("vllm-medium").medium == "CPU" and first("vllm-medium").lora_name is None
    assert first("vllm-lora-name").lora_name == "adapter"
    assert first("vllm-lora-name").extra_keys is None
    assert first("vllm-extra-keys").extra_keys == (("adapter", "salt"), None)
    assert first("vllm-extra-keys").group_idx is None
    assert first("vllm-group-idx").group_idx == 1
    assert first("vllm-spec-kind").kv_cache_spec_kind == "full_attention"
    assert first("vllm-map-batch").kv_cache_spec_kind == "full_attention"


def test_sglang_metadata_in_lora_name_position_is_the_cache_salt() -> None:
    event = stored([1], medium="GPU", cache_salt="tenant-a")
    for wire in ("sglang-medium", "sglang-map-events"):
        store = decode_batch(encode_batch(WIRES[wire], [event])).events[0]
        assert isinstance(store, BlockStored)
        assert store.cache_salt == "tenant-a"
        assert store.lora_name is None
        assert store.medium == "GPU"


def test_map_events_omit_defaulted_fields_and_ignore_unknown_ones() -> None:
    event = stored([1, 2], extra_map_fields={"session_id": "s1", "future": [1, 2]})
    raw = msgpack.unpackb(encode_batch(WIRES["vllm-map-events"], [event]))
    assert "group_idx" not in raw[1][0] and raw[1][0]["session_id"] == "s1"
    store = decode_batch(encode_batch(WIRES["vllm-map-events"], [event])).events[0]
    assert isinstance(store, BlockStored) and store.block_hashes == (1, 2)


def test_positional_fields_past_the_known_ones_are_ignored() -> None:
    event = stored([1], extra_positional=["a future field", {"x": 1}])
    batch = decode_batch(encode_batch(WIRES["vllm-spec-kind"], [event]))
    assert isinstance(batch.events[0], BlockStored)
    assert batch.malformed == ()


def test_unknown_tags_are_counted_and_skipped() -> None:
    unknown = {"type": "BlockInactive", "fields": [[1, 2]]}
    for wire in ("vllm-group-idx", "vllm-map-batch"):
        batch = decode_batch(encode_batch(WIRES[wire], [unknown, removed([1])]))
        assert batch.unknown == 1
        assert batch.events == (BlockRemoved((1,)),)


def test_hashes_as_bytes_or_integers_reach_one_normal_form() -> None:
    as_int = int.from_bytes(DIGEST[-8:], "big")
    as_signed = as_int - (1 << 64) if as_int >= 1 << 63 else as_int
    batch = decode_batch(encode_batch(WIRES["vllm-map-batch"], [removed([DIGEST, as_int])]))
    assert batch.events[0] == BlockRemoved((as_int, as_int))  # type: ignore[arg-type]
    signed = decode_event(["BlockRemoved", [as_signed]])
    assert signed == BlockRemoved((as_int,))  # type: ignore[arg-type]


def test_stored_keeps_the_published_hashes_for_verification() -> None:
    store = decode_event(encode_positional(stored([DIGEST], parent_block_hash=DIGEST)))
    assert isinstance(store, BlockStored)
    assert store.raw_block_hashes == (DIGEST,)
    assert store.raw_parent_block_hash == DIGEST


def encode_positional(event: dict[str, object]) -> list[object]:
    """A full-length positional event, msgpack round-tripped."""
    wire = WIRES["vllm-spec-kind"]
    return msgpack.unpackb(encode_batch(wire, [event]))[1][0]  # type: ignore[no-any-return]


def test_sglang_bigram_tokens_keep_each_first_token() -> None:
    store = decode_event(["BlockStored", [1], None, [[5, 6], [6, 7], [7, 8]], 3, None])
    assert isinstance(store, BlockStored)
    assert store.token_ids == (5, 6, 7) and store.bigram_tokens


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # a msgpack code that is never used
        b"\x92\x01",  # an array announcing two items, holding one
        msgpack.packb(1.0) + b"trailing",
        msgpack.packb("a string"),
        msgpack.packb([1.0]),
        msgpack.packb(["ts", []]),
        msgpack.packb([True, []]),
        msgpack.packb([1.0, {"not": "a list"}]),
        msgpack.packb([1.0, [], "rank"]),
        msgpack.packb({"ts": 1.0}),
        msgpack.packb(msgpack.ExtType(5, b"x")),
    ],
)
def test_a_malformed_batch_raises_malformed_event_with_a_reason(payload: bytes) -> None:
    with pytest.raises(MalformedEvent) as raised:
        decode_batch(payload)
    assert raised.value.reason


@pytest.mark.parametrize(
    "event",
    [
        [],
        [7, [1]],
        "BlockStored",
        {"block_hashes": [1]},
        ["BlockStored"],
        ["BlockStored", "not a list"],
        ["BlockStored", [1.5]],
        ["BlockStored", [True]],
        ["BlockStored", [b""]],
        ["BlockStored", ["hex string"]],
        ["BlockStored", [1], None, [1, -2], 2],
        ["BlockStored", [1], None, [1, [2, 3]], 2],
        ["BlockStored", [1], None, [1], "16"],
        ["BlockStored", [1], None, [1], 1, None, 5],
        ["BlockStored", [1], None, [1], 1, None, "GPU", None, "not a list"],
        ["BlockRemoved", [1], "GPU", "zero"],
        {"type": "BlockStored", "block_hashes": [1], "metadata": "salt"},
    ],
)
def test_a_malformed_event_is_skipped_and_its_neighbours_kept(event: object) -> None:
    with pytest.raises(MalformedEvent):
        decode_event(event)
    payload = msgpack.packb([1.0, [event, ["AllBlocksCleared"]]])
    batch = decode_batch(payload)
    assert batch.events == (AllBlocksCleared(),)
    assert len(batch.malformed) == 1


def test_an_integer_wider_than_64_bits_is_not_a_hash() -> None:
    # msgpack cannot carry one, but an already unpacked object could hold it.
    with pytest.raises(MalformedEvent):
        decode_event(["BlockRemoved", [1 << 64]])


@given(st.binary(max_size=64))
def test_any_bytes_decode_or_raise_malformed_event_only(payload: bytes) -> None:
    with contextlib.suppress(MalformedEvent):
        decode_batch(payload)


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.text() | st.binary(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4)
    ),
    max_leaves=20,
)


@given(st.lists(st.sampled_from(["BlockStored", "BlockRemoved", "X"]) | json_like, max_size=12))
def test_any_msgpack_shaped_batch_decodes_or_raises_malformed_event_only(
    event: list[object],
) -> None:
    for obj in ([1.0, [event]], [1.0, [{"type": "BlockStored", "block_hashes": event}]]):
        with contextlib.suppress(MalformedEvent):
            decode_batch(msgpack.packb(obj))
