"""The rule that makes an eviction policy eligible to be the default (README: Eviction): never
more than 0.01 below LRU in block hit ratio at any capacity the replay reports, on traces of
structure unlike the ones it was tuned on (the bench's held-out generator: many tenants,
agent loops, one-off documents, a scan larger than the cache)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.eviction_policies import LRU_SLACK, run
from cache_service.core.eviction import DEFAULT_POLICY
from cache_service.service.settings import Settings
from cache_service.tools.replay.command import ReplayConfig

SCALE = 0.1  # the bench's --quick scale: about 500-800 requests per trace
SEEDS = (15, 16)  # the bench's published seed, and one nobody looked at while tuning
# About 2.5 min a seed on 2 cores: CI checks the held-out draw (the one the rule guards against
# tuning to); `--eligibility=long` checks both.
CI_SEEDS = (16,)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """The seeds of this run: both with --eligibility=long, else the held-out one."""
    if "seed" in metafunc.fixturenames:
        long_run = metafunc.config.getoption("--eligibility") == "long"
        metafunc.parametrize("seed", SEEDS if long_run else CI_SEEDS)


def test_the_service_and_the_replay_share_one_default() -> None:
    assert Settings().eviction_policy == DEFAULT_POLICY
    assert ReplayConfig(traces=[]).policy == DEFAULT_POLICY


@pytest.mark.eligibility
def test_the_default_is_never_more_than_0_01_below_lru_at_any_capacity(
    tmp_path: Path, seed: int
) -> None:
    result = run(
        tmp_path, seed=seed, scale=SCALE, shared=False, policies=[DEFAULT_POLICY], command="test"
    )
    assert LRU_SLACK == 0.01
    assert set(result["traces"]) == {"tenants", "agents", "docs", "scan"}
    for trace, data in result["traces"].items():
        rows = data["rows"][DEFAULT_POLICY]
        assert len(rows) >= 6, trace  # every Belady capacity, from a thousandth of the blocks up
        for row in rows:
            below = row["lru_block_hit_ratio"] - row["block_hit_ratio"]
            assert below <= LRU_SLACK, (trace, row)
