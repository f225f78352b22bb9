"""The prefill TTFT bench's Markdown, JSON and figure (numbers from prefill_ttft_summary)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

PREFIX = "prefill-ttft"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


def _ranges(entries: list[tuple[int, list[float]]]) -> str:
    return ", ".join(f"{n:,}: {lo:.2f}-{hi:.2f} s" for n, (lo, hi) in entries)


def _breakeven_verdict(entry: dict[str, Any]) -> str:
    """Where fetching stops paying at one length, end to end and by the parts alone."""
    rows, n = entry["rows"], entry["length"]
    if not rows:
        return f"{n:,} tokens: no cut measured."
    low, spread = rows[0], entry["uncached_range_seconds"]
    below, above = entry["breakeven_between"]
    if below is None:
        margin = entry["uncached_seconds"] - low["first_token_seconds"]
        text = (
            f"{n:,} tokens: cached TTFT below uncached at every k measured, so the break-even "
            f"is below the smallest share measured, one block ({low['cached_tokens']} tokens, "
            f"{low['share']:.1%}), the smallest unit the cache stores"
        )
        if margin < spread[1] - spread[0]:
            text += (
                f"; at one block by {margin * 1e3:,.0f} ms, less than the uncached TTFT's "
                f"spread ({spread[0]:.2f}-{spread[1]:.2f} s): even there, within noise"
            )
    else:
        where = (
            f"between {below:,} and {above:,} tokens cached ({below / n:.1%}-{above / n:.1%})"
            if above is not None
            else f"above {below:,} tokens cached ({below / n:.1%}), the most measured"
        )
        text = (
            f"{n:,} tokens: cached TTFT >= uncached ({entry['uncached_seconds']:.2f} s, samples "
            f"{spread[0]:.2f}-{spread[1]:.2f} s) with {entry['slower_end_to_end_at']} tokens "
            f"cached: the break-even lies {where}"
        )
    alone = entry["slower_alone_at"]
    if alone:
        text += f"; by the parts alone, fetching is slower than computing at {alone} tokens"
    else:
        text += (
            f"; by the parts alone, fetching k tokens is faster than computing them at every k, "
            f"{low['compute_over_fetch_alone']:.0f}x at one block"
        )
        if below is not None:
            text += ": what is lost end to end is the rest's slower compute, not the fetch"
    return text + "."


def _busy(cores: dict[str, float] | None, threads: int) -> str:
    if cores is None:
        return ""
    return (
        f"; cores this process kept busy in its uncached passes: median {cores['median']:.2f}, "
        f"least {cores['min']:.2f} ({threads} = every torch thread busy throughout; fewer: "
        "another process took CPU)"
    )


def markdown(result: dict[str, Any]) -> str:
    """The tables, the method and the verdicts, ready to paste."""
    kv, bs = result["kv"], result["block_size"]
    lines = [
        "## Time to first token with and without the prompt cache",
        "",
        f"`{result['command']}`: {result['model']} ({result['layers']} layers, "
        f"{result['kv_heads']} KV heads x {result['head_size']}, {result['dtype']}), "
        f"{result['torch_threads']} torch threads, blocks of {bs} tokens, against "
        f"`cache-service serve` (LMDB in a fresh temp folder, --capacity {result['capacity']}) "
        f"on 127.0.0.1. Medians of {result['repeats']} repeat(s) (each component's median "
        f"on its own); the whole run took {result['seconds'] / 60:.1f} min (load average "
        f"{result['load_average_before'][0]:.2f} before, {result['load_average_after'][0]:.2f} "
        f"after, on {result['cpu_count']} CPUs)"
        + _busy(result["busy_cores"], result["torch_threads"])
        + ".",
        "",
        "Uncached: `model.forward(prompt)` of a fresh random prompt, to the last position's "
        "logits. Share 0: the reference worker's prefill of that prompt under a salt of its "
        "own, a miss (its lookup round trip included), which stores every full block of the "
        "prompt. Share s: the worker's prefill of a prompt made of the stored prompt's first "
        "s x n tokens (rounded down to whole blocks) and fresh tokens after, so exactly those "
        "hit: lookup with the payloads' transfer, load (decode, rebuild the KV cache), compute "
        "of the rest. Measured prefills do not store (storing follows the first token).",
        "",
        "| prompt tokens | cached share | cached tokens | uncached TTFT (s) | cached TTFT (s) "
        "| speed-up | lookup+transfer (ms) | load (ms) | compute (s) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in result["cells"]:
        lines.append(
            f"| {c['length']:,} | {c['share']:.0%} | {c['cached_tokens']:,} "
            f"({c['cached_share']:.1%}) | {c['uncached_seconds']:.3f} | "
            f"{c['first_token_seconds']:.3f} | {c['speedup']:.2f}x | {_ms(c['lookup_seconds'])} "
            f"| {_ms(c['load_seconds'])} | {c['compute_seconds']:.3f} |"
        )
    slower = [c for c in result["cells"] if c["share"] and c["speedup"] <= 1]
    spreads = [
        (c["length"], c["uncached_range_seconds"]) for c in result["cells"] if not c["share"]
    ]
    lines += [
        "",
        "Cached TTFT below uncached at every share above 0: "
        + (
            "yes"
            if not slower
            else "NO at " + ", ".join(f"{c['length']:,}/{c['share']:.0%}" for c in slower)
        )
        + f". Uncached TTFT, fastest-slowest sample: {_ranges(spreads)}.",
        "",
    ]
    if result["rest"]:
        lines += [
            "The rest computed after a loaded prefix against the same positions inside an "
            "uncached pass (where slower, likely because with fewer new tokens than keys "
            "transformers hands SDPA an explicit mask instead of is_causal, so the kernel cannot "
            "skip the masked upper triangle): "
            + "; ".join(
                f"{r['length']:,} tokens with {r['cached_tokens']:,} cached: "
                f"{r['after_cache_seconds']:.2f} s against uncached({r['length']:,}) - "
                f"uncached({r['cached_tokens']:,}) = {r['inside_uncached_seconds']:.2f} s"
                for r in result["rest"]
            )
            + ".",
            "",
        ]
    lines += [
        "### KV bytes per token",
        "",
        f"{kv['kv_bytes_per_token']:,} B of keys and values per token (layout); a stored "
        f"block of {bs} tokens is {kv['payload_bytes_per_block']:,} B with its "
        f"{kv['header_bytes']} B header: {kv['payload_bytes_per_token']:,.1f} B per token, "
        f"{kv['ratio_to_public']:.1f}x the {kv['public_bytes_per_token']} B per token of the "
        "public report (DeepSeek's figure, for its own model). The service's stats at the end: "
        f"{kv['service_blocks']:,} blocks, {kv['service_payload_bytes_per_token']:,.1f} B of "
        f"payload and {kv['service_used_bytes_per_token']:,.1f} B of LMDB pages per token.",
        "",
        "### Break-even",
        "",
        "Method: with k tokens cached a prefill pays lookup+load of them and saves what the "
        "uncached pass spends on them: the uncached TTFT less the compute of the rest. "
        "Fetching is slower than recomputing where lookup+load >= that saving, i.e. where the "
        "cached TTFT >= the uncached TTFT. Measured end to end, at the shortest and the longest "
        "length, for k of one block, 2%, 5%, 10% and 25% of the prompt (whole blocks, repeated "
        "cuts dropped). At small k the saving is the difference of two nearly equal TTFTs, so "
        "it is also measured by the parts alone: lookup+load of a prompt of those k tokens and "
        "one more (k hit) against `model.forward` of those k tokens (causal attention: the "
        "same work as inside the whole prompt).",
        "",
        "| prompt tokens | cached tokens | lookup+load (ms) | saved: uncached - compute of "
        "the rest (ms) | cached / uncached TTFT (s) | alone: lookup+load (ms) | alone: compute "
        "them (ms) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for entry in result["breakeven"]:
        for r in entry["rows"]:
            lines.append(
                f"| {entry['length']:,} | {r['cached_tokens']:,} ({r['share']:.1%}) | "
                f"{_ms(r['fetch_seconds'])} | {_ms(r['saved_seconds'])} | "
                f"{r['first_token_seconds']:.3f} / {r['uncached_seconds']:.3f} | "
                f"{_ms(r['fetch_alone_seconds'])} | {_ms(r['compute_alone_seconds'])} |"
            )
    lines += ["", *(f"- {_breakeven_verdict(entry)}" for entry in result["breakeven"]), ""]
    lines += [
        "Per token (compute per token grows with position: attention is quadratic):",
        "",
        "| prompt tokens | miss: lookup (ms) | lookup+load per cached token (us) "
        "| compute per token, whole prompt (us) | compute per token, last tokens, after the "
        "cached prefix (us) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for p in result["per_token"]:
        fetch = p["fetch_seconds_per_token"]
        lines.append(
            f"| {p['length']:,} | {_ms(p['miss_lookup_seconds'])} | "
            f"{'-' if fetch is None else f'{fetch * 1e6:,.1f}'} | "
            f"{p['compute_seconds_per_token_mean'] * 1e6:,.0f} | "
            f"{p['compute_seconds_per_token_last'] * 1e6:,.0f} (last {p['last_tokens']:,}) |"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """TTFT against cached share per length (uncached dashed), with the break-even cuts; the
    parts alone: fetch+load of k tokens against model.forward of them."""
    import matplotlib  # noqa: PLC0415 - optional dependency, loaded only to plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    colours = plt.get_cmap("viridis")
    lengths = result["lengths"]
    for index, length in enumerate(lengths):
        colour = colours(index / max(1, len(lengths) - 1) * 0.85)
        cells = [c for c in result["cells"] if c["length"] == length]
        points = [(c["cached_tokens"], c["first_token_seconds"]) for c in cells]
        for entry in result["breakeven"]:  # its end-to-end cuts too, shares included
            if entry["length"] == length:
                points = points[:1] + [
                    (p["cached_tokens"], p["first_token_seconds"]) for p in entry["end_to_end"]
                ]
        left.plot(
            [k / length for k, _ in points],
            [ttft for _, ttft in points],
            "o-",
            color=colour,
            ms=4,
            label=f"{length:,} tokens, cached",
        )
        left.axhline(
            cells[0]["uncached_seconds"],
            color=colour,
            ls="--",
            lw=1,
            label=f"{length:,} tokens, uncached",
        )
    left.set(
        yscale="log",
        xlabel="cached share of the prompt (whole blocks)",
        ylabel="time to first token (s)",
        title="Time to first token, median (uncached dashed)",
    )
    left.grid(alpha=0.3, which="both")
    left.legend(fontsize=7, ncol=2)
    grid = [(e["length"], r) for e in result["breakeven"] for r in e["rows"]]
    fetch = [(r["cached_tokens"], r["fetch_alone_seconds"]) for _, r in grid]
    fetch += [
        (c["cached_tokens"], c["fetch_seconds"]) for c in result["cells"] if c["cached_tokens"]
    ]
    compute = [(r["cached_tokens"], r["compute_alone_seconds"]) for _, r in grid]
    compute += [(c["length"], c["uncached_seconds"]) for c in result["cells"] if not c["share"]]
    for points, style, label in (
        (fetch, "s-", "fetch + load k tokens"),
        (compute, "o--", "compute k tokens alone (model.forward)"),
    ):
        by_k: dict[int, list[float]] = {}
        for k, seconds in points:
            by_k.setdefault(k, []).append(seconds)
        ks = sorted(by_k)  # one point per k: the lengths' break-even grids share their cuts
        right.plot(ks, [statistics.median(by_k[k]) for k in ks], style, label=label)
    right.set(
        xscale="log",
        yscale="log",
        xlabel="k (tokens from the prompt's start)",
        ylabel="seconds",
        title="The parts alone: fetching vs computing the first k tokens",
    )
    right.grid(alpha=0.3, which="both")
    right.legend(fontsize=8)
    figure.suptitle(
        f"{result['model']} on CPU ({result['torch_threads']} threads), LMDB service on 127.0.0.1",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def write(result: dict[str, Any], results_dir: Path, png: Path) -> str:
    """Write results_dir/prefill-ttft.{md,json} and the figure; the Markdown."""
    text = markdown(result)
    results_dir.mkdir(parents=True, exist_ok=True)
    png.parent.mkdir(parents=True, exist_ok=True)
    (results_dir / f"{PREFIX}.md").write_text(text + "\n", encoding="utf-8")
    (results_dir / f"{PREFIX}.json").write_text(json.dumps(result, indent=1) + "\n", "utf-8")
    plot(result, png)
    return text
