"""A real Prometheus process on 127.0.0.1, with our rule files, queried over its HTTP API."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from tests.integration.conftest import free_port, stop_process, wait_until_ready

STARTUP_SECONDS = 30.0
STOP_SECONDS = 10.0

Series = list[dict[str, Any]]  # the `result` of an instant query: metric labels and value


class PrometheusError(RuntimeError):
    """Prometheus refused a query (a parse error names the expression)."""


class PrometheusProcess:
    """One Prometheus scraping `targets` as job prompt-cache every second, evaluating
    `rule_files` every second; its data lives in `workdir` and goes with it."""

    def __init__(
        self,
        binary: Path,
        workdir: Path,
        *,
        targets: Sequence[str],
        rule_files: Sequence[Path],
        interval_seconds: float = 1.0,
    ) -> None:
        self.binary = binary
        self.workdir = workdir
        self.targets = list(targets)
        self.rule_files = list(rule_files)
        self.interval_seconds = interval_seconds
        self.port = free_port()
        self.log_path = workdir / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Base URL of Prometheus."""
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> dict[str, Any]:
        """The configuration file's content (JSON is YAML, so no YAML library is needed)."""
        interval = f"{int(self.interval_seconds * 1000)}ms"
        return {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(path) for path in self.rule_files],
            "scrape_configs": [
                {"job_name": "prompt-cache", "static_configs": [{"targets": self.targets}]}
            ],
        }

    def start(self) -> None:
        """Write the configuration, start Prometheus and wait until it is ready."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        config_path = self.workdir / "prometheus.yml"
        config_path.write_text(json.dumps(self.config(), indent=2))
        args = [
            str(self.binary),
            f"--config.file={config_path}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        if not wait_until_ready(self.proc, self.url + "/-/ready", self.log_path, STARTUP_SECONDS):
            self.stop()
            raise RuntimeError(
                f"prometheus not ready in {STARTUP_SECONDS}s:\n{self.log_path.read_text()}"
            )

    def stop(self) -> None:
        """Stop the process this object started (SIGTERM, then SIGKILL), by its PID."""
        if self.proc is None:
            return
        stop_process(self.proc, seconds=STOP_SECONDS)
        self.proc = None

    def query(self, expr: str, *, at: float | None = None) -> Series:
        """The instant vector `expr` gives now (or at Unix time `at`); PrometheusError if
        Prometheus refuses it."""
        params = {"query": expr} if at is None else {"query": expr, "time": str(at)}
        response = httpx.get(self.url + "/api/v1/query", params=params, timeout=10.0)
        body = response.json()
        if body.get("status") != "success":
            raise PrometheusError(f"{expr!r}: {body.get('errorType')}: {body.get('error')}")
        data = body["data"]
        if data["resultType"] == "scalar":  # a number: one unlabelled value
            return [{"metric": {}, "value": data["result"]}]
        if data["resultType"] != "vector":
            raise PrometheusError(f"{expr!r}: a {data['resultType']}, not an instant vector")
        return list(data["result"])

    def rule_health(self) -> list[dict[str, Any]]:
        """Every loaded rule with its health and last error (from /api/v1/rules)."""
        body = httpx.get(self.url + "/api/v1/rules", timeout=10.0).json()
        return [rule for group in body["data"]["groups"] for rule in group["rules"]]

    def wait_for(
        self,
        expr: str,
        ready: Callable[[Series], bool],
        *,
        what: str,
        timeout_seconds: float = 30.0,
    ) -> Series:
        """Poll `expr` until `ready` holds for its result; fail naming `what` and the last
        result after the timeout."""
        deadline = time.monotonic() + timeout_seconds
        result: Series = []
        while True:
            result = self.query(expr)
            if ready(result):
                return result
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out after {timeout_seconds}s waiting for {what}: "
                    f"{expr} gave {result}\nprometheus log:\n{self.log_path.read_text()[-4000:]}"
                )
            time.sleep(self.interval_seconds / 4)


def wait_for_rules_after_scrape(
    prometheus: PrometheusProcess, scraped: str, recorded: str, *, timeout_seconds: float
) -> None:
    """Wait until the rule recording `recorded` has been evaluated after the last scrape of
    `scraped`: a rule evaluated one interval after the scrape's timestamp sees its sample."""
    last = prometheus.query(f"max(timestamp({scraped}))")
    after = float(last[0]["value"][1]) + prometheus.interval_seconds
    prometheus.wait_for(
        f"min(timestamp({recorded}))",
        lambda result: bool(result) and float(result[0]["value"][1]) >= after,
        what="a rule evaluation after the final scrape",
        timeout_seconds=timeout_seconds,
    )


def values_by(series: Series, label: str) -> dict[str, float]:
    """A query result's values keyed by one label."""
    return {item["metric"].get(label, ""): float(item["value"][1]) for item in series}
