"""Every KV cache layout's per-layer views, as vLLM 0.32 itself lays them out, as JSON.

Run with the vLLM environment's Python: `python tests/vllm/kv_views.py > FILE`. For each case
(GQA in bf16 and fp8, MLA, MLA with vLLM blocks of 64 split into kernel blocks of 16) and each
of vLLM's six `KVCacheLayout`s, it places three layers of 8 blocks the way vLLM's
`get_kv_cache_config_from_groups` does (`KVCacheTensor` strides from `compute_layout_strides`)
and builds the views vLLM hands a connector's `register_kv_caches` with vLLM's own
`create_kv_cache_views`; it records their dtype, shape, strides and offsets, or why vLLM
refused the layout. `tests/fixtures/vllm_kv_views.json` is its output, which the tests of the
connector's page seam (and the GPU check in bench/) lay tensors out from without vLLM;
tests/vllm/test_kv_views.py holds that file to this script's output.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from vllm.v1.core.kv_cache_utils import _get_kv_cache_bytes_per_block
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

NUM_BLOCKS = 8
LAYERS = ["model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn"]


def _cases() -> dict[str, tuple[Any, int | None]]:
    """Each case's spec and kernel block size (None: vLLM's block)."""
    gqa = {"block_size": 16, "num_kv_heads": 2, "head_size": 64}
    mla = {"num_kv_heads": 1, "head_size": 576, "dtype": torch.bfloat16}
    return {
        "gqa-bf16": (FullAttentionSpec(**gqa, dtype=torch.bfloat16), None),
        "gqa-fp8": (FullAttentionSpec(**gqa, dtype=torch.uint8), None),
        "mla-bf16": (MLAAttentionSpec(block_size=16, **mla), None),
        "mla-bf16-kernel16": (MLAAttentionSpec(block_size=64, **mla), 16),
    }


def _record(spec: Any, layout: KVCacheLayout, kernel: int | None) -> dict[str, Any]:
    groups = [KVCacheGroupSpec(layer_names=LAYERS, kv_cache_spec=spec)]
    per_block = _get_kv_cache_bytes_per_block(groups, layout)
    size = per_block * NUM_BLOCKS
    fixed = per_block if layout.is_block_outermost else None
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, NUM_BLOCKS, len(LAYERS), layout, fixed_strides=(None, fixed, None, None, None)
    )
    tensor = KVCacheTensor(
        size=size, layers=LAYERS, layer_stride=layer_stride, block_stride=block_stride
    )
    entry: dict[str, Any] = {
        "layout": layout.name,
        "num_blocks": NUM_BLOCKS,
        "page_size_bytes": spec.page_size_bytes,
        "buffer_bytes": size,
        "layer_stride": layer_stride,
        "block_stride": block_stride,
        "block_compact": layout.is_block_compact,
    }
    raw = torch.zeros(size, dtype=torch.int8)
    try:
        views = create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor, kernel)
    except ValueError as exc:
        return {**entry, "refused": str(exc).split(".")[0]}
    entry["views"] = [
        {
            "name": name,
            "dtype": str(view.dtype).removeprefix("torch."),
            "shape": list(view.shape),
            "stride": list(view.stride()),
            "storage_offset": view.storage_offset(),
        }
        for name, view in zip(LAYERS, views, strict=True)
    ]
    return entry


def main() -> None:
    """Print every case's views under every layout."""
    out: dict[str, Any] = {"vllm": __import__("vllm").__version__, "cases": {}}
    for name, (spec, kernel) in _cases().items():
        out["cases"][name] = {
            "kernel_block_size": kernel,
            "block_size": spec.block_size,
            "layouts": [_record(spec, layout, kernel) for layout in KVCacheLayout],
        }
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
