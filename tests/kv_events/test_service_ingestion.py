"""`cache-service serve --kv-events ...` as a real process, fed by a test publisher over real
ZMQ sockets on 127.0.0.1: /v1/stats, /metrics and the log follow the engine's events through
gaps, replays, restarts and a wrong seed, and the server stops cleanly with the subscriber
running."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from tests.integration.conftest import ServerProcess
from tests.kv_events.prompts import prompt_events
from tests.kv_events.publisher import WIRES, TestPublisher, stored

pytestmark = pytest.mark.integration

WAIT_SECONDS = 10.0
SCHEME = "vllm-sha256-cbor"
PROMPT = list(range(1000, 1064))  # four blocks of 16


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def engine_stats(server: ServerProcess, name: str) -> dict[str, Any]:
    report: dict[str, Any] = httpx.get(server.url + "/v1/stats", timeout=5.0).json()["kv_events"]
    return dict(report[name])


def metric(server: ServerProcess, sample: str) -> float | None:
    for line in httpx.get(server.url + "/metrics", timeout=5.0).text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split(" ")[1])
    return None


def stop_cleanly(server: ServerProcess) -> None:
    """SIGTERM, and the exit status of a clean stop, within the shutdown bound."""
    assert server.proc is not None
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=20) == 0, server.log_path.read_text()
    server.proc = None
    assert time.monotonic() - started < 10.0


def serve_one_engine(
    make_server: Callable[..., ServerProcess], publisher: TestPublisher, **flags: str
) -> tuple[ServerProcess, str]:
    server = make_server(
        kv_events=publisher.endpoint,
        kv_events_hash_scheme=SCHEME,
        kv_events_block_size="16",
        **flags,
    )
    publisher.wait_for_subscriber()
    return server, publisher.endpoint.removeprefix("tcp://")


def test_views_follow_the_engine_through_a_gap_and_a_publisher_restart(
    make_server: Callable[..., ServerProcess], context: zmq.Context[Any]
) -> None:
    publisher = TestPublisher(context, wire=WIRES["vllm-map-batch"])
    try:
        server, name = serve_one_engine(make_server, publisher, kv_events_seed="0")
        for event in prompt_events(SCHEME, PROMPT, seed="0", splits=[2, 2]):
            publisher.publish([event])
        wait_until(lambda: engine_stats(server, name)["blocks"] == 4, "the stored blocks")
        stats = engine_stats(server, name)
        assert stats["endpoints"] == [publisher.endpoint]
        assert stats["hash_scheme"] == SCHEME
        assert (stats["events"], stats["verified"], stats["mismatches"]) == (2, 2, 0)
        assert (stats["gaps"], stats["stale_ranks"], stats["last_mismatch"]) == (0, 0, None)
        assert metric(server, f'prompt_cache_kv_events_view_blocks{{engine="{name}"}}') == 4.0

        publisher.publish([stored([11])], drop=True)  # lost on the way; no replay socket
        publisher.publish([stored([12])])
        wait_until(lambda: engine_stats(server, name)["gaps"] == 1, "the gap")
        assert engine_stats(server, name)["stale_ranks"] == 1
        assert metric(server, f'prompt_cache_kv_events_stale_ranks{{engine="{name}"}}') == 1.0
    finally:
        publisher.close()

    restarted = TestPublisher(
        context, wire=WIRES["vllm-map-batch"], port=publisher.port, rebind_wait_seconds=5.0
    )
    try:
        restarted.wait_for_subscriber()
        restarted.publish(prompt_events(SCHEME, PROMPT[:16], seed="0"))  # seq 0 again
        wait_until(lambda: engine_stats(server, name)["restarts"] == 1, "the restart")
        stats = engine_stats(server, name)
        assert (stats["blocks"], stats["stale_ranks"]) == (1, 0)  # rebuilt from the new stream
        stop_cleanly(server)  # the subscriber is running, connected
    finally:
        restarted.close()
    log = server.log_path.read_text()
    assert f"engine {name} rank 0: the publisher restarted" in log
    assert "Traceback" not in log


def test_a_wrong_seed_raises_the_alarm_on_metrics_stats_and_the_log(
    make_server: Callable[..., ServerProcess], context: zmq.Context[Any]
) -> None:
    publisher = TestPublisher(context, wire=WIRES["vllm-spec-kind"])
    try:
        server, name = serve_one_engine(make_server, publisher, kv_events_seed="0")
        mismatch = f'prompt_cache_kv_events_mismatch_total{{engine="{name}"}}'
        assert metric(server, mismatch) == 0.0
        for offset in range(3):  # the engine runs with PYTHONHASHSEED=1
            tokens = [token + offset for token in PROMPT]
            # With each block's extra keys shown, block 0 can only be a wrong seed (an event
            # without them might carry a cache_salt: unverifiable, not a mismatch).
            publisher.publish(prompt_events(SCHEME, tokens, seed="1", extra_keys=[None] * 4))
        wait_until(lambda: metric(server, mismatch) == 3.0, "three mismatches")
        stats = engine_stats(server, name)
        assert (stats["mismatches"], stats["verified"], stats["blocks"]) == (3, 0, 12)
        assert stats["last_mismatch"].startswith(
            f"an event that starts a prompt: block 0: {SCHEME} gives"
        )
        wait_until(lambda: "does not reproduce" in server.log_path.read_text(), "the alarm")
        log = server.log_path.read_text()
        assert f"engine {name}: 3 stored events have block hashes that hash scheme" in log
        assert f"engine {name}: a stored event's block hashes were not reproduced" in log
        promtool = shutil.which("promtool")
        if promtool is not None:  # the exposition with our families passes promtool's lint
            text = httpx.get(server.url + "/metrics", timeout=5.0).text
            done = subprocess.run(
                [promtool, "check", "metrics"],
                input=text,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert (done.returncode, done.stdout + done.stderr) == (0, "")
    finally:
        publisher.close()


def test_a_gap_is_replayed_from_the_engines_replay_socket_named_in_the_config_file(
    make_server: Callable[..., ServerProcess], context: zmq.Context[Any], tmp_path: Path
) -> None:
    publisher = TestPublisher(context, wire=WIRES["sglang-medium"], replay=True)
    config = tmp_path / "engines.toml"
    config.write_text(
        "[defaults]\nblock_size = 16\n\n[[engine]]\n"
        f'name = "sglang-a"\nendpoint = "{publisher.endpoint}"\n'
        f'replay_endpoint = "{publisher.replay_endpoint}"\nhash_scheme = "sglang"\n'
        'model = "m"\n'
    )
    try:
        server = make_server(kv_events_config=str(config))
        publisher.wait_for_subscriber()
        publisher.wait_for_replay_requests(1)  # the history, asked at connection
        first, second = prompt_events("sglang", PROMPT, seed=None, splits=[2, 2])
        publisher.publish([first])
        publisher.publish([second], drop=True)  # replayed
        publisher.publish([stored([99])])
        wait_until(lambda: engine_stats(server, "sglang-a")["blocks"] == 5, "the replayed store")
        stats = engine_stats(server, "sglang-a")
        assert (stats["gaps"], stats["replays"], stats["stale_ranks"]) == (1, 2, 0)
        assert (stats["verified"], stats["mismatches"]) == (2, 0)  # chained on its parent
        assert stats["replay_endpoints"] == [publisher.replay_endpoint]
        assert stats["model"] == "m"
    finally:
        publisher.close()


def test_each_worker_follows_the_engine(
    make_server: Callable[..., ServerProcess], context: zmq.Context[Any]
) -> None:
    publisher = TestPublisher(context, wire=WIRES["vllm-map-batch"])
    # Every worker's SUB subscribes to "": an XPUB passes on only the first of identical
    # subscriptions unless verbose.
    publisher._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
    try:
        server = make_server(
            workers="2",
            kv_events=publisher.endpoint,
            kv_events_hash_scheme=SCHEME,
            kv_events_seed="0",
        )
        publisher.wait_for_subscriber()
        publisher.wait_for_subscriber()  # both workers are connected
        name = publisher.endpoint.removeprefix("tcp://")
        publisher.publish(prompt_events(SCHEME, PROMPT, seed="0"))
        # Each request on a new connection, taken by either worker: all answer with the blocks.
        wait_until(
            lambda: all(engine_stats(server, name)["blocks"] == 4 for _ in range(20)),
            "every worker's view",
        )
        stop_cleanly(server)
    finally:
        publisher.close()


def test_without_engines_the_stats_say_ingestion_is_off(
    make_server: Callable[..., ServerProcess],
) -> None:
    server = make_server()
    assert httpx.get(server.url + "/v1/stats", timeout=5.0).json()["kv_events"] is None
    assert metric(server, "prompt_cache_kv_events_mismatch_total") is None


def test_a_vllm_xxhash_scheme_without_a_seed_is_refused_at_start_up(tmp_path: Path) -> None:
    """vLLM 0.32 roots xxhash chains at random bytes when PYTHONHASHSEED is unset (sha256
    ones at a fixed default, which needs no seed: tests/vllm/test_kv_events.py)."""
    server = ServerProcess(
        tmp_path / "data",
        tmp_path / "server.log",
        kv_events="tcp://127.0.0.1:5557",
        kv_events_hash_scheme="vllm-xxhash",
    )
    with pytest.raises(RuntimeError, match="exited early"):
        server.start()
    log = server.log_path.read_text()
    assert "hash scheme vllm-xxhash needs the engine's PYTHONHASHSEED" in log
    assert "Traceback" not in log
