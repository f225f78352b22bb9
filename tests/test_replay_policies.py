"""`cache-service replay --mrc --policy A,B`: policies compared against LRU and Belady.

The console script runs on a small generated trace (a few popular system prompts, growing
conversations, one-shot tails); every figure of the comparison is checked against what a
separate run of the same script gives (single-policy replays, LRU's exact curve, Belady).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cache_service.tools.replay.plots import LRU_COLOUR, RUN_COLOUR, draw_report
from cache_service.tools.replay.policy_curves import gap_closed, headline_capacities
from cache_service.tools.replay.policy_table import headline_figure

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BLOCK_TOKENS = 16
REQUESTS = 400
ASKED_TOKENS = (2000, 8000)  # --capacities: 125 and 500 blocks
ROW_KEYS = {
    "capacity_blocks",
    "capacity_tokens",
    "block_hit_ratio",
    "token_hit_ratio",
    "lru_block_hit_ratio",
    "belady_block_hit_ratio",
    "gap_closed",
}
RUN_SECONDS = 300.0


def cli() -> list[str]:
    """The installed console script beside this Python, as users run it."""
    script = Path(sys.executable).with_name("cache-service")
    return [str(script)] if script.exists() else [sys.executable, "-m", "cache_service.cli"]


def clean_env() -> dict[str, str]:
    """No CACHE_SERVICE_* settings from the developer's shell."""
    return {k: v for k, v in os.environ.items() if not k.startswith("CACHE_SERVICE_")}


def start(*args: str | Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*cli(), "replay", *(str(arg) for arg in args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )


@dataclass(frozen=True)
class Run:
    code: int
    stdout: str
    stderr: str


def finish(proc: subprocess.Popen[str]) -> Run:
    stdout, stderr = proc.communicate(timeout=RUN_SECONDS)
    return Run(proc.returncode, stdout, stderr)


def run(*args: str | Path) -> Run:
    return finish(start(*args))


def write_conversations(path: Path, *, seed: int = 15) -> Path:
    """REQUESTS requests, a second apart: a system prompt (a few are popular), then a
    conversation that later requests may continue, each adding new blocks."""
    rng = random.Random(seed)
    systems = [[1000 * s + k for k in range(6)] for s in range(5)]
    conversations: list[list[int]] = []
    fresh = 10**6
    with path.open("w") as out:
        for second in range(REQUESTS):
            if conversations and rng.random() < 0.4:
                conversation = rng.choice(conversations)
            else:
                conversation = list(systems[min(int(rng.expovariate(0.7)), 4)])
                conversations.append(conversation)
            added = rng.randint(2, 8)
            conversation.extend(range(fresh, fresh + added))
            fresh += added
            line = {
                "timestamp": float(second),
                "hash_ids": list(conversation),
                "block_tokens": BLOCK_TOKENS,
                "input_length": BLOCK_TOKENS * len(conversation) - rng.randint(0, 5),
                "output_length": 5,
            }
            out.write(json.dumps(line) + "\n")
    return path


def replay_json(*args: str | Path, folder: Path, name: str) -> dict[str, Any]:
    """A run that must succeed; its JSON report."""
    report_path = folder / f"{name}.json"
    done = run(*args, "--store", "memory", "--workdir", folder, "--json", report_path)
    assert done.code == 0, done.stderr
    report: dict[str, Any] = json.loads(report_path.read_text())
    return report


@dataclass(frozen=True)
class Comparison:
    report: dict[str, Any]
    summary: str
    plot: Path
    trace: Path
    folder: Path


@pytest.fixture(scope="module")
def comparison(tmp_path_factory: pytest.TempPathFactory) -> Comparison:
    folder = tmp_path_factory.mktemp("policies")
    trace = write_conversations(folder / "conversations.jsonl")
    out = folder / "out" / "run"  # no such folder yet: the replay makes it, as the docs' out/
    plot = out / "policies.png"
    done = run(
        trace,
        "--mrc",
        "--policy",
        "lru,protected",
        "--capacities",
        ",".join(map(str, ASKED_TOKENS)),
        "--store",
        "memory",
        "--workdir",
        folder,
        "--json",
        out / "policies.json",
        "--plot",
        plot,
    )
    assert done.code == 0, done.stderr
    report = json.loads((out / "policies.json").read_text())
    return Comparison(report, done.stdout, plot, trace, folder)


def capacities(rows: Sequence[dict[str, Any]]) -> list[int]:
    return [row["capacity_blocks"] for row in rows]


# -- the report ---------------------------------------------------------------------------------


def test_policies_section_has_a_row_per_belady_capacity_for_each_named_policy(
    comparison: Comparison,
) -> None:
    report = comparison.report
    assert report["policy"] == "lru"  # the first named policy drives the main replay
    assert list(report["policies"]) == ["lru", "protected"]
    belady = capacities(report["belady"]["points"])
    assert {ask // BLOCK_TOKENS for ask in ASKED_TOKENS} <= set(belady)
    for rows in report["policies"].values():
        assert capacities(rows) == belady
        for row in rows:
            assert set(row) == ROW_KEYS
            assert row["capacity_tokens"] == row["capacity_blocks"] * BLOCK_TOKENS
            for key in ROW_KEYS - {"capacity_blocks", "capacity_tokens", "gap_closed"}:
                assert 0.0 <= row[key] <= 1.0, (key, row)


def test_gap_closed_is_the_share_of_the_lru_to_belady_gap_and_null_without_a_gap(
    comparison: Comparison,
) -> None:
    nulls = 0
    for rows in comparison.report["policies"].values():
        for row in rows:
            lru, best, ours = (
                row["lru_block_hit_ratio"],
                row["belady_block_hit_ratio"],
                row["block_hit_ratio"],
            )
            if best == lru:
                assert row["gap_closed"] is None
                nulls += 1
            else:
                assert row["gap_closed"] == pytest.approx((ours - lru) / (best - lru), abs=1e-6)
    assert nulls  # at the whole working set nothing is evicted: LRU ties with Belady
    lru_rows = comparison.report["policies"]["lru"]
    assert {row["gap_closed"] for row in lru_rows} <= {0.0, None}


def test_protected_points_equal_single_policy_replays_at_the_same_capacity(
    comparison: Comparison,
) -> None:
    rows = comparison.report["policies"]["protected"]
    folder = comparison.folder
    procs = {
        row["capacity_tokens"]: start(
            comparison.trace,
            "--policy",
            "protected",
            "--capacity-tokens",
            row["capacity_tokens"],
            "--store",
            "memory",
            "--workdir",
            folder,
            "--json",
            folder / f"single-{row['capacity_tokens']}.json",
        )
        for row in rows
    }
    for tokens, proc in procs.items():
        done = finish(proc)
        assert done.code == 0, done.stderr
        single = json.loads((folder / f"single-{tokens}.json").read_text())
        row = next(row for row in rows if row["capacity_tokens"] == tokens)
        assert single["policy"] == "protected"
        assert (row["block_hit_ratio"], row["token_hit_ratio"]) == (
            single["block_hit_ratio"],
            single["token_hit_ratio"],
        )
    # The comparison shows a difference: protected is not LRU under another name here.
    assert any(row["block_hit_ratio"] != row["lru_block_hit_ratio"] for row in rows)


def test_lru_column_equals_the_exact_lru_curve(comparison: Comparison) -> None:
    mrc = comparison.report["mrc"]
    assert mrc["method"] == "lru-stack-distance"
    curve = {point["capacity_blocks"]: point for point in mrc["points"]}
    for rows in comparison.report["policies"].values():
        for row in rows:
            assert row["lru_block_hit_ratio"] == curve[row["capacity_blocks"]]["block_hit_ratio"]
    for row in comparison.report["policies"]["lru"]:
        assert row["token_hit_ratio"] == curve[row["capacity_blocks"]]["token_hit_ratio"]


def test_belady_is_at_least_every_policy_at_every_capacity(comparison: Comparison) -> None:
    belady = {
        p["capacity_blocks"]: p["block_hit_ratio"] for p in comparison.report["belady"]["points"]
    }
    for rows in comparison.report["policies"].values():
        for row in rows:
            assert row["belady_block_hit_ratio"] == belady[row["capacity_blocks"]]
            assert row["belady_block_hit_ratio"] >= row["block_hit_ratio"]
            assert row["belady_block_hit_ratio"] >= row["lru_block_hit_ratio"]


def test_with_expiring_ttls_lru_is_replayed_and_equals_a_single_lru_replay(
    tmp_path: Path,
) -> None:
    """Stack distances know no TTLs: when blocks expire, LRU's column is replayed too."""
    trace = write_conversations(tmp_path / "t.jsonl", seed=7)
    ttls = ("--retention-map", "agent=60s,chat=60s")
    report = replay_json(
        trace, "--mrc", "--policy", "protected,lru", *ttls, folder=tmp_path, name="cmp"
    )
    assert report["policy"] == "protected"
    assert report["mrc"]["method"] == "replay-per-capacity"
    rows = report["policies"]["protected"]
    middle = rows[len(rows) // 2]
    single = replay_json(
        trace,
        "--policy",
        "lru",
        "--capacity-tokens",
        middle["capacity_tokens"],
        *ttls,
        folder=tmp_path,
        name="lru",
    )
    assert middle["lru_block_hit_ratio"] == single["block_hit_ratio"]
    assert [row["block_hit_ratio"] for row in report["policies"]["lru"]] == [
        row["lru_block_hit_ratio"] for row in rows
    ]
    # protected drives the curve here: its mrc points are its own column
    assert [p["block_hit_ratio"] for p in report["mrc"]["points"]] == [
        row["block_hit_ratio"] for row in rows
    ]


# -- the summary and the plot -------------------------------------------------------------------


def test_summary_tabulates_each_capacity_and_headlines_the_asked_capacities(
    comparison: Comparison,
) -> None:
    lines = comparison.summary.splitlines()
    top = lines.index(next(line for line in lines if line.startswith("Policies against LRU")))
    header = lines[top + 1].split()
    assert header == ["tokens", "blocks", "LRU", "protected", "Belady", "gap", "protected"]
    rows = comparison.report["policies"]["protected"]
    for offset, row in enumerate(rows, start=2):
        cells = lines[top + offset].split()
        assert cells[0] == f"{row['capacity_tokens']:,}"
        assert cells[3] == f"{row['block_hit_ratio']:.1%}"
    headline = next(line for line in lines if line.startswith("Headline: protected at "))
    for tokens in ASKED_TOKENS:
        row = next(row for row in rows if row["capacity_tokens"] == tokens)
        assert headline_figure(row) in headline
    assert "--capacities" in comparison.summary  # the rule that chose them is said


def test_headline_says_the_share_closed_only_where_belady_leads_lru_by_a_point() -> None:
    row = {"capacity_tokens": 29_999_616, "block_hit_ratio": 0.35879}
    wide = {**row, "lru_block_hit_ratio": 0.136, "belady_block_hit_ratio": 0.353}
    assert headline_figure({**wide, "gap_closed": 0.123}) == (
        "at 29,999,616 tokens: closes 12.3% of the LRU-to-Belady gap"
    )
    # The run: LRU 35.9% against Belady 36.6%, where 0.0% of the gap read as a failure.
    narrow = {**row, "lru_block_hit_ratio": 0.35879, "belady_block_hit_ratio": 0.366412}
    assert headline_figure({**narrow, "gap_closed": 0.0}) == (
        "at 29,999,616 tokens: little to gain, LRU (35.9%) is within a point of Belady (36.6%)"
    )
    tied = {**row, "lru_block_hit_ratio": 0.366412, "belady_block_hit_ratio": 0.366412}
    assert headline_figure({**tied, "gap_closed": None}) == (
        "at 29,999,616 tokens: nothing to gain, LRU already equals Belady (36.6%)"
    )
    assert "closes" not in headline_figure({**narrow, "gap_closed": 1.0})


def test_plot_is_a_png(comparison: Comparison) -> None:
    assert comparison.plot.read_bytes().startswith(PNG_MAGIC)


def test_report_and_figures_go_into_a_folder_the_run_makes(comparison: Comparison) -> None:
    out = comparison.plot.parent
    assert out.relative_to(comparison.folder) == Path("out", "run")  # made by the replay
    assert sorted(path.name for path in out.iterdir()) == ["policies.json", "policies.png"]
    assert f"Wrote the report (JSON): {out / 'policies.json'}" in comparison.summary


# matplotlib 3.8 (the lowest version pyproject.toml allows) looks fonts up through pyparsing's
# old names (parseString, resetCache, endQuoteChar...), which pyparsing 3.3 deprecates one by
# one; the CLI's plots run where a warning is no error, and colours are this test's subject.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_every_panel_draws_each_policy_in_one_colour(tmp_path: Path) -> None:
    """LRU beside the run's own curve and in the policies panel: the same colour in both, and
    so is the policy the replay ran."""
    plt = pytest.importorskip("matplotlib.pyplot")
    from matplotlib.colors import to_hex  # noqa: PLC0415 - after the skip above

    trace = write_conversations(tmp_path / "t.jsonl")
    report = replay_json(trace, "--mrc", "--policy", "protected,lru", folder=tmp_path, name="c")
    figure = draw_report(report)
    try:
        drawn: dict[str, list[str]] = {}
        for axis in figure.axes:
            for line in axis.get_lines():  # labels: "LRU (method)", "LRU", "protected", ...
                name = str(line.get_label()).split(" (")[0].lower()
                drawn.setdefault(name, []).append(to_hex(line.get_color()))
    finally:
        plt.close(figure)
    assert drawn["lru"] == [to_hex(LRU_COLOUR)] * 2  # the curve panel and the policies panel
    # The policy the replay ran: its curve, its row of the comparison, its hits over time.
    assert drawn["protected"] == [to_hex(RUN_COLOUR)] * 2 == drawn["token hit ratio"] * 2


def test_headline_without_asked_capacities_is_the_largest_below_the_working_set() -> None:
    belady = {
        "points": [{"capacity_blocks": c} for c in (1, 5, 20, 80)],
        "requested_capacity_blocks": [],
    }
    chosen, rule = headline_capacities(belady)
    assert chosen == [20]
    assert "80 blocks" in rule
    assert headline_capacities({**belady, "requested_capacity_blocks": [5]})[0] == [5]
    assert gap_closed(0.3, 0.2, 0.4) == 0.5
    assert gap_closed(0.3, 0.4, 0.4) is None


# -- refusals -----------------------------------------------------------------------------------


def test_unknown_policy_name_is_refused_naming_it(tmp_path: Path) -> None:
    trace = write_conversations(tmp_path / "t.jsonl")
    done = run(trace, "--mrc", "--policy", "lru,fifo", "--store", "memory")
    assert done.code == 2
    assert "argument --policy: unknown eviction policy 'fifo'" in done.stderr
    assert "(known: " in done.stderr and "protected" in done.stderr


def test_several_policies_without_mrc_are_refused_with_the_reason(tmp_path: Path) -> None:
    trace = write_conversations(tmp_path / "t.jsonl")
    done = run(trace, "--policy", "lru,protected", "--store", "memory", "--workdir", tmp_path)
    assert done.code == 2
    assert "--policy lru,protected compares policies, which needs --mrc" in done.stderr
