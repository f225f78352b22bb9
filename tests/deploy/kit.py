"""Helpers for the deploy kit's checks: render manifests, and read a
`cache-service serve` command line the way the service itself would."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from cache_service.service.settings import ENV_PREFIX, Settings
from tests.deploy.conftest import require_module, require_tool

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
COMPOSE = DEPLOY / "compose.yaml"
README = REPO / "README.md"


def import_yaml() -> Any:
    """PyYAML, imported here so that the tests collect without it (skipped when missing,
    failed under CI)."""
    return require_module("yaml")


def load_yaml_documents(text: str) -> list[dict[str, Any]]:
    """Every non-empty document of a YAML stream."""
    yaml = import_yaml()
    return [doc for doc in yaml.safe_load_all(text) if doc]


def kustomize(folder: Path) -> list[dict[str, Any]]:
    """The manifests `kubectl kustomize` renders from a kustomization folder."""
    kubectl = require_tool("kubectl")
    done = subprocess.run(
        [kubectl, "kustomize", str(folder)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"kubectl kustomize {folder} failed:\n{done.stderr}"
    return load_yaml_documents(done.stdout)


# --- The service's command line, read by the service's own parser and settings ---------------


def parse_serve(argv: Sequence[str]) -> dict[str, Any]:
    """The flags of `cache-service <argv>` as the CLI's parser reads them (subcommand serve);
    an unknown flag fails the test with the parser's message."""
    from cache_service.cli import build_parser  # noqa: PLC0415  (the CLI imports the app lazily)

    parser = build_parser()
    try:
        parsed = vars(parser.parse_args(list(argv)))
    except SystemExit:  # argparse prints the reason to stderr, which pytest shows
        pytest.fail(f"cache-service refuses the command line {shlex.join(argv)}")
    assert parsed.pop("command") == "serve", f"not `cache-service serve`: {shlex.join(argv)}"
    return parsed


@contextmanager
def only_environment(env: Mapping[str, str]) -> Iterator[None]:
    """Run with exactly these CACHE_SERVICE_* variables (the test's own are set aside)."""
    saved = {name: value for name, value in os.environ.items() if name.startswith(ENV_PREFIX)}
    for name in saved:
        del os.environ[name]
    os.environ.update(env)
    try:
        yield
    finally:
        for name in env:
            os.environ.pop(name, None)
        os.environ.update(saved)


def unknown_variables(env: Mapping[str, str]) -> list[str]:
    """The CACHE_SERVICE_* names among `env` that no setting reads (a typo is silently
    ignored by the service, so it is caught here)."""
    known = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    return sorted(name for name in env if name.startswith(ENV_PREFIX) and name not in known)


def effective_settings(
    argv: Sequence[str], env: Mapping[str, str], *, key_file: Path | None = None
) -> Settings:
    """The settings `cache-service <argv>` would run with, given these environment variables:
    flags through the CLI's parser, then the service's own validation. `key_file` (a real key
    file made by the test) stands in for --api-keys-file, whose path exists only in the
    container; the path the command gave is kept in the answer."""
    flags = parse_serve(argv)
    given_keys_file = flags.get("api_keys_file")
    if key_file is not None and given_keys_file is not None:
        flags["api_keys_file"] = str(key_file)
    with only_environment({k: v for k, v in env.items() if k.startswith(ENV_PREFIX)}):
        try:
            settings = Settings(**flags)
        except ValidationError as exc:
            pytest.fail(f"cache-service refuses {shlex.join(argv)} with {dict(env)}:\n{exc}")
    if given_keys_file is not None:
        settings = settings.model_copy(update={"api_keys_file": Path(given_keys_file)})
    return settings


def make_key_file(folder: Path) -> Path:
    """A real key file with one admin key, made by the service's own admin command."""
    path = folder / "keys.toml"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "cache_service.cli",
            "admin",
            "new-key",
            "--id",
            "deploy-check",
            "--tenant",
            "ops",
            "--role",
            "admin",
            "--append",
            str(path),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return path


# --- README's and the docs' commands ---------------------------------------------------------


def docs_page(path: str) -> str:
    """The Markdown of a page of the documentation site (under docs/content)."""
    return (REPO / "docs" / "content" / path).read_text(encoding="utf-8")


def shell_blocks(markdown: str) -> list[str]:
    """The ```sh code blocks of a piece of Markdown, continuation lines joined."""
    blocks = re.findall(r"^```sh\n(.*?)^```", markdown, re.M | re.S)
    return [block.replace("\\\n", " ") for block in blocks]


def shell_commands(script: str) -> list[list[str]]:
    """The simple commands of a shell script, one a line or joined by && (each one split as
    the shell would)."""
    return [shlex.split(part) for part in re.split(r"&&|\n", script) if part.strip()]


# --- Running a command line for real, on this machine's loopback ------------------------------

LOCAL_VALUES = {"--host": "127.0.0.1", "--metrics-host": "127.0.0.1"}
STARTUP_SECONDS = 60.0


def localised(argv: Sequence[str], replacements: Mapping[str, str]) -> list[str]:
    """A command line with the values of some flags replaced (`--flag value` form)."""
    out = list(argv)
    for index, part in enumerate(out[:-1]):
        if part in replacements:
            out[index + 1] = replacements[part]
    return out


def get(url: str, *, timeout: float = 2.0) -> int:
    """The HTTP status of a GET (an error status too)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


@contextmanager
def running_service(
    argv: Sequence[str], env: Mapping[str, str], log_path: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """`cache-service <argv>` started with these CACHE_SERVICE_* variables, until its /healthz
    answers; stopped (SIGTERM, then SIGKILL) by its PID when the block ends."""
    from tests.integration.conftest import service_command  # noqa: PLC0415

    port = effective_settings(argv, env).port
    environment = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    environment.update(env)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*service_command(), *argv], stdout=log, stderr=subprocess.STDOUT, env=environment
        )
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            assert proc.poll() is None, f"the service exited:\n{log_path.read_text()}"
            try:
                if get(f"http://127.0.0.1:{port}/healthz", timeout=1.0) == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"not up in {STARTUP_SECONDS}s"
            time.sleep(0.05)
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def promtool_check_metrics(promtool: Path, text: str) -> None:
    """`promtool check metrics` on a scrape: it exits 0 and prints nothing when no lint
    problem is found."""
    done = subprocess.run(
        [str(promtool), "check", "metrics"],
        check=False,
        input=text,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout + done.stderr) == (0, "")
