"""The layers written down in pyproject.toml hold, and they would catch a change that breaks
them: import-linter itself, on this tree and on copies with one import too many."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
CONTRACTS = {
    contract["id"]: " ".join(contract["name"].split())
    for contract in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"
    ]
}

pytestmark = pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter not installed")


def broken_contracts(tree: Path) -> set[str]:
    """The ids of the contracts the real tool finds broken in a tree holding pyproject.toml
    and cache_service/."""
    result = subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(tree / "pyproject.toml")],
        cwd=tree,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    report = " ".join(result.stdout.split())  # long contract names wrap across lines
    verdicts = {
        cid: "BROKEN" if f"{name} BROKEN" in report else "KEPT" if f"{name} KEPT" in report else ""
        for cid, name in CONTRACTS.items()
    }
    assert all(verdicts.values()), result.stdout + result.stderr
    broken = {cid for cid, verdict in verdicts.items() if verdict == "BROKEN"}
    assert (result.returncode != 0) == bool(broken), result.stdout
    return broken


def copy_with_import(tmp_path: Path, module: str, statement: str) -> Path:
    """A copy of the package and its contracts with `statement` added to `module`."""
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(
        REPO / "cache_service",
        tmp_path / "cache_service",
        ignore=shutil.ignore_patterns("__pycache__", "static"),
    )
    target = tmp_path / "cache_service" / module
    target.write_text(target.read_text() + f"\n{statement}\n")
    return tmp_path


def test_the_tree_keeps_every_contract() -> None:
    assert broken_contracts(REPO) == set()


@pytest.mark.parametrize(
    ("module", "statement", "broken"),
    [
        # An upward import breaks the layers, and makes a cycle with the import that goes down;
        # from blocks.py, which every module imports, it drags pydantic, the store and the
        # hashing into everything: every contract but the model runtime's, vLLM's and the
        # wire's (whose answers import nothing of the core) breaks.
        (
            "core/blocks.py",
            "import cache_service.service.settings",
            set(CONTRACTS) - {"no-model-runtime", "vllm-only-in-its-connector", "plain-wire"},
        ),
        ("service/metrics.py", "import cache_service.tools.admin", {"layers", "no-cycles"}),
        (
            "client/base.py",
            "import cache_service.service.settings",
            {"layers", "connector-without-server"},  # the connector imports the client
        ),
        ("core/cache.py", "import fastapi", {"plain-core"}),
        ("wire/answers.py", "import pydantic", {"plain-wire"}),
        # The wire sits below the client: reaching up to it makes a cycle, and brings httpx.
        (
            "wire/reader.py",
            "import cache_service.client.failures",
            {"layers", "no-cycles", "plain-wire"},
        ),
        (
            "core/store/parts/records.py",
            "import cache_service.core.hashing",
            {"store-never-hashes"},
        ),
        ("core/hashing.py", "import cache_service.core.store.protocols", {"hashing-never-stores"}),
        ("core/cache_observer.py", "import cache_service.core.cache", {"no-cycles"}),
        (
            "core/store/redis/values.py",
            "import cache_service.core.store.lmdb.store",
            {"store-backends-apart"},
        ),
        (
            "core/store/parts/evictions.py",
            "import cache_service.core.store.memory",
            # LMDB's store imports the parts: through them it would import memory, and
            # memory imports the parts back
            {"store-parts-without-backends", "store-backends-apart", "no-cycles"},
        ),
        (
            "core/store/protocols.py",
            "import cache_service.core.store.parts.codec",
            {"store-protocols-first", "no-cycles"},  # the parts import the protocols
        ),
        ("client/sync.py", "import torch", {"no-model-runtime"}),
        ("client/sync.py", "import vllm", {"vllm-only-in-its-connector"}),
        ("integrations/worker.py", "import vllm.config", {"vllm-only-in-its-connector"}),
        (
            "integrations/vllm/options.py",
            "import cache_service.service.settings",
            {"connector-without-server"},
        ),
        (
            "tools/doctor.py",
            "import cache_service.integrations.worker",
            {"layers", "no-model-runtime"},
        ),
    ],
)
def test_an_import_against_the_layers_breaks_its_contract(
    tmp_path: Path, module: str, statement: str, broken: set[str]
) -> None:
    assert broken_contracts(copy_with_import(tmp_path, module, statement)) == broken
