"""Routing scores: a 32k-token prompt scored against 16 engines, in process (the service time
of POST /v1/route without HTTP and JSON).

Usage: python -m bench.route_scores [--quick]   (also the `route` scenario of python -m bench)

Each engine's view holds realistic chains: half the engines hold a prefix of the prompt (from
a quarter of it to all of it, so they share the prompt's leading blocks) among other
prompts' chains, the other half only other prompts' chains. Per configuration the figures
are the median of: hashing the prompt once per (scheme, seed, block size) in use, the view
look-ups for all 16 engines, and the whole `RouteScorer.score`; and the ratio of hashing to
look-ups.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from dataclasses import dataclass

from bench.peers.harness import time_calls
from bench.report import Row, format_table, latency_row
from bench.scenarios.context import Context
from cache_service.core.engines.block_hashes import EngineBlockHash
from cache_service.core.engines.events import BlockStored
from cache_service.core.engines.routing import EngineSpec, RouteScorer
from cache_service.core.engines.schemes import scheme_named
from cache_service.core.engines.views import EngineViews

PROMPT_TOKENS = 32768
ENGINES = 16
OTHER_PROMPTS_PER_ENGINE = 8  # other prompts' chains (each 8k tokens) in every view
CASE = f"{PROMPT_TOKENS // 1024}k tokens, {ENGINES} engines"


@dataclass(frozen=True)
class Setup:
    """One fleet: which scheme each engine uses (and the block size they share)."""

    name: str
    schemes: tuple[str, ...]  # cycled over the engines
    block_size: int


SETUPS = (
    Setup("vllm-sha256 (vLLM's default), block 16", ("vllm-sha256",), 16),
    Setup("vllm-sha256-cbor, block 16", ("vllm-sha256-cbor",), 16),
    Setup("xxh3-64-1337 (Dynamo), block 16", ("xxh3-64-1337",), 16),
    Setup("vllm-sha256-cbor + sglang, block 16", ("vllm-sha256-cbor", "sglang"), 16),
    Setup("vllm-sha256, block 64", ("vllm-sha256",), 64),
)
QUICK_SETUPS = (SETUPS[0],)


def fleet(
    setup: Setup, prompt: list[int], rng: random.Random
) -> tuple[EngineViews, list[EngineSpec]]:
    """16 engines' specs and views filled as the module docstring says."""
    views = EngineViews(max_blocks_per_engine=1 << 20)
    engines = [
        EngineSpec(f"engine-{i:02d}", setup.schemes[i % len(setup.schemes)], "0", setup.block_size)
        for i in range(ENGINES)
    ]
    chains = {
        name: scheme_named(name, seed="0").normalized(prompt, block_size=setup.block_size)
        for name in set(setup.schemes)
    }
    for index, engine in enumerate(engines):
        assert engine.hash_scheme is not None
        scheme = scheme_named(engine.hash_scheme, seed="0")
        blocks: list[EngineBlockHash] = []
        for _ in range(OTHER_PROMPTS_PER_ENGINE):
            other = [rng.randrange(2**17) for _ in range(8192)]
            blocks += scheme.normalized(other, block_size=setup.block_size)
        if index % 2 == 0:  # half the fleet holds a prefix of the prompt: a quarter .. all
            chain = chains[engine.hash_scheme]
            blocks += chain[: len(chain) * (1 + index // 2 % 4) // 4]
        views.apply_events(engine.name, 0, [BlockStored(tuple(blocks))])
    return views, engines


def measure(setup: Setup, reps: int) -> list[Row]:
    """Hashing, look-ups and the whole score of one fleet, as rows."""
    rng = random.Random(20261201)
    prompt = [rng.randrange(2**17) for _ in range(PROMPT_TOKENS)]
    views, engines = fleet(setup, prompt, rng)
    scorer = RouteScorer(views)
    scores = scorer.score(prompt, engines)
    assert scores.chains_hashed == len(set(setup.schemes))
    assert scores.best is not None and scores.best.tokens_to_prefill < setup.block_size
    chains = {
        name: scheme_named(name, seed="0").normalized(prompt, block_size=setup.block_size)
        for name in set(setup.schemes)
    }
    members = {name: [e.name for e in engines if e.hash_scheme == name] for name in chains}

    def hashing() -> object:
        return [
            scheme_named(name, seed="0").normalized(prompt, block_size=setup.block_size)
            for name in chains
        ]

    def lookups() -> object:
        return [views.match_prefix(chain, engines=members[name]) for name, chain in chains.items()]

    case = f"{CASE}: {setup.name}"
    hashed = latency_row("route", case, "hashing (once per scheme)", "in-process",
                         time_calls(hashing, repetitions=reps))  # fmt: skip
    looked = latency_row("route", case, "view look-ups, 16 engines", "in-process",
                         time_calls(lookups, repetitions=reps))  # fmt: skip

    def score() -> object:
        return scorer.score(prompt, engines)

    whole = latency_row("route", case, "RouteScorer.score", "in-process",
                        time_calls(score, repetitions=reps))  # fmt: skip
    assert hashed.value is not None and looked.value is not None
    ratio = hashed.value / looked.value
    whole.note = f"hashing {ratio:.1f}x the look-ups"
    whole.extra = {"hashing_ms": hashed.value, "lookups_ms": looked.value, "hash_to_lookup": ratio}
    return [hashed, looked, whole]


def run(ctx: Context) -> list[Row]:
    """The `route` scenario of python -m bench."""
    rows: list[Row] = []
    for setup in QUICK_SETUPS if ctx.quick else SETUPS:
        rows += measure(setup, ctx.reps(15, 100))
    return rows


def main() -> None:
    """Measure and print."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one fleet, few repetitions")
    args = parser.parse_args()
    rows = run(Context(quick=args.quick, allow_install=False))
    print(format_table(rows))
    for row in rows:
        if row.subject == "RouteScorer.score":
            extra = row.extra
            print(f"{row.case}: score {row.value:.3f} ms median = hashing "
                  f"{extra['hashing_ms']:.3f} ms + look-ups {extra['lookups_ms']:.3f} ms "
                  f"(hashing {extra['hash_to_lookup']:.1f}x the look-ups)")  # fmt: skip
    print(f"medians of {statistics.median([row.samples for row in rows]):.0f} runs each")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
