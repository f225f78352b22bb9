"""Request traces with structure unlike the two Mooncake ones, to test eviction against LRU.

Usage: python -m bench.eviction_traces OUTDIR [--seed N] [--scale F]

Writes OUTDIR/{tenants,agents,docs,scan}_trace.jsonl in the Mooncake format that
`cache-service replay` reads (bench/traces/README.md): one JSON object per line with
`timestamp` (ms, non-decreasing), `input_length` and `output_length` (tokens) and `hash_ids`
(one id per 512-token block; the last block is partial; equal ids after equal prefixes mean
equal content). Every id is fresh unless the structure below shares it, so the prefix
sharing in a trace is exactly what its description says. Ids count from 0 in each file.

Issue 15 asks that an eviction policy beat LRU on traces it was not tuned on. Each trace
stresses one thing a policy can get wrong:

- tenants: many tenants, each with its own system prompt. 60 tenants, system prompts of
  4-40 blocks (log-uniform), popularity Zipf(1.0); a request is its tenant's system prompt +
  1-12 private blocks, or (20%) a follow-up that extends one of the tenant's last 5 prompts
  whole by 1-4 blocks. Poisson arrivals at 5 req/s; 6,000 requests. Stresses keeping many
  mid-popular system prompts while the private tails churn through the cache.
- agents: agent loops that extend one prompt turn after turn. An agent starts from one of 5
  shared tool prompts (6 blocks) and each turn appends 1-3 blocks to its own previous prompt;
  4-60 turns with gaps exponential of mean 8 s (tool calls); agents start at 0.3/s. Agents
  stop starting once 6,000 turns are planned; the trace is the first 6,000 turns in time, so
  its last part only finishes agents already running. Stresses keeping a long prompt whose
  tail is new at every turn and reused once, a few seconds later.
- docs: one-off long documents. 70% of requests are a document of 30-200 blocks never seen
  again; 30% are one of 40 hot short prompts (2-8 blocks, Zipf(1.2)) + 1 private block.
  Poisson at 3 req/s; 5,000 requests. Stresses not letting a flood of blocks used once evict
  small hot prefixes.
- scan: a cyclic scan larger than the cache. 400 documents of 40 blocks (16,000 blocks,
  2.7x the 3M-token cache of 5,859 blocks) read in order, again and again, interleaved 1:1
  with 100 hot prompts of 10 blocks (Zipf(0.9)) + 1 private block. Poisson at 2 req/s;
  8,000 requests (10 passes). Under LRU a loop larger than the cache never hits; a policy
  that keeps part of it does.

The defaults (seed 15, scale 1) are the traces measured in docs/content/eviction-research.md.
`--scale F` multiplies every trace's request count (and the scan's loop length, so it still
makes 10 passes) for quick runs; scale a cache capacity by the same factor to compare. Each
trace draws from its own `random.Random(f"{seed}:{kind}")`, so a trace depends only on the
seed and the scale.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

from cache_service.tools.replay.traces import MOONCAKE_BLOCK_TOKENS

KINDS = ("tenants", "agents", "docs", "scan")
DEFAULT_SEED = 15


class TraceLine(TypedDict):
    """One request, as a line of a Mooncake trace."""

    timestamp: int  # ms from the trace's start
    input_length: int
    output_length: int
    hash_ids: list[int]


class _Ids:
    """Fresh block ids: a new id is new content."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, count: int) -> list[int]:
        out = list(range(self.next, self.next + count))
        self.next += count
        return out


def _zipf(n: int, s: float) -> list[float]:
    return [1.0 / (rank + 1) ** s for rank in range(n)]


def _line(seconds: float, ids: list[int], rng: random.Random) -> TraceLine:
    # The last block is partial, as in Mooncake: the prompt ends somewhere inside it.
    return {
        "timestamp": int(seconds * 1000),
        "input_length": (len(ids) - 1) * MOONCAKE_BLOCK_TOKENS
        + rng.randint(1, MOONCAKE_BLOCK_TOKENS),
        "output_length": rng.randint(10, 600),
        "hash_ids": ids,
    }


def _tenants(rng: random.Random, requests: int) -> list[TraceLine]:
    ids, tenants = _Ids(), 60
    systems = [ids.take(round(4 * 10 ** rng.uniform(0, 1))) for _ in range(tenants)]
    weights = _zipf(tenants, 1.0)
    recent: list[list[list[int]]] = [[] for _ in range(tenants)]
    out, t = [], 0.0
    for _ in range(requests):
        t += rng.expovariate(5.0)
        k = rng.choices(range(tenants), weights)[0]
        if recent[k] and rng.random() < 0.2:
            prompt = rng.choice(recent[k][-5:]) + ids.take(rng.randint(1, 4))
        else:
            prompt = systems[k] + ids.take(rng.randint(1, 12))
        recent[k].append(prompt)
        out.append(_line(t, prompt, rng))
    return out


def _agents(rng: random.Random, requests: int) -> list[TraceLine]:
    ids = _Ids()
    tools = [ids.take(6) for _ in range(5)]
    turns: list[tuple[float, int, int]] = []  # (time, agent, turn)
    prompts: list[list[int]] = []  # each agent's prompt so far
    start = 0.0
    # Plan whole agents until there are enough turns, then keep the earliest in time. (Keep
    # the order of the draws: seed 15's measured trace came from it.)
    while len(turns) < requests:
        start += rng.expovariate(0.3)
        count = rng.randint(4, 60)
        agent = len(prompts)
        prompts.append(list(rng.choice(tools)))
        t = start
        for turn in range(count):
            turns.append((t, agent, turn))
            t += rng.expovariate(1 / 8.0)
    turns.sort()
    out = []
    for t, agent, _ in turns[:requests]:
        prompts[agent] = prompts[agent] + ids.take(rng.randint(1, 3))
        out.append(_line(t, list(prompts[agent]), rng))
    return out


def _docs(rng: random.Random, requests: int) -> list[TraceLine]:
    ids = _Ids()
    hot = [ids.take(rng.randint(2, 8)) for _ in range(40)]
    weights = _zipf(len(hot), 1.2)
    out, t = [], 0.0
    for _ in range(requests):
        t += rng.expovariate(3.0)
        if rng.random() < 0.7:
            prompt = ids.take(rng.randint(30, 200))
        else:
            prompt = rng.choices(hot, weights)[0] + ids.take(1)
        out.append(_line(t, prompt, rng))
    return out


def _scan(rng: random.Random, requests: int, loop_documents: int) -> list[TraceLine]:
    ids = _Ids()
    loop = [ids.take(40) for _ in range(loop_documents)]
    hot = [ids.take(10) for _ in range(100)]
    weights = _zipf(len(hot), 0.9)
    out, t, position = [], 0.0, 0
    for request in range(requests):
        t += rng.expovariate(2.0)
        if request % 2 == 0:
            prompt = list(loop[position % len(loop)])
            position += 1
        else:
            prompt = rng.choices(hot, weights)[0] + ids.take(1)
        out.append(_line(t, prompt, rng))
    return out


def _scaled(count: int, scale: float, minimum: int) -> int:
    return max(minimum, round(count * scale))


_GENERATORS: dict[str, Callable[[random.Random, float], list[TraceLine]]] = {
    "tenants": lambda rng, scale: _tenants(rng, _scaled(6000, scale, 1)),
    "agents": lambda rng, scale: _agents(rng, _scaled(6000, scale, 1)),
    "docs": lambda rng, scale: _docs(rng, _scaled(5000, scale, 1)),
    "scan": lambda rng, scale: _scan(rng, _scaled(8000, scale, 4), _scaled(400, scale, 2)),
}


def generate(kind: str, *, seed: int, scale: float = 1.0) -> list[TraceLine]:
    """The requests of one trace kind (see the module docstring), in time order."""
    if kind not in _GENERATORS:
        raise ValueError(f"unknown trace kind {kind!r} (known: {', '.join(KINDS)})")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale!r}")
    return _GENERATORS[kind](random.Random(f"{seed}:{kind}"), scale)


def write_traces(outdir: str | Path, *, seed: int, scale: float = 1.0) -> dict[str, Path]:
    """Write every kind's trace to OUTDIR/<kind>_trace.jsonl; the paths by kind."""
    folder = Path(outdir)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for kind in KINDS:
        lines = generate(kind, seed=seed, scale=scale)
        path = folder / f"{kind}_trace.jsonl"
        with open(path, "w", encoding="utf-8") as out:
            for line in lines:
                out.write(json.dumps(line) + "\n")
        blocks = len({block for line in lines for block in line["hash_ids"]})
        # A line per trace on stderr: progress for large --scale, and the sizes at a glance.
        print(f"{path}: {len(lines):,} requests, {blocks:,} blocks", file=sys.stderr)
        paths[kind] = path
    return paths


def main(argv: list[str] | None = None) -> None:
    """Command line: python -m bench.eviction_traces OUTDIR [--seed N] [--scale F]."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.eviction_traces", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply request counts (default 1)"
    )
    args = parser.parse_args(argv)
    if not args.scale > 0:
        parser.error(f"--scale must be > 0, got {args.scale}")
    write_traces(args.outdir, seed=args.seed, scale=args.scale)


if __name__ == "__main__":
    main()
