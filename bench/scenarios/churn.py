"""LMDB file size against live data after churn (stores far beyond the capacity)."""

from __future__ import annotations

from bench.peers.payloads import prefix_blocks
from bench.report import Row
from bench.scenarios.context import Context
from bench.services import our_service
from cache_service.client import CacheClient
from cache_service.core.tokens import tokens_to_bytes

MODEL = "bench"
CAPACITY = "128MiB"


def run(ctx: Context) -> list[Row]:
    """Store `rounds` x 28 MiB through a 128 MiB cache; compare data.mdb with live pages."""
    blocks = prefix_blocks()
    rounds = ctx.reps(8, 24)
    with our_service(capacity=CAPACITY) as service, CacheClient(service.url, timeout=120) as client:
        for index in range(rounds):
            base = index * 10**6
            client.put_prefix(MODEL, tokens_to_bytes(range(base, base + 32768)), blocks)
        stats = client.stats()
        assert service.data_dir is not None
        file_bytes = (service.data_dir / "data.mdb").stat().st_size
        rss = service.peak_rss_mib()
    live = stats["used_bytes"]
    case = f"{rounds} x 28 MiB through a {CAPACITY} cache"
    return [
        Row("memory", case, "LMDB data.mdb", "-", file_bytes / 2**20, "MiB on disk",
            ratio=file_bytes / live if live else None, ratio_to="live pages",
            extra={"live_bytes": live, "payload_bytes": stats["payload_bytes"]}),
        Row("memory", case, "live pages", "-", live / 2**20, "MiB"),
        Row("memory", "churn scenario", "ours", "-", rss, "MiB peak RSS"),
    ]  # fmt: skip
