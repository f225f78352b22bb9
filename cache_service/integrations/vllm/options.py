"""The connector's settings, from `kv_connector_extra_config`, and a request's own options.

Every key is checked when the engine starts: an unknown key (a typo) or a value of the wrong
type stops the engine with a message naming the key, rather than silently running on a
default. A request may name a retention class, or skip loading or storing, under the key
`prompt_cache` of its `kv_transfer_params`.

Prefill and decode on separate engines use vLLM's own convention for the hand-off: a prefill
engine's request carries `{"do_remote_decode": true}`, and its answer's `kv_transfer_params`
(`{"do_remote_prefill": true, "prompt_cache": {"stored_tokens": N, ...}}`, `handoff.py`) go
with the request to the decode engine, whose connector waits, bounded, until the service
holds what was reported.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

REQUEST_PARAMS_KEY = "prompt_cache"  # kv_transfer_params={"prompt_cache": {...}}
DEFAULT_URL = "http://127.0.0.1:8080"
DEFAULT_API_KEY_ENV = "CACHE_SERVICE_API_KEY"
LOAD_MODES = ("auto", "async", "sync")
NONCE = re.compile(r"(?:[0-9a-f]{32})?")  # a tail's nonce (handoff.py), or none


class OptionError(ValueError):
    """A connector setting or a request's prompt_cache option that cannot be used."""


@dataclass(frozen=True, slots=True)
class ConnectorOptions:
    """What `kv_connector_extra_config` may say; every field has a working default."""

    url: str = DEFAULT_URL
    # The API key is read from this environment variable (unset: no key), never from the
    # command line, where `ps` and logs would show it.
    api_key_env: str = DEFAULT_API_KEY_ENV
    model: str = ""  # the namespace's model name; "" = vLLM's served model name
    weights_id: str = ""  # names the weights; "" = a digest of the model folder's files
    retention: str = ""  # the retention class of stored blocks; "" = the service's default
    # The lookup runs beside vLLM's scheduler loop, which waits for it this long when it first
    # asks, then schedules other requests until the answer is in: a slow service never stalls
    # the loop for more than this per new request.
    lookup_wait_seconds: float = 0.05
    lookup_timeout_seconds: float = 0.5  # a lookup not answered by then is a miss
    transfer_timeout_seconds: float = 10.0  # fetching and storing payloads
    store_queue_bytes: int = 1 << 30  # KV copied out and waiting to be stored, at most
    store_request_bytes: int = 64 << 20  # payload bytes in one store request, at most
    backoff_max_seconds: float = 30.0  # after failures, calls skip the network this long at most
    # Loads read the payloads from the service's LMDB files when the engine runs on the
    # service's host and the service offers it (`serve --local-reads`); else over HTTP.
    local_reads: bool = False
    local_reads_path: str = ""  # the store's folder as this host mounts it; "" = as offered
    # "async": vLLM parks a request while its prefix loads on a thread of the connector's and
    # schedules the others meanwhile (a failed load is known before the request computes; the
    # only mode that is right under async scheduling). "sync": the load runs before the step's
    # forward, which waits for it. "auto": async, except on vLLM's CPU backend without async
    # scheduling, where sync was measured faster (docs/content/vllm-connector.md).
    load_mode: str = "auto"
    # A decode engine given a prefill engine's report (`stored_tokens`) waits at most this long
    # for those stores to reach the service before it loads what is there: the prefill
    # engine's answer can reach the proxy before its background stores land.
    prefill_wait_seconds: float = 5.0
    # The retention class of a prompt's partial last group, stored by a prefill engine for its
    # decode engine alone and read within seconds: the service's built-in `handoff` (10 min)
    # lets those blocks go soon after. "" = the request's class, as it is (with a warning)
    # where the service has no class of this name.
    handoff_retention: str = "handoff"

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorOptions:
        """The options `extra` sets; OptionError naming the key for an unknown or bad one."""
        given = dict(extra or {})
        known = {field.name: field for field in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in given.items():
            if key not in known:
                raise OptionError(
                    f"kv_connector_extra_config: unknown key {key!r} (known: {sorted(known)})"
                )
            default = getattr(cls(), key)
            values[key] = _checked(key, value, type(default))
        options = cls(**values)
        for key in ("lookup_timeout_seconds", "transfer_timeout_seconds", "backoff_max_seconds"):
            if getattr(options, key) <= 0:
                raise OptionError(f"kv_connector_extra_config: {key} must be above 0")
        if options.load_mode not in LOAD_MODES:
            raise OptionError(f"kv_connector_extra_config: load_mode must be one of {LOAD_MODES}")
        for key in ("lookup_wait_seconds", "prefill_wait_seconds"):
            if getattr(options, key) < 0:
                raise OptionError(f"kv_connector_extra_config: {key} must be 0 or more")
        for key in ("store_queue_bytes", "store_request_bytes"):
            if getattr(options, key) < 1:
                raise OptionError(f"kv_connector_extra_config: {key} must be at least 1")
        return options

    def api_key(self) -> str | None:
        """The API key from the environment variable `api_key_env`, or None."""
        return os.environ.get(self.api_key_env) or None


def _checked(key: str, value: Any, kind: type) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise OptionError(
            f"kv_connector_extra_config: {key} must be {kind.__name__}, got {value!r}"
        )
    return value


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """One request's `kv_transfer_params`: under `prompt_cache` its retention, whether to use
    us, and the tokens a prefill engine stored for it; and vLLM's `do_remote_decode`."""

    retention: str = ""  # "" = the connector's retention
    load: bool = True
    store: bool = True
    stored_tokens: int = 0  # a prefill engine stored this many of the prompt's tokens
    tail_tokens: int = 0  # and the partial last group's tokens, under this nonce
    tail_nonce: str = ""
    remote_decode: bool = False  # a prefill request: its answer reports what was stored

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> RequestOptions:
        """The options a request's kv_transfer_params give; OptionError naming a bad one."""
        if params is not None and not isinstance(params, Mapping):
            raise OptionError("kv_transfer_params must be an object")
        remote_decode = (params or {}).get("do_remote_decode", False)
        if not isinstance(remote_decode, bool):
            raise OptionError("kv_transfer_params.do_remote_decode is a boolean")
        own = (params or {}).get(REQUEST_PARAMS_KEY)
        if own is None:
            return cls(remote_decode=remote_decode)
        if not isinstance(own, Mapping):
            raise OptionError(f"kv_transfer_params.{REQUEST_PARAMS_KEY} must be an object")
        unknown = set(own) - {
            "retention", "load", "store", "stored_tokens", "tail_tokens", "tail_nonce"
        }  # fmt: skip
        if unknown:
            raise OptionError(
                f"kv_transfer_params.{REQUEST_PARAMS_KEY}: unknown key {sorted(unknown)[0]!r}"
            )
        retention = own.get("retention", "")
        if not isinstance(retention, str):
            raise OptionError(f"kv_transfer_params.{REQUEST_PARAMS_KEY}.retention is a string")
        flags = {name: own.get(name, True) for name in ("load", "store")}
        for name, flag in flags.items():
            if not isinstance(flag, bool):
                raise OptionError(f"kv_transfer_params.{REQUEST_PARAMS_KEY}.{name} is a boolean")
        counts = {name: own.get(name, 0) for name in ("stored_tokens", "tail_tokens")}
        for name, count in counts.items():
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise OptionError(
                    f"kv_transfer_params.{REQUEST_PARAMS_KEY}.{name} is a whole number >= 0"
                )
        nonce = own.get("tail_nonce", "")
        if not isinstance(nonce, str) or not NONCE.fullmatch(nonce):
            raise OptionError(
                f"kv_transfer_params.{REQUEST_PARAMS_KEY}.tail_nonce is 32 lowercase hex digits"
            )
        return cls(
            retention=retention,
            remote_decode=remote_decode,
            tail_nonce=nonce,
            **flags,
            **counts,
        )
