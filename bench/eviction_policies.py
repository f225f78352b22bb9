"""Every eviction policy against LRU and Belady on six traces: the figures issue 15 judges.

For the two Mooncake traces (bench/traces) and the four held-out ones bench/eviction_traces.py
generates, `cache-service replay --mrc --policy <all> --store memory` is run in-process at
1,000 / 2,000 / 5,859 (3M tokens) / 10,000 / 20,000 blocks of 512 tokens and at the trace's
distinct blocks (inf, where nothing is evicted), besides Belady's own capacities. Per policy
per trace it reports the block hit ratio (prefix semantics) at those capacities, the worst
difference from LRU over every capacity the replay reports from 1,000 blocks to inf (the issue's
range; the per-trace tables also show the smaller ones), and the share of the LRU-to-Belady
gap closed at 5,859 blocks. A policy meets the issue's rules on a trace when it is never more
than 0.01 below LRU there and, at 5,859 blocks, reaches 0.18 (conversation) or 0.34 (synthetic).

README numbers: `python -m bench.eviction_policies --out DIR` (seed 15: the held-out traces of
docs/content/eviction-research.md). On one core it takes about 12 minutes with one policy
besides LRU and about as much again for each further one (the conversation and docs traces take
most of it). Writes DIR/eviction-policies.md (the tables printed, ready to paste), .json and
.png (a panel per trace: hit ratio against capacity). Progress goes to stderr, a line per
replay.

`--quick` generates the held-out traces at scale 0.1, scales the capacities the same way and
skips the Mooncake traces: about a minute with three policies (`--scale 0.03`: 20 s), a smoke
test for CI. Its numbers are not the README's, and the hit-ratio targets (which belong to the
Mooncake traces) are not checked.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from bench import CONVERSATION_TRACE, SYNTHETIC_TRACE
from bench.eviction_traces import DEFAULT_SEED, write_traces
from cache_service.core.eviction import POLICIES
from cache_service.tools.replay.accesses import build_accesses
from cache_service.tools.replay.block_units import plan_units
from cache_service.tools.replay.command import ReplayConfig, load_traces, run_replay
from cache_service.tools.replay.traces import MOONCAKE_BLOCK_TOKENS

CAPACITY_BLOCKS = (1000, 2000, 5859, 10000, 20000)  # of 512 tokens; 5,859 is the 3M-token cache
TARGET_BLOCKS = 5859
TARGETS = {"conversation": 0.18, "synthetic": 0.34}  # block hit ratio at 5,859 blocks
LRU_SLACK = 0.01  # the most a policy may fall below LRU at any capacity
QUICK_SCALE = 0.1
PREFIX = "eviction-policies"
COLOURS = ("tab:green", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive")


class _ProgressLines(io.TextIOBase):
    """Stderr for the replay's progress bar (drawn on terminals only): one line per replay."""

    def __init__(self, trace: str, stream: TextIO) -> None:
        self.trace, self.stream, self.last = trace, stream, ""
        self.started = time.perf_counter()

    def isatty(self) -> bool:
        """Claim a terminal, so the replay draws its bar (labelled policy @capacity) here."""
        return True

    def write(self, text: str) -> int:
        """Pass a new replay's label on as a line; drop the bar's redraws."""
        if not text.startswith("\r"):
            if text.strip():
                self.stream.write(text)
            return len(text)
        label = text[1:].split(" [", 1)[0].strip()
        if label != self.last:
            self.last = label
            elapsed = time.perf_counter() - self.started
            self.stream.write(f"  {self.trace}: {label} (+{elapsed:.0f}s)\n")
            self.stream.flush()
        return len(text)


def capacities(scale: float) -> list[int]:
    """The table's capacities in blocks, scaled like the traces."""
    return [max(1, round(blocks * scale)) for blocks in CAPACITY_BLOCKS]


def distinct_blocks(path: Path) -> int:
    """The trace's distinct blocks as the replay numbers them (its infinite-capacity point)."""
    requests = load_traces(ReplayConfig(traces=[str(path)])).requests
    return build_accesses(requests, plan_units(requests, None)).distinct


def replay(path: Path, policies: Sequence[str], blocks: Sequence[int]) -> dict[str, Any]:
    """The replay's report with --mrc, every policy, at `blocks` (and Belady's capacities)."""
    config = ReplayConfig(
        traces=[str(path)],
        mrc=True,
        compare=list(policies),
        capacities=[b * MOONCAKE_BLOCK_TOKENS for b in blocks],
        store="memory",
    )
    with contextlib.redirect_stderr(_ProgressLines(path.stem.removesuffix("_trace"), sys.stderr)):
        report = run_replay(config, log=sys.stderr)
    if report["cache_block_tokens"] != MOONCAKE_BLOCK_TOKENS:  # the capacities assume it
        raise ValueError(f"{path}: blocks of {report['cache_block_tokens']} tokens, not 512")
    return report


def summarise(
    trace: str, rows: list[dict[str, Any]], blocks: Sequence[int], inf: int
) -> dict[str, Any]:
    """One policy on one trace: hit ratios at `blocks` and inf, worst vs LRU, gap, rules."""
    at = {row["capacity_blocks"]: row for row in rows}
    columns = {**{f"{b:,}": b for b in blocks}, "inf": inf}
    floor = min(blocks)  # the range: from 1,000 blocks (scaled) to inf
    target_blocks = blocks[CAPACITY_BLOCKS.index(TARGET_BLOCKS)]
    diffs = [
        (round(row["block_hit_ratio"] - row["lru_block_hit_ratio"], 6), row["capacity_blocks"])
        for row in rows
        if row["capacity_blocks"] >= floor
    ]
    worst, worst_at = min(diffs)
    hit = at[target_blocks]["block_hit_ratio"]
    target = TARGETS.get(trace) if target_blocks == TARGET_BLOCKS else None
    failures = []
    if worst < -LRU_SLACK:
        failures.append(f"{worst:+.4f} vs LRU at {worst_at:,}")
    if target is not None and hit < target:
        failures.append(f"{hit:.3f} < {target} at {target_blocks:,}")
    return {
        "block_hit_ratio": {name: at[c]["block_hit_ratio"] for name, c in columns.items()},
        "lru_block_hit_ratio": {name: at[c]["lru_block_hit_ratio"] for name, c in columns.items()},
        "worst_vs_lru": worst,
        "worst_at_blocks": worst_at,
        "gap_closed": at[target_blocks]["gap_closed"],
        "target": target,
        "meets": not failures,
        "failures": failures,
    }


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def summary_table(result: dict[str, Any]) -> list[str]:
    """Markdown: a row per policy per trace, and whether the policy meets the rules."""
    heads = [f"{c:,}" for c in result["capacity_blocks"]] + ["inf"]
    gap_head = f"gap closed @{result['target_blocks']:,}"
    lines = [
        f"| policy | trace | {' | '.join(heads)} | worst vs LRU | {gap_head} | rules |",
        "|---|---|" + "---:|" * (len(heads) + 2) + "---|",
    ]
    for policy, traces in result["summary"].items():
        for trace, cell in traces.items():
            ratios = " | ".join(_ratio(cell["block_hit_ratio"][head]) for head in heads)
            worst = f"{cell['worst_vs_lru']:+.4f} @{cell['worst_at_blocks']:,}"
            rules = "yes" if cell["meets"] else "NO: " + "; ".join(cell["failures"])
            lines.append(
                f"| {policy} | {trace} | {ratios} | {worst} | "
                f"{_ratio(cell['gap_closed'])} | {rules} |"
            )
    lines.append("")
    for policy, verdict in result["meets"].items():
        lines.append(f"- **{policy}**: {'meets' if verdict else 'does not meet'} the rules")
    return lines


def trace_table(trace: str, data: dict[str, Any]) -> list[str]:
    """Markdown: every capacity the replay reports, Belady, LRU and each policy (vs LRU)."""
    policies = [name for name in data["rows"] if name != "lru"]
    lines = [
        f"### {trace} ({data['distinct_blocks']:,} distinct blocks, {data['seconds']:.0f} s)",
        "",
        f"| blocks | Belady | LRU | {' | '.join(policies)} |",
        "|---:|---:|---:|" + "---:|" * len(policies),
    ]
    lru_rows = next(iter(data["rows"].values()))
    for index, row in enumerate(lru_rows):
        cells = []
        for name in policies:
            ours = data["rows"][name][index]["block_hit_ratio"]
            cells.append(f"{ours:.3f} ({ours - row['lru_block_hit_ratio']:+.3f})")
        lines.append(
            f"| {row['capacity_blocks']:,} | {row['belady_block_hit_ratio']:.3f} | "
            f"{row['lru_block_hit_ratio']:.3f} | {' | '.join(cells)} |"
        )
    return [*lines, ""]


def markdown(result: dict[str, Any]) -> str:
    """The whole report: how it was made, the summary, then a table per trace."""
    scale = result["scale"]
    note = "" if scale == 1 else f" (scale {scale}: not the README's; no hit-ratio targets)"
    lines = [
        f"## Eviction policies against LRU and Belady{note}",
        "",
        f"`{result['command']}`, seed {result['seed']}, {result['seconds'] / 60:.1f} min. "
        f"Block hit ratio; worst vs LRU over every reported capacity from "
        f"{result['capacity_blocks'][0]:,} blocks to inf; rules: never below LRU by more "
        f"than {LRU_SLACK}, and at {TARGET_BLOCKS:,} blocks "
        + ", ".join(f"{t} >= {v}" for t, v in TARGETS.items())
        + ".",
        "",
        *summary_table(result),
        "",
        *(line for trace, data in result["traces"].items() for line in trace_table(trace, data)),
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """A panel per trace: block hit ratio against capacity, LRU, Belady and each policy."""
    import matplotlib  # noqa: PLC0415 - optional dependency, loaded only to plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    traces = result["traces"]
    cols = min(3, len(traces))
    rows = math.ceil(len(traces) / cols)
    figure, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    for axis, (trace, data) in zip(axes.flat, traces.items(), strict=False):
        axis.plot(*_xy(data["mrc"]), label="LRU", color="tab:blue", lw=2)
        axis.plot(*_xy(data["belady"]), "o--", label="Belady", color="tab:red", ms=3)
        others = [name for name in data["rows"] if name != "lru"]
        for name, colour in zip(others, itertools.cycle(COLOURS), strict=False):
            axis.plot(*_xy(data["rows"][name]), "s-", label=name, color=colour, ms=3, lw=1)
        axis.axvline(result["target_blocks"], color="gray", ls=":", lw=1)
        axis.set(xscale="log", title=trace, xlabel="capacity (blocks of 512)")
        axis.set_ylim(bottom=0)  # not 0-1: the docs trace's ratios are about 0.01
        axis.set_ylabel("block hit ratio")
        axis.grid(alpha=0.3, which="both")
        axis.legend(fontsize=7, loc="upper left")
    for axis in list(axes.flat)[len(traces) :]:
        axis.set_visible(False)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _xy(points: list[dict[str, Any]]) -> tuple[list[int], list[float]]:
    return [p["capacity_blocks"] for p in points], [p["block_hit_ratio"] for p in points]


def run(
    outdir: Path, *, seed: int, scale: float, shared: bool, policies: Sequence[str], command: str
) -> dict[str, Any]:
    """Generate the traces, replay each under every policy, and write .md, .json and .png."""
    started = time.perf_counter()
    outdir.mkdir(parents=True, exist_ok=True)
    paths = {"conversation": CONVERSATION_TRACE, "synthetic": SYNTHETIC_TRACE} if shared else {}
    paths.update(write_traces(outdir, seed=seed, scale=scale))
    names = list(dict.fromkeys(["lru", *policies]))
    blocks = capacities(scale)
    result: dict[str, Any] = {"command": command, "seed": seed, "scale": scale, "traces": {}}
    summary: dict[str, dict[str, Any]] = {name: {} for name in names}
    for number, (trace, path) in enumerate(paths.items(), 1):
        print(f"[{number}/{len(paths)}] {trace}: {', '.join(names)}", file=sys.stderr)
        trace_started = time.perf_counter()
        inf = distinct_blocks(path)
        report = replay(path, names, [*blocks, inf])
        result["traces"][trace] = {
            "path": str(path),
            "distinct_blocks": inf,
            "seconds": round(time.perf_counter() - trace_started, 1),
            "rows": report["policies"],
            "mrc": report["lru"]["points"],  # LRU's exact curve
            "belady": report["belady"]["points"],
        }
        for name in names:
            summary[name][trace] = summarise(trace, report["policies"][name], blocks, inf)
    result.update(
        capacity_blocks=blocks,
        target_blocks=blocks[CAPACITY_BLOCKS.index(TARGET_BLOCKS)],
        summary=summary,
        meets={name: all(c["meets"] for c in summary[name].values()) for name in names},
        seconds=round(time.perf_counter() - started, 1),
    )
    return result


def write(result: dict[str, Any], outdir: Path) -> str:
    """Write DIR/eviction-policies.{md,json,png}; the Markdown."""
    text = markdown(result)
    (outdir / f"{PREFIX}.md").write_text(text + "\n", encoding="utf-8")
    (outdir / f"{PREFIX}.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    plot(result, outdir / f"{PREFIX}.png")
    return text


def main(argv: list[str] | None = None) -> None:
    """Command line: python -m bench.eviction_policies [--quick] [--out DIR] [--seed N] ..."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.eviction_policies", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="held-out traces at scale 0.1 only")
    parser.add_argument("--out", type=Path, default=Path("eviction-policies"))
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument(
        "--scale",
        type=float,
        help="of the held-out traces and capacities (default 1; --quick 0.1); not 1 skips the "
        "Mooncake traces, which cannot be scaled",
    )
    parser.add_argument("--policies", default=",".join(POLICIES), help="default: every policy")
    args = parser.parse_args(argv)
    policies = [name for name in args.policies.split(",") if name]
    unknown = [name for name in policies if name not in POLICIES]
    if unknown:
        parser.error(f"unknown policy {', '.join(unknown)} (known: {', '.join(POLICIES)})")
    if not set(policies) - {"lru"}:
        parser.error("--policies needs one besides lru (LRU is always the baseline)")
    scale = args.scale if args.scale is not None else QUICK_SCALE if args.quick else 1.0
    if not scale > 0:
        parser.error(f"--scale must be > 0, got {scale}")
    command = " ".join(["python -m bench.eviction_policies", *(argv or sys.argv[1:])])
    result = run(
        args.out,
        seed=args.seed,
        scale=scale,
        shared=scale == 1 and not args.quick,
        policies=policies,
        command=command,
    )
    print(write(result, args.out))
    print(f"wrote {args.out / PREFIX}.md/.json/.png, {result['seconds']:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
