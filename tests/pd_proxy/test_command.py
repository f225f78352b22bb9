"""`cache-service pd-proxy` on the command line: refusals of flags that cannot work, each with
a readable message, and the subcommand run as users run it, stopped by a signal."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from cache_service.cli import main
from tests.integration.conftest import free_port, service_command, stop_process, wait_until_ready
from tests.pd_proxy.fake_engine import MODEL, FakeEngine, answer_text

GOOD = ["--prefill", "p0=http://127.0.0.1:8100", "--decode", "d0=http://127.0.0.1:8200"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--prefill", "p0"], "'p0' is not NAME=URL"),
        (["--prefill", "p0=127.0.0.1:8100"], "is not an http:// or https:// URL"),
        (["--decode", "d0=http://127.0.0.1:8200/v1"], "without a path (no /v1)"),
        (["--decode", "d0=http://127.0.0.1:port"], "is not a URL"),
        (["--prefill-timeout-seconds", "0"], "need a number of seconds above 0"),
        (["--health-interval-seconds", "soon"], "is not a number of seconds"),
        (["--cache", "localhost:8080"], "--cache: 'localhost:8080' is not an http://"),
        (["--decode", "d0=http://127.0.0.1:8300"], "--decode: the name 'd0' is given twice"),
    ],
)
def test_flags_that_cannot_work_are_refused_with_a_readable_message(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["pd-proxy", *GOOD, *argv])
    assert exited.value.code == 2
    assert says in capsys.readouterr().err


def test_a_missing_role_is_refused() -> None:
    with pytest.raises(SystemExit) as exited:
        main(["pd-proxy", "--prefill", "p0=http://127.0.0.1:8100"])
    assert exited.value.code == 2


@pytest.mark.integration
def test_the_subcommand_serves_until_a_signal(
    make_engine: Callable[[str], FakeEngine], tmp_path: Path
) -> None:
    prefill, decode = make_engine("p0"), make_engine("d0")
    port = free_port()
    args = [*service_command(), "pd-proxy", "--port", str(port)]
    args += ["--prefill", f"p0={prefill.url}", "--decode", f"d0={decode.url}"]
    log_path = tmp_path / "proxy.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHE_SERVICE_")}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        assert wait_until_ready(proc, url + "/readyz", log_path, 20.0), log_path.read_text()
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        answer = httpx.post(url + "/v1/completions", json=body, timeout=10.0)
        assert answer.json()["choices"][0]["text"] == answer_text("d0")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        stop_process(proc, seconds=5)
    log_text = log_path.read_text()
    assert f"prefill p0={prefill.url}; decode d0={decode.url}" in log_text
    assert "Traceback" not in log_text
