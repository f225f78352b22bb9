"""The deploy kit's checks: the `deploy` marker, tool lookup, and one live stack (the service,
a real Prometheus with our rules, and known traffic) shared by the tests that need it.

Optional tools (promtool, prometheus, kubectl, hadolint, chromium, Python packages such as
yaml or playwright) are looked up inside fixtures and tests, never at import, so this folder
collects anywhere. A missing tool skips its tests, except under CI (the environment variable
CI set), where it fails them: CI installs everything.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tests.deploy.live_stack import LiveStack
    from tests.deploy.redis_stack import RedisStack

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here is a deploy test (select with -m deploy)."""
    for item in items:
        if "tests/deploy/" in item.nodeid:
            item.add_marker(pytest.mark.deploy)


def find_tool(name: str) -> Path | None:
    """The executable `name`: beside this Python first (the venv's bin), then on PATH."""
    beside = Path(sys.executable).with_name(name)
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which(name)
    return Path(found) if found else None


def missing(reason: str) -> None:
    """Skip for a missing tool; under CI (which installs every tool) fail instead."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: every deploy tool must be installed)")
    pytest.skip(reason)


def require_tool(name: str) -> Path:
    """The executable `name`, or skip (fail under CI) when it is not installed."""
    path = find_tool(name)
    if path is None:
        missing(f"{name} is not installed (not beside {sys.executable}, not on PATH)")
        raise AssertionError("unreachable")  # missing() always raises
    return path


def require_module(name: str) -> Any:
    """The Python module `name`, or skip (fail under CI) when it is not installed."""
    try:
        return importlib.import_module(name)
    except ImportError:
        missing(f"the Python package of {name!r} is not installed")
        raise


@pytest.fixture(scope="session")
def promtool() -> Path:
    """Debian's promtool (package prometheus)."""
    return require_tool("promtool")


@pytest.fixture(scope="session")
def prometheus_binary() -> Path:
    """Debian's prometheus server."""
    return require_tool("prometheus")


@pytest.fixture(scope="session")
def live_stack(
    prometheus_binary: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveStack]:
    """The service with tenant keys and a metrics port, a Prometheus scraping it every second
    with our rule files, and known traffic, scraped and evaluated; started once, stopped by
    PID at the end of the session."""
    from tests.deploy.live_stack import start_live_stack  # noqa: PLC0415

    with start_live_stack(prometheus_binary, tmp_path_factory.mktemp("live-stack")) as stack:
        yield stack


@pytest.fixture(scope="session")
def redis_stack(
    prometheus_binary: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RedisStack]:
    """The service on a real redis-server, a Prometheus scraping it every second with our
    rule files, traffic, then Redis killed: lookups failed and stores refused, scraped and
    evaluated; started once, every process stopped by PID at the end of the session."""
    from tests.deploy.redis_stack import start_redis_stack  # noqa: PLC0415

    with start_redis_stack(prometheus_binary, tmp_path_factory.mktemp("redis-stack")) as stack:
        yield stack
