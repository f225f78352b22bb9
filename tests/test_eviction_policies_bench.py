"""bench/eviction_policies.py --quick: its files are written, and its LRU column is what the
replay itself gives when run at each capacity under LRU (a replay, not the stack distances the
comparison uses)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cache_service.core.eviction import POLICIES
from cache_service.tools.replay.command import ReplayConfig, run_replay

pytestmark = pytest.mark.simulation  # whole-trace replays: once per CI run (pyproject markers)

ROOT = Path(__file__).resolve().parent.parent
SCALE = 0.03  # a few hundred requests per held-out trace: about 20 s in all
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The bench run once with --quick at a small scale: its folder and what it printed."""
    out = tmp_path_factory.mktemp("eviction-policies")
    command = ["-m", "bench.eviction_policies", "--quick", "--scale", str(SCALE), "--out", str(out)]
    done = subprocess.run(
        [sys.executable, *command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return out, done.stdout


def result_of(out: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((out / "eviction-policies.json").read_text("utf-8"))
    return result


def test_quick_writes_markdown_json_and_png(quick: tuple[Path, str]) -> None:
    out, printed = quick
    markdown = (out / "eviction-policies.md").read_text(encoding="utf-8")
    assert markdown.strip() == printed.strip()  # the tables printed are the file's
    assert (out / "eviction-policies.png").read_bytes().startswith(PNG_MAGIC)
    result = result_of(out)
    # Quick skips the Mooncake traces; every policy is compared on every held-out trace.
    assert list(result["traces"]) == ["tenants", "agents", "docs", "scan"]
    assert list(result["summary"]) == list(POLICIES)
    assert result["capacity_blocks"] == [round(b * SCALE) for b in (1000, 2000, 5859, 10000, 20000)]
    for name in POLICIES:
        assert f"**{name}**" in markdown
        for trace in result["traces"]:
            assert f"| {name} | {trace} |" in markdown


def test_lru_column_equals_the_replay_under_lru(quick: tuple[Path, str]) -> None:
    out, _ = quick
    result = result_of(out)
    markdown = (out / "eviction-policies.md").read_text(encoding="utf-8")
    for trace, data in result["traces"].items():
        cells = result["summary"]["lru"][trace]["block_hit_ratio"]
        capacities = [*result["capacity_blocks"], data["distinct_blocks"]]
        assert list(cells) == [f"{c:,}" for c in result["capacity_blocks"]] + ["inf"]
        for cell, blocks in zip(cells.values(), capacities, strict=True):
            config = ReplayConfig(
                traces=[data["path"]], capacity_tokens=blocks * 512, store="memory", policy="lru"
            )
            assert cell == run_replay(config)["block_hit_ratio"], (trace, blocks)
        shown = " | ".join(f"{cell:.3f}" for cell in cells.values())
        assert f"| lru | {trace} | {shown} |" in markdown
        # Every policy's row carries the same LRU figures it was compared against.
        for name in POLICIES:
            assert result["summary"][name][trace]["lru_block_hit_ratio"] == cells
        assert result["summary"]["lru"][trace]["worst_vs_lru"] == 0
