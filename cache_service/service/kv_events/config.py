"""Which engines to subscribe to: from a TOML file, or the `--kv-events` short form.

A file lists engines as ``[[engine]]`` tables, with optional ``[defaults]`` for every
engine's unset keys::

    [defaults]
    block_size = 16
    hash_scheme = "vllm-sha256-cbor"
    seed = "0"                                 # the engine's PYTHONHASHSEED
    extra_keys_form = "tagged"                 # vLLM 0.32's; "untagged" for older releases

    [[engine]]
    name = "vllm-a"
    endpoint = "tcp://10.0.0.5:5557"           # rank r publishes on port + r
    replay_endpoint = "tcp://10.0.0.5:5558"    # likewise
    data_parallel_size = 2
    model = "meta-llama/Llama-3.1-8B-Instruct"
    lora_modules = { sql-lora = "/adapters/sql-lora" }   # as vLLM's --lora-modules

`seed` unset is filled in by `resolve_engines` (hub.py) where vLLM has a fixed default.
`extra_keys_form` says how the engine's vLLM release hashes a block's extra keys (LoRA,
cache salt, multimodal): "tagged" (vLLM 0.32, the default) or "untagged" (older releases);
other schemes ignore it. `lora_modules` maps each LoRA adapter's name to the path vLLM was
given for it: vLLM 0.32 hashes the path, and its KV events carry only the name.

The short form ``tcp://HOST:PORT[,tcp://HOST:PORT...]`` makes one engine per endpoint,
named ``HOST:PORT``, with the defaults given by the caller. Mistakes (an unknown key, a
``*`` host, a duplicate name) raise `KvEventsConfigError` naming the engine and the key.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cache_service.core.engines.schemes import DEFAULT_EXTRA_KEYS_FORM, EXTRA_KEYS_FORMS

DEFAULT_BLOCK_SIZE = 16  # vLLM's default block size


@dataclass(frozen=True, slots=True)
class KvEventsConfig:
    """The service's KV-event settings, the engines resolved (`resolve_engines`): which
    engines to follow (none: off), and how their views are kept. Named as `KvEventsHub`'s
    arguments, which `KvEventsHub.following` passes them as."""

    engines: tuple[EngineConfig, ...]
    max_blocks_per_engine: int  # --kv-events-max-blocks
    grace_seconds: float  # --kv-events-grace
    silence_timeout_seconds: float  # --kv-events-silence-timeout (0: never)


class KvEventsConfigError(ValueError):
    """A KV-events configuration that cannot be used, with the reason."""


@dataclass(frozen=True, slots=True)
class RankEndpoints:
    """Where one data-parallel rank of an engine publishes (and answers replay requests)."""

    rank: int
    endpoint: str
    replay_endpoint: str | None


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One engine publishing KV events: where, and how its block hashes are made."""

    name: str
    endpoint: str
    model: str | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    hash_scheme: str | None = None  # a name of cache_service.core.engines.schemes
    seed: str | None = None  # vLLM's PYTHONHASHSEED, as the string it is
    replay_endpoint: str | None = None
    data_parallel_size: int = 1
    topic: str = ""  # a prefix filter; "" takes every topic
    extra_keys_form: str = DEFAULT_EXTRA_KEYS_FORM  # how its vLLM release hashes extra keys
    lora_modules: tuple[tuple[str, str], ...] = ()  # (LoRA name, adapter path), sorted

    def lora_path(self, lora_name: str | None) -> str | None:
        """The configured path of the LoRA adapter `lora_name`, or None."""
        return None if lora_name is None else dict(self.lora_modules).get(lora_name)

    def ranks(self) -> list[RankEndpoints]:
        """Each rank's endpoints: rank r on the configured port + r (as vLLM and SGLang bind)."""
        return [
            RankEndpoints(
                rank,
                _offset_port(self.endpoint, rank),
                None if self.replay_endpoint is None else _offset_port(self.replay_endpoint, rank),
            )
            for rank in range(self.data_parallel_size)
        ]


_KEYS = {field.name for field in fields(EngineConfig)}


def parse_endpoints(value: str, **defaults: Any) -> list[EngineConfig]:
    """Engines from ``tcp://HOST:PORT[,...]``, one per endpoint, named ``HOST:PORT``."""
    engines = []
    for item in (part.strip() for part in value.split(",")):
        if not item:
            continue
        host, port = _host_port(item, "endpoint", item)
        engines.append(_checked({**defaults, "name": f"{host}:{port}", "endpoint": item}))
    if not engines:
        raise KvEventsConfigError("--kv-events names no endpoint")
    _check_unique(engines)
    return engines


def load_engines(path: str | Path) -> list[EngineConfig]:
    """Engines from a TOML file (see the module docstring for its format)."""
    try:
        with open(path, "rb") as file:
            document = tomllib.load(file)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise KvEventsConfigError(f"{path}: {exc}") from exc
    return parse_document(document, source=str(path))


def parse_document(document: Mapping[str, Any], *, source: str = "config") -> list[EngineConfig]:
    """Engines from an already parsed TOML document."""
    unknown = set(document) - {"defaults", "engine"}
    if unknown:
        raise KvEventsConfigError(f"{source}: unknown tables {sorted(unknown)}")
    defaults = document.get("defaults", {})
    tables = document.get("engine", [])
    if not isinstance(defaults, Mapping) or not isinstance(tables, Sequence) or not tables:
        raise KvEventsConfigError(f"{source}: expected [defaults] and one or more [[engine]]")
    engines = [_checked({**defaults, **table}) for table in tables]
    _check_unique(engines)
    return engines


def with_defaults(engine: EngineConfig, **values: Any) -> EngineConfig:
    """The engine with some keys replaced (the CLI's flags over a file's values)."""
    return _checked({**{key: getattr(engine, key) for key in _KEYS}, **values})


def _checked(table: Mapping[str, Any]) -> EngineConfig:
    name = table.get("name")
    if not isinstance(name, str) or not name:
        raise KvEventsConfigError("an engine without a name")
    unknown = set(table) - _KEYS
    if unknown:
        raise KvEventsConfigError(f"engine {name}: unknown keys {sorted(unknown)}")
    values = dict(table)
    if isinstance(values.get("seed"), int) and not isinstance(values["seed"], bool):
        values["seed"] = str(values["seed"])  # PYTHONHASHSEED is a string in the engine
    if "lora_modules" in values:
        values["lora_modules"] = _lora_modules(values["lora_modules"], name)
    for key, kind in (
        ("endpoint", str),
        ("model", str),
        ("hash_scheme", str),
        ("seed", str),
        ("replay_endpoint", str),
        ("topic", str),
        ("extra_keys_form", str),
        ("block_size", int),
        ("data_parallel_size", int),
    ):
        value = values.get(key)
        required = key == "endpoint"
        if (value is None and required) or (
            value is not None and (not isinstance(value, kind) or isinstance(value, bool))
        ):
            raise KvEventsConfigError(f"engine {name}: {key} must be a {kind.__name__}")
    engine = replace(EngineConfig(name=name, endpoint=values["endpoint"]), **values)
    if engine.block_size < 1 or engine.data_parallel_size < 1:
        raise KvEventsConfigError(
            f"engine {name}: block_size and data_parallel_size must be at least 1"
        )
    if engine.extra_keys_form not in EXTRA_KEYS_FORMS:
        raise KvEventsConfigError(
            f"engine {name}: extra_keys_form must be one of {', '.join(EXTRA_KEYS_FORMS)} "
            f"(vLLM 0.32's is tagged, older releases' untagged), not {engine.extra_keys_form!r}"
        )
    _host_port(engine.endpoint, "endpoint", name)
    if engine.replay_endpoint is not None:
        _host_port(engine.replay_endpoint, "replay_endpoint", name)
    return engine


def _lora_modules(value: object, name: str) -> tuple[tuple[str, str], ...]:
    """A `lora_modules` table (or the pairs `with_defaults` passes back) as sorted pairs."""
    problem = (
        f"engine {name}: lora_modules must be a table of LoRA names to adapter paths "
        '(lora_modules = { name = "/path" }), as given to vLLM\'s --lora-modules'
    )
    if isinstance(value, Mapping):
        pairs: Iterable[object] = value.items()
    elif isinstance(value, tuple):  # an engine's own, passed back by `with_defaults`
        pairs = value
    else:
        raise KvEventsConfigError(problem)
    modules: dict[str, str] = {}
    for pair in pairs:
        if not (isinstance(pair, tuple | list) and len(pair) == 2):
            raise KvEventsConfigError(problem)
        lora, path = pair
        if not isinstance(lora, str) or not lora or not isinstance(path, str) or not path:
            raise KvEventsConfigError(f"{problem}; {lora!r} = {path!r} is not")
        modules[lora] = path
    return tuple(sorted(modules.items()))


def _host_port(endpoint: str, key: str, name: str) -> tuple[str, int]:
    parts = urlsplit(endpoint)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or port is None:
        raise KvEventsConfigError(f"engine {name}: {key} {endpoint!r} is not tcp://HOST:PORT")
    if parts.hostname == "*":
        raise KvEventsConfigError(
            f"engine {name}: {key} {endpoint!r} is the engine's bind address; "
            "give the host it can be reached at"
        )
    return parts.hostname, port


def _offset_port(endpoint: str, rank: int) -> str:
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


def _check_unique(engines: Sequence[EngineConfig]) -> None:
    names = [engine.name for engine in engines]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise KvEventsConfigError(f"engines named twice: {duplicates}")
