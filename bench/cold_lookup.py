"""The first lookup of each of many 32k prompts after a restart (nothing in the memo).

Usage: python -m bench.cold_lookup [--prompts 200] [--rounds 3]

Stores the prompts through one service, starts a fresh one on the same data, and looks each
prompt up once through our client; prints p50 and p90 per round, and their medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.peers.harness import time_calls
from bench.services import our_service
from cache_service.client import CacheClient
from cache_service.core.tokens import tokens_to_bytes

MODEL = "bench"
BLOCKS = 512  # 32k tokens in blocks of 64


def one_round(prompts: Sequence[bytes]) -> list[float]:
    """Seconds of each first lookup after a restart."""
    with tempfile.TemporaryDirectory(prefix="bench-cold-") as folder:
        with our_service(Path(folder)) as service, CacheClient(service.url) as client:
            for prompt in prompts:
                client.put_prefix(MODEL, prompt, [b""] * BLOCKS)
        with our_service(Path(folder)) as service, CacheClient(service.url) as client:
            order = iter(prompts)
            return time_calls(
                lambda: client.lookup(MODEL, next(order)), repetitions=len(prompts), warmup=0
            )


def main() -> None:
    """Measure and print."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    prompts = [
        tokens_to_bytes(range(50_000_000 + i * 40_000, 50_000_000 + i * 40_000 + BLOCKS * 64))
        for i in range(args.prompts)
    ]
    p50s, p90s = [], []
    for index in range(args.rounds):
        seconds = sorted(one_round(prompts))
        p50s.append(statistics.median(seconds) * 1000)
        p90s.append(seconds[int(len(seconds) * 0.9)] * 1000)
        print(f"round {index + 1}: p50 {p50s[-1]:.2f} ms, p90 {p90s[-1]:.2f} ms", flush=True)
    p50, p90 = statistics.median(p50s), statistics.median(p90s)
    print(f"{args.prompts} prompts, median of {args.rounds} rounds: p50 {p50:.2f} ms, "
          f"p90 {p90:.2f} ms")  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()
