"""`cache-service admin explain | pin | unpin | pins | purge`: operator actions sent to a
running service over HTTP, printed as JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8080"


def _connection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        default=os.environ.get("CACHE_SERVICE_URL", DEFAULT_URL),
        help=f"the service [env CACHE_SERVICE_URL; default {DEFAULT_URL}]",
    )
    parser.add_argument(
        "--key",
        default=os.environ.get("CACHE_SERVICE_API_KEY"),
        help="an API key [env CACHE_SERVICE_API_KEY; none with --auth none]",
    )
    parser.add_argument("--tenant", help="act for this tenant (an admin key may name any)")


def _namespace_arguments(parser: argparse.ArgumentParser, *, model_required: bool) -> None:
    parser.add_argument("--model", required=model_required, help="the model of the namespace")
    parser.add_argument("--kv-layout", help="the namespace's KV layout string")
    parser.add_argument("--salt", help="the namespace's cache salt")
    parser.add_argument(
        "--tokens",
        type=Path,
        metavar="FILE",
        help="a JSON array of token ids ('-' for stdin)",
    )


def add_http_actions(actions: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The admin actions that talk to a running service."""
    explain = actions.add_parser("explain", help="why a lookup of these tokens stops where it does")
    pin = actions.add_parser("pin", help="pin every full block of these tokens")
    unpin = actions.add_parser("unpin", help="release the pin of these tokens")
    for parser in (explain, pin, unpin):
        _connection_arguments(parser)
        _namespace_arguments(parser, model_required=True)
    pins = actions.add_parser("pins", help="list a tenant's pins")
    _connection_arguments(pins)
    purge = actions.add_parser(
        "purge",
        help="delete a tenant's blocks; with --model, one namespace's; with --tokens too, "
        "that prompt's last full block and everything under it",
    )
    _connection_arguments(purge)
    _namespace_arguments(purge, model_required=False)


HTTP_ACTIONS = ("explain", "pin", "unpin", "pins", "purge")


def run_http_action(args: argparse.Namespace) -> int:
    """Send one action; print the answer; exit status 0 on success, 1 on a refusal."""
    headers = {"Authorization": f"Bearer {args.key}"} if args.key else {}
    body: dict[str, Any] = {}
    for field in ("tenant", "model", "kv_layout", "salt"):
        value = getattr(args, field, None)
        if value is not None:
            body[field] = value
    tokens_file = getattr(args, "tokens", None)
    if tokens_file is not None:
        text = sys.stdin.read() if str(tokens_file) == "-" else tokens_file.read_text()
        body["tokens"] = json.loads(text)
    elif args.admin_command in ("explain", "pin", "unpin"):
        print("cache-service admin: --tokens FILE is required", file=sys.stderr)
        return 2
    try:
        with httpx.Client(base_url=args.url, headers=headers, timeout=600) as client:
            if args.admin_command == "pins":
                params = {"tenant": args.tenant} if args.tenant else {}
                answer = client.get("/v1/pins", params=params)
            else:
                answer = client.post(f"/v1/{args.admin_command}", json=body)
    except httpx.HTTPError as exc:
        print(f"cache-service admin: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(answer.json(), indent=2))
    return 0 if answer.is_success else 1
