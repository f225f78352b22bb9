"""The KV cache views the page seam's tests lay out are vLLM 0.32's own: running
tests/vllm/kv_views.py (vLLM's `create_kv_cache_views` for every case and layout) gives
exactly tests/fixtures/vllm_kv_views.json. After a vLLM upgrade, write the file again with
`.venv-vllm/bin/python tests/vllm/kv_views.py > tests/fixtures/vllm_kv_views.json`."""

from __future__ import annotations

import json
import subprocess

from tests.vllm.conftest import REPO, VLLM_PYTHON


def test_the_recorded_views_are_the_ones_vllm_builds() -> None:
    done = subprocess.run(
        [str(VLLM_PYTHON), str(REPO / "tests/vllm/kv_views.py")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        check=True,
    )
    recorded = (REPO / "tests/fixtures/vllm_kv_views.json").read_text(encoding="utf-8")
    assert json.loads(done.stdout) == json.loads(recorded)
