"""The `cache-service replay` command line: its flags, and running it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cache_service.client.base import checked_base_url
from cache_service.core.eviction import DEFAULT_POLICY, POLICIES
from cache_service.core.retention import (
    DEFAULT_CLASS,
    RetentionPolicy,
    parse_retention_table,
)
from cache_service.core.units import parse_size
from cache_service.tools.replay.capacity_runs import default_jobs
from cache_service.tools.replay.command import ReplayConfig, run_replay
from cache_service.tools.replay.cost import DEFAULT_STORE_GB_DAY, Prices
from cache_service.tools.replay.engine import ReplayError
from cache_service.tools.replay.fleet import (
    DEFAULT_ENGINE_BLOCK_TOKENS,
    FleetOptions,
    engine_blocks_for_memory,
)
from cache_service.tools.replay.plots import PlotUnavailable, plot_report
from cache_service.tools.replay.routing import ROUTINGS
from cache_service.tools.replay.summary import format_summary
from cache_service.tools.replay.traces import FORMATS, TraceError


def _tokens(text: str) -> int:
    """A token count: 3000000, 3M, 128k."""
    scaled = text.strip().lower()
    for suffix, factor in (("k", 10**3), ("m", 10**6), ("g", 10**9)):
        if scaled.endswith(suffix):
            return int(float(scaled[:-1]) * factor)
    return int(scaled)


def _positive(text: str) -> int:
    """A whole number of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _token_list(text: str) -> list[int]:
    return [_tokens(part) for part in text.split(",") if part.strip()]


def _policy_list(text: str) -> list[str]:
    """Known eviction policy names, comma separated, each once, in the order given."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError("name at least one policy")
    for name in names:
        if name not in POLICIES:
            raise argparse.ArgumentTypeError(
                f"unknown eviction policy {name!r} (known: {', '.join(sorted(POLICIES))})"
            )
    return list(dict.fromkeys(names))


def add_replay_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `replay` and its flags."""
    parser = commands.add_parser(
        "replay",
        help="replay request logs: hit rates, capacity curves, cost, plots",
        description="Replay request traces through an embedded cache (a private LMDB store on "
        "a virtual clock, so days of TTL replay in seconds) or a running service (--url).",
    )
    parser.add_argument("traces", nargs="+", metavar="TRACE", help="trace files (JSONL)")
    parser.add_argument(
        "--format",
        dest="fmt",
        choices=FORMATS,
        default="auto",
        help="trace format (auto: detected from the first line)",
    )
    parser.add_argument("--url", help="replay against this running service instead")
    parser.add_argument("--api-key", help="API key for --url")
    parser.add_argument(
        "--capacity-tokens",
        type=_tokens,
        help="embedded cache capacity in tokens (e.g. 3M); unbounded if omitted",
    )
    parser.add_argument(
        "--policy",
        type=_policy_list,
        default=[DEFAULT_POLICY],
        metavar="NAME[,NAME...]",
        help=f"eviction policy ({', '.join(sorted(POLICIES))}; default {DEFAULT_POLICY}, the "
        "service's); with --mrc, several comma separated are compared against LRU and Belady; "
        "without it, one",
    )
    parser.add_argument(
        "--retention-map",
        default="agent=3d,chat=7d",
        help="retention classes and TTLs that trace lines may name (default agent=3d,chat=7d)",
    )
    parser.add_argument(
        "--default-retention",
        default=DEFAULT_CLASS,
        help="retention class of trace lines that name none",
    )
    parser.add_argument("--speed", type=float, help="with --url: X times real time")
    parser.add_argument(
        "--block-size", type=int, help="cache block size (default: the trace's own, or 64)"
    )
    parser.add_argument(
        "--payload-bytes-per-token",
        type=int,
        default=0,
        help="KV bytes stored per token (default 0: index-only blocks, fast)",
    )
    parser.add_argument("--json", dest="json_path", help="write the full report here")
    parser.add_argument("--plot", dest="plot_path", help="write PNG figures here")
    parser.add_argument(
        "--mrc", action="store_true", help="miss-ratio curve and offline optimum too"
    )
    parser.add_argument(
        "--capacities",
        type=_token_list,
        default=[],
        help="extra capacities (tokens, comma separated) for the curves",
    )
    parser.add_argument(
        "--jobs",
        type=_positive,
        default=default_jobs(),
        help="with --mrc: replays of the capacity curves run side by side in this many "
        "processes (default: one per core)",
    )
    parser.add_argument(
        "--kv-bytes-per-token",
        type=parse_size,
        default=890,
        help="KV bytes per token, to turn the curves' capacities into bytes",
    )
    parser.add_argument("--price-hit", type=float, default=0.003, help="$ per M cache-hit tokens")
    parser.add_argument("--price-miss", type=float, default=0.15, help="$ per M cache-miss tokens")
    parser.add_argument("--price-output", type=float, default=0.60, help="$ per M output tokens")
    parser.add_argument(
        "--active-params",
        type=float,
        default=8e9,
        help="the model's active parameters, for the prefill FLOPs the hits saved",
    )
    parser.add_argument(
        "--window-seconds",
        type=float,
        help="hit-ratio-over-time window (default 60, wider for traces of days)",
    )
    parser.add_argument("--strict", action="store_true", help="a malformed line fails the run")
    parser.add_argument(
        "--store",
        choices=("lmdb", "memory"),
        default="lmdb",
        help="store of the embedded cache (memory: faster, for traces that fit in RAM)",
    )
    parser.add_argument("--workdir", type=Path, help="folder for the temporary LMDB store")
    fleet = parser.add_argument_group(
        "a fleet in front of the store",
        "Engines with their own prefix caches (vLLM's) take the first hits; the store serves "
        "what they miss. Each routing is replayed with the store and without it.",
    )
    fleet.add_argument("--engines", type=_positive, help="simulated engines in front of the store")
    fleet.add_argument(
        "--engine-cache-blocks",
        type=_positive,
        help="each engine's own cache in blocks (vLLM's num_gpu_blocks)",
    )
    fleet.add_argument(
        "--engine-kv-gib",
        type=float,
        help="each engine's own cache as the memory it gives KV: blocks = GiB x 2^30 / "
        "(--kv-bytes-per-token x --engine-block-size)",
    )
    fleet.add_argument(
        "--engine-block-size",
        type=_positive,
        default=DEFAULT_ENGINE_BLOCK_TOKENS,
        help=f"tokens per engine block (default {DEFAULT_ENGINE_BLOCK_TOKENS}, vLLM's)",
    )
    fleet.add_argument(
        "--routing",
        type=_routing_list,
        default=list(ROUTINGS),
        metavar="NAME[,NAME...]",
        help=f"routings to compare ({', '.join(ROUTINGS)}; default all)",
    )
    fleet.add_argument(
        "--price-store-gb-day",
        type=float,
        default=DEFAULT_STORE_GB_DAY,
        help=f"$ per GB held in the store a day (default {DEFAULT_STORE_GB_DAY}: about $0.12 "
        "per GB-month, an SSD volume's list price)",
    )


def _routing_list(text: str) -> list[str]:
    """Known routing names, comma separated, each once, in the order given."""
    names = list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [name for name in names if name not in ROUTINGS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"name routings among {', '.join(ROUTINGS)}"
            + (f" (unknown: {', '.join(unknown)})" if unknown else "")
        )
    return names


def _fleet(args: argparse.Namespace) -> FleetOptions | None:
    """The fleet the flags describe, or None without --engines."""
    sized = [args.engine_cache_blocks is not None, args.engine_kv_gib is not None]
    if args.engines is None:
        if any(sized):
            raise ReplayError("--engine-cache-blocks and --engine-kv-gib need --engines")
        return None
    if sized.count(True) != 1:
        raise ReplayError("with --engines, give one of --engine-cache-blocks or --engine-kv-gib")
    blocks = args.engine_cache_blocks
    if blocks is None:
        blocks = engine_blocks_for_memory(
            args.engine_kv_gib, args.kv_bytes_per_token, args.engine_block_size
        )
    return FleetOptions(
        engines=args.engines, engine_cache_blocks=blocks, engine_block_tokens=args.engine_block_size
    )


def run_replay_command(args: argparse.Namespace) -> int:
    """Run `replay` from parsed flags; the exit status."""
    try:
        if args.url is not None:  # a typo fails now, not after reading the traces
            checked_base_url(args.url)
        retention = RetentionPolicy(
            ttl_seconds=parse_retention_table(args.retention_map),
            default_class=args.default_retention,
        )
        config = ReplayConfig(
            traces=args.traces,
            fmt=args.fmt,
            url=args.url,
            api_key=args.api_key,
            capacity_tokens=args.capacity_tokens,
            policy=args.policy[0],
            compare=args.policy,
            retention=retention,
            speed=args.speed,
            block_size=args.block_size,
            payload_bytes_per_token=args.payload_bytes_per_token,
            mrc=args.mrc,
            capacities=args.capacities,
            kv_bytes_per_token=args.kv_bytes_per_token,
            prices=Prices(
                args.price_hit,
                args.price_miss,
                args.price_output,
                args.active_params,
                args.price_store_gb_day,
            ),
            window_seconds=args.window_seconds,
            strict=args.strict,
            store=args.store,
            workdir=args.workdir,
            jobs=args.jobs,
            fleet=_fleet(args),
            routings=args.routing,
        )
        for path in (args.json_path, args.plot_path):  # made now, not after minutes of replay
            if path:
                Path(path).resolve().parent.mkdir(parents=True, exist_ok=True)
        report = run_replay(config)
        written: list[tuple[str, Path]] = []
        if args.json_path:
            json_path = Path(args.json_path).resolve()
            json_path.write_text(json.dumps(report, indent=2) + "\n")
            written.append(("the report (JSON)", json_path))
        if args.plot_path:
            plot_path = Path(args.plot_path).resolve()
            plot_report(report, plot_path)
            written.append(("the figures (PNG)", plot_path))
    except (ReplayError, TraceError, PlotUnavailable, ValueError, OSError) as exc:
        print(f"cache-service replay: {exc}", file=sys.stderr)
        return 2
    print(format_summary(report, written))
    return 0
