"""What the clock-goes-back rule (core.lifetimes) costs a long lookup: a 32k-token prompt
(512 blocks of 64 tokens) matched on LMDB, per retention class, with no retention table, with
the table, and with the table while the clock reads earlier than the latest write (the only
time a lookup reads each block's class name).

Usage: python -m bench.lifetimes_lookup [--rounds 300]
"""

from __future__ import annotations

import argparse
import tempfile
import time

from cache_service.core.blocks import Chain, Namespace, NewBlock
from cache_service.core.hashing import BlockHasher
from cache_service.core.lifetimes import UNBOUNDED, Lifetimes
from cache_service.core.retention import DEFAULT_RETENTION
from cache_service.core.store.lmdb.store import LmdbStore
from cache_service.core.tokens import tokens_to_bytes

PROMPT_TOKENS = 32768
BLOCK_SIZE = 64
STORED_AT = 1_000_000.0


def main() -> None:
    """Print the best lookup time of each case."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=300)
    rounds = parser.parse_args().rounds
    hasher, namespace = BlockHasher(), Namespace(model="bench")
    scope = hasher.namespace_id(namespace)
    table = Lifetimes(dict(DEFAULT_RETENTION))
    with tempfile.TemporaryDirectory() as folder:
        # Written as a cache's store writes them; then opened again under each case's table.
        store = LmdbStore(folder, map_size_bytes=1 << 30, lifetimes=table)
        chains: dict[str, Chain] = {}
        for number, retention in enumerate(DEFAULT_RETENTION):
            tokens = [number * PROMPT_TOKENS + i for i in range(PROMPT_TOKENS)]
            chain = hasher.chain(namespace, tokens_to_bytes(tokens), block_size=BLOCK_SIZE)
            blocks = [NewBlock(link, b"x" * 64) for link in chain]
            store.insert(scope, blocks, parent=None, now=STORED_AT, retention=retention,
                         ttl_seconds=DEFAULT_RETENTION[retention])  # fmt: skip
            chains[retention] = chain
        store.close()
        cases = (("no table", UNBOUNDED, 0.0), ("table", table, 0.0),
                 ("table, clock behind a write", table, -0.5))  # fmt: skip
        for name, lifetimes, offset in cases:
            store = LmdbStore(folder, map_size_bytes=1 << 30, lifetimes=lifetimes)
            for retention, chain in chains.items():
                best = float("inf")
                for _ in range(rounds):
                    started = time.perf_counter()
                    found = store.match(scope, chain, now=STORED_AT + offset)
                    best = min(best, time.perf_counter() - started)
                assert found.matched == len(chain)
                print(f"{name:28s} {retention:6s} {len(chain)}-block lookup: {best * 1e6:.0f} us")
            store.close()


if __name__ == "__main__":
    main()
