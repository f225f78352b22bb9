"""`cache-service demo` as users run it: the installed command, against a real service."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.integration.conftest import ServerProcess, free_port, service_command

DEMO_SECONDS = 300.0  # SmolLM2 loads in ~15 s alone; far longer on a busy machine
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # PyTorch's intra-op threads


def run_demo(
    tmp_path: Path, url: str, *flags: str, env: dict[str, str] | None = None
) -> tuple[str, dict[str, Any]]:
    """Run the demo to its end (exit 0); its standard output and its --json document."""
    out = tmp_path / f"demo-{len(list(tmp_path.glob('demo-*.json')))}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHE_SERVICE_")} | (env or {})
    done = subprocess.run(
        [*service_command(), "demo", "--url", url, "--json", str(out), *flags],
        capture_output=True,
        text=True,
        env=env,
        timeout=DEMO_SECONDS,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr, json.loads(out.read_text())


def scenario_rows(document: dict[str, Any], scenario: str) -> list[dict[str, Any]]:
    """One scenario's rows, in turn order (checked)."""
    rows = [row for row in document["rows"] if row["scenario"] == scenario]
    assert [row["turn"] for row in rows] == list(range(1, len(rows) + 1))
    return rows


def assert_each_turn_reuses_the_last(document: dict[str, Any], *, exact: bool) -> None:
    """Turn 1 of each scenario is cold; every later turn loads the last turn's prompt's full
    blocks (all of them with stand-in tokens, which retokenise the same; with a tokenizer,
    all but at most one, as the last turn's end may tokenise differently once extended);
    the greedy continuation is the same with and without the cache on every turn. (A prompt
    cached whole still computes its last token, for its logits.)"""
    block = document["block_size"]
    for scenario in ("chat", "agent"):
        rows = scenario_rows(document, scenario)
        assert len(rows) >= 2
        assert rows[0]["cached_tokens"] == 0
        for before, row in itertools.pairwise(rows):
            full = before["prompt_tokens"] // block * block
            assert row["cached_tokens"] > 0
            if exact:
                assert row["cached_tokens"] == min(full, row["prompt_tokens"] - 1)
            else:
                assert full - block <= row["cached_tokens"] < row["prompt_tokens"]
    assert all(row["identical"] for row in document["rows"]), document["rows"]


def test_tiny_demo_loads_each_turns_prefix_from_the_service(
    cache_server: ServerProcess, tmp_path: Path
) -> None:
    output, document = run_demo(tmp_path, cache_server.url, "--model", "tiny")
    assert document["block_size"] == 64  # asked of the service
    assert document["cache_errors"] == {}
    assert len(scenario_rows(document, "chat")) == 4
    assert len(scenario_rows(document, "agent")) == 9
    assert_each_turn_reuses_the_last(document, exact=True)
    summary = document["summary"]
    assert summary["cached_tokens"] == sum(row["cached_tokens"] for row in document["rows"])
    assert summary["identical_turns"] == summary["turns"] == 13
    assert f"salt {document['salt']} (fresh: this run starts cold)" in output
    assert "total: " in output.splitlines()[-1]


def test_a_second_run_starts_cold_unless_given_the_first_runs_salt(
    cache_server: ServerProcess, tmp_path: Path
) -> None:
    flags = ("--model", "tiny", "--turns", "2", "--new-tokens", "4")
    _, first = run_demo(tmp_path, cache_server.url, *flags)
    _, fresh = run_demo(tmp_path, cache_server.url, *flags)
    _, same = run_demo(tmp_path, cache_server.url, *flags, "--salt", first["salt"])
    assert fresh["salt"] != first["salt"]
    assert [row["cached_tokens"] for row in fresh["rows"] if row["turn"] == 1] == [0, 0]
    assert same["salt"] == first["salt"]
    block = first["block_size"]
    for row in same["rows"]:  # every turn's full blocks were stored by the first run
        full = row["prompt_tokens"] // block * block
        assert row["cached_tokens"] == min(full, row["prompt_tokens"] - 1) > 0


def test_demo_without_a_service_computes_every_prompt_and_exits_0(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    output, document = run_demo(
        tmp_path, url, "--model", "tiny", "--turns", "3", "--new-tokens", "4"
    )
    assert "unreachable or refusing" in output
    assert document["rows"]
    assert all(row["cached_tokens"] == 0 for row in document["rows"])
    assert all(row["identical"] for row in document["rows"])
    assert document["cache_errors"]  # counted, by call and status


def test_smollm2_demo_reuses_prefixes_with_identical_continuations(
    cache_server: ServerProcess, tmp_path: Path
) -> None:
    # One PyTorch thread: a busy machine then slows both prefills alike, where it would stall
    # a pool of threads (one descheduled thread holds up the others) at random.
    output, document = run_demo(
        tmp_path, cache_server.url, "--turns", "3", "--new-tokens", "8", env=ONE_THREAD
    )
    assert document["model"] == "SmolLM2-135M-Instruct.Q4_1"
    assert_each_turn_reuses_the_last(document, exact=False)
    assert all(row["continuation"] for row in document["rows"])  # decoded text
    longest = max(document["rows"], key=lambda row: row["prompt_tokens"])
    assert longest["cached_tokens"] > 0
    assert all(row["identical"] for row in document["rows"])
    # How much faster is measured by the demo itself and python -m bench.prefill_ttft, not
    # asserted here: timings on a shared machine are no test.
    assert "de-quantizing" not in output  # no progress bars


def test_the_command_line_does_not_load_the_model_runtime() -> None:
    code = (
        "import sys\n"
        "from cache_service.cli import build_parser\n"
        "build_parser()\n"
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
    helped = subprocess.run(
        [*service_command(), "demo", "--help"], capture_output=True, text=True, check=True
    )
    assert "--salt" in helped.stdout


def test_demo_without_the_model_extra_says_what_to_install() -> None:
    # A None entry in sys.modules makes `import torch` fail, as if it were not installed.
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "from cache_service.cli import main\n"
        "main(['demo', '--model', 'tiny'])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 2
    assert "install the [model] extra" in done.stderr
    assert "missing: torch" in done.stderr
