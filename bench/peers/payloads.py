"""The payload workload shared by our service and every peer.

A 32k-token prefix at 890 bytes per token in blocks of 64 tokens: 512 blocks of 56,960 bytes
(29,163,520 bytes, about 27.8 MiB), and single blocks of 256 KiB and 2 MiB. Bytes are
pseudo-random from a fixed seed, so every run and every peer moves the same data and nothing
compresses.
"""

from __future__ import annotations

import hashlib
import random

SCENARIO = "payload"
PREFIX_TOKENS = 32768
BLOCK_TOKENS = 64
BYTES_PER_TOKEN = 890
SINGLE_BLOCK_BYTES = {"256 KiB": 256 * 1024, "2 MiB": 2 * 1024 * 1024}
MB_PER_S = "MB/s (10^6 B)"  # the unit of every bandwidth row: MB = 10^6 bytes


def prefix_blocks(
    tokens: int = PREFIX_TOKENS,
    block_tokens: int = BLOCK_TOKENS,
    bytes_per_token: int = BYTES_PER_TOKEN,
    seed: int = 0,
) -> list[bytes]:
    """The payloads of a prefix's full blocks: deterministic random bytes, one per block."""
    block_bytes = block_tokens * bytes_per_token
    count = tokens // block_tokens
    data = random.Random(seed).randbytes(block_bytes * count)
    return [data[i * block_bytes : (i + 1) * block_bytes] for i in range(count)]


def single_block(size_bytes: int, seed: int = 1) -> bytes:
    """One block of `size_bytes` deterministic random bytes."""
    return random.Random(seed).randbytes(size_bytes)


def single_blocks() -> dict[str, bytes]:
    """The single-block payloads by label ("256 KiB", "2 MiB")."""
    return {label: single_block(size) for label, size in SINGLE_BLOCK_BYTES.items()}


def block_keys(count: int, namespace: bytes = b"bench") -> list[bytes]:
    """`count` distinct 16-byte keys, the size of our xxh3-128 block keys."""
    return [
        hashlib.blake2b(namespace + i.to_bytes(8, "little"), digest_size=16).digest()
        for i in range(count)
    ]


def prefix_case(operation: str, detail: str = "") -> str:
    """The case name of a 32k-prefix row, e.g. "32k prefix fetch, 512 blocks"."""
    return f"32k prefix {operation}" + (f", {detail}" if detail else "")


def single_case(label: str, operation: str, detail: str = "") -> str:
    """The case name of a single-block row, e.g. "2 MiB block store"."""
    return f"{label} block {operation}" + (f", {detail}" if detail else "")
