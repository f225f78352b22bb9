"""Routing scores: a 32k-token prompt scored against 16 engines, in process (the service time
of POST /v1/route without HTTP and JSON).

Usage: python -m bench.route_scores [--quick]   (also the `route` scenario of python -m bench)

Each engine's view holds realistic chains: half the engines hold a prefix of the prompt (from
a quarter of it to all of it, so they share the prompt's leading blocks) among other
prompts' chains, the other half only other prompts' chains. Per fleet (a scheme mix), the
medians of `RouteScorer.score` in these cases, each with its ratio to the old path (every
block hashed, no memo, no early stop: `full_hash=True`) measured in the same run:

- cold: no memo, full hit (one engine holds the whole prompt, so every block is hashed);
- cold, engine stored it: the holders' views and the memo filled only by feeding their
  stored events (with token ids, in vLLM-like chunks of 2k tokens) through the verifier, as
  ingestion does; /v1/route never saw the prompt (each repetition scores on a fresh copy
  of the ingested memo, so every one is a first-time score);
- warm: a memo filled by an earlier identical prompt;
- extended: a fresh memo filled by an earlier prompt sharing the first 90% of this one;
- partial: the engines hold only the prompt's first 2k tokens (no memo, and warm).

Also the view look-ups alone, and the memory per entry of the memo and of the views.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import tracemalloc
from dataclasses import dataclass
from typing import Any

from bench.peers.harness import time_calls
from bench.report import Row, compare, format_table, latency_row
from bench.scenarios.context import Context
from cache_service.core.engines.block_hashes import EngineBlockHash, normalize_block_hash
from cache_service.core.engines.chain_memo import ChainMemo, prompt_chain
from cache_service.core.engines.decoding import BlockStored
from cache_service.core.engines.memo_feed import MemoFeed
from cache_service.core.engines.routing import EngineSpec, RouteScorer
from cache_service.core.engines.schemes import scheme_named
from cache_service.core.engines.views import EngineViews
from cache_service.service.kv_events.config import EngineConfig
from cache_service.service.kv_events.verifier import SchemeVerifier

PROMPT_TOKENS = 32768
ENGINES = 16
OTHER_PROMPTS_PER_ENGINE = 8  # other prompts' chains (each 8k tokens) in every view
CASE = f"{PROMPT_TOKENS // 1024}k tokens, {ENGINES} engines"
PARTIAL_TOKENS = 2048
STORED_EVENT_TOKENS = 2048  # one BlockStored per chunk of prefill, as vLLM's chunked prefill


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
    setup: Setup, prompt: list[int], rng: random.Random, *, held_tokens: int | None = None
) -> tuple[EngineViews, list[EngineSpec]]:
    """16 engines' specs and views filled as the module docstring says (the holders hold at
    most the prompt's first `held_tokens` tokens when given)."""
    views = EngineViews(max_blocks_per_engine=1 << 20)
    engines = [
        EngineSpec(f"engine-{i:02d}", setup.schemes[i % len(setup.schemes)], "0", setup.block_size)
        for i in range(ENGINES)
    ]
    held = prompt if held_tokens is None else prompt[:held_tokens]
    chains = {
        name: scheme_named(name, seed="0").normalized(held, block_size=setup.block_size)
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


def ingested(
    setup: Setup, prompt: list[int], rng: random.Random
) -> tuple[EngineViews, ChainMemo, list[EngineSpec]]:
    """The fleet's views with the holders' prefixes of `prompt` applied from stored events
    that carry their tokens, each verified by a SchemeVerifier feeding a fresh memo."""
    views, engines = fleet(setup, prompt, rng, held_tokens=0)
    memo = ChainMemo()
    configs = [
        EngineConfig(e.name, "tcp://127.0.0.1:1", hash_scheme=e.hash_scheme, seed=e.seed,
                     block_size=e.block_size)
        for e in engines
    ]  # fmt: skip
    verifier = SchemeVerifier(configs, chain_memo=memo)
    size = setup.block_size
    for index, (engine, config) in enumerate(zip(engines, configs, strict=True)):
        if index % 2:
            continue
        assert engine.hash_scheme is not None
        scheme = scheme_named(engine.hash_scheme, seed="0")
        held = prompt[: len(prompt) // size * (1 + index // 2 % 4) // 4 * size]
        raw = scheme.block_hashes(held, block_size=size)
        step = STORED_EVENT_TOKENS // size
        events = []
        for start in range(0, len(raw), step):
            ints = tuple(int(normalize_block_hash(h)) for h in raw[start : start + step])
            events.append(
                BlockStored(
                    tuple(EngineBlockHash(h) for h in ints),
                    parent_block_hash=(
                        EngineBlockHash(normalize_block_hash(raw[start - 1])) if start else None
                    ),
                    token_ids=tuple(held[start * size : (start + step) * size]),
                    block_size=size,
                    raw_block_hashes=ints,
                )
            )
        for event in events:
            assert verifier(config, event) is True
        views.apply_events(engine.name, 0, events)
    return views, memo, engines


def _timed(case: str, subject: str, reps: int, work: Any, before: Any = None) -> Row:
    return latency_row("route", case, subject, "in-process",
                       time_calls(work, repetitions=reps, before=before))  # fmt: skip


def measure(setup: Setup, reps: int) -> list[Row]:
    """The old full-hash path and the four cases of one fleet, as rows."""
    rng = random.Random(20261201)
    prompt = [rng.randrange(2**17) for _ in range(PROMPT_TOKENS)]
    shared = PROMPT_TOKENS * 9 // 10
    earlier = prompt[:shared] + [rng.randrange(2**17) for _ in range(PROMPT_TOKENS - shared)]
    views, engines = fleet(setup, prompt, rng)
    partial_views, _ = fleet(setup, prompt, rng, held_tokens=PARTIAL_TOKENS)
    case = f"{CASE}: {setup.name}"
    old = RouteScorer(views, full_hash=True)
    reference = old.score(prompt, engines)
    assert reference.chains_hashed == len(set(setup.schemes))
    assert reference.best is not None and reference.best.tokens_to_prefill < setup.block_size

    def same(scorer: RouteScorer, expected: object) -> RouteScorer:
        assert scorer.score(prompt, engines) == expected  # honest: the very same answer
        return scorer

    rows = [_timed(case, "old: full hash", reps, lambda: old.score(prompt, engines))]
    cold = same(RouteScorer(views), reference)
    rows.append(_timed(case, "cold (no memo), full hit", reps, lambda: cold.score(prompt, engines)))
    stored_views, stored_memo, _ = ingested(setup, prompt, rng)
    assert RouteScorer(stored_views, full_hash=True).score(prompt, engines) == reference
    stored = same(RouteScorer(stored_views, memo=stored_memo.copy()), reference)

    def as_ingested() -> None:  # every timed score is the prompt's first on this memo
        stored.memo = stored_memo.copy()

    rows.append(_timed(case, "cold, engine stored it (ingestion-fed memo)", reps,
                       lambda: stored.score(prompt, engines), before=as_ingested))  # fmt: skip
    warm = same(RouteScorer(views, memo=ChainMemo()), reference)  # fills the memo
    rows.append(
        _timed(case, "warm (same prompt before)", reps, lambda: warm.score(prompt, engines))
    )
    extended = RouteScorer(views, memo=ChainMemo())

    def fresh_memo() -> None:
        extended.memo = ChainMemo()
        extended.score(earlier, engines)

    fresh_memo()
    same(extended, reference)
    rows.append(_timed(case, "extended (90% seen before)", reps,
                       lambda: extended.score(prompt, engines), before=fresh_memo))  # fmt: skip
    for row in rows[1:]:
        compare(row, rows[0])
        row.ratio_to = "old: full hash"
    # Each extended call follows the earlier prompt's scoring (untimed), which leaves the CPU
    # caches cold for the views' sets: its look-ups cost about 0.6 ms there, 0.4 ms warm.
    rows[-1].note = "after the earlier prompt's scoring: CPU caches cold"
    old_partial = RouteScorer(partial_views, full_hash=True)
    partial_reference = old_partial.score(prompt, engines)
    rows.append(_timed(case, "partial hit (2k held): old full hash", reps,
                       lambda: old_partial.score(prompt, engines)))  # fmt: skip
    cold_partial = RouteScorer(partial_views)
    warm_partial = RouteScorer(partial_views, memo=ChainMemo())
    for scorer in (cold_partial, warm_partial):
        assert scorer.score(prompt, engines) == partial_reference
    rows.append(_timed(case, "partial hit (2k held): cold", reps,
                       lambda: cold_partial.score(prompt, engines)))  # fmt: skip
    rows.append(_timed(case, "partial hit (2k held): warm", reps,
                       lambda: warm_partial.score(prompt, engines)))  # fmt: skip
    for row in rows[-2:]:
        compare(row, rows[-3])
        row.ratio_to = "partial hit: old full hash"
    chains = {
        name: scheme_named(name, seed="0").normalized(prompt, block_size=setup.block_size)
        for name in set(setup.schemes)
    }
    members = {name: [e.name for e in engines if e.hash_scheme == name] for name in chains}

    def lookups() -> object:
        return [views.match_prefix(chain, engines=members[name]) for name, chain in chains.items()]

    rows.append(_timed(case, "view look-ups alone", reps, lookups))
    return rows


def memory_rows() -> list[Row]:
    """Bytes per block of a filled memo, and per entry of the views (with the held index)."""
    rng = random.Random(7)
    scheme = scheme_named("vllm-sha256", seed="0")
    prompts = [[rng.randrange(2**17) for _ in range(PROMPT_TOKENS)] for _ in range(4)]
    gc.collect()
    tracemalloc.start()
    memo = ChainMemo()
    for prompt in prompts:
        prompt_chain(scheme, prompt, block_size=16, memo=memo)  # no held check: all of it
    gc.collect()
    memo_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    states = scheme.chain(prompts[0], block_size=16)
    hashes = [scheme.normal_form(state) for state in states]
    gc.collect()
    tracemalloc.start()
    feed = MemoFeed(ChainMemo(), max_blocks_per_engine=1 << 20)
    for start in range(0, len(states), 128):  # events of 2k tokens, chained
        feed.feed("a", scheme, block_size=16, parent=hashes[start - 1] if start else None,
                  hashes=hashes[start : start + 128], states=states[start : start + 128],
                  token_ids=prompts[0][start * 16 : (start + 128) * 16])  # fmt: skip
    gc.collect()
    feed_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert feed.blocks("a") == len(states) and len(feed.memo) == len(states) // 16
    blocks = [EngineBlockHash(rng.getrandbits(64)) for _ in range(100_000)]
    gc.collect()
    tracemalloc.start()
    views = EngineViews(max_blocks_per_engine=1 << 20)
    views.apply_events("a", 0, [BlockStored(tuple(blocks))])
    views_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return [
        Row("route", "memo, vllm-sha256 block 16", "bytes per memoized block", "tracemalloc",
            memo_bytes / memo.blocks, "B", samples=memo.blocks),
        Row("route", "memo feed, vllm-sha256 block 16",
            "bytes per ingested block (links + the memo segments)", "tracemalloc",
            feed_bytes / len(states), "B", samples=len(states)),
        Row("route", "views, 100k distinct blocks", "bytes per view entry (incl. held index)",
            "tracemalloc", views_bytes / len(blocks), "B", samples=len(blocks)),
    ]  # fmt: skip


def run(ctx: Context) -> list[Row]:
    """The `route` scenario of python -m bench."""
    rows: list[Row] = []
    for setup in QUICK_SETUPS if ctx.quick else SETUPS:
        rows += measure(setup, ctx.reps(15, 100))
    return rows + memory_rows()


def main() -> None:
    """Measure and print."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one fleet, few repetitions")
    args = parser.parse_args()
    rows = run(Context(quick=args.quick, allow_install=False))
    print(format_table(rows))
    print(f"medians of {statistics.median([row.samples for row in rows]):.0f} runs each")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
