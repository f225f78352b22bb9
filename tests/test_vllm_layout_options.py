"""The vLLM connector's namespace, piece headers and options (plain Python, no vLLM)."""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import pytest

from cache_service.core.engines.groups import BlockGroups
from cache_service.integrations.kv_layout import BlockRefused
from cache_service.integrations.vllm.layout import MAX_KV_LAYOUT_CHARS, EngineLayout
from cache_service.integrations.vllm.options import (
    DEFAULT_API_KEY_ENV,
    DEFAULT_URL,
    ConnectorOptions,
    OptionError,
    RequestOptions,
)
from tests.vllm_layout import TEST_LAYOUT

LAYOUT = TEST_LAYOUT
GROUPS = BlockGroups(LAYOUT.engine_block_tokens, 64)
PIECES = GROUPS.service_blocks
PIECE_BYTES = GROUPS.piece_bytes(LAYOUT.block_bytes)
NAMESPACE = LAYOUT.namespace_name  # the request's namespace layout, carried in each header


def piece(
    layout: EngineLayout, *, index: int = 0, pieces: int = PIECES, kv: int = PIECE_BYTES
) -> bytes:
    """A stored piece: `layout`'s header for place `index` of `pieces`, then `kv` bytes of KV."""
    return layout.header(piece=index, pieces=pieces, kv_layout=NAMESPACE) + b"\x5a" * kv


# -- the namespace ------------------------------------------------------------------------------

# One other value for every field but the model; each must give another namespace.
OTHER_VALUES: list[Any] = [
    pytest.param("weights", "xxh3:" + "cd" * 16, id="weights"),
    pytest.param("engine_version", "0.33.0", id="engine_version"),
    pytest.param("backend", "TORCH_SDPA", id="backend"),
    pytest.param("isa", "amx", id="isa"),
    pytest.param("isa", "", id="isa-none"),
    pytest.param("kv_dtype", "float16", id="kv_dtype"),
    pytest.param("layers", 3, id="layers"),
    pytest.param("kv_heads", 2, id="kv_heads"),
    pytest.param("head_size", 8, id="head_size"),
    pytest.param("engine_block_tokens", 16, id="engine_block_tokens"),
    pytest.param("block_bytes", LAYOUT.block_bytes * 2, id="block_bytes"),
    pytest.param("tp_rank", 1, id="tp_rank"),
    pytest.param("tp_size", 2, id="tp_size"),
    pytest.param("tp_replicated", True, id="tp_replicated"),
    pytest.param("device", "cuda", id="device"),
    pytest.param("kv_cache_layout", "LBNHC", id="kv_cache_layout"),
]


@pytest.mark.parametrize(("field", "other"), OTHER_VALUES)
def test_the_namespace_changes_with_every_field_but_the_model(field: str, other: Any) -> None:
    changed = dataclasses.replace(LAYOUT, **{field: other})
    assert changed.namespace_name != LAYOUT.namespace_name


def test_the_namespace_leaves_the_model_to_the_namespaces_own_model() -> None:
    assert dataclasses.replace(LAYOUT, model="other").namespace_name == LAYOUT.namespace_name


def test_a_lora_adapter_gives_another_namespace_per_adapter() -> None:
    first, second = LAYOUT.for_lora("sql /adapters/sql"), LAYOUT.for_lora("chat /adapters/chat")
    names = {LAYOUT.namespace_name, first.namespace_name, second.namespace_name}
    assert len(names) == 3
    assert first.lora == "sql /adapters/sql" and LAYOUT.lora == ""
    assert LAYOUT.for_lora("") == LAYOUT
    assert "/adapters" not in first.namespace_name  # only a digest of the adapter's name


def test_the_namespace_is_deterministic() -> None:
    twin = EngineLayout(**dataclasses.asdict(LAYOUT))
    assert twin.namespace_name == LAYOUT.namespace_name
    assert twin.for_lora("x").namespace_name == LAYOUT.for_lora("x").namespace_name


def test_the_namespace_names_the_layouts_parts_within_the_services_limit() -> None:
    realistic = dataclasses.replace(
        LAYOUT,
        weights="xxh3:" + "f" * 32,
        device="cuda",
        backend="FLASH_ATTN_WITH_A_LONG_BACKEND_NAME",
        kv_cache_layout="LBNHC",
        isa="vec16",
        kv_dtype="float8_e4m3fnuz",
        layers=128,
        kv_heads=64,
        head_size=256,
        engine_block_tokens=1024,
        tp_rank=15,
        tp_size=16,
        lora="a-long-adapter-name /a/very/long/path/to/the/adapter/" + "x" * 300,
    )
    name = realistic.namespace_name
    assert len(name) <= MAX_KV_LAYOUT_CHARS == 256
    parts = ("cuda:FLASH_ATTN", ";LBNHC;", "isa=vec16", "float8_e4m3fnuz", "layers=128", "tp=15/16")
    for part in parts:
        assert part in name
    assert "isa=-" in dataclasses.replace(LAYOUT, isa="").namespace_name


def test_replicated_kv_has_one_rank_free_namespace_that_still_names_the_size() -> None:
    mla = dataclasses.replace(LAYOUT, tp_size=2, tp_replicated=True)
    assert mla.ranks == 1
    assert mla.for_rank(1).namespace_name == mla.namespace_name
    assert "tp=replicated/2" in mla.namespace_name
    assert dataclasses.replace(mla, tp_size=4).namespace_name != mla.namespace_name
    sharded = dataclasses.replace(LAYOUT, tp_size=2)
    assert sharded.ranks == 2
    assert sharded.for_rank(1).namespace_name != sharded.namespace_name


def test_a_namespace_too_long_for_the_service_is_refused() -> None:
    with pytest.raises(ValueError, match="name the weights shorter"):
        _ = dataclasses.replace(LAYOUT, weights="w" * 300).namespace_name


# -- piece headers ------------------------------------------------------------------------------


def test_a_piece_of_this_layout_and_place_is_accepted_at_its_kv_offset() -> None:
    for index in range(PIECES):
        stored = piece(LAYOUT, index=index)
        offset = LAYOUT.check_piece(
            stored, piece=index, pieces=PIECES, kv_bytes=PIECE_BYTES, kv_layout=NAMESPACE
        )
        assert offset == len(LAYOUT.header(piece=index, pieces=PIECES, kv_layout=NAMESPACE))
        assert len(stored) - offset == PIECE_BYTES
        assert (
            LAYOUT.check_piece(
                memoryview(stored),
                piece=index,
                pieces=PIECES,
                kv_bytes=PIECE_BYTES,
                kv_layout=NAMESPACE,
            )
            == offset
        )


@pytest.mark.parametrize(
    ("field", "other"),
    [
        ("kv_dtype", "float16"),
        ("engine_block_tokens", 16),
        ("isa", "amx"),
        ("weights", "xxh3:" + "00" * 16),
        ("backend", "TORCH_SDPA"),
        ("layers", 3),
        ("tp_rank", 1),
        ("kv_cache_layout", "LBNHC"),
        ("device", "cuda"),
        ("lora", "sql /adapters/sql"),
        ("model", "another"),
    ],
)
def test_a_piece_of_another_layout_is_refused_naming_the_field(field: str, other: Any) -> None:
    stored = piece(dataclasses.replace(LAYOUT, **{field: other}))
    with pytest.raises(BlockRefused) as refused:
        LAYOUT.check_piece(
            stored, piece=0, pieces=PIECES, kv_bytes=PIECE_BYTES, kv_layout=NAMESPACE
        )
    assert refused.value.field == field


def test_a_piece_of_another_place_in_its_group_is_refused_as_piece() -> None:
    with pytest.raises(BlockRefused) as refused:
        LAYOUT.check_piece(
            piece(LAYOUT, index=1),
            piece=0,
            pieces=PIECES,
            kv_bytes=PIECE_BYTES,
            kv_layout=NAMESPACE,
        )
    assert refused.value.field == "piece"


def test_a_piece_of_a_group_of_another_size_is_refused_as_pieces() -> None:
    with pytest.raises(BlockRefused) as refused:
        LAYOUT.check_piece(
            piece(LAYOUT, pieces=PIECES + 1),
            piece=0,
            pieces=PIECES,
            kv_bytes=PIECE_BYTES,
            kv_layout=NAMESPACE,
        )
    assert refused.value.field == "pieces"


@pytest.mark.parametrize(
    "stored",
    [
        pytest.param(piece(LAYOUT, kv=PIECE_BYTES - 1), id="kv-short"),
        pytest.param(piece(LAYOUT, kv=PIECE_BYTES + 1), id="kv-long"),
        pytest.param(piece(LAYOUT, kv=0), id="kv-absent"),
        pytest.param(b"", id="empty"),
        pytest.param(b"PCK", id="shorter-than-a-header"),
        pytest.param(b"garbage, not a piece at all" * 40, id="garbage"),
        pytest.param(
            struct.pack("<4sHH", b"PCKV", 1, 9) + b"{not json" + bytes(PIECE_BYTES), id="not-json"
        ),
        pytest.param(struct.pack("<4sHH", b"PCKV", 1, 2) + b"[]" + bytes(PIECE_BYTES), id="list"),
    ],
)
def test_a_damaged_or_foreign_piece_is_refused_as_format(stored: bytes) -> None:
    with pytest.raises(BlockRefused) as refused:
        LAYOUT.check_piece(
            stored, piece=0, pieces=PIECES, kv_bytes=PIECE_BYTES, kv_layout=NAMESPACE
        )
    assert refused.value.field == "format"


def test_a_piece_stored_under_another_namespace_layout_is_refused_as_kv_layout() -> None:
    lora = LAYOUT.for_lora("adapter@/path").namespace_name
    stored = LAYOUT.header(piece=0, pieces=PIECES, kv_layout=lora) + b"\x5a" * PIECE_BYTES
    with pytest.raises(BlockRefused) as refused:
        LAYOUT.check_piece(
            stored, piece=0, pieces=PIECES, kv_bytes=PIECE_BYTES, kv_layout=NAMESPACE
        )
    assert refused.value.field == "kv_layout"


def test_the_header_says_the_engine_and_every_layout_field() -> None:
    fields = LAYOUT.header_fields(piece=1, pieces=2, kv_layout=NAMESPACE)
    assert fields["engine"] == "vllm"
    assert fields["kv_layout"] == NAMESPACE
    assert (fields["piece"], fields["pieces"]) == (1, 2)
    for field in dataclasses.fields(EngineLayout):
        assert fields[field.name] == getattr(LAYOUT, field.name)


# -- ConnectorOptions ---------------------------------------------------------------------------


def test_no_extra_config_gives_the_defaults() -> None:
    assert ConnectorOptions.from_extra_config(None) == ConnectorOptions()
    options = ConnectorOptions.from_extra_config({})
    assert options == ConnectorOptions()
    assert options.url == DEFAULT_URL
    assert options.api_key_env == DEFAULT_API_KEY_ENV
    assert (options.model, options.weights_id, options.retention) == ("", "", "")
    assert options.lookup_timeout_seconds == 0.5
    assert options.transfer_timeout_seconds == 10.0
    assert options.store_queue_bytes == 1 << 30
    assert options.store_request_bytes == 64 << 20
    assert options.backoff_max_seconds == 30.0
    assert (options.local_reads, options.local_reads_path) == (False, "")
    assert options.load_mode == "auto"
    assert options.prefill_wait_seconds == 5.0


def test_extra_config_sets_every_option() -> None:
    given = {
        "url": "http://127.0.0.1:9999",
        "api_key_env": "MY_KEY",
        "model": "llama",
        "weights_id": "llama-3-8b-v2",
        "retention": "agent",
        "lookup_wait_seconds": 0.0,
        "lookup_timeout_seconds": 0.25,
        "transfer_timeout_seconds": 3.5,
        "store_queue_bytes": 1 << 20,
        "store_request_bytes": 1 << 16,
        "backoff_max_seconds": 5.0,
        "local_reads": True,
        "local_reads_path": "/mnt/prompt-cache",
        "load_mode": "sync",
        "prefill_wait_seconds": 1.5,
        "handoff_retention": "handoff",
    }
    options = ConnectorOptions.from_extra_config(given)
    assert dataclasses.asdict(options) == given


def test_an_unknown_key_is_refused_naming_it() -> None:
    with pytest.raises(OptionError, match="unknown key 'lookup_timeout'"):
        ConnectorOptions.from_extra_config({"url": DEFAULT_URL, "lookup_timeout": 1.0})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("url", 8080),
        ("api_key_env", None),
        ("retention", ["agent"]),
        ("lookup_timeout_seconds", "0.5"),
        ("lookup_timeout_seconds", True),
        ("transfer_timeout_seconds", None),
        ("store_queue_bytes", "1024"),
        ("store_queue_bytes", 1024.0),
        ("store_request_bytes", 1.5),
        ("local_reads", 1),
        ("local_reads", "true"),
        ("local_reads_path", False),
        ("load_mode", "later"),
        ("load_mode", True),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_naming_the_key(key: str, value: Any) -> None:
    with pytest.raises(OptionError, match=key):
        ConnectorOptions.from_extra_config({key: value})


@pytest.mark.parametrize("key", ["store_queue_bytes", "store_request_bytes"])
@pytest.mark.parametrize("flag", [True, False])
def test_a_bool_is_not_taken_for_an_int(key: str, flag: bool) -> None:
    with pytest.raises(OptionError, match=f"{key} must be int"):
        ConnectorOptions.from_extra_config({key: flag})


@pytest.mark.parametrize(
    "key", ["lookup_timeout_seconds", "transfer_timeout_seconds", "backoff_max_seconds"]
)
def test_an_int_is_taken_for_a_float(key: str) -> None:
    value = getattr(ConnectorOptions.from_extra_config({key: 2}), key)
    assert value == 2.0 and isinstance(value, float)


@pytest.mark.parametrize(
    "key", ["lookup_timeout_seconds", "transfer_timeout_seconds", "backoff_max_seconds"]
)
@pytest.mark.parametrize("value", [0, 0.0, -1.0])
def test_a_time_that_is_not_above_zero_is_refused(key: str, value: float) -> None:
    with pytest.raises(OptionError, match=f"{key} must be above 0"):
        ConnectorOptions.from_extra_config({key: value})


@pytest.mark.parametrize("key", ["store_queue_bytes", "store_request_bytes"])
@pytest.mark.parametrize("value", [0, -1])
def test_a_byte_limit_below_one_is_refused(key: str, value: int) -> None:
    with pytest.raises(OptionError, match=f"{key} must be at least 1"):
        ConnectorOptions.from_extra_config({key: value})


def test_the_api_key_is_read_from_the_environment_variable_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(DEFAULT_API_KEY_ENV, raising=False)
    monkeypatch.delenv("MY_CACHE_KEY", raising=False)
    assert ConnectorOptions().api_key() is None
    monkeypatch.setenv(DEFAULT_API_KEY_ENV, "default-secret")
    assert ConnectorOptions().api_key() == "default-secret"
    own = ConnectorOptions.from_extra_config({"api_key_env": "MY_CACHE_KEY"})
    assert own.api_key() is None  # its variable is unset; the default's is not read
    monkeypatch.setenv("MY_CACHE_KEY", "own-secret")
    assert own.api_key() == "own-secret"
    monkeypatch.setenv("MY_CACHE_KEY", "")
    assert own.api_key() is None  # set but empty: no key


# -- RequestOptions -----------------------------------------------------------------------------


@pytest.mark.parametrize("params", [None, {}, {"prompt_cache": None}, {"do_remote_prefill": True}])
def test_a_request_without_prompt_cache_options_gets_the_defaults(
    params: dict[str, Any] | None,
) -> None:
    options = RequestOptions.from_params(params)
    assert options == RequestOptions(retention="", load=True, store=True)


def test_a_requests_options_are_read() -> None:
    options = RequestOptions.from_params(
        {"prompt_cache": {"retention": "agent", "load": False, "store": False}, "other": 1}
    )
    assert options == RequestOptions(retention="agent", load=False, store=False)
    assert RequestOptions.from_params({"prompt_cache": {"store": False}}) == RequestOptions(
        store=False
    )
    assert RequestOptions.from_params({"prompt_cache": {}}) == RequestOptions()


@pytest.mark.parametrize(
    ("own", "message"),
    [
        ({"retention": "agent", "ttl": 5}, "unknown key 'ttl'"),
        ("agent", "must be an object"),
        (["load"], "must be an object"),
        (True, "must be an object"),
        ({"retention": 5}, "retention is a string"),
        ({"retention": None}, "retention is a string"),
        ({"load": "yes"}, "load is a boolean"),
        ({"load": 1}, "load is a boolean"),
        ({"store": 0}, "store is a boolean"),
        ({"store": None}, "store is a boolean"),
    ],
)
def test_a_bad_request_option_is_refused(own: Any, message: str) -> None:
    with pytest.raises(OptionError, match=message):
        RequestOptions.from_params({"prompt_cache": own})
