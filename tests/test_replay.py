"""The replay tool in process: checked against the brute-force oracle in tests/replay_oracle.py.

Traces here are small and random (a tree of prefix ids, several tenants, retention classes and
timestamps) or built by hand for one behaviour of the issue: TTL classes over days, malformed
lines, token traces, the report's fields and cost, and the replay order across files.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_service.core.retention import RetentionPolicy
from cache_service.tools.replay.accesses import build_accesses
from cache_service.tools.replay.belady import belady_hits, next_uses
from cache_service.tools.replay.block_units import plan_units
from cache_service.tools.replay.command import ReplayConfig, load_traces, run_replay
from cache_service.tools.replay.cost import Prices
from cache_service.tools.replay.engine import EmbeddedOptions, replay_embedded
from cache_service.tools.replay.mrc import lru_curve
from cache_service.tools.replay.stats import Outcome
from cache_service.tools.replay.traces import TraceError, detect_format, read_trace
from tests.replay_oracle import (
    Request,
    RequestHits,
    Totals,
    replay_belady,
    replay_block_lru,
    replay_order,
    replay_prefix_cache,
    totals,
)

DAY = 86400.0
SHORT_TTLS = {"agent": 30.0, "chat": 70.0}  # seconds: random traces span minutes, so blocks expire
DEFAULT_TTLS = {"agent": 3 * DAY, "chat": 7 * DAY}
TENANTS = ("", "acme", "globex")
STORES = ("memory", "lmdb")
EXAMPLES = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# -- helpers ----------------------------------------------------------------------------------


def write_trace(path: Path, lines: Iterable[Mapping[str, Any] | str]) -> Path:
    """One JSON object per line (a str is written as it is, to make malformed lines)."""
    path.write_text(
        "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    )
    return path


def trace_line(request: Request) -> dict[str, Any]:
    """An oracle request as a line of our JSONL format (no `retention` key when None)."""
    return {key: value for key, value in request.items() if value is not None}


def config_for(
    paths: Sequence[Path],
    tmp_path: Path,
    *,
    ttl_seconds: Mapping[str, float] = DEFAULT_TTLS,
    **overrides: Any,
) -> ReplayConfig:
    """A replay of `paths` whose temporary stores live in tmp_path."""
    return ReplayConfig(
        traces=[str(path) for path in paths],
        retention=RetentionPolicy(ttl_seconds=dict(ttl_seconds), default_class="chat"),
        workdir=tmp_path,
        **overrides,
    )


def replay(config: ReplayConfig) -> dict[str, Any]:
    """run_replay with its skipped-line log kept out of the test output."""
    return run_replay(config, log=io.StringIO())


def per_request_hits(config: ReplayConfig) -> list[int]:
    """Hit blocks of every request, in replay order, from the embedded engine."""
    loaded = load_traces(config, log=io.StringIO())
    outcomes: list[Outcome] = []
    options = EmbeddedOptions(
        units=plan_units(loaded.requests, config.block_size),
        retention=config.retention,
        capacity_tokens=config.capacity_tokens,
        payload_bytes_per_token=config.payload_bytes_per_token,
        store=config.store,
        workdir=config.workdir,
    )
    replay_embedded(loaded.requests, options, lambda outcome, _: outcomes.append(outcome))
    return [outcome.hit_blocks for outcome in outcomes]


def report_totals(figures: Mapping[str, Any]) -> Totals:
    return Totals(
        hit_blocks=figures["hit_blocks"],
        hit_tokens=figures["hit_tokens"],
        requests_with_hit=figures["requests_with_hit"],
    )


def oracle_totals_by(
    requests: Sequence[Request], hits: Sequence[RequestHits], field: str, default: str
) -> dict[str, Totals]:
    groups: dict[str, list[RequestHits]] = {}
    for request, hit in zip(requests, hits, strict=True):
        groups.setdefault(request.get(field) or default, []).append(hit)
    return {name: totals(group) for name, group in groups.items()}


# -- random traces over a small tree of prefix ids --------------------------------------------


@st.composite
def random_traces(draw: st.DrawFn, max_nodes: int = 10, max_requests: int = 24) -> list[Request]:
    """Requests whose hash ids are root-to-node paths of a small random tree, in a random
    file order; timestamps repeat, and gaps reach past the short TTLs."""
    block_tokens = draw(st.sampled_from([2, 4, 16]))
    nodes = draw(st.integers(min_value=1, max_value=max_nodes))
    parents = [-1] + [draw(st.integers(min_value=-1, max_value=k - 1)) for k in range(1, nodes)]
    node_ids = [k * 7919 + (k % 3) * 2**40 for k in range(nodes)]  # distinct, some above 2^32

    def path(node: int) -> list[int]:
        ids: list[int] = []
        while node >= 0:
            ids.insert(0, node_ids[node])
            node = parents[node]
        return ids

    requests: list[Request] = []
    now = 0.0
    for _ in range(draw(st.integers(min_value=1, max_value=max_requests))):
        now += draw(st.sampled_from([0.0, 0.0, 1.0, 5.5, 20.0, 45.0]))
        ids = path(draw(st.integers(min_value=0, max_value=nodes - 1)))
        requests.append(
            {
                "timestamp": now,
                "hash_ids": ids,
                "block_tokens": block_tokens,
                # the last block may be partial, or the prompt may run past the ids
                "input_length": (len(ids) - 1) * block_tokens
                + draw(st.integers(min_value=1, max_value=3 * block_tokens)),
                "output_length": draw(st.integers(min_value=0, max_value=40)),
                "tenant": draw(st.sampled_from(TENANTS)),
                "retention": draw(st.sampled_from([None, "agent", "chat"])),
            }
        )
    order = draw(st.permutations(range(len(requests))))
    return [requests[i] for i in order]


def distinct_blocks(requests: Sequence[Request]) -> int:
    return len(
        {
            (r["tenant"], tuple(r["hash_ids"][: d + 1]))
            for r in requests
            for d in range(len(r["hash_ids"]))
        }
    )


@pytest.mark.parametrize("store", STORES)
@EXAMPLES
@given(trace=random_traces(), data=st.data())
def test_embedded_replay_equals_brute_force_oracle_with_ttls_and_capacity(
    tmp_path: Path, store: str, trace: list[Request], data: st.DataObject
) -> None:
    path = write_trace(tmp_path / "trace.jsonl", map(trace_line, trace))
    ordered = replay_order(trace)
    block_tokens = trace[0]["block_tokens"]
    capacity = data.draw(
        st.integers(min_value=0, max_value=distinct_blocks(trace) + 1), label="capacity"
    )
    slack = data.draw(st.integers(min_value=0, max_value=block_tokens - 1), label="slack")
    capacity_tokens = capacity * block_tokens + slack  # a part block of capacity is no block

    ceiling = replay_prefix_cache(ordered, capacity_blocks=None, ttl_seconds=SHORT_TTLS)
    bounded = replay_prefix_cache(ordered, capacity_blocks=capacity, ttl_seconds=SHORT_TTLS)
    report = replay(
        config_for([path], tmp_path, ttl_seconds=SHORT_TTLS, store=store, capacity_tokens=None)
    )
    assert report_totals(report) == totals(ceiling)
    assert report_totals(report["ceiling"]) == totals(ceiling)

    report = replay(
        config_for(
            [path], tmp_path, ttl_seconds=SHORT_TTLS, store=store, capacity_tokens=capacity_tokens
        )
    )
    assert report_totals(report) == totals(bounded)
    assert report_totals(report["ceiling"]) == totals(ceiling)
    by_tenant = {name: report_totals(t) for name, t in report["by_tenant"].items()}
    assert by_tenant == oracle_totals_by(ordered, bounded, "tenant", "")
    by_retention = {name: report_totals(t) for name, t in report["by_retention"].items()}
    assert by_retention == oracle_totals_by(ordered, bounded, "retention", "chat")
    assert report["prompt_tokens"] == sum(r["input_length"] for r in trace)
    assert report["output_tokens"] == sum(r["output_length"] for r in trace)
    assert report["hit_tokens"] + report["miss_tokens"] == report["prompt_tokens"]


def curve_inputs(trace: Sequence[Request], tmp_path: Path) -> tuple[Any, list[Request]]:
    path = write_trace(tmp_path / "trace.jsonl", map(trace_line, trace))
    loaded = load_traces(config_for([path], tmp_path), log=io.StringIO())
    accesses = build_accesses(loaded.requests, plan_units(loaded.requests, None))
    return accesses, replay_order(trace)


@EXAMPLES
@given(trace=random_traces())
def test_lru_curve_equals_per_capacity_brute_force_lru_at_every_capacity(
    tmp_path: Path, trace: list[Request]
) -> None:
    accesses, ordered = curve_inputs(trace, tmp_path)
    assert accesses.distinct == distinct_blocks(trace)
    curve = lru_curve(accesses)
    no_expiry = {"agent": math.inf, "chat": math.inf}
    for capacity in range(accesses.distinct + 2):
        plain_lru = totals(replay_block_lru(ordered, capacity_blocks=capacity))
        prefix_lru = totals(
            replay_prefix_cache(ordered, capacity_blocks=capacity, ttl_seconds=no_expiry)
        )
        assert prefix_lru == plain_lru, f"capacity {capacity}"
        assert curve.at(capacity) == (plain_lru.hit_blocks, plain_lru.hit_tokens), capacity


@EXAMPLES
@given(trace=random_traces())
def test_belady_equals_brute_force_min_and_never_hits_less_than_lru(
    tmp_path: Path, trace: list[Request]
) -> None:
    accesses, ordered = curve_inputs(trace, tmp_path)
    upcoming = next_uses(accesses)
    for capacity in range(accesses.distinct + 2):
        optimum = totals(replay_belady(ordered, capacity_blocks=capacity))
        lru = totals(replay_block_lru(ordered, capacity_blocks=capacity))
        hits = belady_hits(accesses, capacity, upcoming)
        assert hits == (optimum.hit_blocks, optimum.hit_tokens), f"capacity {capacity}"
        assert hits[0] >= lru.hit_blocks, f"capacity {capacity}"


def ratio(hits: int, total: int) -> float:
    return round(hits / total, 6) if total else 0.0


@settings(EXAMPLES, max_examples=40)
@given(trace=random_traces(), expiring=st.booleans())
def test_report_curves_equal_oracle_at_every_listed_capacity(
    tmp_path: Path, trace: list[Request], expiring: bool
) -> None:
    """Stack distances when no TTL can expire; one replay per capacity when one can. The
    `lru` section is LRU's curve whatever the policy; under LRU it is the `mrc` itself."""
    ttls = SHORT_TTLS if expiring else DEFAULT_TTLS
    path = write_trace(tmp_path / "trace.jsonl", map(trace_line, trace))
    report = replay(
        config_for([path], tmp_path, ttl_seconds=ttls, store="memory", mrc=True, policy="lru")
    )
    assert report["lru"] == report["mrc"]
    default = replay(config_for([path], tmp_path, ttl_seconds=ttls, store="memory", mrc=True))
    assert default["lru"] == report["mrc"]
    ordered = replay_order(trace)
    blocks = sum(len(r["hash_ids"]) for r in trace)
    prompt = sum(r["input_length"] for r in trace)
    span = ordered[-1]["timestamp"] - ordered[0]["timestamp"]
    exact = span < min(ttls[r.get("retention") or "chat"] for r in trace)
    assert report["mrc"]["method"] == ("lru-stack-distance" if exact else "replay-per-capacity")
    for point in report["mrc"]["points"]:
        expected = totals(
            replay_prefix_cache(ordered, capacity_blocks=point["capacity_blocks"], ttl_seconds=ttls)
        )
        assert point["block_hit_ratio"] == ratio(expected.hit_blocks, blocks), point
        assert point["token_hit_ratio"] == ratio(expected.hit_tokens, prompt), point
    for point in report["belady"]["points"]:
        expected = totals(replay_belady(ordered, capacity_blocks=point["capacity_blocks"]))
        assert point["block_hit_ratio"] == ratio(expected.hit_blocks, blocks), point
        assert point["token_hit_ratio"] == ratio(expected.hit_tokens, prompt), point


# -- capacity, by hand ------------------------------------------------------------------------


def hash_line(
    timestamp: float, ids: list[int], *, block_tokens: int = 4, **fields: Any
) -> dict[str, Any]:
    """A JSONL request whose prompt is exactly its blocks unless input_length says more."""
    fields.setdefault("input_length", len(ids) * block_tokens)
    return {"timestamp": timestamp, "hash_ids": ids, "block_tokens": block_tokens, **fields}


@pytest.mark.parametrize("store", STORES)
def test_request_larger_than_the_cache_keeps_its_head_blocks(tmp_path: Path, store: str) -> None:
    path = write_trace(
        tmp_path / "t.jsonl", [hash_line(0, [1, 2, 3, 4, 5]), hash_line(1, [1, 2, 3, 4, 5])]
    )
    config = config_for([path], tmp_path, store=store, capacity_tokens=3 * 4)
    assert per_request_hits(config) == [0, 3]


@pytest.mark.parametrize(
    ("store", "payload_bytes_per_token"), [("memory", 0), ("lmdb", 0), ("lmdb", 8)]
)
def test_capacity_evicts_to_exactly_its_block_count_leaf_first_lru(
    tmp_path: Path, store: str, payload_bytes_per_token: int
) -> None:
    lines = [
        hash_line(0, [1, 2]),
        hash_line(1, [3, 4]),
        hash_line(2, [5]),  # 5 blocks in a 4-block cache: exactly one goes, the oldest leaf (2)
        hash_line(3, [3, 4]),
        hash_line(4, [1, 2]),
    ]
    path = write_trace(tmp_path / "t.jsonl", lines)
    # 19 tokens of 4-token blocks: 4 blocks (a part block of capacity holds nothing)
    config = config_for(
        [path],
        tmp_path,
        store=store,
        capacity_tokens=19,
        payload_bytes_per_token=payload_bytes_per_token,  # real payloads change nothing
    )
    assert per_request_hits(config) == [0, 0, 0, 2, 1]


@pytest.mark.parametrize("store", STORES)
def test_capacity_evicts_expired_blocks_before_older_live_ones(tmp_path: Path, store: str) -> None:
    lines = [
        hash_line(0, [20], retention="chat"),  # alive until day 7
        hash_line(DAY, [10], retention="agent"),  # used later, but dead from day 4
        hash_line(5 * DAY, [30]),  # 3 blocks in a 2-block cache: the dead one goes, not [20]
        hash_line(5 * DAY + 1, [20]),
    ]
    path = write_trace(tmp_path / "t.jsonl", lines)
    config = config_for([path], tmp_path, store=store, capacity_tokens=2 * 4)
    assert per_request_hits(config) == [0, 0, 0, 1]
    oracle = replay_prefix_cache(lines, capacity_blocks=2, ttl_seconds=DEFAULT_TTLS)
    assert [hit.hit_blocks for hit in oracle] == [0, 0, 0, 1]


# -- TTL classes over days --------------------------------------------------------------------


@pytest.mark.parametrize("store", STORES)
def test_agent_prefix_expires_after_3_days_and_chat_prefix_lives_7_days_after_last_hit(
    tmp_path: Path, store: str
) -> None:
    agent, chat, other_chat = [1, 2], [10, 11], [30, 31]
    lines = [
        hash_line(0, agent, retention="agent", tenant="acme"),
        hash_line(0, chat, retention="chat", tenant="acme"),
        hash_line(2 * DAY, agent, retention="agent", tenant="acme"),  # hit: refreshed to day 5
        hash_line(5 * DAY, agent, retention="agent", tenant="acme"),  # 3 days on: missed
        hash_line(6 * DAY, chat, retention="chat", tenant="acme"),  # day 6: still a hit
        hash_line(6 * DAY, other_chat, tenant="acme"),  # no class named: chat, the default
        hash_line(13 * DAY - 1, other_chat, retention="chat", tenant="acme"),  # 1 s early: hit
        hash_line(13 * DAY, chat, retention="chat", tenant="acme"),  # 7 days after its hit: miss
    ]
    path = write_trace(tmp_path / "days.jsonl", lines)
    config = config_for([path], tmp_path, store=store)
    expected = [0, 0, 2, 0, 2, 0, 2, 0]
    assert per_request_hits(config) == expected
    oracle = replay_prefix_cache(lines, capacity_blocks=None, ttl_seconds=DEFAULT_TTLS)
    assert [hit.hit_blocks for hit in oracle] == expected

    config.mrc = True
    report = replay(config)
    assert report["by_retention"]["agent"]["hit_blocks"] == 2
    assert report["by_retention"]["agent"]["requests"] == 3
    assert report["by_retention"]["chat"]["hit_blocks"] == 4
    assert report["by_retention"]["chat"]["requests"] == 5
    assert report["mrc"]["method"] == "replay-per-capacity"  # stack distances know no TTLs


def test_curve_of_a_trace_spanning_exactly_one_ttl_replays_per_capacity(tmp_path: Path) -> None:
    """now < t + T: a block reused exactly one TTL later misses, so stack distances (which
    know no TTLs) would be wrong and the curve must be replayed instead."""
    lines = [hash_line(0, [1, 2], retention="chat"), hash_line(7 * DAY, [1, 2], retention="chat")]
    path = write_trace(tmp_path / "t.jsonl", lines)
    report = replay(config_for([path], tmp_path, mrc=True, store="memory"))
    assert report["ceiling"]["hit_blocks"] == 0
    assert report["mrc"]["method"] == "replay-per-capacity"
    assert {point["block_hit_ratio"] for point in report["mrc"]["points"]} == {0.0}


def test_shorter_retention_table_turns_the_same_trace_into_misses(tmp_path: Path) -> None:
    lines = [hash_line(0, [1, 2], retention="chat"), hash_line(DAY, [1, 2], retention="chat")]
    path = write_trace(tmp_path / "t.jsonl", lines)
    week = replay(config_for([path], tmp_path))
    hours = replay(config_for([path], tmp_path, ttl_seconds={"agent": 3600.0, "chat": 7200.0}))
    assert (week["hit_blocks"], hours["hit_blocks"]) == (2, 0)


# -- trace parsing ----------------------------------------------------------------------------


def test_format_auto_detects_mooncake_and_our_jsonl(tmp_path: Path) -> None:
    mooncake = write_trace(
        tmp_path / "m.jsonl",
        [{"timestamp": 1500, "input_length": 600, "output_length": 9, "hash_ids": [7, 8]}],
    )
    ours = write_trace(tmp_path / "o.jsonl", [hash_line(1500, [7, 8], tenant="acme")])
    tokens = write_trace(tmp_path / "k.jsonl", [{"timestamp": 2, "tokens": [1, 2, 3]}])

    [m] = read_trace(mooncake)
    [o] = read_trace(ours)
    [k] = read_trace(tokens)
    assert not isinstance(m, TraceError)
    assert not isinstance(o, TraceError)
    assert not isinstance(k, TraceError)
    assert (m.timestamp, m.block_tokens, m.hash_ids, m.output_length) == (1.5, 512, (7, 8), 9)
    assert (o.timestamp, o.block_tokens, o.tenant) == (1500.0, 4, "acme")
    assert (k.timestamp, k.block_tokens, k.hash_ids, k.input_length) == (2.0, 0, None, 3)
    assert detect_format({"timestamp": 0, "hash_ids": [1], "input_length": 5}) == "mooncake"
    assert detect_format({"timestamp": 0, "tokens": [1]}) == "jsonl"


def test_mooncake_partial_last_block_counts_only_the_prompts_tokens(tmp_path: Path) -> None:
    line = {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [7, 8]}
    path = write_trace(tmp_path / "m.jsonl", [line, {**line, "timestamp": 1000}])
    report = replay(config_for([path], tmp_path, fmt="mooncake"))
    assert (report["block_tokens"], report["hit_blocks"], report["hit_tokens"]) == (512, 2, 600)
    assert report["block_hit_ratio"] == 0.5


MALFORMED = {
    "bad json": '{"timestamp": 1, "hash_ids": [1',
    "negative id": json.dumps(hash_line(1, [1, -2])),
    "missing field": json.dumps({"timestamp": 1, "hash_ids": [1, 2], "block_tokens": 4}),
    "ids past input_length": json.dumps(hash_line(1, [1, 2, 3], input_length=8)),
    "unknown retention": json.dumps(hash_line(1, [1, 2], retention="forever")),
}


def test_malformed_lines_are_reported_with_their_line_numbers_and_skipped(tmp_path: Path) -> None:
    good = hash_line(0, [1, 2])
    path = write_trace(
        tmp_path / "bad.jsonl", [good, *MALFORMED.values(), {**good, "timestamp": 2}]
    )
    log = io.StringIO()
    report = run_replay(config_for([path], tmp_path), log=log)
    assert report["skipped_lines"] == len(MALFORMED)
    assert report["requests"] == 2
    assert report["hit_blocks"] == 2  # the good lines still replay as if the others were absent
    skipped = log.getvalue().splitlines()
    assert len(skipped) == len(MALFORMED)
    for number, (line, kind) in enumerate(zip(skipped, MALFORMED, strict=True), start=2):
        assert line.startswith(f"skipped {path}:{number}: "), (kind, line)
    assert "forever" in skipped[-1]
    assert "input_length" in skipped[3]


UNREADABLE = {
    "timestamp overflows to inf": b'{"timestamp": 1e400, "hash_ids": [1], "block_tokens": 4, '
    b'"input_length": 4}',
    "timestamp NaN": b'{"timestamp": NaN, "hash_ids": [1], "block_tokens": 4, "input_length": 4}',
    "timestamp Infinity": b'{"timestamp": Infinity, "hash_ids": [1], "block_tokens": 4, '
    b'"input_length": 4}',
    "integer timestamp beyond a float": b'{"timestamp": 1%s, "hash_ids": [1], "block_tokens": 4, '
    b'"input_length": 4}' % (b"0" * 400),
    "bytes that are not UTF-8": b'\xff\xfe{"timestamp": 3, "hash_ids": [1], "block_tokens": 4, '
    b'"input_length": 4}',
}


@pytest.mark.parametrize("kind", list(UNREADABLE))
def test_unreadable_line_is_reported_with_its_number_and_skipped_not_fatal(
    tmp_path: Path, kind: str
) -> None:
    """Lines that decode to no finite timestamp, or not at all, are malformed lines too."""
    good = json.dumps(hash_line(0, [1, 2])).encode()
    path = tmp_path / "odd.jsonl"
    path.write_bytes(b"\n".join([good, UNREADABLE[kind], good]) + b"\n")
    log = io.StringIO()
    report = run_replay(config_for([path], tmp_path), log=log)
    assert (report["requests"], report["skipped_lines"]) == (2, 1)
    assert f"{path}:2: " in log.getvalue()


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_strict_replay_fails_on_a_malformed_line_naming_it(tmp_path: Path, kind: str) -> None:
    path = write_trace(tmp_path / "bad.jsonl", [hash_line(0, [1, 2]), MALFORMED[kind]])
    with pytest.raises(TraceError) as failure:
        replay(config_for([path], tmp_path, strict=True))
    assert (failure.value.path, failure.value.line) == (str(path), 2)
    assert f"{path}:2:" in str(failure.value)


def test_token_trace_replays_in_64_token_blocks_by_default(tmp_path: Path) -> None:
    prompt = list(range(1000, 1150))  # 150 tokens: 2 full blocks of 64, 22 tokens past them
    other = prompt[:64] + [5] * 100  # shares only the first block
    lines = [
        {"timestamp": 0, "tokens": prompt},
        {"timestamp": 1, "tokens": prompt},
        {"timestamp": 2, "tokens": other},
        {"timestamp": 3, "tokens": prompt[:128], "input_length": 200},
    ]
    path = write_trace(tmp_path / "tokens.jsonl", lines)
    report = replay(config_for([path], tmp_path))
    assert (report["block_tokens"], report["cache_block_tokens"]) == (64, 64)
    assert per_request_hits(config_for([path], tmp_path)) == [0, 2, 1, 2]
    assert report["hit_tokens"] == 128 + 64 + 128
    assert report["prompt_tokens"] == 150 + 150 + 164 + 200
    assert report["blocks"] == 2 + 2 + 2 + 2


def test_input_length_beyond_the_hash_ids_counts_as_miss_tokens(tmp_path: Path) -> None:
    lines = [hash_line(0, [1, 2], input_length=20), hash_line(1, [1, 2], input_length=20)]
    path = write_trace(tmp_path / "t.jsonl", lines)
    report = replay(config_for([path], tmp_path))
    assert (report["hit_blocks"], report["hit_tokens"], report["miss_tokens"]) == (2, 8, 32)
    assert report["token_hit_ratio"] == 0.2


# -- the report -------------------------------------------------------------------------------

RUN_FIGURES = {
    "requests",
    "prompt_tokens",
    "hit_tokens",
    "miss_tokens",
    "output_tokens",
    "token_hit_ratio",
    "block_hit_ratio",
    "requests_with_hit",
}


def assert_figures(figures: Mapping[str, Any]) -> None:
    assert set(figures) >= RUN_FIGURES, RUN_FIGURES - set(figures)
    assert figures["hit_tokens"] + figures["miss_tokens"] == figures["prompt_tokens"]


def test_report_has_every_field_of_the_issue_and_hits_plus_misses_make_the_prompt(
    tmp_path: Path,
) -> None:
    lines = [
        hash_line(0, [1, 2, 3], tenant="acme", retention="agent", output_length=3),
        hash_line(30, [1, 2, 9], tenant="acme", output_length=4, input_length=15),
        hash_line(90, [1, 2, 3], tenant="globex", retention="agent"),
        hash_line(95, [1, 2], tenant="acme", retention="chat"),
    ]
    path = write_trace(tmp_path / "t.jsonl", lines)
    report = replay(config_for([path], tmp_path, capacity_tokens=16, mrc=True, capacities=[8]))

    assert report["capacity_tokens"] == 16
    assert report["policy"] == "adaptive"  # the service's default
    assert_figures(report)
    assert_figures(report["ceiling"])
    assert set(report["by_retention"]) == {"agent", "chat"}
    assert set(report["by_tenant"]) == {"acme", "globex"}
    for figures in [*report["by_retention"].values(), *report["by_tenant"].values()]:
        assert_figures(figures)
    assert sum(t["requests"] for t in report["by_tenant"].values()) == 4
    windows = report["windows"]
    assert windows["window_seconds"] == 60.0
    assert [w["start_seconds"] for w in windows["points"]] == [0.0, 60.0]
    assert [w["requests"] for w in windows["points"]] == [2, 2]
    for window in windows["points"]:
        assert_figures(window)
    for section in ("mrc", "lru", "belady"):
        assert report[section]["kv_bytes_per_token"] == 890
        assert report[section]["points"], section
        for point in report[section]["points"]:
            assert point["capacity_tokens"] == point["capacity_blocks"] * 4
            assert point["capacity_bytes"] == point["capacity_tokens"] * 890
            assert 0 <= point["block_hit_ratio"] <= 1
            assert 0 <= point["token_hit_ratio"] <= 1
    assert 2 in {point["capacity_blocks"] for point in report["mrc"]["points"]}  # --capacities 8
    assert 4 in {point["capacity_blocks"] for point in report["belady"]["points"]}  # this run's
    cost = report["cost"]
    assert {
        "prices_per_million_tokens",
        "with_cache_usd",
        "without_cache_usd",
        "saved_usd",
        "prefill_flops_saved",
    } <= set(cost)
    json.dumps(report)  # --json writes it as it is


def test_cost_is_billed_per_token_type_as_worked_out_by_hand(tmp_path: Path) -> None:
    lines = [
        hash_line(0, [1, 2, 3], block_tokens=100_000, input_length=250_000, output_length=1_000),
        hash_line(1, [1, 2, 4], block_tokens=100_000, input_length=300_000, output_length=2_000),
    ]
    path = write_trace(tmp_path / "t.jsonl", lines)
    report = replay(config_for([path], tmp_path, store="memory"))
    # 550,000 prompt tokens: 200,000 hit (2 blocks of the second request), 350,000 miss
    assert (report["prompt_tokens"], report["hit_tokens"], report["miss_tokens"]) == (
        550_000,
        200_000,
        350_000,
    )
    cost = report["cost"]
    output = 3_000 * 0.60 / 1e6  # 0.0018
    with_cache = 200_000 * 0.003 / 1e6 + 350_000 * 0.15 / 1e6 + output  # 0.0549
    without = 550_000 * 0.15 / 1e6 + output  # 0.0843
    assert cost["with_cache_usd"] == pytest.approx(0.0549)
    assert cost["with_cache_usd"] == pytest.approx(with_cache)
    assert cost["without_cache_usd"] == pytest.approx(0.0843)
    assert cost["without_cache_usd"] == pytest.approx(without)
    assert cost["saved_usd"] == pytest.approx(0.0294)
    assert cost["saved_share"] == pytest.approx(0.0294 / 0.0843, abs=1e-6)
    assert cost["prefill_flops_saved"] == pytest.approx(200_000 * 2 * 8e9)  # 3.2e15

    prices = Prices(hit_per_million=1.0, miss_per_million=10.0, output_per_million=100.0)
    priced = replay(config_for([path], tmp_path, store="memory", prices=prices))["cost"]
    assert priced["with_cache_usd"] == pytest.approx(0.2 + 3.5 + 0.3)
    assert priced["without_cache_usd"] == pytest.approx(5.5 + 0.3)
    assert priced["prices_per_million_tokens"] == {
        "cache_hit": 1.0,
        "cache_miss": 10.0,
        "output": 100.0,
    }


def test_hash_ids_of_different_files_never_share_blocks(tmp_path: Path) -> None:
    """Hash ids mean something only within their file (README: replay your request logs)."""
    first = write_trace(tmp_path / "a.jsonl", [hash_line(0, [1, 2])])
    second = write_trace(tmp_path / "b.jsonl", [hash_line(1, [1, 2])])
    tokens = [{"timestamp": 2, "tokens": list(range(64))}]
    report = replay(config_for([first, second], tmp_path))
    assert report["hit_blocks"] == 0
    tokens_first = write_trace(tmp_path / "c.jsonl", tokens)
    tokens_second = write_trace(tmp_path / "d.jsonl", tokens)
    report = replay(config_for([tokens_first, tokens_second], tmp_path))
    assert report["hit_blocks"] == 1  # token blocks are named by their content: shared


# -- replay order -----------------------------------------------------------------------------


def test_equal_timestamps_replay_in_file_order_then_line_order(tmp_path: Path) -> None:
    """One retention class per line, so by_retention shows which line came first: of two
    requests for the same tokens, only the later one can hit."""
    prompt_a, prompt_b = list(range(64)), list(range(100, 164))
    first = write_trace(
        tmp_path / "first.jsonl",
        [
            {"timestamp": 5, "tokens": prompt_a, "retention": "c1"},
            {"timestamp": 0, "tokens": prompt_b, "retention": "c2"},
            {"timestamp": 0, "tokens": prompt_b, "retention": "c3"},
        ],
    )
    second = write_trace(
        tmp_path / "second.jsonl",
        [
            {"timestamp": 0, "tokens": prompt_b, "retention": "c4"},
            {"timestamp": 5, "tokens": prompt_a, "retention": "c5"},
        ],
    )
    ttls = {name: DAY for name in ("c1", "c2", "c3", "c4", "c5", "chat")}
    config = config_for([second, first], tmp_path, ttl_seconds=ttls)
    loaded = load_traces(config, log=io.StringIO())
    order = [(r.timestamp, r.source, r.line, r.retention) for r in loaded.requests]
    assert order == [
        (0.0, 0, 1, "c4"),
        (0.0, 1, 2, "c2"),
        (0.0, 1, 3, "c3"),
        (5.0, 0, 2, "c5"),
        (5.0, 1, 1, "c1"),
    ]
    hits = {name: t["hit_blocks"] for name, t in replay(config)["by_retention"].items()}
    assert hits == {"c4": 0, "c2": 1, "c3": 1, "c5": 0, "c1": 1}

    config = config_for([first, second], tmp_path, ttl_seconds=ttls)
    hits = {name: t["hit_blocks"] for name, t in replay(config)["by_retention"].items()}
    assert hits == {"c2": 0, "c3": 1, "c4": 1, "c1": 0, "c5": 1}


def test_an_id_reused_after_another_prefix_is_another_block_in_replay_and_curve(
    tmp_path: Path,
) -> None:
    # Id 5 follows 1 in the first request and 2 in the second: two different blocks.
    lines = [hash_line(0, [1, 5]), hash_line(1, [2, 5]), hash_line(2, [1, 5]), hash_line(3, [2, 5])]
    path = write_trace(tmp_path / "t.jsonl", lines)
    config = config_for([path], tmp_path, store="memory", capacity_tokens=2 * 4)
    replayed = per_request_hits(config)
    requests = load_traces(config, log=io.StringIO()).requests
    accesses = build_accesses(requests, plan_units(requests, None))
    assert accesses.distinct == 4
    curve = lru_curve(accesses)
    assert curve.at(2)[0] == sum(replayed)
