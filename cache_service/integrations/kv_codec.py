"""One block of a model's keys and values as a payload, and back (layout in `kv_layout`).

Tensors here are per layer `[kv_heads, tokens, head_size]` (a batch of one, squeezed), in the
layout's dtype; bytes are copied as they are, so a decoded block equals the encoded one bit
for bit.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from cache_service.integrations.kv_layout import KVLayout

LayerKV = tuple[torch.Tensor, torch.Tensor]  # one layer's (keys, values)

if sys.byteorder != "little":  # the payload format is little-endian, as every host here is
    raise ImportError("kv_codec writes little-endian payloads and runs on little-endian hosts")


def torch_dtype(layout: KVLayout) -> torch.dtype:
    """The torch dtype the layout names."""
    dtype = getattr(torch, layout.dtype)
    assert isinstance(dtype, torch.dtype)
    return dtype


def encode_block(layout: KVLayout, block: Sequence[LayerKV]) -> bytes:
    """The payload of one block: the layout's header, then each layer's keys and values."""
    shape = (layout.kv_heads, layout.block_size, layout.head_size)
    if len(block) != layout.layers:
        raise ValueError(f"{len(block)} layers given, the layout has {layout.layers}")
    for keys, values in block:
        if tuple(keys.shape) != shape or tuple(values.shape) != shape:
            raise ValueError(f"a layer's keys or values are not {shape}")
        if keys.dtype != torch_dtype(layout) or values.dtype != torch_dtype(layout):
            raise ValueError(f"a layer's keys or values are not {layout.dtype}")
    stacked = torch.stack([torch.stack(pair) for pair in block]).contiguous()
    return layout.header() + stacked.view(torch.uint8).numpy().tobytes()


def decode_block(layout: KVLayout, payload: bytes | memoryview) -> list[LayerKV]:
    """Each layer's (keys, values) of one payload; BlockRefused unless it fits the layout."""
    offset = layout.check_header(payload)
    kv = bytearray(memoryview(payload)[offset:])  # writable, so torch can view it directly
    stacked = torch.frombuffer(kv, dtype=torch_dtype(layout)).view(
        layout.layers, 2, layout.kv_heads, layout.block_size, layout.head_size
    )
    return [(stacked[layer, 0], stacked[layer, 1]) for layer in range(layout.layers)]
