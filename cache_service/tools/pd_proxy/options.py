"""The proxy's settings as one value, and the flags of `cache-service pd-proxy` that make it.

Only `command.py` reads flags and the environment; everything below takes a `ProxyOptions`.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from cache_service.core.units import parse_size

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")
CACHE_KEY_ENV = "CACHE_SERVICE_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True, slots=True)
class EngineAddress:
    """One engine: its instance name as the cache service knows it (from its KV events), and
    the base URL of its OpenAI-compatible server (no /v1)."""

    name: str
    url: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxyOptions:
    """Everything the proxy runs with; `check` says what is wrong with a combination."""

    prefill: tuple[EngineAddress, ...]
    decode: tuple[EngineAddress, ...]
    cache_url: str | None = None  # None: choose engines by requests in flight only
    cache_api_key: str | None = None
    host: str = "127.0.0.1"
    port: int = 8200
    prefill_timeout_seconds: float = 60.0  # P's whole answer (one token)
    decode_timeout_seconds: float = 600.0  # the longest wait for D's next bytes
    connect_timeout_seconds: float = 2.0  # every connection, and every health check
    health_interval_seconds: float = 2.0
    route_timeout_seconds: float = 1.0  # each of the /tokenize and /v1/route calls
    # A request's body: refused with 413 past this size, and with 408 when it has not all
    # come within the timeout plus a second per MiB (a client trickling bytes).
    max_body_size: int = 64 * 2**20
    body_timeout_seconds: float = 30.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        problems = self.check()
        if problems:
            raise ValueError("; ".join(problems))

    def check(self) -> list[str]:
        """What is wrong with these options (empty when nothing is)."""
        problems = []
        for role in ROLES:
            engines = self.engines(role)
            if not engines:
                problems.append(f"at least one --{role} NAME=URL is needed")
            names = [engine.name for engine in engines]
            for name in sorted({name for name in names if names.count(name) > 1}):
                problems.append(f"--{role}: the name {name!r} is given twice")
        if self.cache_url is not None and _url_problem(self.cache_url) is not None:
            problems.append(f"--cache: {_url_problem(self.cache_url)}")
        if self.max_body_size < 1:
            problems.append(f"--max-body-size: {self.max_body_size} is not a size above 0")
        if not 0 <= self.port <= 65535:
            problems.append(f"--port: {self.port} is not a TCP port")
        return problems

    def engines(self, role: Role) -> tuple[EngineAddress, ...]:
        """The engines of one role, in the order given."""
        return self.prefill if role == "prefill" else self.decode


def parse_engine(text: str) -> EngineAddress:
    """An EngineAddress from NAME=URL (argparse's type: a readable refusal)."""
    name, sep, url = text.partition("=")
    name, url = name.strip(), url.strip()
    if not sep or not name or not url:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not NAME=URL (e.g. prefill-0=http://127.0.0.1:8100)"
        )
    problem = _url_problem(url)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text!r}: {problem}")
    return EngineAddress(name, url.rstrip("/"))


def positive_seconds(text: str) -> float:
    """A duration in seconds above 0 and finite (argparse's type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r}: need a number of seconds above 0")
    return value


def _url_problem(url: str) -> str | None:
    try:
        parts = urlsplit(url)
        _ = parts.port  # a port that is not a number raises here
    except ValueError as exc:
        return f"{url!r} is not a URL ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{url!r} is not an http:// or https:// URL"
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return f"{url!r}: give the server's base URL, without a path (no /v1)"
    return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `cache-service pd-proxy`."""
    defaults = ProxyOptions.__dataclass_fields__
    engine_help = (
        "an engine as NAME=URL: NAME its instance name in the cache service's KV events "
        "(used for /v1/route), URL its OpenAI server's base (e.g. http://127.0.0.1:8100); "
        "repeat for more"
    )
    parser.add_argument(
        "--prefill", action="append", type=parse_engine, default=[], metavar="NAME=URL",
        help="a prefill engine (kv_role kv_both: it loads what the cache holds and stores "
        f"the rest): {engine_help}",
    )  # fmt: skip
    parser.add_argument(
        "--decode", action="append", type=parse_engine, default=[], metavar="NAME=URL",
        help=f"a decode engine (kv_role kv_consumer, load_mode async): {engine_help}",
    )  # fmt: skip
    parser.add_argument(
        "--cache",
        metavar="URL",
        help="the prompt cache service: choose the engines holding the longest prefix "
        "(POST /v1/route); without it, the engines with fewest requests in flight",
    )
    parser.add_argument(
        "--cache-api-key",
        default=os.environ.get(CACHE_KEY_ENV),
        metavar="KEY",
        help=f"the cache service's API key [env {CACHE_KEY_ENV}]",
    )
    parser.add_argument("--host", default=defaults["host"].default, help="[default 127.0.0.1]")
    parser.add_argument("--port", type=int, default=defaults["port"].default, help="[default 8200]")
    for flag, what in (
        ("prefill_timeout_seconds", "the longest wait for P's answer (then D computes alone)"),
        ("decode_timeout_seconds", "the longest wait for D's next bytes"),
        ("connect_timeout_seconds", "the longest wait for a connection, and a health check"),
        ("health_interval_seconds", "time between two checks of an engine's GET /health"),
        ("route_timeout_seconds", "the longest wait for /tokenize and for /v1/route each"),
        ("body_timeout_seconds", "the longest wait for a request's body, plus 1 s a MiB"),
    ):
        default = defaults[flag].default
        parser.add_argument(
            "--" + flag.replace("_", "-"),
            type=positive_seconds,
            default=default,
            metavar="SECONDS",
            help=f"{what} [default {default:g}]",
        )
    parser.add_argument(
        "--max-body-size",
        type=parse_size,
        default=defaults["max_body_size"].default,
        metavar="SIZE",
        help="the largest request body taken (units: 64MiB, 1GB) [default 64 MiB]",
    )
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="[default info]")


def options_from_args(args: argparse.Namespace) -> ProxyOptions:
    """The ProxyOptions of parsed flags; ValueError naming every problem."""
    return ProxyOptions(
        prefill=tuple(args.prefill),
        decode=tuple(args.decode),
        cache_url=args.cache.rstrip("/") if args.cache else None,
        cache_api_key=args.cache_api_key or None,
        host=args.host,
        port=args.port,
        prefill_timeout_seconds=args.prefill_timeout_seconds,
        decode_timeout_seconds=args.decode_timeout_seconds,
        connect_timeout_seconds=args.connect_timeout_seconds,
        health_interval_seconds=args.health_interval_seconds,
        route_timeout_seconds=args.route_timeout_seconds,
        max_body_size=args.max_body_size,
        body_timeout_seconds=args.body_timeout_seconds,
        log_level=args.log_level,
    )
