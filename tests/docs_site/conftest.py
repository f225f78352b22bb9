"""The documentation site (docs/mkdocs.yml): built once per session, strictly, for the tests
here. MkDocs and its theme come with the `docs` extra (README's test command installs it);
without them these tests skip, except under CI (the environment variable CI set), where they
fail: CI installs everything."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "docs" / "mkdocs.yml"
CONTENT = REPO / "docs" / "content"
BUILD_SECONDS = 300


def needs(module: str) -> None:
    """Skip (or, under CI, fail) when `module` cannot be imported."""
    if importlib.util.find_spec(module) is None:
        message = f"{module} is missing: pip install -e '.[docs]'"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="session")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`mkdocs build --strict` of the site into a temporary folder: that folder."""
    needs("mkdocs")
    needs("material")
    site = tmp_path_factory.mktemp("site")
    # The theme's end-of-support banner goes to stderr on every build; it is not a warning.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(CONFIG), "-d", str(site)],
        capture_output=True,
        text=True,
        env=env,
        timeout=BUILD_SECONDS,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("WARNING")]
    assert warnings == [], "\n".join(warnings)
    return site
