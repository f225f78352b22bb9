"""deploy/README.md's shortest path for a team, step by step against the kit and the code.

No cluster runs here, so each kubectl step runs as far as it can without one: `create` with
`--dry-run=client -o yaml` and a pipeline into `kubectl apply -f -` with `cat` in its place
print what they would send; `apply -k` renders the layout with kubectl's kustomize. The
commands are read from the README itself, so that what a reader pastes is what is checked.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cache_service.service.api_keys import Role, load_key_ring
from cache_service.service.settings import ENV_PREFIX
from tests.deploy.conftest import DEPLOY, REPO, require_tool
from tests.deploy.kit import KUBERNETES, import_yaml, kustomize, load_yaml_documents
from tests.docs_site.code_blocks import CodeBlock, find_blocks

README = DEPLOY / "README.md"
SECTION = "## The shortest path for a team"
STEPS = 7
NAMESPACE = "team-cache"
MONITORING = "monitoring"
SECONDS = 120


def steps() -> list[str]:
    """The section's commands, a block a step, continuation lines joined and the names a
    reader fills in filled in."""
    text = README.read_text(encoding="utf-8")
    section = text.split(SECTION + "\n", 1)[1].split("\n## ", 1)[0]
    blocks: list[CodeBlock] = find_blocks(section, README)
    assert [block.language for block in blocks] == ["sh"] * STEPS
    return [
        block.text.replace("\\\n", " ")
        .replace("NAMESPACE", NAMESPACE)
        .replace("MONITORING", MONITORING)
        for block in blocks
    ]


def bash(script: str, cwd: Path) -> str:
    """Run a script with bash (-e, pipefail) in `cwd`, this Python's environment first on
    PATH (as a reader's activated venv); its standard output. Fails with its output unless it
    exits 0."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(ENV_PREFIX)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=SECONDS,
        check=False,
    )
    assert done.returncode == 0, f"{script}\n{done.stdout}{done.stderr}"
    return done.stdout


def client_side(command: str) -> str:
    """A kubectl step as it can run without a cluster: what it would send, printed."""
    piped = re.sub(r"\|\s*kubectl apply( -n \S+)? -f -\s*$", "| cat", command.strip())
    if piped != command.strip():  # a pipeline that ends in `kubectl apply -f -`
        return piped
    assert command.startswith("kubectl create "), command
    return command.strip() + " --dry-run=client -o yaml"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where a reader runs step 1 (keys.toml is made there) and steps 2 and 3."""
    return tmp_path_factory.mktemp("team")


@pytest.fixture(scope="module")
def printed_keys(folder: Path) -> list[str]:
    """Step 1, run for real: the keys it printed."""
    return bash(steps()[0], folder).split()


@pytest.fixture(scope="module")
def layout() -> list[dict[str, Any]]:
    """Step 4's layout, rendered as `kubectl apply -k` would send it."""
    argv = shlex.split(steps()[3])
    assert argv[:3] == ["kubectl", "apply", "-k"] and argv[4:] == ["-n", NAMESPACE], argv
    folder = REPO / argv[3]
    assert folder == KUBERNETES / "overlays" / "redis-cluster"
    return kustomize(folder)


def secrets_read(documents: list[dict[str, Any]]) -> Iterator[tuple[str, str]]:
    """(Secret, key) for every key a workload of the layout reads from a Secret: variables
    from `secretKeyRef`, and the file a mounted Secret volume gives to `--api-keys-file`."""
    for document in documents:
        pod = document.get("spec", {}).get("template", {}).get("spec")
        if pod is None:
            continue
        volumes = {v["name"]: v["secret"] for v in pod.get("volumes", []) if "secret" in v}
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            for variable in container.get("env", []):
                ref = variable.get("valueFrom", {}).get("secretKeyRef")
                if ref is not None:
                    yield ref["name"], ref["key"]
            arguments = container.get("args", []) + container.get("command", [])
            for mount in container.get("volumeMounts", []):
                if mount["name"] in volumes:
                    keys_file = arguments[arguments.index("--api-keys-file") + 1]
                    directory, _, key = keys_file.rpartition("/")
                    assert directory == mount["mountPath"], (keys_file, mount)
                    yield volumes[mount["name"]]["secretName"], key


def test_step_1_makes_a_writer_key_for_a_team_and_an_admin_key(
    folder: Path, printed_keys: list[str]
) -> None:
    ring = load_key_ring(folder / "keys.toml")
    assert [(key.id, key.tenant, key.role) for key in ring] == [
        ("team-a", "team-a", Role.WRITER),
        ("ops", "ops", Role.ADMIN),
    ]
    assert [ring.authenticate(key) for key in printed_keys] == list(ring)
    assert not any(key in (folder / "keys.toml").read_text() for key in printed_keys)


def test_steps_2_and_3_make_exactly_the_secrets_the_layout_reads(
    folder: Path, printed_keys: list[str], layout: list[dict[str, Any]]
) -> None:
    require_tool("kubectl")
    require_tool("openssl")
    made: set[tuple[str, str]] = set()
    for command in steps()[1:3]:
        (secret,) = load_yaml_documents(bash(client_side(command), folder))
        assert (secret["kind"], secret["metadata"]["namespace"]) == ("Secret", NAMESPACE)
        made |= {(secret["metadata"]["name"], key) for key in secret["data"]}
    assert made == set(secrets_read(layout))
    assert ("prompt-cache-api-keys", "keys.toml") in made  # step 1's file, mounted whole


def test_step_5_waits_for_the_layout_s_caches(layout: list[dict[str, Any]]) -> None:
    argv = shlex.split(steps()[4])
    assert argv[:3] == ["kubectl", "rollout", "status"] and argv[4:] == ["-n", NAMESPACE]
    kind, _, name = argv[3].partition("/")
    (caches,) = [d for d in layout if (d["kind"].lower(), d["metadata"]["name"]) == (kind, name)]
    assert caches["spec"]["replicas"] >= 2  # a team's caches: several, sharing the cluster
    assert any(d["kind"] == "ServiceMonitor" for d in layout)  # what step 6's rules read


def test_step_6_sends_our_rule_files_as_one_prometheus_rule(promtool: Path, tmp_path: Path) -> None:
    require_tool("kubectl")
    (rule,) = load_yaml_documents(bash(client_side(steps()[5]), REPO))
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    groups = []
    for path in sorted((DEPLOY / "prometheus" / "rules").glob("*.yml")):
        (rules,) = load_yaml_documents(path.read_text(encoding="utf-8"))
        groups += rules["groups"]
    assert rule["spec"]["groups"] == groups
    spec = tmp_path / "spec.yml"
    spec.write_text(import_yaml().safe_dump(rule["spec"], sort_keys=False))
    done = subprocess.run(
        [str(promtool), "check", "rules", str(spec)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_step_7_sends_the_dashboard_as_a_configmap_grafana_loads() -> None:
    require_tool("kubectl")
    (config_map,) = load_yaml_documents(bash(client_side(steps()[6]), REPO))
    assert config_map["kind"] == "ConfigMap"
    assert config_map["metadata"]["namespace"] == MONITORING
    assert config_map["metadata"]["labels"] == {"grafana_dashboard": "1"}
    dashboard = DEPLOY / "grafana" / "dashboards" / "prompt-cache.json"
    assert config_map["data"] == {dashboard.name: dashboard.read_text(encoding="utf-8")}
