"""The Dockerfile (deploy/docker/Dockerfile): linted by hadolint, its install and run commands
the README's, its flags the service's, and its health check run against a real server. (No
Docker engine runs here: the image itself is not built.)"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cache_service.service.settings import Settings, is_loopback
from tests.deploy.conftest import require_tool
from tests.deploy.kit import (
    DOCKERFILE,
    README,
    docs_page,
    effective_settings,
    running_service,
    shell_blocks,
    shell_commands,
)
from tests.integration.conftest import free_port

# Options the image adds to README's pip commands, each for a reason of its own.
EXTRA_PIP_OPTIONS = {"--no-cache-dir"}  # no wheel cache left in an image layer


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction: its keyword and the rest of its (joined) line."""

    keyword: str
    rest: str

    def exec_form(self) -> list[str]:
        """The JSON array of an exec-form CMD, ENTRYPOINT or HEALTHCHECK CMD."""
        text = self.rest.split("CMD", 1)[1] if self.keyword == "HEALTHCHECK" else self.rest
        value = json.loads(text)
        assert isinstance(value, list), f"{self.keyword} is not in exec form"
        return [str(part) for part in value]


def read_dockerfile(path: Path = DOCKERFILE) -> list[Instruction]:
    """The instructions of a Dockerfile, continuation lines joined and comments dropped."""
    instructions: list[Instruction] = []
    pending = ""
    for line in path.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        pending += " " + stripped.removesuffix("\\").strip() if pending else stripped
        pending = pending.removesuffix("\\").strip()
        if stripped.endswith("\\"):
            continue
        keyword, _, rest = pending.partition(" ")
        instructions.append(Instruction(keyword.upper(), rest.strip()))
        pending = ""
    return instructions


def only(instructions: list[Instruction], keyword: str) -> Instruction:
    """The last instruction of this kind (the one in force in the final stage)."""
    found = [i for i in instructions if i.keyword == keyword]
    assert found, f"the Dockerfile has no {keyword}"
    return found[-1]


def run_commands(instructions: list[Instruction]) -> list[list[str]]:
    """Every simple command the RUN instructions run, in order."""
    return [
        command for i in instructions if i.keyword == "RUN" for command in shell_commands(i.rest)
    ]


def image_command(instructions: list[Instruction]) -> list[str]:
    """What the image runs by default: ENTRYPOINT then CMD, the program found on its PATH."""
    argv = only(instructions, "ENTRYPOINT").exec_form() + only(instructions, "CMD").exec_form()
    env = only(instructions, "ENV").rest
    path = re.search(r"\bPATH=([^\s]+)", env)
    assert path, "the image sets no PATH"
    first = path[1].split(":")[0]
    return [f"{first}/{argv[0]}", *argv[1:]]


def image_environment(instructions: list[Instruction]) -> dict[str, str]:
    """The variables the final stage's ENV instructions set (KEY=VALUE forms)."""
    final = instructions[max(i for i, ins in enumerate(instructions) if ins.keyword == "FROM") :]
    env: dict[str, str] = {}
    for instruction in final:
        if instruction.keyword == "ENV":
            for pair in shlex.split(instruction.rest):
                name, _, value = pair.partition("=")
                env[name] = value
    return env


def readme_versions_commands() -> list[list[str]]:
    """The docs' Versions page: the commands that install the lock and run the service."""
    (block,) = shell_blocks(docs_page("operations/versions.md"))
    return shell_commands(block)


def readme_run_commands() -> list[list[str]]:
    """README's first command: install the package and run the service."""
    intro = README.read_text(encoding="utf-8").split("\n## ", 1)[0]
    return shell_commands(shell_blocks(intro)[0])


def is_subsequence(short: list[str], long: list[str]) -> bool:
    """Whether `short` appears in `long` in order (other items may come between)."""
    items = iter(long)
    return all(any(part == item for item in items) for part in short)


def flag_names(argv: list[str]) -> set[str]:
    """The --flags of a command line."""
    return {part.split("=", 1)[0] for part in argv if part.startswith("--")}


def test_dockerfile_passes_hadolint() -> None:
    hadolint = require_tool("hadolint")
    done = subprocess.run(
        [str(hadolint), "--no-color", str(DOCKERFILE)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # An ignored rule must say why, on its line.
    for line in DOCKERFILE.read_text().splitlines():
        if "hadolint ignore=" in line:
            assert re.search(r"hadolint ignore=\S+\s+\S", line), f"no reason: {line}"


def test_the_vllm_image_with_the_connector_passes_hadolint() -> None:
    dockerfile = DOCKERFILE.with_name("Dockerfile.vllm")
    done = subprocess.run(
        [str(require_tool("hadolint")), "--no-color", str(dockerfile)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_image_installs_the_lock_then_the_package_as_readme_versions_says() -> None:
    readme = readme_versions_commands()
    installs = [command for command in readme if "serve" not in command]
    assert installs[0][:3] == ["python3", "-m", "venv"], installs
    image = run_commands(read_dockerfile())
    position = 0
    for wanted in installs:  # each in README's order, with README's arguments in order
        for index in range(position, len(image)):
            command = image[index]
            if command[0] == wanted[0] and is_subsequence(wanted, command):
                extra = set(command) - set(wanted)
                assert extra <= EXTRA_PIP_OPTIONS, f"{shlex.join(command)} adds {extra}"
                position = index + 1
                break
        else:
            pytest.fail(f"the Dockerfile does not run README's {shlex.join(wanted)}")


def test_image_runs_readmes_serve_command() -> None:
    instructions = read_dockerfile()
    (versions_serve,) = [c for c in readme_versions_commands() if "serve" in c]
    assert image_command(instructions) == versions_serve
    # README's first command runs the same console script and subcommand with the same flags.
    (first_serve,) = [c for c in readme_run_commands() if "serve" in c]
    assert Path(first_serve[0]).name == Path(versions_serve[0]).name == "cache-service"
    assert first_serve[1] == "serve"
    assert flag_names(first_serve) == flag_names(versions_serve) == {"--data-dir"}
    # Both install this package from the repository root.
    first_installs = [c for c in readme_run_commands() if "install" in c]
    assert any(c[-1] == "." for c in first_installs)
    assert any(c[-1] == "." for c in run_commands(instructions) if "install" in c)


def test_image_default_is_a_loopback_sidecar_on_the_data_volume() -> None:
    instructions = read_dockerfile()
    argv = only(instructions, "ENTRYPOINT").exec_form() + only(instructions, "CMD").exec_form()
    settings = effective_settings(argv[1:], image_environment(instructions))
    # No key and no --allow-unauthenticated: only the pod's (or network namespace's) other
    # containers can reach it until the operator opens it deliberately.
    assert settings.auth == "none"
    assert is_loopback(settings.host)
    assert settings.metrics_port is None
    volumes = json.loads(only(instructions, "VOLUME").rest)
    assert volumes == [str(settings.data_dir)] == ["/data"]


def test_image_runs_as_a_fixed_non_root_user_that_owns_the_volume() -> None:
    instructions = read_dockerfile()
    user = only(instructions, "USER").rest
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0, "a numeric, non-root USER (runAsNonRoot checks it)"
    assert not gid or (gid.isdigit() and int(gid) != 0)
    commands = run_commands(instructions)
    assert any(c[0] == "useradd" and "--uid" in c and uid in c for c in commands)
    assert any(c[0] == "chown" and c[-1] == "/data" for c in commands)
    # The VOLUME comes after the folder is made and given away (Docker copies it into a new
    # named volume, ownership included), and USER after both.
    keywords = [i.keyword for i in instructions]
    last_run = max(i for i, k in enumerate(keywords) if k == "RUN")
    assert last_run < keywords.index("VOLUME") < keywords.index("USER")


def test_image_exposes_the_service_port() -> None:
    exposed = {int(port.split("/")[0]) for port in only(read_dockerfile(), "EXPOSE").rest.split()}
    assert Settings.model_fields["port"].default in exposed
    assert 9464 in exposed  # the metrics port compose and the manifests give --metrics-port


def test_build_context_ignore_file_keeps_what_the_dockerfile_copies() -> None:
    ignore = DOCKERFILE.with_name("Dockerfile.dockerignore").read_text().splitlines()
    kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copied = set()
    for instruction in read_dockerfile():
        if instruction.keyword == "COPY" and "--from=" not in instruction.rest:
            copied |= set(instruction.rest.split()[:-1])
    assert copied <= kept, copied - kept
    assert "*" in ignore  # everything else (.venv, .git, bench traces) stays out


@pytest.fixture
def image_default_server(tmp_path: Path) -> Iterator[int]:
    """A real service run with the image's default command (the data folder under tmp_path,
    the port given as the Dockerfile advises, in CACHE_SERVICE_PORT); stopped by its PID."""
    instructions = read_dockerfile()
    argv = only(instructions, "ENTRYPOINT").exec_form() + only(instructions, "CMD").exec_form()
    args = [str(tmp_path / "data") if part == "/data" else part for part in argv[1:]]
    port = free_port()
    with running_service(args, {"CACHE_SERVICE_PORT": str(port)}, tmp_path / "server.log"):
        yield port


def run_health_check(port: int) -> int:
    """The Dockerfile's HEALTHCHECK command, run here; its exit status."""
    check = only(read_dockerfile(), "HEALTHCHECK").exec_form()
    assert check[0] == "python3"  # the image's venv Python; here, this one
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHE_SERVICE_")}
    env["CACHE_SERVICE_PORT"] = str(port)
    done = subprocess.run(
        [sys.executable, *check[1:]], check=False, capture_output=True, env=env, timeout=30
    )
    return done.returncode


def test_health_check_passes_against_the_image_command_and_fails_without_it(
    image_default_server: int,
) -> None:
    assert "/healthz" in only(read_dockerfile(), "HEALTHCHECK").rest
    assert run_health_check(image_default_server) == 0
    assert run_health_check(free_port()) != 0  # nothing listens there
