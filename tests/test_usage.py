"""The usage log: JSON lines per lookup, rotated by size."""

from __future__ import annotations

import json
from pathlib import Path

from cache_service.service.usage import UsageLog


def test_records_are_json_lines_written_at_flush(tmp_path: Path) -> None:
    log = UsageLog(tmp_path / "usage.jsonl", clock=lambda: 1_764_417_600.25)
    log.record(tenant="team-a", key_id="a-writer", model="m", hit_tokens=640, miss_tokens=24)
    assert not (tmp_path / "usage.jsonl").exists()
    assert log.flush() == 1
    assert log.flush() == 0
    (line,) = (tmp_path / "usage.jsonl").read_text().splitlines()
    assert json.loads(line) == {
        "time": "2025-11-29T12:00:00.250Z",
        "tenant": "team-a",
        "key": "a-writer",
        "model": "m",
        "prompt_cache_hit_tokens": 640,
        "prompt_cache_miss_tokens": 24,
    }


def test_the_log_rotates_by_size_and_keeps_a_bounded_number_of_files(tmp_path: Path) -> None:
    path = tmp_path / "usage.jsonl"
    log = UsageLog(path, max_bytes=500, keep=2)
    written = 0
    for round_ in range(12):
        for _ in range(3):
            log.record(tenant="t", key_id="k", model="m", hit_tokens=round_, miss_tokens=0)
        written += log.flush()
    files = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock"))
    # The current file, if the last flush did not just rotate it, and two older ones.
    assert files in (["usage.jsonl", "usage.jsonl.1", "usage.jsonl.2"],
                     ["usage.jsonl.1", "usage.jsonl.2"])  # fmt: skip
    # A file is rotated once a flush takes it past 500 bytes: at most one flush (3 lines) over.
    assert all(p.stat().st_size < 500 + 3 * 160 for p in tmp_path.glob("usage.jsonl*"))
    kept = [json.loads(x) for p in tmp_path.glob("usage.jsonl*") for x in p.read_text().split()]
    assert max(r["prompt_cache_hit_tokens"] for r in kept) == 11  # the newest are kept
    assert written == 36
