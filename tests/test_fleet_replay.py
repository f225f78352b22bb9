"""`cache-service replay --engines`: a fleet of engines with their own prefix caches in front of
the store. The tiers never claim more than the prompt or the ceiling; one engine with a cache
that never evicts and no store hits what the store alone hits (less vLLM's last-token rule);
each routing routes as it says; the command line and the report carry the fleet."""

from __future__ import annotations

import io
import json
import math
import random
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_service.core.retention import RetentionPolicy
from cache_service.core.tokens import tokens_to_bytes
from cache_service.tools.replay.block_units import plan_units
from cache_service.tools.replay.command import ReplayConfig, run_replay
from cache_service.tools.replay.engine import (
    EmbeddedOptions,
    ReplayError,
    embedded_store,
    replay_embedded,
)
from cache_service.tools.replay.engine_cache import EngineCache, block_hashes
from cache_service.tools.replay.fleet import (
    FleetOptions,
    TierHits,
    drive_fleet,
    engine_blocks_for_memory,
)
from cache_service.tools.replay.routing import ROUTINGS, make_router
from cache_service.tools.replay.stats import Outcome
from cache_service.tools.replay.traces import TraceRequest

BLOCK = 4
EXAMPLES = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def token_request(
    line: int, tokens: Sequence[int], *, output: int = 0, session: str = ""
) -> TraceRequest:
    """A request of a token trace, at second `line`."""
    return TraceRequest(
        source=0,
        line=line,
        timestamp=float(line),
        input_length=len(tokens),
        output_length=output,
        hash_ids=None,
        block_tokens=0,
        tokens=tokens_to_bytes(list(tokens)),
        retention=None,
        tenant="",
        model="m",
        salt="",
        session=session,
    )


def options_for(
    requests: Sequence[TraceRequest], tmp_path: Path, **overrides: Any
) -> EmbeddedOptions:
    """The embedded store a replay of `requests` in blocks of BLOCK would use."""
    return EmbeddedOptions(
        units=plan_units(requests, BLOCK),
        retention=RetentionPolicy(),
        store="memory",
        workdir=tmp_path,
        **overrides,
    )


def fleet_tiers(
    requests: Sequence[TraceRequest],
    options: EmbeddedOptions,
    fleet: FleetOptions,
    *,
    with_store: bool,
) -> list[TierHits]:
    """Every request's tiers, in replay order."""
    seen: list[TierHits] = []
    if with_store:
        with embedded_store(options) as store:
            drive_fleet(requests, options, fleet, store, lambda _r, tiers: seen.append(tiers))
    else:
        drive_fleet(requests, options, fleet, None, lambda _r, tiers: seen.append(tiers))
    return seen


def store_alone_hits(requests: Sequence[TraceRequest], options: EmbeddedOptions) -> list[int]:
    """Hit tokens of every request with the store alone (today's replay)."""
    outcomes: list[Outcome] = []
    replay_embedded(requests, options, lambda outcome, _: outcomes.append(outcome))
    return [outcome.hit_tokens for outcome in outcomes]


@st.composite
def conversations(draw: st.DrawFn) -> list[TraceRequest]:
    """Requests that grow a few shared prefixes by random turns, with random outputs."""
    rng = random.Random(draw(st.integers(0, 2**32)))
    stems: list[list[int]] = [[]]
    requests = []
    for line in range(draw(st.integers(1, 30))):
        stem = list(rng.choice(stems))
        prompt = stem + [rng.randrange(1000) for _ in range(rng.randrange(1, 3 * BLOCK))]
        stems.append(prompt)
        requests.append(token_request(line, prompt, output=rng.randrange(0, 2 * BLOCK)))
    return requests


@EXAMPLES
@given(
    requests=conversations(),
    engines=st.integers(1, 3),
    blocks=st.integers(16, 40),
    routing=st.sampled_from(ROUTINGS),
    capacity=st.one_of(st.none(), st.integers(0, 40)),
)
def test_tiers_never_exceed_the_prompt_nor_the_stores_ceiling(
    tmp_path: Path,
    *,
    requests: list[TraceRequest],
    engines: int,
    blocks: int,
    routing: str,
    capacity: int | None,
) -> None:
    options = options_for(
        requests, tmp_path, capacity_tokens=None if capacity is None else capacity * BLOCK
    )
    fleet = FleetOptions(engines, blocks, BLOCK, routing)
    tiers = fleet_tiers(requests, options, fleet, with_store=True)
    ceiling = store_alone_hits(requests, options_for(requests, tmp_path))
    for hit, request, ceiling_hit in zip(tiers, requests, ceiling, strict=True):
        assert hit.prompt_tokens == request.input_length
        assert hit.engine_tokens >= 0 and hit.store_tokens >= 0
        assert hit.engine_tokens + hit.store_tokens <= max(hit.prompt_tokens - 1, 0)
        assert hit.engine_tokens + hit.store_tokens <= ceiling_hit
        assert hit.miss_tokens >= 1


@EXAMPLES
@given(requests=conversations())
def test_one_engine_that_never_evicts_and_no_store_hits_what_the_store_alone_hits(
    tmp_path: Path, requests: list[TraceRequest]
) -> None:
    options = options_for(requests, tmp_path)
    fleet = FleetOptions(1, 10_000, BLOCK, "round-robin")
    tiers = fleet_tiers(requests, options, fleet, with_store=False)
    unbounded = store_alone_hits(requests, options)
    for hit, request, ceiling_hit in zip(tiers, requests, unbounded, strict=True):
        last_token_rule = (request.input_length - 1) // BLOCK * BLOCK
        assert hit.engine_tokens == min(ceiling_hit, last_token_rule)
        assert hit.store_tokens == 0 and hit.store_tokens_held == 0


def test_the_store_serves_what_the_other_engine_cached(tmp_path: Path) -> None:
    prompt = list(range(10 * BLOCK + 1))
    requests = [token_request(0, prompt), token_request(1, prompt), token_request(2, prompt)]
    options = options_for(requests, tmp_path)
    tiers = fleet_tiers(
        requests, options, FleetOptions(2, 64, BLOCK, "round-robin"), with_store=True
    )
    assert [(t.engine, t.engine_tokens, t.store_tokens) for t in tiers] == [
        (0, 0, 0),  # first seen: computed, stored in both
        (1, 0, 10 * BLOCK),  # engine 1 never saw it: the store has it
        (0, 10 * BLOCK, 0),  # engine 0 still holds it: the store adds nothing
    ]
    assert tiers[0].store_tokens_held == 10 * BLOCK


def test_store_loads_come_in_whole_groups_of_both_block_sizes(tmp_path: Path) -> None:
    prompt = list(range(10 * BLOCK + 1))
    requests = [token_request(0, prompt), token_request(1, prompt)]
    options = options_for(requests, tmp_path)
    # Engine blocks of 6, store blocks of 4: loads come in groups of lcm(6, 4) = 12 tokens.
    tiers = fleet_tiers(requests, options, FleetOptions(2, 64, 6, "round-robin"), with_store=True)
    assert tiers[1].store_tokens == 36  # the store holds 40 of the 41 tokens; 3 groups of 12


def test_routers_route_as_they_say() -> None:
    engines = [EngineCache(64, BLOCK) for _ in range(3)]
    request = token_request(0, range(3 * BLOCK), session="conversation-7")
    hashes = block_hashes(request.tokens or b"", BLOCK)  # type: ignore[arg-type]
    round_robin = make_router("round-robin", engines)
    assert [round_robin.pick(request, hashes, 12) for _ in range(4)] == [0, 1, 2, 0]
    sticky = make_router("sticky", engines)
    same = {
        sticky.pick(token_request(n, range(n + 5), session="conversation-7"), [], 5)
        for n in range(5)
    }
    assert len(same) == 1  # one session, one engine, whatever its prompts
    least = make_router("least-loaded", engines)
    least.served(0, 100)
    least.served(1, 50)
    assert least.pick(request, hashes, 12) == 2
    least.served(2, 70)
    assert least.pick(request, hashes, 12) == 1
    aware = make_router("prefix-aware", engines)
    engines[2].serve(hashes, 12, 0)  # only engine 2 holds the prompt's blocks
    assert aware.pick(request, hashes, 12) == 2
    aware.served(2, 1000)
    assert (
        aware.pick(token_request(1, [9] * 12), block_hashes(tokens_to_bytes([9] * 12), BLOCK), 12)
        == 0
    )
    # A hit of a tenth of the prompt is under the routers' 0.3 threshold: the emptiest cache
    # takes the request, not the engine holding the shared start (a system prompt, say).
    engines[0].serve(block_hashes(tokens_to_bytes([5] * 8), BLOCK), 8, 0)
    shared_start = list(range(BLOCK)) + [7] * (9 * BLOCK)
    long_hashes = block_hashes(tokens_to_bytes(shared_start), BLOCK)
    assert aware.pick(token_request(2, shared_start), long_hashes, 10 * BLOCK) == 1


def test_an_engines_cache_is_sized_from_its_kv_memory_as_vllm_sizes_its_pool() -> None:
    assert engine_blocks_for_memory(1.0, 890, 16) == math.floor(2**30 / (890 * 16))
    # SmolLM2-135M in bf16: 2 x 30 layers x 3 KV heads x 64 x 2 bytes = 23,040 bytes a token.
    assert engine_blocks_for_memory(4.0, 23_040, 16) == 4 * 2**30 // (23_040 * 16)
    with pytest.raises(ReplayError):
        engine_blocks_for_memory(0, 890, 16)


def test_a_request_larger_than_an_engines_cache_is_a_clear_error(tmp_path: Path) -> None:
    requests = [token_request(0, range(20 * BLOCK))]
    with pytest.raises(ReplayError, match=r"trace line 0: .*needs 20 blocks"):
        fleet_tiers(
            requests, options_for(requests, tmp_path), FleetOptions(1, 8, BLOCK), with_store=False
        )


def test_the_report_splits_each_routing_by_tier_and_prices_the_store(tmp_path: Path) -> None:
    prompt = list(range(8 * BLOCK + 1))
    lines = [
        {"timestamp": t, "tokens": prompt, "output_length": 3} for t in (0, 86_400, 2 * 86_400)
    ]
    config = fleet_config(
        tmp_path,
        lines,
        fleet=FleetOptions(2, 64, BLOCK),
        routings=["round-robin", "sticky"],
        kv_bytes_per_token=1_000_000,
    )
    report = run_replay(config, log=io.StringIO())
    fleet = report["fleet"]
    assert list(fleet["routings"]) == ["round-robin", "sticky"]
    spread = fleet["routings"]["round-robin"]
    stored = spread["with_store"]
    assert (stored["engine_tokens"], stored["store_tokens"]) == (8 * BLOCK, 8 * BLOCK)
    assert spread["engines_only"]["engine_tokens"] == 8 * BLOCK
    assert spread["store_adds_tokens"] == 8 * BLOCK
    assert spread["per_request"] == {
        "engine": [0, 1, 0],
        "engine_tokens": [0, 0, 8 * BLOCK],
        "store_tokens": [0, 8 * BLOCK, 0],
    }
    # 32 tokens of 1 MB held for two days: 0.064 GB-days at $0.004.
    assert stored["cost"]["store_gb_days"] == pytest.approx(32 * 1e6 / 1e9 * 2)
    assert stored["cost"]["store_usd"] == pytest.approx(32 * 1e6 / 1e9 * 2 * 0.004)
    together = fleet["routings"]["sticky"]["with_store"]
    assert together["engine_tokens"] == 16 * BLOCK and together["store_tokens"] == 0


def fleet_config(tmp_path: Path, lines: list[dict[str, Any]], **overrides: Any) -> ReplayConfig:
    """A replay of `lines` (a token trace written to tmp_path) in blocks of BLOCK."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return ReplayConfig(
        traces=[str(trace)], block_size=BLOCK, workdir=tmp_path, store="memory", **overrides
    )


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("cache-service")
    return subprocess.run(
        [str(script), "replay", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
        check=False,
    )


def test_the_command_line_runs_a_fleet_and_refuses_what_it_cannot(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": t, "tokens": list(range(40 + t))}) + "\n" for t in range(6)
        )
    )
    ran = cli(
        str(trace), "--engines", "2", "--engine-kv-gib", "0.001", "--json", "r.json", cwd=tmp_path
    )
    assert ran.returncode == 0, ran.stderr
    assert "Fleet: 2 engines" in ran.stdout and "prefix-aware" in ran.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["fleet"]["engine_cache_blocks"] == engine_blocks_for_memory(0.001, 890, 16)
    assert list(report["fleet"]["routings"]) == list(ROUTINGS)
    for flags, said in [
        (["--engines", "2"], "give one of --engine-cache-blocks or --engine-kv-gib"),
        (["--engine-cache-blocks", "9"], "need --engines"),
        (
            ["--engines", "2", "--engine-cache-blocks", "9", "--url", "http://127.0.0.1:9"],
            "drop --url",
        ),
        (
            ["--engines", "2", "--engine-cache-blocks", "9", "--routing", "random"],
            "unknown: random",
        ),
    ]:
        refused = cli(str(trace), *flags, cwd=tmp_path)
        assert refused.returncode == 2 and said in refused.stderr, (flags, refused.stderr)


def test_the_stores_marginal_curve_meets_the_fleet_run_at_the_stores_own_capacity(
    tmp_path: Path,
) -> None:
    rng = random.Random(7)
    stems = [[rng.randrange(1000) for _ in range(3 * BLOCK)] for _ in range(4)]
    lines = []
    for second in range(60):
        prompt = rng.choice(stems) + [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
        lines.append({"timestamp": second, "tokens": prompt})
    config = fleet_config(
        tmp_path,
        lines,
        capacity_tokens=6 * BLOCK,
        mrc=True,
        jobs=1,
        fleet=FleetOptions(2, 8, BLOCK),
        routings=["round-robin", "prefix-aware"],
    )
    fleet = run_replay(config, log=io.StringIO())["fleet"]
    assert list(fleet["curves"]) == ["round-robin", "prefix-aware"]
    for name, points in fleet["curves"].items():
        capacities = [point["capacity_tokens"] for point in points]
        assert capacities == sorted(capacities) and 6 * BLOCK in capacities
        at_own = next(p for p in points if p["capacity_tokens"] == 6 * BLOCK)
        ran = fleet["routings"][name]["with_store"]
        assert (at_own["engine_tokens"], at_own["store_tokens"]) == (
            ran["engine_tokens"],
            ran["store_tokens"],
        )
        assert points[-1]["store_tokens"] >= points[0]["store_tokens"]


def test_prompt_tokens_past_what_the_trace_gives_count_as_computed_in_every_tier(
    tmp_path: Path,
) -> None:
    lines = [
        {"timestamp": t, "hash_ids": [1, 2], "block_tokens": BLOCK, "input_length": 20}
        for t in range(3)
    ]
    report = run_replay(
        fleet_config(tmp_path, lines, fleet=FleetOptions(1, 64, BLOCK), routings=["sticky"]),
        log=io.StringIO(),
    )
    stored = report["fleet"]["routings"]["sticky"]["with_store"]
    assert stored["prompt_tokens"] == report["prompt_tokens"] == 60
    # The ids cover 8 tokens: 2 blocks, both cached after the first request.
    assert stored["engine_tokens"] == 2 * 2 * BLOCK and stored["miss_tokens"] == 60 - 16
