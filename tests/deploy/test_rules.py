"""deploy/prometheus: promtool checks the config and rules and runs their unit tests, which
cover every recording rule and every alert; each alert carries its runbook section."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

from tests.deploy.conftest import DEPLOY, require_module

PROMETHEUS = DEPLOY / "prometheus"
RULE_FILES = sorted((PROMETHEUS / "rules").glob("*.yml"))
UNIT_TESTS = sorted((PROMETHEUS / "tests").glob("*.yml"))


def run(args: list[str | Path], cwd: Path = PROMETHEUS) -> str:
    """Run a command; fail with its output unless it exits 0."""
    done = subprocess.run(
        [str(arg) for arg in args],
        check=False,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


def load(path: Path) -> Any:
    """A YAML file (PyYAML is imported here: the tests collect without it)."""
    return require_module("yaml").safe_load(path.read_text())


def rules() -> list[dict[str, Any]]:
    """Every rule of every rule file."""
    return [
        rule for path in RULE_FILES for group in load(path)["groups"] for rule in group["rules"]
    ]


def test_the_rule_files_pass_promtool_check_rules(promtool: Path) -> None:
    output = run([promtool, "check", "rules", *RULE_FILES])
    assert "SUCCESS" in output


def test_the_compose_config_and_its_rule_files_pass_promtool_check_config(
    promtool: Path,
) -> None:
    output = run([promtool, "check", "config", "prometheus.yml"])
    assert f"SUCCESS: {len(RULE_FILES)} rule files found" in output


def test_the_compose_config_scrapes_the_cache_service_metrics_port() -> None:
    config = load(PROMETHEUS / "prometheus.yml")
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "prompt-cache"  # the name the `up` alerts select
    assert job["static_configs"] == [{"targets": ["cache:9464"]}]
    assert config["rule_files"] == ["rules/*.yml"]


def test_the_promtool_unit_tests_pass(promtool: Path) -> None:
    run([promtool, "test", "rules", *UNIT_TESTS])


def test_every_recording_rule_has_a_unit_test() -> None:
    tested = {
        case["expr"].strip()
        for path in UNIT_TESTS
        for test in load(path)["tests"]
        for case in test.get("promql_expr_test", [])
    }
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    assert recorded, "no recording rules found"
    assert recorded - tested == set()


def test_every_alert_has_a_firing_and_a_quiet_unit_test() -> None:
    firing: set[str] = set()
    quiet: set[str] = set()
    for path in UNIT_TESTS:
        for test in load(path)["tests"]:
            for case in test.get("alert_rule_test", []):
                (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    alerts = {rule["alert"] for rule in rules() if "alert" in rule}
    assert alerts - firing == set()
    assert alerts - quiet == set()


def test_recording_rules_follow_level_metric_operation_naming() -> None:
    for rule in rules():
        if "record" in rule:
            level, metric, operation = rule["record"].split(":")
            assert re.fullmatch(r"[a-z]+(_[a-z]+)*", level), rule["record"]
            assert metric.startswith("prompt_cache_"), rule["record"]
            assert operation, rule["record"]


def test_every_alert_has_severity_summary_description_and_runbook() -> None:
    for rule in rules():
        if "alert" in rule:
            assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
            assert {"summary", "description", "runbook_url"} <= rule["annotations"].keys()
            anchor = "deploy/README.md#" + rule["alert"].lower()
            assert rule["annotations"]["runbook_url"] == anchor


def test_every_runbook_url_has_its_section_in_the_deploy_readme() -> None:
    readme = DEPLOY / "README.md"
    # GitHub's anchor of a heading: lower case, spaces to dashes, punctuation dropped.
    anchors = {
        re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        for heading in re.findall(r"^#+ (.+)$", readme.read_text(), flags=re.MULTILINE)
    }
    for rule in rules():
        if "alert" in rule:
            assert rule["annotations"]["runbook_url"].split("#")[1] in anchors, rule["alert"]
