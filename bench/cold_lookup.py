"""The first lookup of each of many 32k prompts after a restart (nothing in the memo).

Usage: python -m bench.cold_lookup [--prompts 200] [--rounds 3] [--ids high|low|both]
       [--tokens bytes|list|numpy] [--payload-bytes 0]

Stores the prompts through one service, starts a fresh one on the same data, and looks each
prompt up once through our client; prints p50 and p90 per round, and their medians, with the
service's minor page faults per lookup (read from /proc); then looks each up again, answered
from the service's memo of verified prompts (one read): the floor of a lookup that had nothing
to verify. `--ids both` stores two sets of the
same shape, one with ids below 50,000 as real vocabularies have and the same ids plus
50,000,000, and alternates them in one process: any gap between them is the ids' own.
`--tokens` is what the caller hands the client (converted inside the timed call, as an engine's
ids would be).
"""

from __future__ import annotations

import argparse
import importlib
import random
import statistics
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

from bench.peers.harness import process_stat, time_calls
from bench.services import our_service
from cache_service.client import CacheClient
from cache_service.core.tokens import tokens_to_bytes

MODEL = "bench"
BLOCKS = 512  # 32k tokens in blocks of 64
TOKENS = BLOCKS * 64
HIGH_OFFSET = 50_000_000  # the bench's historical ids sit above this
LOW_IDS = (100, 49_000)  # a real vocabulary's range (SmolLM2 has 49,152 ids)


def prompt_ids(count: int, ids: str, seed: int = 0) -> dict[str, list[list[int]]]:
    """Prompt token ids per set: 'low' random ids, 'high' the same plus HIGH_OFFSET."""
    rng = random.Random(seed)
    low = [[rng.randrange(*LOW_IDS) for _ in range(TOKENS)] for _ in range(count)]
    sets = {"low": low, "high": [[t + HIGH_OFFSET for t in p] for p in low]}
    return {name: sets[name] for name in (["low", "high"] if ids == "both" else [ids])}


def as_given(tokens: list[int], kind: str) -> Any:
    """The prompt in the form a caller would hand it over."""
    if kind == "list":
        return tokens
    if kind == "numpy":  # what a tokenizer or engine hands over; numpy only for this option
        numpy = importlib.import_module("numpy")
        return numpy.asarray(tokens, dtype=numpy.int64)
    return tokens_to_bytes(tokens)


def minor_faults(pid: int) -> int:
    """Minor page faults of a process so far (/proc/<pid>/stat, field 10)."""
    return int(process_stat(pid)[7])


def one_round(
    sets: dict[str, list[Any]], payload_bytes: int
) -> tuple[dict[str, tuple[list[float], list[int]]], dict[str, list[float]]]:
    """Per set, seconds and service minor faults of each first lookup after a restart; and
    seconds of each second lookup of the same prompt."""
    payloads = [bytes(payload_bytes)] * BLOCKS
    measured: dict[str, tuple[list[float], list[int]]] = {name: ([], []) for name in sets}
    again: dict[str, list[float]] = {name: [] for name in sets}
    with tempfile.TemporaryDirectory(prefix="bench-cold-") as folder:
        with our_service(Path(folder)) as service, CacheClient(service.url) as client:
            for prompts in sets.values():
                for prompt in prompts:
                    client.put_prefix(MODEL, prompt, payloads)
        with our_service(Path(folder)) as service, CacheClient(service.url) as client:
            pid = service.process.pid
            count = len(next(iter(sets.values())))
            for index in range(count):  # the sets alternate, prompt by prompt
                for name, prompts in sets.items():
                    faults = minor_faults(pid)
                    call = partial(client.lookup, MODEL, prompts[index])
                    (seconds,) = time_calls(call, repetitions=1, warmup=0)
                    measured[name][0].append(seconds)
                    measured[name][1].append(minor_faults(pid) - faults)
            for index in range(count):
                for name, prompts in sets.items():
                    call = partial(client.lookup, MODEL, prompts[index])
                    again[name] += time_calls(call, repetitions=1, warmup=0)
    return measured, again


def main() -> None:
    """Measure and print."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ids", choices=["high", "low", "both"], default="high")
    parser.add_argument("--tokens", choices=["bytes", "list", "numpy"], default="bytes")
    parser.add_argument("--payload-bytes", type=int, default=0)
    args = parser.parse_args()
    sets = {
        name: [as_given(p, args.tokens) for p in prompts]
        for name, prompts in prompt_ids(args.prompts, args.ids).items()
    }
    p50s: dict[str, list[float]] = {name: [] for name in sets}
    faults: dict[str, list[float]] = {name: [] for name in sets}
    repeated: dict[str, list[float]] = {name: [] for name in sets}
    for index in range(args.rounds):
        measured, again = one_round(sets, args.payload_bytes)
        for name, (seconds, fault_counts) in measured.items():
            p50s[name].append(statistics.median(seconds) * 1000)
            faults[name].append(statistics.median(fault_counts))
            repeated[name].append(statistics.median(again[name]) * 1000)
            p90 = sorted(seconds)[int(len(seconds) * 0.9)] * 1000
            print(f"round {index + 1} {name} ids: p50 {p50s[name][-1]:.2f} ms, p90 {p90:.2f} ms, "
                  f"{faults[name][-1]:.0f} minor faults; again p50 {repeated[name][-1]:.2f} ms",
                  flush=True)  # fmt: skip
    for name in sets:
        print(f"{name} ids, {args.tokens}, {args.prompts} prompts, median of {args.rounds} "
              f"rounds: p50 {statistics.median(p50s[name]):.2f} ms, "
              f"{statistics.median(faults[name]):.0f} minor faults per lookup; looked up "
              f"again p50 {statistics.median(repeated[name]):.2f} ms")  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()
