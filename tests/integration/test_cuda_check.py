"""bench/gpu/cuda_check.py, the GPU page copy's check, runs here on host tensors: the script
carried to a GPU machine is kept working, and its bytes step passes through both host copies
(in place, and the GPU copy's staging without streams) against a real service."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")  # the [model] extra (README's command)
pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def test_the_gpu_check_runs_on_host_tensors(tmp_path: Path) -> None:
    out = tmp_path / "cuda-check.json"
    args = ["--device", "cpu", "--tokens", "64", "--rounds", "1", "--out", str(out)]
    run = subprocess.run(
        [sys.executable, "-m", "bench.gpu.cuda_check", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads(out.read_text())
    checked = report["bytes"]
    # the fixture's 17 block-compact (case, layout) pairs: GQA bf16 and fp8 under 4 layouts
    # each, MLA under all 6, MLA in kernel blocks under the 3 L-outer ones; both copies each
    assert len(checked) == 34
    assert {name.rsplit("-", 1)[1] for name in checked} == {"host", "staged"}
    assert all(
        outcome == "ok http/sync http/async local/sync local/async" for outcome in checked.values()
    )
    assert report["order"] == "not run: needs CUDA"
    for copy in ("host", "staged"):
        speed = report["speed"][copy]
        assert speed["save_gb_s"] > 0 and speed["service"]["load_local_reads_gb_s"] > 0
