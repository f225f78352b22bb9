"""The reliability suite's fixtures: its scale (short in CI, long on request) and its report.

Run the long form with `python -m pytest tests/reliability --reliability=long`; README.md's
Reliability section records the last long run's figures.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here is a reliability test (select with -m reliability)."""
    for item in items:
        if "tests/reliability/" in item.nodeid:
            item.add_marker(pytest.mark.reliability)


@pytest.fixture
def long_run(request: pytest.FixtureRequest) -> bool:
    """Whether this is the long run (--reliability=long)."""
    return bool(request.config.getoption("--reliability") == "long")


@pytest.fixture
def scale(long_run: bool) -> Callable[[int, int], int]:
    """scale(short, long): the count for this run, e.g. scale(30, 1000) kill cycles."""
    return lambda short, long: long if long_run else short
