"""Engines' KV-event configuration: the TOML file and the --kv-events short form."""

from __future__ import annotations

from pathlib import Path

import pytest

from cache_service.service.kv_events.config import (
    EngineConfig,
    KvEventsConfigError,
    RankEndpoints,
    load_engines,
    parse_endpoints,
    with_defaults,
)

TWO_ENGINES = """
[defaults]
block_size = 16
seed = 0

[[engine]]
name = "vllm-a"
endpoint = "tcp://10.0.0.5:5557"
replay_endpoint = "tcp://10.0.0.5:5560"
data_parallel_size = 2
hash_scheme = "vllm-sha256-cbor"
model = "meta-llama/Llama-3.1-8B-Instruct"

[[engine]]
name = "sglang-b"
endpoint = "tcp://sglang-b.internal:5557"
hash_scheme = "sglang"
block_size = 64
"""


def test_a_file_gives_each_engine_its_keys_over_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "engines.toml"
    path.write_text(TWO_ENGINES)
    vllm, sglang = load_engines(path)
    assert vllm == EngineConfig(
        name="vllm-a",
        endpoint="tcp://10.0.0.5:5557",
        model="meta-llama/Llama-3.1-8B-Instruct",
        block_size=16,
        hash_scheme="vllm-sha256-cbor",
        seed="0",  # PYTHONHASHSEED is a string
        replay_endpoint="tcp://10.0.0.5:5560",
        data_parallel_size=2,
    )
    assert vllm.ranks() == [
        RankEndpoints(0, "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5560"),
        RankEndpoints(1, "tcp://10.0.0.5:5558", "tcp://10.0.0.5:5561"),
    ]
    assert (sglang.block_size, sglang.hash_scheme, sglang.seed) == (64, "sglang", "0")
    assert sglang.ranks() == [RankEndpoints(0, "tcp://sglang-b.internal:5557", None)]


def test_the_short_form_makes_one_engine_per_endpoint() -> None:
    engines = parse_endpoints(
        "tcp://127.0.0.1:5557, tcp://127.0.0.1:6557", hash_scheme="vllm-xxhash-cbor"
    )
    assert [(e.name, e.endpoint, e.hash_scheme) for e in engines] == [
        ("127.0.0.1:5557", "tcp://127.0.0.1:5557", "vllm-xxhash-cbor"),
        ("127.0.0.1:6557", "tcp://127.0.0.1:6557", "vllm-xxhash-cbor"),
    ]
    assert engines[0].block_size == 16 and engines[0].data_parallel_size == 1


def test_flags_can_override_a_configured_engine() -> None:
    (engine,) = parse_endpoints("tcp://h:1")
    assert with_defaults(engine, seed=42).seed == "42"


TWICE = '[[engine]]\nname="a"\nendpoint="tcp://h:1"\n[[engine]]\nname="a"\nendpoint="tcp://h:2"\n'
ONE = '[[engine]]\nname = "a"\nendpoint = "tcp://h:1"\n'


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ('[[engine]]\nname = "a"\nendpoint = "tcp://*:5557"\n', "bind address"),
        ('[[engine]]\nname = "a"\nendpoint = "http://h:1"\n', "not tcp://HOST:PORT"),
        ('[[engine]]\nname = "a"\nendpoint = "tcp://h"\n', "not tcp://HOST:PORT"),
        ('[[engine]]\nname = "a"\n', "endpoint must be a str"),
        ('[[engine]]\nname = "a"\nendpoint = "tcp://h:1"\nblok_size = 4\n', "blok_size"),
        ('[[engine]]\nname = "a"\nendpoint = "tcp://h:1"\nblock_size = "16"\n', "block_size"),
        ('[[engine]]\nname = "a"\nendpoint = "tcp://h:1"\nblock_size = 0\n', "at least 1"),
        ('[[engine]]\nendpoint = "tcp://h:1"\n', "without a name"),
        (TWICE, "named twice"),
        ("[engines]\n", "unknown tables"),
        ("[defaults]\n", "one or more [[engine]]"),
        ("not toml = = \n", "engines.toml"),
        (f'{ONE}extra_keys_form = "v2"\n', "engine a: extra_keys_form must be one of tagged, "),
        (f"{ONE}extra_keys_form = 1\n", "engine a: extra_keys_form must be a str"),
        (f'{ONE}lora_modules = "a=/p"\n', "engine a: lora_modules must be a table"),
        (f"{ONE}lora_modules = {{ a = 1 }}\n", "engine a: lora_modules must be a table"),
        (f'{ONE}lora_modules = {{ a = "" }}\n', "'a' = '' is not"),
        (f'{ONE}lora_modules = [["a", "/p"]]\n', "engine a: lora_modules must be a table"),
    ],
)
def test_mistakes_are_refused_with_the_engine_and_key(
    tmp_path: Path, text: str, complaint: str
) -> None:
    path = tmp_path / "engines.toml"
    path.write_text(text)
    with pytest.raises(KvEventsConfigError) as raised:
        load_engines(path)
    assert complaint in str(raised.value)


def test_the_short_form_refuses_an_empty_list_and_a_bad_endpoint() -> None:
    with pytest.raises(KvEventsConfigError):
        parse_endpoints(" , ")
    with pytest.raises(KvEventsConfigError):
        parse_endpoints("tcp://h:notaport")


def test_the_extra_keys_form_defaults_to_vllm_032s_and_older_releases_say_untagged(
    tmp_path: Path,
) -> None:
    path = tmp_path / "engines.toml"
    path.write_text(
        '[defaults]\nextra_keys_form = "untagged"\n\n'
        f'{ONE}\n[[engine]]\nname = "b"\nendpoint = "tcp://h:2"\nextra_keys_form = "tagged"\n'
    )
    old, new = load_engines(path)
    assert (old.extra_keys_form, new.extra_keys_form) == ("untagged", "tagged")
    (engine,) = parse_endpoints("tcp://h:1")
    assert engine.extra_keys_form == "tagged"  # vLLM 0.32's


def test_lora_modules_map_each_adapter_to_the_path_vllm_serves_it_from(tmp_path: Path) -> None:
    path = tmp_path / "engines.toml"
    path.write_text(
        '[defaults]\nlora_modules = { sql = "/adapters/sql" }\n\n'
        f"{ONE}\n"
        '[[engine]]\nname = "b"\nendpoint = "tcp://h:2"\n'
        '[engine.lora_modules]\n"tenant-x/chat" = "/a/chat"\nsql = "/b/sql"\n'
    )
    a, b = load_engines(path)
    assert a.lora_modules == (("sql", "/adapters/sql"),)
    assert b.lora_modules == (("sql", "/b/sql"), ("tenant-x/chat", "/a/chat"))  # its own table
    assert (b.lora_path("sql"), b.lora_path("other"), b.lora_path(None)) == ("/b/sql", None, None)
    assert with_defaults(b, seed="1").lora_modules == b.lora_modules  # kept through the flags
