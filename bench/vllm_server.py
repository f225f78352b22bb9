"""vLLM's OpenAI-compatible server with the connector, and `cache-service pd-proxy`, as
processes a bench or a test starts on 127.0.0.1 and stops by PID.

vLLM runs from its own environment (`.venv-vllm`, or the Python `CACHE_SERVICE_VLLM_PYTHON`
names); the proxy from this one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.peers.harness import free_port, stop_process

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("CACHE_SERVICE_VLLM_PYTHON", REPO / ".venv-vllm/bin/python"))
SERVED_NAME = "smollm2"


def wait_ready(proc: subprocess.Popen[bytes], url: str, log_path: Path, seconds: float) -> None:
    """Wait for `url` to answer 200; RuntimeError with the log's end if the process ends or
    `seconds` pass first."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready:\n{log_path.read_text()[-6000:]}")


def metric(url: str, name: str, label: str = "") -> float:
    """The sum of a metric's samples on the /metrics page of the server at `url` (with
    `label`, e.g. 'reason="x"', only those that have it), 0 when absent."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith((name + "{", name + " ")) and (not label or label in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


class VllmServer:
    """A vLLM OpenAI server of `model` with the prompt cache connector in `role`, started at
    once (`wait_ready` waits for it); `cpus` pins it to those cores (taskset)."""

    def __init__(
        self,
        model: Path,
        service_url: str,
        role: str,
        log_path: Path,
        *,
        dtype: str = "float32",
        block_size: int = 128,
        extra: dict[str, Any] | None = None,
        cpus: str = "",
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        config = {
            "kv_connector": "PromptCacheConnector",
            "kv_connector_module_path": "cache_service.integrations.vllm",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"url": service_url, **(extra or {})},
        }
        args = [
            str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype,
            "--enforce-eager", "--block-size", str(block_size), "--max-model-len", "4608",
            "--seed", "0", "--enable-prompt-tokens-details", "--served-model-name", SERVED_NAME,
            "--kv-transfer-config", json.dumps(config),
        ]  # fmt: skip
        if cpus:
            args = ["taskset", "-c", cpus, *args]
        env = {k: v for k, v in os.environ.items() if not k.startswith("CACHE_SERVICE_")}
        env.update(
            PYTHONPATH=str(REPO),
            VLLM_USE_V2_MODEL_RUNNER="0",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_SERVER_DEV_MODE="1",  # /reset_prefix_cache
        )
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, seconds: float = 300) -> None:
        """Wait for /health (RuntimeError with the log if the server ends or takes too long)."""
        wait_ready(self.proc, self.url + "/health", self.log_path, seconds)

    def metric(self, name: str, label: str = "") -> float:
        """`metric` of this server."""
        return metric(self.url, name, label)

    def reset_prefix_cache(self) -> None:
        """Empty vLLM's own prefix cache (dev mode)."""
        httpx.post(self.url + "/reset_prefix_cache", timeout=60).raise_for_status()

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 30 s), by its PID."""
        stop_process(self.proc, timeout_seconds=30)


class PdProxy:
    """`cache-service pd-proxy` in front of `prefill` and `decode` ({name: url}), started and
    waited for."""

    def __init__(
        self,
        prefill: dict[str, str],
        decode: dict[str, str],
        log_path: Path,
        *,
        cache_url: str = "",
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        script = Path(sys.executable).with_name("cache-service")
        args = [str(script), "pd-proxy", "--host", "127.0.0.1", "--port", str(self.port)]
        for role, engines in (("--prefill", prefill), ("--decode", decode)):
            for name, url in engines.items():
                args += [role, f"{name}={url}"]
        if cache_url:
            args += ["--cache", cache_url]
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        wait_ready(self.proc, self.url + "/readyz", log_path, 60)

    def metrics(self) -> str:
        """The proxy's /metrics page."""
        return httpx.get(self.url + "/metrics", timeout=30).text

    def stop(self) -> None:
        """Stop the proxy, by its PID."""
        stop_process(self.proc)
