"""Time to first token on a real model with and without the prompt cache (issue 16).

The reference prefill worker (cache_service.integrations.worker) on SmolLM2-135M-Instruct
(float32, on this machine's CPU) against a real `cache-service serve` (LMDB in a fresh temp
folder, --capacity 8GiB) that this script starts and stops. For each prompt length and repeat
a fresh random prompt is drawn, then, in this order:

- uncached: `model.forward(prompt)`, the time to the last position's logits;
- share 0: the worker's prefill of the prompt under a salt of its own: a miss (the lookup's
  round trip included), which stores every full block of the prompt through the worker;
- share s > 0: the worker's prefill of a prompt whose first k = s * n tokens (rounded down to
  whole blocks) are the stored prompt's and the rest fresh tokens, so exactly k tokens hit;
  TTFT = lookup and transfer + load (decode, rebuild the KV cache) + compute of the rest;
- break-even (the shortest and the longest length): for k of one block, 2%, 5%, 10% and 25%
  of the prompt (whole blocks), the whole prompt with k tokens cached, end to end: fetching
  pays when its lookup and load take less than the uncached TTFT less the compute of the rest
  (i.e. cached TTFT < uncached); and the parts alone: lookup and load of a prompt of those k
  tokens and one more (k hit) against `model.forward` of those k tokens.

Medians of --repeats (default 3) in every headline; every sample is in the JSON. Writes
bench/results/prefill-ttft.md and .json and docs/content/prefill-ttft.png (all three into --out-dir
if given); progress goes to stderr, a line per measurement. `--quick`: 1k and 2k tokens, one
repeat (a smoke run); `--model tiny`: a tiny seeded Llama instead of SmolLM2 (for the test);
`--render JSON` rewrites the three files from a saved JSON's samples, measuring nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.prefill_ttft_report import PREFIX, write
from bench.prefill_ttft_summary import kv_sizes, summarise
from bench.services import our_service
from cache_service.client import CacheClient
from cache_service.integrations.model import CausalLM, load_gguf, smollm2_gguf, tiny_model
from cache_service.integrations.worker import PrefillWorker

DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)
QUICK_LENGTHS = (1024, 2048)
DEFAULT_SHARES = (0.0, 0.5, 0.9, 0.96)  # 0.96: the public production figure
BREAKEVEN_SHARES = (0.02, 0.05, 0.10, 0.25)  # besides one block
CAPACITY = "8GiB"  # the default run stores about 2.2 GB: nothing is evicted
CLIENT_TIMEOUT_SECONDS = 600.0  # an 8k prompt's blocks are ~370 MB in one request
BENCH_DIR = Path(__file__).resolve().parent


def cut(share: float, length: int, block_size: int) -> int:
    """The tokens a share of a prompt caches: rounded down to whole blocks."""
    return int(share * length) // block_size * block_size


def breakeven_tokens(length: int, block_size: int) -> list[int]:
    """The cached prefixes the break-even grid measures: one block, then each share's."""
    cuts = [block_size, *(cut(share, length, block_size) for share in BREAKEVEN_SHARES)]
    return sorted({k for k in cuts if 0 < k < length})


class Bench:
    """The model, a client of the service, the prompt generator and every sample so far."""

    def __init__(self, model: CausalLM, url: str, *, seed: int) -> None:
        self.model = model
        self.client = CacheClient(url, timeout=CLIENT_TIMEOUT_SECONDS)
        self.block_size = PrefillWorker(model, self.client).layout.block_size  # the service's
        self.rng = random.Random(seed)
        self.vocab = int(model.model.config.vocab_size)
        self.samples: list[dict[str, Any]] = []
        self.started = time.perf_counter()

    def tokens(self, count: int) -> list[int]:
        """Fresh random token ids (no prefix in common with earlier ones, beyond chance)."""
        return [self.rng.randrange(self.vocab) for _ in range(count)]

    def worker(self, salt: str, *, store: bool) -> PrefillWorker:
        """A worker on its own salt; measured prefills do not store (that follows the token)."""
        return PrefillWorker(
            self.model, self.client, block_size=self.block_size, salt=salt, store=store
        )

    def warm_up(self) -> None:
        """First calls pay for lazy set-up (kernels, connections): make them untimed."""
        prompt = self.tokens(4 * self.block_size)
        self.model.forward(prompt)
        self.worker("warm-up", store=True).prefill(prompt)
        self.worker("warm-up", store=False).prefill(prompt)

    def uncached(self, prompt: Sequence[int], *, kind: str, length: int, repeat: int) -> None:
        """Time model.forward over the whole of `prompt` (no cache involved)."""
        cpu, started = time.process_time(), time.perf_counter()
        self.model.forward(prompt)
        seconds = time.perf_counter() - started
        self._record(
            kind=kind,
            length=length,
            repeat=repeat,
            prompt_tokens=len(prompt),
            cached_tokens=0,
            compute_seconds=seconds,
            first_token_seconds=seconds,
            cpu_seconds=time.process_time() - cpu,  # all threads': 2 cores busy = 2 x seconds
        )

    def cached(
        self,
        worker: PrefillWorker,
        prompt: Sequence[int],
        *,
        kind: str,
        length: int,
        repeat: int,
        expect_cached: int,
        share: float | None = None,
    ) -> None:
        """Time the worker's prefill of `prompt`; it must load exactly `expect_cached` tokens."""
        prefill = worker.prefill(prompt)
        if worker.cache_errors or worker.refused:  # the worker fails open: numbers would lie
            raise RuntimeError(f"cache errors {worker.cache_errors}, refused {worker.refused}")
        if prefill.cached_tokens != expect_cached:
            raise RuntimeError(f"{prefill.cached_tokens} tokens cached, expected {expect_cached}")
        self._record(
            kind=kind,
            length=length,
            repeat=repeat,
            share=share,
            prompt_tokens=len(prompt),
            cached_tokens=prefill.cached_tokens,
            lookup_seconds=prefill.lookup_seconds,
            load_seconds=prefill.load_seconds,
            compute_seconds=prefill.compute_seconds,
            first_token_seconds=prefill.first_token_seconds,
            store_seconds=prefill.store_seconds,
            stored_blocks=prefill.stored_blocks,
        )

    def _record(self, **sample: Any) -> None:
        self.samples.append(sample)
        parts = [f"ttft {sample['first_token_seconds']:8.3f} s"]
        if "lookup_seconds" in sample:
            parts.append(
                f"lookup {sample['lookup_seconds'] * 1e3:8.1f} ms, "
                f"load {sample['load_seconds'] * 1e3:7.1f} ms, "
                f"compute {sample['compute_seconds']:7.3f} s"
            )
        if sample.get("stored_blocks"):
            parts.append(
                f"stored {sample['stored_blocks']} blocks in {sample['store_seconds']:.2f} s"
            )
        print(
            f"[{time.perf_counter() - self.started:6.0f} s] r{sample['repeat']} "
            f"{sample['kind']:<14} n={sample['length']:<5} prompt={sample['prompt_tokens']:<5} "
            f"cached={sample['cached_tokens']:<5} " + ", ".join(parts),
            file=sys.stderr,
            flush=True,
        )


def measure_round(
    bench: Bench, *, length: int, repeat: int, shares: Sequence[float], breakeven: bool
) -> None:
    """One repeat at one prompt length: uncached, each share, then the break-even grid
    (if `breakeven`)."""
    prompt = bench.tokens(length)
    salt = f"n{length}-r{repeat}"  # this prompt's blocks, apart from every other round's
    bench.uncached(prompt, kind="uncached", length=length, repeat=repeat)
    # The miss: it stores every full block of the prompt (as a worker would) for what follows.
    miss = bench.worker(salt, store=True)
    bench.cached(
        miss, prompt, kind="share", share=0.0, length=length, repeat=repeat, expect_cached=0
    )
    hits = bench.worker(salt, store=False)
    for share in shares:
        if share > 0:
            k = cut(share, length, bench.block_size)
            shared = prompt[:k] + bench.tokens(length - k)
            bench.cached(
                hits,
                shared,
                kind="share",
                share=share,
                length=length,
                repeat=repeat,
                expect_cached=k,
            )
    if not breakeven:
        return
    for k in breakeven_tokens(length, bench.block_size):
        bench.uncached(prompt[:k], kind="prefix_compute", length=length, repeat=repeat)
        one_more = prompt[:k] + bench.tokens(1)  # all but the last token cached: k of them
        bench.cached(
            hits, one_more, kind="prefix_fetch", length=length, repeat=repeat, expect_cached=k
        )
        shared = prompt[:k] + bench.tokens(length - k)  # the whole prompt, k of it cached
        bench.cached(hits, shared, kind="breakeven", length=length, repeat=repeat, expect_cached=k)


def load_model(name: str) -> CausalLM:
    """SmolLM2-135M-Instruct (float32) or the tiny seeded Llama."""
    if name == "tiny":
        return tiny_model(seed=0)
    return load_gguf(smollm2_gguf(), tokenizer=False)


def run(
    *,
    model_name: str,
    lengths: Sequence[int],
    shares: Sequence[float],
    repeats: int,
    seed: int,
    command: str,
) -> dict[str, Any]:
    """Start the service, measure every round (repeats outermost), and summarise."""
    started = time.perf_counter()
    load_before = os.getloadavg()  # other work on the machine shows here (2 cores: 2 is full)
    model = load_model(model_name)
    ends = {min(lengths), max(lengths)}  # the break-even grid's lengths
    with our_service(capacity=CAPACITY) as service:
        bench = Bench(model, service.url, seed=seed)
        bench.warm_up()
        for repeat in range(repeats):
            for length in lengths:
                breakeven = length in ends
                measure_round(
                    bench, length=length, repeat=repeat, shares=shares, breakeven=breakeven
                )
        stats = bench.client.stats()
        bench.client.close()
    result: dict[str, Any] = {
        "command": command,
        "model": model.name,
        "layers": model.layers,
        "kv_heads": model.kv_heads,
        "head_size": model.head_size,
        "dtype": model.dtype,
        "block_size": bench.block_size,
        "lengths": list(lengths),
        "shares": list(shares),
        "breakeven_lengths": sorted(ends),
        "repeats": repeats,
        "seed": seed,
        "capacity": CAPACITY,
        "torch_threads": _torch_threads(),
        "cpu_count": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "kv": kv_sizes(model.layout(bench.block_size), stats),
        "samples": bench.samples,
        "seconds": round(time.perf_counter() - started, 1),
    }
    result.update(summarise(result))
    return result


def _torch_threads() -> int:
    import torch  # noqa: PLC0415 - loaded already by the model; imported here for one number

    return int(torch.get_num_threads())


def _numbers(text: str, kind: type[int] | type[float]) -> list[Any]:
    return [kind(part) for part in text.split(",") if part]


def main(argv: list[str] | None = None) -> None:
    """Command line: python -m bench.prefill_ttft [--quick] [--model tiny] [--lengths ...]."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.prefill_ttft", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="1k and 2k tokens, one repeat")
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--lengths", help="prompt tokens, e.g. 1024,8192 (default 1k to 8k)")
    parser.add_argument("--shares", help="cached shares, e.g. 0.5,0.9 (0 is always measured)")
    parser.add_argument("--repeats", type=int, help="rounds (default 3; --quick 1)")
    parser.add_argument("--seed", type=int, default=16)
    parser.add_argument("--out-dir", type=Path, help="all three files here (default: see doc)")
    parser.add_argument(
        "--render", type=Path, metavar="JSON", help="measure nothing: rewrite from a saved JSON"
    )
    args = parser.parse_args(argv)
    results_dir = args.out_dir or BENCH_DIR / "results"
    png = (args.out_dir or BENCH_DIR.parent / "docs") / f"{PREFIX}.png"
    if args.render:  # the summary again from the samples (after a change to the report)
        saved = json.loads(args.render.read_text(encoding="utf-8"))
        saved.update(summarise(saved))
        print(write(saved, results_dir, png))
        return
    lengths = _numbers(args.lengths, int) if args.lengths else None
    lengths = lengths or list(QUICK_LENGTHS if args.quick else DEFAULT_LENGTHS)
    shares = _numbers(args.shares, float) if args.shares else list(DEFAULT_SHARES)
    shares = sorted({0.0, *shares})
    repeats = args.repeats or (1 if args.quick else 3)
    if any(not 0 <= share < 1 for share in shares):
        parser.error("--shares must each be at least 0 and below 1")
    if min(lengths) < 1 or repeats < 1:
        parser.error("--lengths and --repeats must be positive")
    # SIGTERM ends the run through its clean-up, which stops the service it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    command = " ".join(["python -m bench.prefill_ttft", *(sys.argv[1:] if argv is None else argv)])
    result = run(
        model_name=args.model,
        lengths=lengths,
        shares=shares,
        repeats=repeats,
        seed=args.seed,
        command=command,
    )
    print(write(result, results_dir, png))
    print(
        f"wrote {results_dir / PREFIX}.md/.json and {png}, {result['seconds']:.0f} s",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
