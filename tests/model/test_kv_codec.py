"""A block of keys and values survives the payload bit for bit, and only in its own layout."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cache_service.integrations.kv_codec import decode_block, encode_block
from cache_service.integrations.kv_layout import BlockRefused
from cache_service.integrations.model import CausalLM, tiny_model


def test_a_block_decodes_to_the_very_tensors_encoded(tiny: CausalLM) -> None:
    layout = tiny.layout(16)
    _, cache = tiny.forward(list(range(1, 40)))
    block = tiny.kv_range(cache, 16, 32)
    payload = encode_block(layout, block)
    assert len(payload) == len(layout.header()) + layout.block_kv_bytes
    decoded = decode_block(layout, memoryview(payload))
    assert len(decoded) == tiny.layers
    for (keys, values), (got_keys, got_values) in zip(block, decoded, strict=True):
        assert torch.equal(keys, got_keys) and torch.equal(values, got_values)
        assert got_keys.dtype == torch.float32 and got_keys.shape == keys.shape


def test_a_cache_rebuilt_from_blocks_equals_the_prefill_that_made_them(tiny: CausalLM) -> None:
    layout = tiny.layout(16)
    _, cache = tiny.forward(list(range(1, 65)))
    blocks = [
        decode_block(layout, encode_block(layout, tiny.kv_range(cache, start, start + 16)))
        for start in range(0, 64, 16)
    ]
    rebuilt = tiny.cache_from_blocks(blocks, tokens=60)
    assert rebuilt.get_seq_length() == 60
    for got, want in zip(tiny.kv_range(rebuilt, 0, 60), tiny.kv_range(cache, 0, 60), strict=True):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_encoding_refuses_tensors_that_do_not_fit_the_layout(tiny: CausalLM) -> None:
    layout = tiny.layout(16)
    _, cache = tiny.forward(list(range(1, 40)))
    with pytest.raises(ValueError, match="not"):
        encode_block(layout, tiny.kv_range(cache, 0, 15))  # a token short
    with pytest.raises(ValueError, match="layers"):
        encode_block(layout, tiny.kv_range(cache, 0, 16)[:1])
    half = [(k.half(), v.half()) for k, v in tiny.kv_range(cache, 0, 16)]
    with pytest.raises(ValueError, match="float32"):
        encode_block(layout, half)


def test_a_block_of_another_model_is_refused_by_digest(tiny: CausalLM) -> None:
    other = tiny_model(seed=1)
    _, cache = other.forward(list(range(1, 20)))
    payload = encode_block(other.layout(16), other.kv_range(cache, 0, 16))
    assert other.digest != tiny.digest
    with pytest.raises(BlockRefused) as refused:
        decode_block(dataclasses.replace(tiny.layout(16), model=other.name), payload)
    assert refused.value.field == "digest"
