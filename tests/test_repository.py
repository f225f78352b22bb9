"""The repository stands alone: what its tests, examples and deployments need is inside it."""

from __future__ import annotations

import re
import subprocess
import tomllib
from fnmatch import fnmatch
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "deploy" / "requirements.lock"
# Written in two parts so that this file does not match itself.
OUTSIDE_FOLDER = re.compile(r"\.\./" + r"shared|/ *[\"']" + r"shared[/\"']")


def tracked_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    return [REPO / name.decode() for name in listed if name]


def locked_versions() -> dict[str, str]:
    """Name -> pinned version of every line of the lock that applies to this interpreter."""
    pins: dict[str, str] = {}
    for line in LOCK.read_text().splitlines():
        if not line or line[0] in " #-":
            continue
        requirement = Requirement(line.rstrip(" \\"))
        if requirement.marker is None or requirement.marker.evaluate():
            (spec,) = requirement.specifier
            pins[canonicalize_name(requirement.name)] = spec.version
    return pins


def test_nothing_in_the_repository_reads_a_folder_beside_the_checkout() -> None:
    offenders = []
    for path in tracked_files():
        if not path.is_file() or path.suffix in {".jsonl", ".json", ".txt"}:
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE_FOLDER.search(line):
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert offenders == []


def test_the_replay_guide_s_examples_name_traces_the_repository_carries() -> None:
    guide = (REPO / "docs" / "content" / "guides" / "replay.md").read_text()
    traces = re.findall(r"cache-service replay (\S+\.jsonl)", guide)
    assert traces, "the replay guide shows no replay example"
    for trace in traces:
        assert (REPO / trace).is_file(), trace
        assert (REPO / trace).stat().st_size > 1_000_000


def test_deployment_lock_pins_every_runtime_dependency_within_its_bounds() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = locked_versions()
    environment = default_environment()
    for line in project["dependencies"]:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate(environment):
            continue
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} is not in {LOCK.name}: regenerate it (README, Install)"
        assert requirement.specifier.contains(pins[name]), (
            f"{LOCK.name} pins {name}=={pins[name]}, outside pyproject's {requirement.specifier}"
        )


def test_deployment_lock_carries_a_hash_for_every_pin() -> None:
    for block in re.split(r"\n(?=[a-z0-9])", LOCK.read_text()):
        if block.strip() and not block.startswith("#"):
            assert "--hash=sha256:" in block, block.splitlines()[0]


def test_every_data_file_of_the_package_is_declared_so_that_a_wheel_ships_it() -> None:
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared = {
        REPO.joinpath(*package.split(".")): patterns
        for package, patterns in tool.get("package-data", {}).items()
    }

    def shipped(path: Path) -> bool:
        return any(
            path.is_relative_to(folder)
            and any(fnmatch(str(path.relative_to(folder)), pattern) for pattern in patterns)
            for folder, patterns in declared.items()
        )

    data = [p for p in tracked_files() if p.is_relative_to(REPO / "cache_service")]
    missing = [str(p.relative_to(REPO)) for p in data if p.suffix != ".py" and not shipped(p)]
    assert missing == [], "declare these in pyproject.toml's [tool.setuptools.package-data]"
