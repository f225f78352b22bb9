"""The block-record checksum's share of a long lookup: a 32k-token prompt (512 blocks of 64
tokens) matched on LMDB, against the same 512 records' checksum checks alone, in one process.

Usage: python -m bench.record_checksum [--rounds 400]

Each figure is the best of its rounds (the two interleaved), so a loaded machine shows the
cost of the work rather than of the wait.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable

from cache_service.core.blocks import Namespace, NewBlock, StoreKey
from cache_service.core.hashing import BlockHasher
from cache_service.core.store.lmdb.store import LmdbStore
from cache_service.core.store.parts.codec import (
    RECORD_VERSION,
    SUM_BYTES,
    TOKENS_AT,
    VERSION_AT,
    encode_meta,
    seal,
)
from cache_service.core.tokens import tokens_to_bytes

PROMPT_TOKENS = 32768
BLOCK_SIZE = 64


def _best(rounds: int, works: dict[str, Callable[[], object]]) -> dict[str, float]:
    """The best time of each work in seconds, the works interleaved round by round."""
    best = dict.fromkeys(works, float("inf"))
    for _ in range(rounds):
        for name, work in works.items():
            started = time.perf_counter()
            work()
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def measure(rounds: int) -> tuple[float, float]:
    """(lookup, checksums alone) in microseconds."""
    hasher = BlockHasher()
    namespace = Namespace(model="bench")
    namespace_id = hasher.namespace_id(namespace)
    chain = hasher.chain(
        namespace, tokens_to_bytes(list(range(PROMPT_TOKENS))), block_size=BLOCK_SIZE
    )
    with tempfile.TemporaryDirectory() as folder:
        store = LmdbStore(folder, map_size_bytes=1 << 30)
        blocks = [NewBlock(link, bytes(256)) for link in chain]
        store.insert(namespace_id, blocks, parent=None, now=1.0, retention="chat",
                     ttl_seconds=1e6)  # fmt: skip
        with store.backend.read() as txn:
            records = [encode_meta(meta) for key in chain.keys if (meta := txn.get(StoreKey(key)))]

        def lookup() -> None:
            assert store.match(namespace_id, chain, now=2.0).matched == len(chain)

        def checksums() -> None:  # what count_hits adds a block, as it is written there
            for raw in records:
                if (
                    len(raw) < TOKENS_AT
                    or raw[VERSION_AT] != RECORD_VERSION
                    or raw[:SUM_BYTES] != seal(raw[SUM_BYTES:])
                ):
                    raise AssertionError("a record fails its checksum")

        best = _best(rounds, {"lookup": lookup, "checksums": checksums})
        store.close()
    return best["lookup"] * 1e6, best["checksums"] * 1e6


def main() -> None:
    """Print the lookup's time and the checksums' share of it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=400)
    rounds = parser.parse_args().rounds
    lookup, checksums = measure(rounds)
    blocks = PROMPT_TOKENS // BLOCK_SIZE
    print(
        f"lookup of {blocks} blocks: {lookup:.0f} us (best of {rounds}); their record "
        f"checksums alone: {checksums:.0f} us = {100 * checksums / lookup:.0f}% of it, "
        f"{1000 * checksums / blocks:.0f} ns a block"
    )


if __name__ == "__main__":
    main()
