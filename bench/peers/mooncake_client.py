"""Run inside Mooncake's own virtual environment: a segment host, or the timed client.

Usage: python mooncake_client.py segment RPC_PORT METADATA_PORT SEGMENT_BYTES
       python mooncake_client.py client RPC_PORT METADATA_PORT PAYLOADS_PY COUNTS_JSON
(COUNTS_JSON: {"prefix": N, "single": N, "distribution": the pip name, for its version})

Not imported by the bench (it needs `mooncake`, which lives only in that venv). A `segment`
process waits for the master, mounts SEGMENT_BYTES of its memory into the store, prints
"ready" and waits to be stopped: it is the storage server. The `client` process mounts no
memory of its own, so every put and get moves over Mooncake's TCP transport to the segment
host. It loads `payloads.py` by path (the very bytes every other peer moves), times
`put_batch`/`get_batch` of the 32k prefix's 512 blocks and `put`/`get` of single blocks (the
bytes API, as redis-py returns bytes), and prints one JSON object on its last line. Before
each timed store, `remove_all` empties the store, untimed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from mooncake.store import MooncakeDistributedStore

CLIENT_BUFFER_BYTES = 128 * 1024 * 1024  # the client's registered transfer buffer


def _load_payloads(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("bench_payloads", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _open(
    rpc_port: str, metadata_port: str, segment_bytes: int, *, wait_seconds: float = 0
) -> MooncakeDistributedStore:
    """A store client; retried for `wait_seconds` while the master is still starting."""
    deadline = time.monotonic() + wait_seconds
    while True:
        store = MooncakeDistributedStore()
        code = store.setup(
            "127.0.0.1",
            f"http://127.0.0.1:{metadata_port}/metadata",
            segment_bytes,
            CLIENT_BUFFER_BYTES,
            "tcp",
            "",
            f"127.0.0.1:{rpc_port}",
        )
        if code == 0:
            return store
        if time.monotonic() > deadline:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {code}")
        time.sleep(0.2)


def _timed(
    work: Callable[[], Any],
    count: int,
    *,
    before: Callable[[], Any] | None = None,
    check: Callable[[Any], None] | None = None,
) -> list[float]:
    seconds = []
    for index in range(1 + count):  # one untimed warm-up
        if before is not None:
            before()
        started = time.perf_counter()
        result = work()
        elapsed = time.perf_counter() - started
        if check is not None:
            check(result)
        if index:
            seconds.append(elapsed)
    return seconds


def _expect(expected: list[bytes]) -> Callable[[Any], None]:
    def check(result: Any) -> None:
        values = result if isinstance(result, list) else [result]
        if len(values) != len(expected) or any(
            bytes(got) != want for got, want in zip(values, expected, strict=True)
        ):
            raise RuntimeError("fetched payload differs from what was stored")

    return check


def _succeeded(code: int) -> None:
    if code != 0:
        raise RuntimeError(f"put returned {code}")


def client(
    rpc_port: str, metadata_port: str, payloads_path: str, counts: dict[str, Any]
) -> dict[str, Any]:
    """Seconds per store and fetch of the prefix and of each single block."""
    payloads = _load_payloads(payloads_path)
    store = _open(rpc_port, metadata_port, 0)
    blocks = payloads.prefix_blocks()
    keys = [f"prefix-{i}" for i in range(len(blocks))]
    distribution = counts.get("distribution", "mooncake-transfer-engine-non-cuda")
    result: dict[str, Any] = {"mooncake_version": importlib.metadata.version(distribution)}
    result["prefix"] = {
        "store_seconds": _timed(
            lambda: store.put_batch(keys, blocks),
            counts["prefix"],
            before=store.remove_all,
            check=_succeeded,
        ),
        "fetch_seconds": _timed(
            lambda: store.get_batch(keys), counts["prefix"], check=_expect(blocks)
        ),
        "payload_bytes": sum(map(len, blocks)),
        "blocks": len(blocks),
    }
    for label, payload in payloads.single_blocks().items():
        key = f"single-{label}"
        result[label] = {
            "store_seconds": _timed(
                partial(store.put, key, payload),
                counts["single"],
                before=store.remove_all,
                check=_succeeded,
            ),
            "fetch_seconds": _timed(
                partial(store.get, key), counts["single"], check=_expect([payload])
            ),
            "payload_bytes": len(payload),
        }
    store.close()
    return result


def main() -> None:
    """Host a segment until stopped, or measure and print JSON."""
    role, rpc_port, metadata_port = sys.argv[1:4]
    if role == "segment":
        store = _open(rpc_port, metadata_port, int(sys.argv[4]), wait_seconds=30)
        print("ready", flush=True)
        try:
            while True:
                time.sleep(3600)
        finally:
            store.close()
    print(json.dumps(client(rpc_port, metadata_port, sys.argv[4], json.loads(sys.argv[5]))))


if __name__ == "__main__":
    main()
