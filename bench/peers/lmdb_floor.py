"""The storage floor: LMDB read and write in-process, no server, no network.

The 32k prefix's 512 blocks are written in one write transaction and committed, once with
`sync=True` (the commit waits for fsync: durable) and once with `sync=False` (the OS flushes
later: survives a process crash, not a power loss); the case names the mode. Reads take one
read transaction and copy each value out as `bytes` (`buffers=False`), and, for the zero-copy
bound, return memoryviews into the map (`buffers=True`). Single 256 KiB and 2 MiB blocks are
written and read one per transaction. The environment lives in a fresh temporary directory on
the file system named in the note; before each timed write the database is emptied, untimed.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench.peers.harness import (
    SINGLE_BLOCK_REPETITION_FACTOR,
    check_equal,
    payload_rows,
    time_calls,
)
from bench.peers.payloads import (
    SCENARIO,
    block_keys,
    prefix_blocks,
    prefix_case,
    single_blocks,
    single_case,
)
from bench.report import Row, skipped

SUBJECT = "lmdb"
CLIENT = "py-lmdb, in-process"
MAP_SIZE_BYTES = 1 << 30


def _file_system(path: str) -> str:
    """The type and device of the mount holding `path`, e.g. "ext4 on /dev/vda"."""
    best = ("", "unknown", "?")
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                device, mount_point, kind = line.split()[:3]
                if path.startswith(mount_point) and len(mount_point) >= len(best[0]):
                    best = (mount_point, kind, device)
    except OSError:
        return "unknown file system"
    return f"{best[1]} on {best[2]}"


def _measure_in(directory: Path, *, repetitions: int) -> list[Row]:
    import lmdb  # noqa: PLC0415

    blocks = prefix_blocks()
    keys = block_keys(len(blocks), namespace=b"lmdb-prefix")
    prefix_bytes = sum(map(len, blocks))
    singles = single_blocks()
    single_repetitions = repetitions * SINGLE_BLOCK_REPETITION_FACTOR
    note = f"temp dir, {_file_system(str(directory))}"
    rows: list[Row] = []
    for sync in (True, False):
        path = directory / f"sync-{sync}"
        env = lmdb.open(str(path), map_size=MAP_SIZE_BYTES, sync=sync, metasync=sync)
        try:

            def empty(env: lmdb.Environment = env) -> None:
                with env.begin(write=True) as txn:
                    txn.drop(env.open_db(), delete=False)

            def write(
                pairs: list[tuple[bytes, bytes]], env: lmdb.Environment = env
            ) -> Callable[[], None]:
                def work() -> None:
                    with env.begin(write=True) as txn:
                        for key, value in pairs:
                            txn.put(key, value)

                return work

            mode = f"sync={sync}"
            pairs = list(zip(keys, blocks, strict=True))
            seconds = time_calls(write(pairs), repetitions=repetitions, before=empty)
            rows += payload_rows(
                prefix_case("store", f"1 txn, {mode}"),
                SUBJECT,
                CLIENT,
                seconds,
                payload_bytes=prefix_bytes,
                note=note,
            )
            for label, value in singles.items():
                key = block_keys(1, namespace=f"lmdb-{label}".encode())[0]
                seconds = time_calls(write([(key, value)]), repetitions=single_repetitions)
                rows += payload_rows(
                    single_case(label, "store", mode),
                    SUBJECT,
                    CLIENT,
                    seconds,
                    payload_bytes=len(value),
                    note=note,
                )
            if sync:
                continue
            # Reads do not depend on the sync mode: measure them once, on the last write.

            def read(
                read_keys: list[bytes], env: lmdb.Environment = env
            ) -> Callable[[], list[bytes | None]]:
                def work() -> list[bytes | None]:
                    with env.begin() as txn:
                        return [txn.get(key) for key in read_keys]

                return work

            def read_views(env: lmdb.Environment = env) -> int:
                with env.begin(buffers=True) as txn:  # views are valid only inside the txn
                    return sum(len(txn.get(key) or b"") for key in keys)

            def check_total(total: object) -> None:
                if total != prefix_bytes:
                    raise AssertionError(f"read {total} bytes, stored {prefix_bytes}")

            seconds = time_calls(read(keys), repetitions=repetitions, check=check_equal(blocks))
            rows += payload_rows(
                prefix_case("fetch", "copied to bytes"),
                SUBJECT,
                CLIENT,
                seconds,
                payload_bytes=prefix_bytes,
                note=note,
            )
            seconds = time_calls(read_views, repetitions=repetitions, check=check_total)
            rows += payload_rows(
                prefix_case("fetch", "zero-copy views"),
                SUBJECT,
                CLIENT,
                seconds,
                payload_bytes=prefix_bytes,
                note=f"{note}; bound: nothing copied",
            )
            for label, value in singles.items():
                key = block_keys(1, namespace=f"lmdb-{label}".encode())[0]
                seconds = time_calls(
                    read([key]), repetitions=single_repetitions, check=check_equal([value])
                )
                rows += payload_rows(
                    single_case(label, "fetch", "copied to bytes"),
                    SUBJECT,
                    CLIENT,
                    seconds,
                    payload_bytes=len(value),
                    note=note,
                )
        finally:
            env.close()
    return rows


def measure(*, quick: bool, repetitions: int, allow_install: bool) -> list[Row]:
    """LMDB in-process store (sync=True and sync=False) and fetch of the same payloads."""
    del quick, allow_install  # lmdb is a dependency of the project itself
    try:
        import lmdb  # noqa: F401, PLC0415
    except ImportError:
        return [skipped(SCENARIO, prefix_case("store/fetch"), SUBJECT, "lmdb not importable")]
    with tempfile.TemporaryDirectory(prefix="bench-lmdb-", dir=os.environ.get("TMPDIR")) as tmp:
        return _measure_in(Path(tmp), repetitions=repetitions)
