"""Run inside LMCache's own virtual environment: time its client against `lmcache_server`.

Usage: python lmcache_client.py PAYLOADS_PY PORT COUNTS_JSON
(COUNTS_JSON: {"prefix_store": N, "prefix_fetch": N, "single": N, "prefix_fetch_warmup": 0|1})

Not imported by the bench (it needs torch and lmcache, which live only in that venv). It loads
`payloads.py` by path so the blocks are the very bytes every other peer moves, then drives
`LMCServerConnector` -- the client LMCache's engine uses for an `lm://host:port` remote URL --
over one socket, and prints one JSON object of per-repetition seconds on its last line.

A PUT has no reply in LMCache's protocol, so a store is timed up to the answer of an EXIST
on the last key sent: the server handles one connection's commands in order, so that answer
comes after every block was received and stored. A fetch is timed up to the last block
received into the client's buffers (LMCache's own `recv_into`, no copy to `bytes`); the bytes
are compared with the payload outside the timing.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib.metadata
import importlib.util
import json
import logging
import sys
import time
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

# The 32k prefix as LMCache sees it: chunks of 64 tokens, uint8 "KV" of shape
# (layers=5, k/v=2, tokens=64, heads=1, head_size=89): 2 * 5 * 64 * 89 = 56,960 bytes = 64 x 890.
KV_SHAPE = (5, 2, 64, 1, 89)
CHUNK_TOKENS = 64


def _load_payloads(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("bench_payloads", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _key(chunk_hash: int) -> CacheEngineKey:
    return CacheEngineKey("bench", 1, 0, chunk_hash, torch.uint8)


class Bench:
    """One connector, one event loop, one CPU allocator: LMCache's client as an engine has it."""

    def __init__(self, port: int) -> None:
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK_TOKENS,
            local_cpu=False,
            max_local_cpu_size=1.0,  # GB of client buffers: 28 MiB fetched at a time, freed after
            remote_url=f"lm://127.0.0.1:{port}",
            remote_serde="naive",
        )
        metadata = LMCacheMetadata(
            model_name="bench",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.uint8,
            kv_shape=KV_SHAPE,
            chunk_size=CHUNK_TOKENS,
        )
        self.backend = LocalCPUBackend(config, metadata)
        self.loop = asyncio.new_event_loop()
        self.connector = LMCServerConnector("127.0.0.1", port, self.loop, self.backend)

    def to_memory(self, payload: bytes) -> Any:
        """A client buffer holding `payload`, shaped as a KV chunk of the same size."""
        if len(payload) % (2 * KV_SHAPE[0] * KV_SHAPE[4]) == 0:
            tokens = len(payload) // (2 * KV_SHAPE[0] * KV_SHAPE[4])
            shape = torch.Size([2, KV_SHAPE[0], tokens, KV_SHAPE[4]])
        else:
            shape = torch.Size([2, 1, 1, len(payload) // 2])
        memory = self.backend.allocate(shape, torch.uint8)
        assert memory is not None, "LMCache's CPU allocator is full"
        assert memory.get_size() == len(payload), (memory.get_size(), len(payload))
        ctypes.memmove(memory.data_ptr, payload, len(payload))  # byte_array is a '<B' view
        return memory

    async def store(self, keys: list[CacheEngineKey], memories: list[Any]) -> None:
        for key, memory in zip(keys, memories, strict=True):
            await self.connector.put(key, memory)
        if not await self.connector.exists(keys[-1]):
            raise RuntimeError("lmcache_server does not have the last block just stored")

    async def fetch(self, keys: list[CacheEngineKey]) -> list[Any]:
        fetched = []
        for key in keys:
            memory = await self.connector.get(key)
            if memory is None:
                raise RuntimeError("lmcache_server missed a block just stored")
            fetched.append(memory)
        return fetched

    def timed(self, coroutine: Any) -> tuple[float, Any]:
        started = time.perf_counter()
        result = self.loop.run_until_complete(coroutine)
        return time.perf_counter() - started, result


def _check_and_free(fetched: list[Any], expected: list[bytes]) -> None:
    for memory, payload in zip(fetched, expected, strict=True):
        if memory.byte_array.tobytes() != payload:
            raise RuntimeError("fetched payload differs from what was stored")
        memory.ref_count_down()


def run(
    bench: Bench,
    payloads: list[bytes],
    *,
    stores: int,
    fetches: int,
    fetch_warmup: int,
    first_hash: int,
) -> dict[str, Any]:
    """Seconds per store and per fetch of `payloads`; one untimed store first."""
    memories = [bench.to_memory(payload) for payload in payloads]
    store_seconds, fetch_seconds = [], []
    keys: list[CacheEngineKey] = []
    for index in range(1 + stores):  # fresh keys each time: a store inserts, as in Redis
        base = first_hash + index * len(payloads)
        keys = [_key(base + i) for i in range(len(payloads))]
        seconds, _ = bench.timed(bench.store(keys, memories))
        if index:
            store_seconds.append(seconds)
    for index in range(fetch_warmup + fetches):
        seconds, fetched = bench.timed(bench.fetch(keys))
        _check_and_free(fetched, payloads)
        if index >= fetch_warmup:
            fetch_seconds.append(seconds)
    for memory in memories:
        memory.ref_count_down()
    return {"store_seconds": store_seconds, "fetch_seconds": fetch_seconds}


def main() -> None:
    """Measure and print JSON."""
    logging.disable(logging.WARNING)
    payloads_path, port, counts_json = sys.argv[1:4]
    counts = json.loads(counts_json)
    payloads = _load_payloads(payloads_path)
    bench = Bench(int(port))
    import lmcache  # noqa: PLC0415

    result: dict[str, Any] = {
        "lmcache_version": getattr(lmcache, "__version__", None)
        or importlib.metadata.version("lmcache"),
        "torch_version": torch.__version__,
    }
    blocks = payloads.prefix_blocks()
    result["prefix"] = run(
        bench,
        blocks,
        stores=counts["prefix_store"],
        fetches=counts["prefix_fetch"],
        fetch_warmup=counts.get("prefix_fetch_warmup", 1),
        first_hash=1,
    )
    result["prefix"]["payload_bytes"] = sum(map(len, blocks))
    result["prefix"]["blocks"] = len(blocks)
    for number, (label, payload) in enumerate(payloads.single_blocks().items()):
        result[label] = run(
            bench,
            [payload],
            stores=counts["single"],
            fetches=counts["single"],
            fetch_warmup=1,
            first_hash=10**9 * (number + 1),
        )
        result[label]["payload_bytes"] = len(payload)
    bench.loop.run_until_complete(bench.connector.close())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
