"""An engine's block hash in one 64-bit form: digest bytes and their integer forms agree."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cache_service.core.engines.block_hashes import U64_MASK, normalize_block_hash


def vllm_int_form(digest: bytes) -> int:
    """vLLM's maybe_convert_block_hash (vllm/v1/core/kv_cache_utils.py), re-stated."""
    return int.from_bytes(digest, byteorder="big") & ((1 << 64) - 1)


@given(st.binary(min_size=8, max_size=32))
def test_a_digest_and_vllms_int_form_name_the_same_block(digest: bytes) -> None:
    assert normalize_block_hash(digest) == normalize_block_hash(vllm_int_form(digest))


@given(st.integers(-(1 << 63), (1 << 63) - 1))
def test_a_signed_int64_and_its_unsigned_decoding_name_the_same_block(value: int) -> None:
    """msgpack decodes SGLang's negative hashes as negative ints, others as unsigned."""
    assert normalize_block_hash(value) == normalize_block_hash(value & U64_MASK)
    assert 0 <= normalize_block_hash(value) <= U64_MASK


def test_the_fold_keeps_the_last_eight_bytes_big_endian() -> None:
    digest = bytes(range(32))
    assert normalize_block_hash(digest) == int.from_bytes(bytes(range(24, 32)), "big")
    assert normalize_block_hash(bytearray(digest)) == normalize_block_hash(memoryview(digest))
    assert normalize_block_hash(b"\x01\x02") == 0x0102  # a short digest: all of it


@pytest.mark.parametrize(
    ("value", "error"),
    [(True, TypeError), (b"", ValueError), ("00ff", TypeError), (1.5, TypeError)],
)
def test_anything_else_is_refused(value: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        normalize_block_hash(value)  # type: ignore[arg-type]
