"""A small engine layout for the vLLM connector's unit tests (no vLLM needed)."""

from __future__ import annotations

from cache_service.integrations.vllm.layout import EngineLayout

# 2 layers of 1 KV head of 4 in bf16, vLLM blocks of 128 tokens: K and V of every layer
TEST_LAYOUT = EngineLayout(
    model="m",
    weights="xxh3:" + "ab" * 16,
    engine_version="0.32.0",
    device="cpu",
    backend="CPU_ATTN",
    kv_cache_layout="LBHNC",
    isa="vec",
    kv_dtype="bfloat16",
    layers=2,
    kv_heads=1,
    head_size=4,
    engine_block_tokens=128,
    block_bytes=2 * 2 * 128 * 1 * 4 * 2,
)
