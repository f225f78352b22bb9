"""`cache-service doctor` against test publishers over real ZMQ sockets on 127.0.0.1: the
exit status and the cause it names for each engine."""

from __future__ import annotations

import argparse
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from cache_service.tools.doctor import add_doctor_parser, run_doctor_command
from tests.integration.conftest import free_port, service_command
from tests.kv_events.prompts import prompt_events, published_hashes
from tests.kv_events.publisher import WIRES, TestPublisher

PROMPT = list(range(500, 548))  # three blocks of 16


@pytest.fixture
def publisher(context: zmq.Context[Any]) -> Iterator[TestPublisher]:
    publisher = TestPublisher(context, wire=WIRES["vllm-map-batch"])
    yield publisher
    publisher.close()


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="cache-service")
    add_doctor_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["doctor", *argv])


def doctor(feed: Callable[[], None], *argv: str, seconds: float = 10.0) -> tuple[int, float]:
    """Run the doctor in a thread while `feed` publishes; its exit status and run time."""
    outcome: list[int] = []
    started = time.monotonic()
    thread = threading.Thread(
        target=lambda: outcome.append(run_doctor_command(parse(*argv, "--seconds", str(seconds))))
    )
    thread.start()
    try:
        feed()
    finally:
        thread.join(timeout=seconds + 10)
    assert outcome, "the doctor did not finish"
    return outcome[0], time.monotonic() - started


def publish_prompts(publisher: TestPublisher, scheme: str, seed: str | None) -> Callable[[], None]:
    def feed() -> None:
        publisher.wait_for_subscriber()
        # A chained event first (the doctor joined mid-conversation), then a new prompt.
        _, chained = prompt_events(scheme, PROMPT, seed=seed, splits=[2, 1])
        publisher.publish([chained])
        publisher.publish(prompt_events(scheme, PROMPT, seed=seed, splits=[2, 1]))

    return feed


def test_an_engine_whose_hashes_match_is_ok_and_the_doctor_stops_early(
    publisher: TestPublisher, capsys: pytest.CaptureFixture[str]
) -> None:
    status, took = doctor(
        publish_prompts(publisher, "vllm-sha256", "0"),
        "--kv-events", publisher.endpoint, "--kv-events-seed", "0",
    )  # fmt: skip
    out = capsys.readouterr().out
    name = publisher.endpoint.removeprefix("tcp://")
    assert status == 0, out
    assert f"engine {name} (vllm-sha256, seed '0', blocks of 16): ok" in out
    assert "vllm-sha256 reproduces the event" in out
    assert "all 1 engine(s) ok" in out
    assert took < 5.0  # it stopped once the engine had started a prompt, not after 10 s


def test_a_wrong_seed_is_named_with_the_seed_that_matches(
    publisher: TestPublisher, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _ = doctor(
        publish_prompts(publisher, "vllm-sha256-cbor", "42"),
        "--kv-events", publisher.endpoint,
        "--kv-events-hash-scheme", "vllm-sha256-cbor", "--kv-events-seed", "0",
    )  # fmt: skip
    out = capsys.readouterr().out
    assert status == 1, out
    assert ": wrong-seed\n" in out
    assert "vllm-sha256-cbor with PYTHONHASHSEED=42" in out
    assert "1 of 1 engine(s) need attention" in out


def test_a_missing_seed_is_found_and_named(
    publisher: TestPublisher, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _ = doctor(
        publish_prompts(publisher, "vllm-xxhash", "1"),
        "--kv-events", publisher.endpoint, "--kv-events-hash-scheme", "vllm-xxhash",
    )  # fmt: skip
    out = capsys.readouterr().out
    assert status == 1, out
    assert "(vllm-xxhash, no seed, blocks of 16): wrong-seed" in out
    assert "vllm-xxhash with PYTHONHASHSEED=1" in out
    assert "no seed is configured: set --kv-events-seed" in out


def test_a_wrong_scheme_is_named_with_the_scheme_that_matches(
    publisher: TestPublisher, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _ = doctor(
        publish_prompts(publisher, "sglang", None),
        "--kv-events", publisher.endpoint, "--kv-events-seed", "0",
    )  # fmt: skip
    out = capsys.readouterr().out
    assert status == 1, out
    assert ": wrong-scheme\n" in out
    assert "the engine hashes with sglang, not the configured vllm-sha256" in out


def test_an_unguessable_seed_is_unknown_with_the_pythonhashseed_hint(
    publisher: TestPublisher, capsys: pytest.CaptureFixture[str]
) -> None:
    def feed() -> None:
        publisher.wait_for_subscriber()
        events = prompt_events("vllm-sha256", PROMPT, seed="random-per-process-31337")
        events[0]["extra_keys"] = [None] * 3  # newer vLLM: block 0 is shown unsalted
        publisher.publish(events)

    status, _ = doctor(feed, "--kv-events", publisher.endpoint, "--kv-events-seed", "0")
    out = capsys.readouterr().out
    assert status == 1, out
    assert ": unknown\n" in out
    assert "PYTHONHASHSEED is most likely unset" in out


def test_salted_prompts_without_extra_keys_are_not_called_a_wrong_setup(
    publisher: TestPublisher, capsys: pytest.CaptureFixture[str]
) -> None:
    """Older vLLM events do not show block 0's cache_salt: a healthy engine is not 'unknown'."""

    def feed() -> None:
        publisher.wait_for_subscriber()
        events = prompt_events("vllm-sha256", PROMPT, seed="0")
        events[0]["block_hashes"] = published_hashes(
            "vllm-sha256", PROMPT, seed="0", cache_salt="tenant-7"
        )
        publisher.publish(events)

    status, _ = doctor(feed, "--kv-events", publisher.endpoint, "--kv-events-seed", "0")
    out = capsys.readouterr().out
    assert ": unknown\n" not in out and "PYTHONHASHSEED is most likely unset" not in out
    assert ": unverifiable\n" in out, out
    assert "may have a cache_salt" in out and "send the engine an unsalted" in out
    assert status == 1  # not ok either: nothing it saw could confirm the seed


def test_vllm_032s_default_seed_is_among_those_tried(
    publisher: TestPublisher, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM 0.32 with PYTHONHASHSEED unset roots sha256 at "vllm-none-hash"."""
    feed = publish_prompts(publisher, "vllm-sha256", "vllm-none-hash")
    status, _ = doctor(feed, "--kv-events", publisher.endpoint, "--kv-events-seed", "0")
    out = capsys.readouterr().out
    assert status == 1, out
    assert ": wrong-seed\n" in out and "vllm-sha256 with PYTHONHASHSEED=vllm-none-hash" in out


def test_a_sha256_engine_without_a_configured_seed_is_checked_with_vllm_032s_default(
    publisher: TestPublisher, capsys: pytest.CaptureFixture[str]
) -> None:
    feed = publish_prompts(publisher, "vllm-sha256", "vllm-none-hash")
    status, _ = doctor(feed, "--kv-events", publisher.endpoint)
    out = capsys.readouterr().out
    assert status == 0, out
    assert "(vllm-sha256, seed 'vllm-none-hash', blocks of 16): ok" in out


def test_the_seed_flag_says_what_an_unset_pythonhashseed_means() -> None:
    parser = argparse.ArgumentParser(prog="cache-service")
    commands = parser.add_subparsers(dest="command")
    add_doctor_parser(commands)
    help_text = " ".join(commands.choices["doctor"].format_help().split())
    assert "unset: vllm-none-hash for vllm-sha256 and vllm-sha256-cbor" in help_text


def test_an_engine_of_the_other_vllm_releases_extra_keys_form_is_named(
    publisher: TestPublisher, capsys: pytest.CaptureFixture[str]
) -> None:
    """An older vLLM (untagged keys) checked as 0.32's (the default): the seed is right, so
    the doctor names extra_keys_form, not PYTHONHASHSEED."""

    def feed() -> None:
        publisher.wait_for_subscriber()
        events = prompt_events("vllm-sha256", PROMPT, seed="0", extra_keys_form="untagged")
        events[0]["block_hashes"] = published_hashes(
            "vllm-sha256", PROMPT, seed="0", cache_salt="tenant-7", extra_keys_form="untagged"
        )
        events[0]["extra_keys"] = [["tenant-7"], None, None]
        publisher.publish(events)

    status, _ = doctor(feed, "--kv-events", publisher.endpoint, "--kv-events-seed", "0")
    out = capsys.readouterr().out
    assert status == 1, out
    assert ": wrong-extra-keys-form\n" in out
    assert "extra_keys_form = 'untagged', not the configured 'tagged'" in out
    assert "PYTHONHASHSEED" not in out


def test_another_block_size_is_named(
    publisher: TestPublisher, capsys: pytest.CaptureFixture[str]
) -> None:
    def feed() -> None:
        publisher.wait_for_subscriber()
        publisher.publish(prompt_events("sglang", PROMPT[:32], seed=None, block_size=32))

    status, _ = doctor(
        feed, "--kv-events", publisher.endpoint, "--kv-events-hash-scheme", "sglang"
    )  # fmt: skip
    out = capsys.readouterr().out
    assert status == 1, out
    assert ": wrong-block-size\n" in out
    assert "the engine stores blocks of 32 tokens, the configuration says 16" in out


def test_only_chained_events_cannot_tell(
    publisher: TestPublisher, capsys: pytest.CaptureFixture[str]
) -> None:
    def feed() -> None:
        publisher.wait_for_subscriber()
        _, chained = prompt_events("vllm-sha256", PROMPT, seed="0", splits=[2, 1])
        publisher.publish([chained])

    status, took = doctor(
        feed, "--kv-events", publisher.endpoint, "--kv-events-seed", "0", seconds=1.0
    )
    out = capsys.readouterr().out
    assert status == 1, out
    assert ": unverifiable\n" in out
    assert "(1 starting a prompt)" not in out and "(0 starting a prompt)" in out
    assert took >= 1.0  # it waited the whole time for an event that starts a prompt


def test_an_engine_that_sends_nothing_is_named_and_fails(
    publisher: TestPublisher, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _ = doctor(
        lambda: None, "--kv-events", publisher.endpoint, "--kv-events-seed", "0", seconds=0.5
    )
    out = capsys.readouterr().out
    assert status == 1
    assert ": no events\n" in out
    assert f"nothing stored arrived from {publisher.endpoint}" in out


def test_every_engine_of_a_file_is_diagnosed_and_one_bad_one_fails_the_run(
    context: zmq.Context[Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = TestPublisher(context, wire=WIRES["vllm-spec-kind"])
    bad = TestPublisher(context, wire=WIRES["sglang-medium"])
    config = tmp_path / "engines.toml"
    config.write_text(
        '[defaults]\nseed = "0"\n\n'
        f'[[engine]]\nname = "good"\nendpoint = "{good.endpoint}"\n'
        'hash_scheme = "vllm-sha256-cbor"\n\n'
        f'[[engine]]\nname = "bad"\nendpoint = "{bad.endpoint}"\nhash_scheme = "sglang"\n'
        "block_size = 32\n"
    )

    def feed() -> None:
        good.wait_for_subscriber()
        bad.wait_for_subscriber()
        good.publish(prompt_events("vllm-sha256-cbor", PROMPT, seed="0"))
        bad.publish(prompt_events("sglang", PROMPT[:32], seed=None, block_size=16))

    try:
        status, _ = doctor(feed, "--kv-events-config", str(config))
    finally:
        good.close()
        bad.close()
    out = capsys.readouterr().out
    assert status == 1, out
    assert "engine good (vllm-sha256-cbor, seed '0', blocks of 16): ok" in out
    assert "engine bad (sglang, seed '0', blocks of 32): wrong-block-size" in out
    assert "1 of 2 engine(s) need attention" in out


def test_unusable_flags_exit_2_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_doctor_command(parse()) == 2
    assert "no engines: give --kv-events or --kv-events-config" in capsys.readouterr().err
    bad_scheme = parse("--kv-events", "tcp://127.0.0.1:5557", "--kv-events-hash-scheme", "md5")
    assert run_doctor_command(bad_scheme) == 2
    assert "unknown hash scheme 'md5'" in capsys.readouterr().err


def test_the_console_script_runs_the_doctor_and_exits_non_zero_naming_the_engine() -> None:
    """`cache-service doctor` is registered in the CLI (not only importable)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"  # nothing publishes there
    done = subprocess.run(
        [*service_command(), "doctor", "--kv-events", endpoint,
         "--kv-events-hash-scheme", "xxh3-64-1337", "--seconds", "1"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert f"engine {endpoint.removeprefix('tcp://')}" in done.stdout
    assert "no events" in done.stdout
