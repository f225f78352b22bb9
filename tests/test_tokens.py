"""TokenBytes: the one check of a prompt's tokens, its length in tokens and its blocks."""

from __future__ import annotations

from array import array
from typing import Any

import pytest

from cache_service.core.errors import InvalidField
from cache_service.core.tokens import (
    MAX_TOKEN_ID,
    as_token_bytes,
    block_of,
    bytes_of_tokens,
    bytes_to_tokens,
    tokens_in,
    tokens_to_bytes,
)


def test_ids_and_their_bytes_make_the_same_value() -> None:
    from_ids = as_token_bytes([1, 2, MAX_TOKEN_ID])
    from_bytes = as_token_bytes(b"\x01\0\0\0\x02\0\0\0\xff\xff\xff\xff")
    assert from_ids == from_bytes
    assert as_token_bytes(memoryview(bytes(from_ids))) == from_ids
    assert tokens_in(from_ids) == 3
    assert bytes_to_tokens(from_ids) == [1, 2, MAX_TOKEN_ID]


def test_bytes_pass_through_without_a_copy() -> None:
    checked = tokens_to_bytes(range(8))
    assert as_token_bytes(checked) is checked


def test_blocks_and_strides_are_whole_tokens() -> None:
    prompt = tokens_to_bytes(range(10))
    assert block_of(prompt, 1, 4) == tokens_to_bytes([4, 5, 6, 7])
    assert block_of(prompt, 2, 4) == tokens_to_bytes([8, 9])  # the partial tail
    assert block_of(prompt, 3, 4) == b""
    assert bytes_of_tokens(16) == 64
    assert tokens_in(block_of(prompt, 1, 4)) == 4


@pytest.mark.parametrize("data", [b"abc", b"\0" * 5, memoryview(b"\0" * 7)])
def test_bytes_that_are_not_whole_tokens_are_refused(data: bytes | memoryview) -> None:
    with pytest.raises(InvalidField, match="4 bytes a token") as refused:
        as_token_bytes(data, "frames[0]")
    assert refused.value.field == "frames[0]"


def test_an_absent_frame_is_refused() -> None:
    with pytest.raises(InvalidField) as refused:
        as_token_bytes(None, "frames[1]")
    assert refused.value.field == "frames[1]"


@pytest.mark.parametrize(
    "tokens", [[1, -1], [2**32], [1.5], ["7"]], ids=["negative", "big", "float", "text"]
)
def test_ids_outside_uint32_are_refused_naming_the_field(tokens: list[Any]) -> None:
    with pytest.raises(InvalidField, match=f"integers in 0..{MAX_TOKEN_ID}") as refused:
        as_token_bytes(tokens)
    assert refused.value.field == "tokens"


def test_arrays_of_ids_give_the_bytes_their_list_gives() -> None:
    """What tokenizers and engines hand over is taken whole, not id by id (numpy's scalars
    made a 32k prompt cost milliseconds), and means what the same ids as a list mean."""
    numpy = pytest.importorskip("numpy")
    ids = [0, 1, 49_151, MAX_TOKEN_ID]
    expected = tokens_to_bytes(ids)
    given: list[Any] = [
        array("I", ids),
        array("q", ids),
        numpy.asarray(ids, dtype=numpy.uint32),
        numpy.asarray(ids, dtype=numpy.int64),
        numpy.repeat(numpy.asarray(ids, dtype=numpy.uint32), 2)[::2],  # a strided view: its own ids
    ]
    for tokens in given:
        assert as_token_bytes(tokens) == expected, tokens


def test_a_torch_tensor_of_ids_is_taken_whole() -> None:
    torch = pytest.importorskip("torch")
    ids = [3, 2, 1, 60_000]
    assert as_token_bytes(torch.tensor(ids)) == tokens_to_bytes(ids)


@pytest.mark.parametrize(
    "make",
    [
        lambda np: np.asarray([1, -1], dtype=np.int64),
        lambda np: np.asarray([1, 2**32], dtype=np.int64),
        lambda np: np.asarray([1.0, 2.0]),
        lambda np: np.asarray([[1, 2], [3, 4]], dtype=np.uint32),
        lambda np: np.asarray(7, dtype=np.uint32),
    ],
    ids=["negative", "big", "float", "two-dimensional", "scalar"],
)
def test_arrays_that_are_not_a_row_of_uint32_ids_are_refused(make: Any) -> None:
    numpy = pytest.importorskip("numpy")
    with pytest.raises(InvalidField, match=f"integers in 0..{MAX_TOKEN_ID}") as refused:
        as_token_bytes(make(numpy))
    assert refused.value.field == "tokens"
