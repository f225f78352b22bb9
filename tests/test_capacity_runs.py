"""The capacity curves of the default policy: replays in worker processes give what one replay
at each capacity gives, and `--mrc` reports the policy's own curve beside LRU's."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from bench.eviction_traces import write_traces
from cache_service.core.eviction import DEFAULT_POLICY
from cache_service.core.retention import RetentionPolicy
from cache_service.tools.replay import capacity_runs
from cache_service.tools.replay.block_units import plan_units
from cache_service.tools.replay.capacity_runs import replay_hits, run_capacities
from cache_service.tools.replay.command import ReplayConfig, load_traces, run_replay
from cache_service.tools.replay.engine import EmbeddedOptions

SCALE = 0.05  # a few hundred requests per generated trace


@pytest.fixture(scope="module")
def tenants_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bench's held-out `tenants` trace, small."""
    folder = tmp_path_factory.mktemp("traces")
    return write_traces(folder, seed=15, scale=SCALE)["tenants"]


def test_worker_processes_give_what_one_replay_at_each_capacity_gives(
    tenants_trace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    requests = load_traces(ReplayConfig(traces=[str(tenants_trace)]), log=io.StringIO()).requests
    options = EmbeddedOptions(
        units=plan_units(requests, None), retention=RetentionPolicy(), store="memory"
    )
    keys = [(policy, blocks * 512) for policy in ("lru", "adaptive") for blocks in (20, 60, 200)]
    monkeypatch.setattr(capacity_runs, "MIN_REQUESTS_FOR_PROCESSES", 0)  # a small trace too
    log = io.StringIO()
    side_by_side = run_capacities(requests, options, keys, jobs=2, log=log)
    assert side_by_side == {key: replay_hits(requests, options, *key) for key in keys}
    lines = log.getvalue().splitlines()
    assert len(lines) == len(keys)  # a progress line per replay, as each ends
    assert all(line.startswith("capacity curve: ") for line in lines)
    assert lines[-1].split("done (")[1].startswith(f"{len(keys)}/{len(keys)},")


def test_the_default_curve_is_the_policy_s_own_beside_exact_lru(tenants_trace: Path) -> None:
    config = ReplayConfig(traces=[str(tenants_trace)], mrc=True, store="memory", jobs=1)
    report = run_replay(config, log=io.StringIO())
    assert report["policy"] == DEFAULT_POLICY == "adaptive"
    assert report["mrc"]["method"] == "replay-per-capacity"
    assert report["lru"]["method"] == "lru-stack-distance"
    # Each point of the default's curve is a replay of the service's policy at that capacity.
    for point in report["mrc"]["points"][::3]:
        alone = ReplayConfig(
            traces=[str(tenants_trace)], capacity_tokens=point["capacity_tokens"], store="memory"
        )
        assert run_replay(alone, log=io.StringIO())["block_hit_ratio"] == pytest.approx(
            point["block_hit_ratio"], abs=1e-6
        )
    # And LRU's exact curve is the same as a report made under --policy lru.
    lru = run_replay(
        ReplayConfig(traces=[str(tenants_trace)], mrc=True, store="memory", policy="lru"),
        log=io.StringIO(),
    )
    assert lru["mrc"] == lru["lru"] == report["lru"]
    assert report["policies"] is not None and list(report["policies"]) == ["adaptive"]
