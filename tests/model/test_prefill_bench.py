"""bench/prefill_ttft.py end to end on the tiny seeded model against a real service."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LENGTH = 256
SHARES = (0.5, 0.9)


def run_bench(args: list[str], *, seconds: float) -> tuple[int, str]:
    """Run the bench; on a timeout stop it (SIGTERM: its own clean-up stops the service it
    started), killing it only if that does not end it."""
    bench = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _, err = bench.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        bench.send_signal(signal.SIGTERM)
        try:
            _, err = bench.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            bench.kill()
            _, err = bench.communicate()
        return -1, f"timed out after {seconds} s\n{err.decode()}"
    return bench.returncode, err.decode()


def test_prefill_bench_measures_every_cell_and_writes_its_files(tmp_path: Path) -> None:
    args = [sys.executable, "-m", "bench.prefill_ttft", "--model", "tiny"]
    args += ["--lengths", str(LENGTH), "--repeats", "1", "--shares", "0.5,0.9"]
    args += ["--out-dir", str(tmp_path)]
    status, stderr = run_bench(args, seconds=120)
    assert status == 0, stderr

    result = json.loads((tmp_path / "prefill-ttft.json").read_text())
    block = result["block_size"]
    assert block == 64  # the service's default, asked by the worker
    samples = result["samples"]
    uncached = [s for s in samples if s["kind"] == "uncached"]
    assert len(uncached) == 1 and uncached[0]["first_token_seconds"] > 0
    for share in (0.0, *SHARES):
        runs = [s for s in samples if s["kind"] == "share" and s["share"] == share]
        assert len(runs) == 1, share
        run = runs[0]
        assert run["cached_tokens"] == int(share * LENGTH) // block * block
        assert run["prompt_tokens"] == LENGTH
        for key in ("lookup_seconds", "compute_seconds", "first_token_seconds"):
            assert run[key] > 0, (share, key)
        assert run["load_seconds"] > 0 or share == 0.0  # a miss loads nothing
        total = run["lookup_seconds"] + run["load_seconds"] + run["compute_seconds"]
        assert abs(run["first_token_seconds"] - total) < 1e-9
    # The miss stored the whole prompt, which the later prefills hit.
    miss = next(s for s in samples if s["kind"] == "share" and s["share"] == 0.0)
    assert miss["stored_blocks"] == LENGTH // block

    cells = {(c["length"], c["share"]): c for c in result["cells"]}
    assert set(cells) == {(LENGTH, share) for share in (0.0, *SHARES)}
    for cell in cells.values():
        assert cell["first_token_seconds"] > 0 and cell["uncached_seconds"] > 0

    # One block is the break-even grid's smallest cut: end to end, and its parts alone.
    grid = result["breakeven"][0]["rows"]
    assert grid[0]["cached_tokens"] == block
    for key in ("fetch_seconds", "first_token_seconds", "fetch_alone_seconds"):
        assert grid[0][key] > 0, key
    assert grid[0]["compute_alone_seconds"] > 0
    ends = [s for s in samples if s["kind"] == "breakeven"]
    assert [(s["cached_tokens"], s["prompt_tokens"]) for s in ends] == [(block, LENGTH)]

    # 2 layers x 2 KV heads x 16 x float32, keys and values: 512 B a token.
    assert result["kv"]["kv_bytes_per_token"] == 512
    assert result["kv"]["service_blocks"] > 0
    text = (tmp_path / "prefill-ttft.md").read_text()
    assert "| 256 | 50% | 128 (50.0%) |" in text
    assert (tmp_path / "prefill-ttft.png").stat().st_size > 0

    # --render rewrites the same report from the saved samples, measuring nothing.
    again = tmp_path / "again"
    args = [sys.executable, "-m", "bench.prefill_ttft", "--render"]
    args += [str(tmp_path / "prefill-ttft.json"), "--out-dir", str(again)]
    status, stderr = run_bench(args, seconds=60)
    assert status == 0, stderr
    assert (again / "prefill-ttft.md").read_text() == text
    assert json.loads((again / "prefill-ttft.json").read_text()) == result
