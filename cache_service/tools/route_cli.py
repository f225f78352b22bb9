"""`cache-service route`: ask a running service which instance holds the longest prefix of the
prompt in a file, and print the answer as a table, best first (or as JSON)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from cache_service.client import CacheClient, InstanceHold, RouteAnswer
from cache_service.core.errors import PromptCacheError

DEFAULT_URL = "http://127.0.0.1:8080"
DEFAULT_KEY_ENV = "CACHE_SERVICE_API_KEY"


def add_route_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The `route` subcommand."""
    route = commands.add_parser(
        "route",
        help="which instance holds the longest prefix of a prompt (POST /v1/route)",
        description="Score a prompt against the engines whose KV events the service follows, "
        "and against the cache itself; print the rows best first.",
    )
    route.add_argument(
        "--url",
        default=os.environ.get("CACHE_SERVICE_URL", DEFAULT_URL),
        help=f"the service [env CACHE_SERVICE_URL; default {DEFAULT_URL}]",
    )
    route.add_argument("--model", required=True, help="the prompt's model")
    route.add_argument(
        "--prompt-file",
        required=True,
        type=Path,
        metavar="FILE",
        help="the prompt's token ids: a JSON array, or integers separated by white space "
        "('-' for stdin)",
    )
    route.add_argument(
        "--api-key-env",
        default=DEFAULT_KEY_ENV,
        metavar="VAR",
        help=f"the environment variable holding the API key [default {DEFAULT_KEY_ENV}]",
    )
    route.add_argument("--instances", help="only these instances, comma separated")
    route.add_argument("--lora-name", help="the LoRA adapter the engines run the prompt with")
    route.add_argument("--cache-salt", help="vLLM's cache_salt of the request")
    route.add_argument("--kv-layout", default="", help="the cache namespace's KV layout")
    route.add_argument("--salt", help="the cache namespace's salt")
    route.add_argument("--json", action="store_true", help="print the answer as JSON")


def read_tokens(path: Path) -> list[int]:
    """Token ids from a file: a JSON array, or integers separated by white space."""
    text = sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8")
    stripped = text.strip()
    if stripped.startswith("["):
        values = json.loads(stripped)
        if not isinstance(values, list) or not all(
            isinstance(value, int) and not isinstance(value, bool) for value in values
        ):
            raise ValueError("the JSON array must hold integers only")
        return values
    return [int(word) for word in stripped.split()]


def run_route_command(args: argparse.Namespace) -> int:
    """Ask, print; 0 on an answer, 1 on a refusal or an unreachable service, 2 on a bad
    prompt file or URL."""
    try:
        tokens = read_tokens(args.prompt_file)
    except (OSError, ValueError) as exc:
        print(f"cache-service route: {args.prompt_file}: {exc}", file=sys.stderr)
        return 2
    instances = None
    if args.instances is not None:
        instances = [name.strip() for name in args.instances.split(",") if name.strip()]
    try:
        with CacheClient(
            args.url, api_key=os.environ.get(args.api_key_env), timeout=60.0
        ) as client:
            answer = client.route(
                args.model,
                tokens,
                instances=instances,
                lora_name=args.lora_name,
                cache_salt=args.cache_salt,
                kv_layout=args.kv_layout,
                salt=args.salt,
            )
    except PromptCacheError as exc:  # a refusal (its status and detail), or unreachable
        print(f"cache-service route: {exc.status}: {exc.detail}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a URL that is not one
        print(f"cache-service route: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(dataclasses.asdict(answer), indent=2) if args.json else format_answer(answer))
    return 0


def format_answer(answer: RouteAnswer) -> str:
    """The answer as a plain text table: the instances best first, then the cache."""
    header = (
        f"{'instance':24} {'medium':6} {'blocks':>7} {'cached':>8} {'prefill':>8} "
        f"{'block':>5} {'rank':>4}  stale"
    )
    lines = [f"model {answer.model}, {answer.prompt_tokens} prompt tokens", header]
    lines += [_line(row) for row in answer.instances]
    store = answer.store
    lines.append(
        f"{'(cache)':24} {'store':6} {store.matched_blocks:>7} {store.cached_tokens:>8} "
        f"{store.tokens_to_prefill:>8} {store.block_size:>5} {'-':>4}  -"
    )
    if not answer.instances:
        lines.append("no instance scored: the service follows no engine's KV events for it")
    for name, reason in answer.unscored.items():
        lines.append(f"not scored: {name}: {reason}")
    best = answer.best
    if best is None:
        lines.append("best: none (nothing holds a block of this prompt)")
    else:
        where = best.instance if best.instance is not None else "any instance, from the cache"
        lines.append(
            f"best: {where} ({best.medium}): {best.cached_tokens} tokens cached, "
            f"{best.tokens_to_prefill} to prefill"
        )
    return "\n".join(lines)


def _line(row: InstanceHold) -> str:
    rank = "-" if row.data_parallel_rank is None else str(row.data_parallel_rank)
    return (
        f"{(row.instance or '')[:24]:24} {row.medium[:6]:6} {row.matched_blocks:>7} "
        f"{row.cached_tokens:>8} {row.tokens_to_prefill:>8} {row.block_size:>5} {rank:>4}  "
        f"{'STALE' if row.stale else 'no'}{'' if row.live else '  DOWN'}"
    )
