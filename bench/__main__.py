"""`python -m bench [--quick] [--json OUT] [--only a,b] [--install]`: run, print, save."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

from bench import redis_scaling, route_scores
from bench.report import Row, format_table, skipped, write_json
from bench.scenarios import (
    churn,
    eviction_cost,
    hashing,
    lookup,
    payload,
    replay,
    rounds,
    store_size,
)
from bench.scenarios.context import Context

SCENARIOS = {
    "hashing": hashing.run,
    "lookup": lookup.run,
    "payload": payload.run,
    "rounds": rounds.run,
    "store-size": store_size.run,
    "replay": replay.run,
    "churn": churn.run,
    "eviction": eviction_cost.run,
    "route": route_scores.run,
    "redis": redis_scaling.run,
}
DEFAULT_JSON = Path(__file__).parent / "results" / "latest.json"


def machine() -> dict[str, object]:
    """What the figures were measured on."""
    model = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")), platform.processor())  # fmt: skip
    memory = next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                  if line.startswith("MemTotal"))  # fmt: skip
    return {
        "cores": os.cpu_count(),
        "cpu": model,
        "memory_gib": round(int(memory) / 2**20, 1),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def main() -> int:
    """Run the chosen scenarios; exit 1 if one failed outright."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="about a minute: a smoke check")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--only", help=f"comma separated: {','.join(SCENARIOS)}")
    parser.add_argument("--install", action="store_true", help="apt/pip-install missing peers")
    args = parser.parse_args()
    chosen = args.only.split(",") if args.only else list(SCENARIOS)
    ctx = Context(quick=args.quick, allow_install=args.install)
    rows: list[Row] = []
    failed = False
    meta = {"machine": machine(), "mode": "quick" if args.quick else "full", "scenarios": {}}
    for name in chosen:
        started = time.perf_counter()
        print(f"bench: {name} ...", file=sys.stderr, flush=True)
        try:
            rows += SCENARIOS[name](ctx)
        except Exception as exc:  # a broken scenario is reported, the others still run
            failed = True
            rows.append(skipped(name, "-", "-", f"failed: {type(exc).__name__}: {exc}"))
        meta["scenarios"][name] = round(time.perf_counter() - started, 1)  # type: ignore[index]
    rows += ctx.memory
    print(f"machine: {meta['machine']}")
    print(format_table(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_json(rows, args.json, meta)
    print(f"written: {args.json}; seconds per scenario: {meta['scenarios']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
