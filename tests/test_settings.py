"""Configuration from flags and CACHE_SERVICE_* variables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from cache_service.cli import build_parser, load_settings
from cache_service.core.eviction import POLICIES
from cache_service.core.lifetimes import Lifetimes
from cache_service.core.touches import TouchOptions
from cache_service.service.settings import Settings, parse_model_block_sizes


def test_defaults_match_the_documented_ones() -> None:
    settings = Settings()
    assert settings.capacity == 10 * 2**30
    assert settings.block_size == 64
    assert settings.retention_policy().ttl_seconds == {
        "agent": 3 * 86400,
        "chat": 7 * 86400,
        "handoff": 600,
    }
    assert settings.retention_policy().default_class == "chat"
    assert settings.host == "127.0.0.1"


def test_environment_variables_configure_every_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHE_SERVICE_CAPACITY", "20GiB")
    monkeypatch.setenv("CACHE_SERVICE_RETENTION", "agent=3d,chat=7d,batch=2h")
    monkeypatch.setenv("CACHE_SERVICE_MODEL_BLOCK_SIZE", "llama-3-8b=16")
    settings = Settings()
    assert settings.capacity == 20 * 2**30
    assert settings.retention_policy().ttl_seconds["batch"] == 7200
    assert settings.model_block_sizes() == {"llama-3-8b": 16}


def test_flags_override_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHE_SERVICE_BLOCK_SIZE", "32")
    args = vars(build_parser().parse_args(["serve", "--block-size", "16", "--capacity", "1GB"]))
    args.pop("command")
    settings = load_settings(args)
    assert settings.block_size == 16
    assert settings.capacity == 10**9


@pytest.mark.parametrize(
    "overrides",
    [
        {"capacity": "lots"},
        {"retention": "chat=forever"},
        {"default_retention": "batch"},
        {"model_block_size": "llama=0"},
        {"lmdb_sync": "sometimes"},
        {"low_water": 0.99, "high_water": 0.9},
        {"block_size": 0},
        {"bogus_flag": 1},
    ],
)
def test_invalid_configuration_is_refused(overrides: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        Settings(**overrides)  # type: ignore[arg-type]


def test_model_block_sizes_allow_equals_free_names() -> None:
    assert parse_model_block_sizes("a=1, org/model-7b=16") == {"a": 1, "org/model-7b": 16}


def test_cli_reports_bad_configuration_without_traceback() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cache_service.cli", "serve", "--capacity", "lots"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert "--capacity" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_help_names_each_environment_variable() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cache_service.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    for name in Settings.model_fields:
        assert f"CACHE_SERVICE_{name.upper()}" in result.stdout.replace("\n", "").replace(" ", "")


KEY_LIST = "k:team-a:reader:" + "a" * 64

KNOWN = ", ".join(POLICIES)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"auth": "keys"}, "--auth keys needs keys"),
        ({"api_keys": KEY_LIST}, "--auth is none: add --auth keys"),
        ({"host": "0.0.0.0"}, "refusing to serve 0.0.0.0 without authentication"),
        ({"host": "10.1.2.3"}, "without authentication"),
        ({"auth": "maybe"}, "use one of none, keys"),
        (
            {"auth": "keys", "api_keys": KEY_LIST, "metrics_port": 9100, "metrics_host": "0.0.0.0"},
            "refusing to serve metrics on 0.0.0.0",
        ),
        ({"auth": "keys", "api_keys": "k:t:reader"}, "use id:tenant:role:sha256"),
    ],
)
def test_authentication_settings_are_refused_when_unsafe_or_wrong(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        Settings(**overrides)  # type: ignore[arg-type]


def test_an_open_address_needs_keys_or_an_explicit_allowance() -> None:
    assert Settings(host="0.0.0.0", auth="keys", api_keys=KEY_LIST).host == "0.0.0.0"
    assert Settings(host="0.0.0.0", allow_unauthenticated=True).auth == "none"
    assert Settings(host="::1").auth == "none"  # loopback needs neither
    assert Settings(host="localhost").auth == "none"


def test_a_true_false_setting_is_also_a_bare_switch() -> None:
    args = vars(build_parser().parse_args(
        ["serve", "--host", "0.0.0.0", "--allow-unauthenticated", "--access-log", "false"]
    ))  # fmt: skip
    args.pop("command")
    settings = load_settings(args)
    assert (settings.allow_unauthenticated, settings.access_log) == (True, False)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"eviction_policy": "fifo"}, f"unknown eviction policy 'fifo' \\(known: {KNOWN}\\)"),
        ({"store": "valkey://cache:6379"}, "unknown store scheme 'valkey'.*lmdb://, memory://"),
        ({"store": "redis://cache:6379/0"}, "redis:// takes HOST:PORT only"),
        ({"store": "redis://"}, "an empty node"),
        ({"store": "memory://", "workers": 2}, "memory:// store lives in one process"),
        # Checked with the settings, so that `serve` says so rather than a worker's traceback.
        ({"store": "lmdb://"}, "lmdb:// needs a folder"),
        ({"store": "memory://somewhere"}, "memory:// takes no path"),
    ],
)
def test_store_and_eviction_policy_settings_are_checked(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        Settings(**overrides)  # type: ignore[arg-type]


def test_the_store_is_the_data_dir_folder_unless_a_store_url_is_given() -> None:
    assert Settings(data_dir="/srv/cache").store_url() == "/srv/cache"  # type: ignore[arg-type]
    assert Settings(data_dir="/srv/cache", store="memory://").store_url() == "memory://"  # type: ignore[arg-type]
    assert Settings().eviction_policy == "adaptive"


def test_cli_names_the_known_eviction_policies_for_an_unknown_one() -> None:
    args = vars(build_parser().parse_args(["serve", "--eviction-policy", "lfu"]))
    args.pop("command")
    with pytest.raises(SystemExit) as exited:
        load_settings(args)
    message = f"--eviction-policy: Value error, unknown eviction policy 'lfu' (known: {KNOWN})"
    assert message in str(exited.value)


def test_the_settings_are_parsed_once_into_the_groups_each_part_is_handed() -> None:
    settings = Settings(
        capacity="1GiB",  # type: ignore[arg-type]
        retention="agent=1h,chat=2h",
        removal_log_entries=5,
        lmdb_sync="nosync",
        auth="keys",
        api_keys=KEY_LIST,
        max_tokens_per_request=100,
        store="memory://",
    )
    groups = settings.groups
    assert groups is settings.groups  # built once, as the settings were validated
    assert (groups.store.url, groups.store.removal_log_entries) == ("memory://", 5)
    assert groups.store.lifetimes == Lifetimes({"agent": 3600.0, "chat": 7200.0})
    assert groups.store.map_size_bytes == settings.map_size_bytes() == 2 * 2**30 + 256 * 2**20
    assert groups.store.changed == {"capacity", "lmdb_sync"}  # differ from their defaults
    assert groups.cache.retention == settings.retention_policy()
    assert (groups.capacity.capacity_bytes, groups.capacity.high_water) == (2**30, 0.95)
    assert groups.touches == TouchOptions(defer=True, slide_fraction=0.01)
    assert groups.limits.max_tokens_per_request == 100
    assert groups.auth.keys is groups.auth.ring and [key.id for key in groups.auth.ring] == ["k"]
    assert Settings().groups.auth.keys is None  # --auth none: every request is trusted


def test_an_engines_file_is_read_once_when_the_settings_are_validated(tmp_path: Path) -> None:
    engines_file = tmp_path / "engines.toml"
    engines_file.write_text('[[engine]]\nname = "a"\nendpoint = "tcp://10.0.0.5:5557"\n')
    settings = Settings(kv_events_config=engines_file)
    engines_file.unlink()  # gone since: nothing reads it again
    assert [engine.name for engine in settings.groups.engines.engines] == ["a"]
    assert settings.kv_event_engines() == settings.groups.engines.engines
    with pytest.raises(ValidationError, match=r"engines\.toml"):
        Settings(kv_events_config=engines_file)  # an unreadable one refuses the start
