"""bench/eviction_learning.py is faithful: with one worker and no restart its harness gives
exactly what the replay gives under adaptive, and its splits and restarts really happen."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.eviction_learning import Setup, WorkerPolicies, replay
from bench.eviction_traces import write_traces
from cache_service.core.eviction import AdaptivePolicy
from cache_service.tools.replay.command import ReplayConfig, run_replay
from tests.test_eviction_policies import meta

# The tenants trace at scale 0.05 (300 requests) with the 3M-token cache scaled alike: there
# adaptive moves off LRU, so matching the replay means the learning itself was reproduced.
CAPACITY_TOKENS = round(5859 * 0.05) * 512
ONE_LEARNER = Setup("adaptive, one learner", "adaptive")


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small generated trace on which adaptive learns."""
    return write_traces(tmp_path_factory.mktemp("traces"), seed=15, scale=0.05)["tenants"]


def replayed(trace: Path, policy: str) -> dict[str, object]:
    config = ReplayConfig(
        traces=[str(trace)], capacity_tokens=CAPACITY_TOKENS, store="memory", policy=policy
    )
    return run_replay(config)


def test_one_worker_gives_the_replays_hit_ratio(trace: Path) -> None:
    ours = replay(trace, ONE_LEARNER, capacity_tokens=CAPACITY_TOKENS)
    plain = replayed(trace, "adaptive")
    assert (ours["hit_blocks"], ours["block_hit_ratio"]) == (
        plain["hit_blocks"],
        plain["block_hit_ratio"],
    )
    assert ours["mean_multiple"] > 0  # it learned: the equality is not LRU's by accident
    assert ours["block_hit_ratio"] != replayed(trace, "lru")["block_hit_ratio"]


def test_restarts_further_apart_than_the_trace_change_nothing(trace: Path) -> None:
    once = replay(trace, ONE_LEARNER, capacity_tokens=CAPACITY_TOKENS)
    never = Setup("late", "adaptive", restart_every=once["requests"] + 1)
    assert replay(trace, never, capacity_tokens=CAPACITY_TOKENS) == {
        **once,
        "seconds": pytest.approx(once["seconds"], abs=5),
    }
    often = Setup("often", "adaptive", restart_every=50)
    assert replay(trace, often, capacity_tokens=CAPACITY_TOKENS)["hit_blocks"] != once["hit_blocks"]


def test_two_workers_give_a_hit_ratio_between_0_and_1(trace: Path) -> None:
    split = replay(trace, Setup("two", "adaptive", workers=2), capacity_tokens=CAPACITY_TOKENS)
    assert 0 < split["block_hit_ratio"] < 1


def test_each_call_goes_to_the_serving_workers_policy_only() -> None:
    policies = WorkerPolicies("adaptive", workers=2)
    block = meta(1, rank=5)
    policies.serve(1)
    policies.begin()
    policies.evicted(block, held_blocks=10)
    policies.commit()
    first, second = policies.policies
    assert isinstance(first, AdaptivePolicy) and isinstance(second, AdaptivePolicy)
    assert (first.ghost_size(), second.ghost_size()) == (0, 1)
    policies.restart()
    assert policies.current is policies.policies[1] and policies.current is not second
