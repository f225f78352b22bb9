"""The engines `serve` and `doctor` are told about (flags, variables, a file), the hub's
model filter, and its metrics: every counter of the subscriber exported by engine."""

from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from cache_service.cli import build_parser, load_settings
from cache_service.service.kv_events.config import EngineConfig, KvEventsConfigError
from cache_service.service.kv_events.counters import EngineCounters
from cache_service.service.kv_events.hub import KvEventsHub, resolve_engines
from cache_service.service.kv_events.metrics import COUNTERS, KvEventsCollector
from cache_service.service.settings import Settings, settings_environment

FILE = """
[defaults]
seed = "0"

[[engine]]
name = "a"
endpoint = "tcp://10.0.0.5:5557"
model = "llama"
hash_scheme = "vllm-sha256-cbor"

[[engine]]
name = "b"
endpoint = "tcp://10.0.0.6:5557"
hash_scheme = "sglang"
block_size = 64
"""


def test_the_short_form_takes_the_flags_and_vllms_default_scheme() -> None:
    (engine,) = resolve_engines(endpoints="tcp://10.0.0.5:5557", seed="0", model="m")
    assert engine == EngineConfig(
        name="10.0.0.5:5557",
        endpoint="tcp://10.0.0.5:5557",
        model="m",
        block_size=16,
        hash_scheme="vllm-sha256",  # vLLM's default --prefix-caching-hash-algo sha256
        seed="0",
    )


def test_flags_that_are_given_set_every_engine_of_a_file(tmp_path: Path) -> None:
    path = tmp_path / "engines.toml"
    path.write_text(FILE)
    a, b = resolve_engines(config_file=path)
    assert (a.hash_scheme, a.seed, a.model, b.block_size) == ("vllm-sha256-cbor", "0", "llama", 64)
    a, b = resolve_engines(config_file=path, seed="7", block_size=32)
    assert (a.seed, a.block_size, b.block_size, b.model) == ("7", 32, 32, None)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (
            {"endpoints": "tcp://h:1", "hash_scheme": "vllm-xxhash"},
            "vllm-xxhash needs the engine's PYTHONHASHSEED",
        ),
        ({"endpoints": "tcp://h:1", "hash_scheme": "sha256"}, "unknown hash scheme 'sha256'"),
        ({"endpoints": "tcp://h:1", "config_file": "x.toml"}, "not both"),
        ({"endpoints": "tcp://*:5557", "seed": "0"}, "the engine's bind address"),
    ],
)
def test_engines_that_could_only_fail_silently_are_refused(
    arguments: dict[str, str], message: str
) -> None:
    with pytest.raises(KvEventsConfigError, match=message):
        resolve_engines(**arguments)  # type: ignore[arg-type]


def test_the_doctor_may_go_without_a_seed_and_neither_source_means_none() -> None:
    (engine,) = resolve_engines(
        endpoints="tcp://h:1", hash_scheme="vllm-xxhash", require_seed=False
    )
    assert engine.seed is None
    assert resolve_engines() == ()


@pytest.mark.parametrize("scheme", [None, "vllm-sha256", "vllm-sha256-cbor"])
def test_a_sha256_engine_without_a_seed_gets_vllm_032s_fixed_default(scheme: str | None) -> None:
    """vLLM 0.32 roots sha256 and sha256_cbor at "vllm-none-hash" when PYTHONHASHSEED is
    unset (xxhash ones at random bytes: refused above)."""
    (engine,) = resolve_engines(endpoints="tcp://h:1", hash_scheme=scheme)
    assert engine.seed == "vllm-none-hash"
    (given,) = resolve_engines(endpoints="tcp://h:1", hash_scheme=scheme, seed="7")
    assert given.seed == "7"
    (sglang,) = resolve_engines(endpoints="tcp://h:1", hash_scheme="sglang")
    assert sglang.seed is None  # seedless: nothing to fill in


def test_serve_flags_reach_the_settings_and_survive_the_workers_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    argv = ["serve", "--kv-events", "tcp://10.0.0.5:5557,tcp://10.0.0.6:5557"]
    argv += ["--kv-events-seed", "0", "--kv-events-hash-scheme", "vllm-sha256-cbor"]
    argv += ["--kv-events-block-size", "32", "--kv-events-max-blocks", "1000"]
    args = vars(build_parser().parse_args(argv))
    args.pop("command")
    settings = load_settings(args)
    engines = settings.kv_event_engines()
    assert [engine.name for engine in engines] == ["10.0.0.5:5557", "10.0.0.6:5557"]
    assert {(e.hash_scheme, e.seed, e.block_size) for e in engines} == {
        ("vllm-sha256-cbor", "0", 32)
    }
    # A worker process reads the settings back from CACHE_SERVICE_* variables.
    for name in [name for name in os.environ if name.startswith("CACHE_SERVICE_")]:
        monkeypatch.delenv(name)
    for name, value in settings_environment(settings).items():
        monkeypatch.setenv(name, value)
    worker = Settings()
    assert worker.kv_event_engines() == engines
    assert worker.kv_events_max_blocks == 1000


def test_an_xxhash_scheme_without_a_seed_is_a_configuration_error() -> None:
    with pytest.raises(ValueError, match="needs the engine's PYTHONHASHSEED"):
        Settings(kv_events="tcp://10.0.0.5:5557", kv_events_hash_scheme="vllm-xxhash-cbor")
    (engine,) = Settings(kv_events="tcp://10.0.0.5:5557").kv_event_engines()
    assert (engine.hash_scheme, engine.seed) == ("vllm-sha256", "vllm-none-hash")
    assert Settings().kv_event_engines() == ()  # ingestion off by default


def test_engines_for_a_model_are_its_own_and_those_of_no_model() -> None:
    hub = KvEventsHub(
        [
            EngineConfig("a", "tcp://h:1", model="llama", hash_scheme="sglang"),
            EngineConfig("b", "tcp://h:2", model="qwen", hash_scheme="sglang"),
            EngineConfig("c", "tcp://h:3", hash_scheme="sglang"),
        ]
    )
    assert [engine.name for engine in hub.engines_for("llama")] == ["a", "c"]
    assert [engine.name for engine in hub.engines_for(None)] == ["a", "b", "c"]
    assert [engine.name for engine in hub.engines_for("mistral")] == ["c"]


def test_every_subscriber_counter_is_exported_by_engine() -> None:
    assert set(COUNTERS) == {field.name for field in fields(EngineCounters)} - {"stale_ranks"}
    hub = KvEventsHub([EngineConfig("a", "tcp://h:1", hash_scheme="sglang")])
    registry = CollectorRegistry()
    registry.register(KvEventsCollector(hub))
    for name, _ in COUNTERS.values():
        assert (
            registry.get_sample_value(f"prompt_cache_kv_events_{name}_total", {"engine": "a"}) == 0
        )
    assert registry.get_sample_value("prompt_cache_kv_events_mismatch_total", {"engine": "a"}) == 0
    assert registry.get_sample_value("prompt_cache_kv_events_stale_ranks", {"engine": "a"}) == 0
    assert registry.get_sample_value("prompt_cache_kv_events_view_blocks", {"engine": "a"}) == 0
    report = hub.report()["a"]
    assert (report["blocks"], report["mismatches"], report["last_mismatch"]) == (0, 0, None)


def test_the_extra_keys_form_flag_sets_every_engine_and_refuses_other_values() -> None:
    (engine,) = Settings(
        kv_events="tcp://10.0.0.5:5557", kv_events_extra_keys_form="untagged"
    ).kv_event_engines()
    assert engine.extra_keys_form == "untagged"
    (default,) = Settings(kv_events="tcp://10.0.0.5:5557").kv_event_engines()
    assert default.extra_keys_form == "tagged"  # vLLM 0.32's
    with pytest.raises(ValueError, match="extra_keys_form"):
        resolve_engines(endpoints="tcp://10.0.0.5:5557", extra_keys_form="bracketed")
