"""One vLLM engine in its own process, driven by JSON lines on stdin (tests and the bench).

Run with the vLLM environment's Python (README: "vLLM"): it builds an offline `LLM` (eager,
greedy, the V1 model runner, the engine core in this process so the connector's own counters
can be read) with our connector, vLLM's file-based `ExampleConnector`, or none, then answers
one line per command on stdout, each starting with `@@engine ` (vLLM logs there too):

    {"op": "generate", "prompts": [[ids...], ...], "max_tokens": 8, "cache_salt": "s",
     "kv_transfer_params": {...}, "logprobs": 5, "ignore_eos": false}
        -> {"outputs": [{"tokens": [...], "cached_tokens": n, "seconds": s,
                         "top": [{"id": logprob, ...}, ...]}, ...]}
           (prompts one at a time, each timed from submission to its last token; "top":
           each new token's `logprobs` most likely ids, when asked)
    {"op": "reset_prefix_cache"}   vLLM's own prefix cache emptied -> {"ok": true}
    {"op": "counters"}             our connector's counts since start -> {"counters": {...}}
    {"op": "wait_stores", "seconds": 30}  until queued stores are sent -> {"ok": bool}
    {"op": "quit"}

`--kv-events tcp://*:PORT` (with `--kv-events-replay`, `--kv-events-topic`) makes it publish
vLLM's KV events, as `vllm serve --kv-events-config` would; `--hash-algo` is vLLM's
`--prefix-caching-hash-algo`; `--num-blocks` sizes its KV cache in blocks (vLLM's
`num_gpu_blocks_override`), so a test can make its own prefix cache evict;
`--tensor-parallel-size N` runs N ranks (one core each), `--attention-backend` pins vLLM's
backend (CPU_MLA for MLA models), `--skip-tokenizer-init` takes a model folder without a
tokenizer (the tests' generated models).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MARK = "@@engine "


class EngineProcess:
    """This script in another process (the vLLM environment's Python), from the caller's side:
    `ask` sends a command and returns its answer."""

    def __init__(
        self, python: Path, model: Path, log_path: Path, *args: str, env: dict[str, str]
    ) -> None:
        self.log_path = log_path
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(
            [str(python), str(Path(__file__).resolve()), "--model", str(model), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
            env=env,
        )
        try:
            self._read()  # {"ready": true}
        except BaseException:
            self.close()
            raise

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            if line.startswith(MARK):
                answer: dict[str, Any] = json.loads(line[len(MARK) :])
                return answer
        self.proc.wait(10)
        raise RuntimeError(
            f"engine exited ({self.proc.returncode}):\n{self.log_path.read_text()[-6000:]}"
        )

    def ask(self, op: str, **command: Any) -> dict[str, Any]:
        """Send one command; its answer."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **command}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def generate(self, prompts: list[list[int]], **command: Any) -> list[dict[str, Any]]:
        """Each prompt's greedy tokens, cached tokens and seconds."""
        outputs: list[dict[str, Any]] = self.ask("generate", prompts=prompts, **command)["outputs"]
        return outputs

    def counters(self) -> dict[str, float]:
        """The connector's counts since the engine started."""
        counters: dict[str, float] = self.ask("counters")["counters"]
        return counters

    def close(self) -> None:
        """Quit (or, if it does not, kill) the engine this object started, by its PID."""
        if self.proc.poll() is None:
            try:
                self.ask("quit")
                self.proc.wait(60)
            except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(30)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        self._log.close()


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model folder")
    parser.add_argument(
        "--connector", choices=("prompt-cache", "example", "none"), default="prompt-cache"
    )
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--module-path", default="cache_service.integrations.vllm")
    parser.add_argument("--connector-name", default="PromptCacheConnector")
    parser.add_argument("--extra", default="{}", help="more kv_connector_extra_config, JSON")
    parser.add_argument("--kv-role", default="kv_both")
    parser.add_argument("--failure-policy", default="recompute")
    parser.add_argument("--storage-path", default="", help="ExampleConnector's folder")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=4608)
    parser.add_argument("--max-num-batched-tokens", type=int, default=0)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument(
        "--num-blocks", type=int, default=0, help="the KV cache's blocks (vLLM's override)"
    )
    # On CPU this is the share of the machine's memory vLLM checks is free at start (its KV
    # cache is VLLM_CPU_KVCACHE_SPACE): the default 0.92 fails beside anything else running.
    parser.add_argument("--memory-utilization", type=float, default=0.3)
    parser.add_argument(
        "--kv-events", default="", help="publish KV events on this ZMQ endpoint (tcp://*:PORT)"
    )
    parser.add_argument("--kv-events-replay", default="", help="and answer replay here")
    parser.add_argument("--kv-events-topic", default="")
    parser.add_argument("--hash-algo", default="sha256", help="--prefix-caching-hash-algo")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--attention-backend", default="", help="e.g. CPU_MLA (vLLM's choice)")
    parser.add_argument(
        "--skip-tokenizer-init", action="store_true", help="a model folder without a tokenizer"
    )
    return parser.parse_args()


def _events_config(args: argparse.Namespace) -> Any:
    if not args.kv_events:
        return None
    from vllm.config import KVEventsConfig  # noqa: PLC0415  (the vLLM environment only)

    return KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=args.kv_events,
        replay_endpoint=args.kv_events_replay or None,
        topic=args.kv_events_topic,
    )


def _transfer_config(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.connector == "none":
        return None
    if args.connector == "example":
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": args.storage_path},
        }
    return {
        "kv_connector": args.connector_name,
        "kv_connector_module_path": args.module_path,
        "kv_role": args.kv_role,
        "kv_load_failure_policy": args.failure_policy,
        "kv_connector_extra_config": {"url": args.url, **json.loads(args.extra)},
    }


def _say(answer: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(answer) + "\n")
    sys.stdout.flush()


def _generate(llm: Any, command: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams  # noqa: PLC0415  (the vLLM environment only)

    extra = {}
    if command.get("kv_transfer_params") is not None:
        extra["kv_transfer_params"] = command["kv_transfer_params"]
    top = int(command.get("logprobs", 0))
    params = SamplingParams(
        temperature=0.0,
        max_tokens=int(command.get("max_tokens", 8)),
        ignore_eos=bool(command.get("ignore_eos", False)),
        logprobs=top or None,
        extra_args=extra or None,
    )
    outputs = []
    for ids in command["prompts"]:
        prompt: dict[str, Any] = {"prompt_token_ids": ids}
        if command.get("cache_salt"):
            prompt["cache_salt"] = command["cache_salt"]
        started = time.perf_counter()
        (result,) = llm.generate([prompt], params, use_tqdm=False)
        output: dict[str, Any] = {
            "tokens": list(result.outputs[0].token_ids),
            "cached_tokens": result.num_cached_tokens or 0,
            "seconds": time.perf_counter() - started,
        }
        if top:
            output["top"] = [
                {str(token): entry.logprob for token, entry in position.items()}
                for position in result.outputs[0].logprobs
            ]
        outputs.append(output)
    return {"outputs": outputs}


def _wait_stores(seconds: float) -> bool:
    """Wait for this process's connectors' queued stores."""
    from cache_service.integrations.vllm.connector import PromptCacheConnector  # noqa: PLC0415  (the vLLM environment only)

    deadline = time.monotonic() + seconds
    for connector in list(PromptCacheConnector._live):
        worker = connector._worker
        if worker is not None and not worker.wait_idle(max(0.0, deadline - time.monotonic())):
            return False
    return True


def _on_worker_wait_stores(worker: Any, seconds: float) -> bool:
    """_wait_stores in a tensor-parallel worker's process (vLLM's collective_rpc)."""
    return _wait_stores(seconds)


def _on_worker_counters(worker: Any) -> dict[str, float]:
    """The connector counts of a tensor-parallel worker's process (vLLM's collective_rpc)."""
    from cache_service.integrations.vllm.connector import PromptCacheConnector  # noqa: PLC0415  (the vLLM environment only)

    return PromptCacheConnector.totals()


def _counters(llm: Any, tensor_parallel: bool) -> dict[str, float]:
    """The scheduler's counts and the workers': with tensor parallelism the workers are
    processes of their own, and rank 0's are taken (every rank moves the same blocks)."""
    from cache_service.integrations.vllm.connector import PromptCacheConnector  # noqa: PLC0415  (the vLLM environment only)
    from cache_service.integrations.vllm.counters import merged  # noqa: PLC0415

    totals = PromptCacheConnector.totals()
    if tensor_parallel:
        totals = merged(totals, llm.collective_rpc(_on_worker_counters)[0])
    return totals


def main() -> None:
    """Build the engine, then answer commands until quit or end of input."""
    args = _arguments()
    # The engine core in this process (the connector's counters readable here), and the V1
    # model runner whether or not triton is installed: the compute path stays the same.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    # vLLM-cpu takes most of the machine's memory for its KV cache unless told: 1 GiB holds
    # 40k tokens of SmolLM2 in bf16, plenty for one request at a time.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM  # noqa: PLC0415  (the vLLM environment only)

    options: dict[str, Any] = {}
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.num_blocks:
        options["num_gpu_blocks_override"] = args.num_blocks
    if args.attention_backend:
        options["attention_backend"] = args.attention_backend
    if args.tensor_parallel_size > 1:
        options["tensor_parallel_size"] = args.tensor_parallel_size
        # One core a rank: vLLM-cpu's default binding wants a NUMA node a rank.
        os.environ.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(args.tensor_parallel_size)))
        )
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        enforce_eager=True,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_transfer_config=_transfer_config(args),
        kv_events_config=_events_config(args),
        prefix_caching_hash_algo=args.hash_algo,
        skip_tokenizer_init=args.skip_tokenizer_init,
        seed=0,
        gpu_memory_utilization=args.memory_utilization,
        **options,
    )
    _say({"ready": True})
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "generate":
            _say(_generate(llm, command))
        elif op == "reset_prefix_cache":
            _say({"ok": bool(llm.reset_prefix_cache())})
        elif op == "counters":
            _say({"counters": _counters(llm, args.tensor_parallel_size > 1)})
        elif op == "wait_stores":
            seconds = float(command.get("seconds", 30))
            if args.tensor_parallel_size > 1:  # the stores are the workers', in their processes
                waited = llm.collective_rpc(_on_worker_wait_stores, args=(seconds,))
                _say({"ok": all(waited)})
            else:
                _say({"ok": _wait_stores(seconds)})
        elif op == "quit":
            break
        else:
            _say({"error": f"unknown op {op!r}"})
    _say({"bye": True})


if __name__ == "__main__":
    main()
