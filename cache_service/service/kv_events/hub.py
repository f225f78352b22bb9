"""KV-event ingestion in a running service: the engines, their views, the subscriber feeding
them and the verifier checking their hashes, started and stopped as one.

`resolve_engines` turns what `serve` and `doctor` were told (`--kv-events` endpoints or a
`--kv-events-config` file, and the `--kv-events-*` defaults) into engines, refusing what
could only fail silently: an unknown scheme, or a vLLM xxhash scheme without the engine's
seed (vLLM 0.32 draws random bytes for those when PYTHONHASHSEED is unset; sha256 and
sha256_cbor engines without a seed get its fixed default, "vllm-none-hash").
With `--workers N` every worker process runs its own hub (each its own SUB per engine rank;
a PUB socket serves any number of subscribers), so whichever worker answers sees the same
views; their counters are each worker's own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from cache_service.core.engines.chain_memo import ChainMemo
from cache_service.core.engines.schemes import SCHEMES, scheme_named
from cache_service.core.engines.views import EngineViews
from cache_service.service.kv_events.config import (
    EngineConfig,
    KvEventsConfig,
    KvEventsConfigError,
    load_engines,
    parse_endpoints,
    with_defaults,
)
from cache_service.service.kv_events.liveness import EngineLiveness
from cache_service.service.kv_events.subscriber import KvEventSubscriber
from cache_service.service.kv_events.verifier import SchemeVerifier

log = logging.getLogger("cache_service.kv_events")

# vLLM's default --prefix-caching-hash-algo is sha256 (pickle based).
DEFAULT_HASH_SCHEME = "vllm-sha256"
DEFAULT_MAX_BLOCKS_PER_ENGINE = 1 << 18  # about 70 MB of view per engine at most
# A restarting engine is back within this; one down longer leaves routing answers.
DEFAULT_GRACE_SECONDS = 30.0


def resolve_engines(
    *,
    endpoints: str = "",
    config_file: str | Path | None = None,
    model: str | None = None,
    block_size: int | None = None,
    hash_scheme: str | None = None,
    seed: str | None = None,
    extra_keys_form: str | None = None,
    require_seed: bool = True,
) -> tuple[EngineConfig, ...]:
    """The engines to follow: from `endpoints` (``tcp://HOST:PORT[,...]``) or a TOML file;
    the other arguments, where given, set every engine's key (over a file's values). An
    engine with no scheme gets vLLM's default, one with no seed the seed its scheme's
    engine uses with PYTHONHASHSEED unset (vLLM 0.32's "vllm-none-hash" for sha256 and
    sha256_cbor). Empty when neither source is given. `require_seed=False` lets an xxhash
    scheme go without a seed (for `doctor`, which then looks for the seed the engine uses)."""
    if endpoints.strip() and config_file is not None:
        raise KvEventsConfigError("give --kv-events or --kv-events-config, not both")
    given: dict[str, Any] = {
        key: value
        for key, value in (
            ("model", model),
            ("block_size", block_size),
            ("hash_scheme", hash_scheme),
            ("seed", seed),
            ("extra_keys_form", extra_keys_form),
        )
        if value is not None
    }
    if endpoints.strip():
        engines = parse_endpoints(endpoints, **given)
    elif config_file is not None:
        engines = [with_defaults(engine, **given) for engine in load_engines(config_file)]
    else:
        return ()
    resolved = tuple(_with_defaults(engine) for engine in engines)
    for engine in resolved:
        _check_scheme(engine, require_seed=require_seed)
    return resolved


def _with_defaults(engine: EngineConfig) -> EngineConfig:
    """The engine with vLLM's default scheme if it names none, and the seed its engine
    uses with PYTHONHASHSEED unset if it gives none and that seed is fixed."""
    if not engine.hash_scheme:
        engine = replace(engine, hash_scheme=DEFAULT_HASH_SCHEME)
    info = SCHEMES.get(engine.hash_scheme or "")
    if engine.seed is None and info is not None and info.default_seed is not None:
        engine = replace(engine, seed=info.default_seed)
    return engine


def _check_scheme(engine: EngineConfig, *, require_seed: bool) -> None:
    assert engine.hash_scheme is not None
    if engine.hash_scheme not in SCHEMES:
        raise KvEventsConfigError(
            f"engine {engine.name}: unknown hash scheme {engine.hash_scheme!r}; "
            f"known: {', '.join(SCHEMES)}"
        )
    if not SCHEMES[engine.hash_scheme].uses_seed or engine.seed is not None:
        # Any other refusal, with its reason.
        scheme_named(engine.hash_scheme, seed=engine.seed, extra_keys_form=engine.extra_keys_form)
    elif require_seed:
        raise KvEventsConfigError(
            f"engine {engine.name}: hash scheme {engine.hash_scheme} needs the engine's "
            "PYTHONHASHSEED as the seed (--kv-events-seed, or seed in the file): run the "
            "engine with PYTHONHASHSEED set (unset, vLLM 0.32 roots every xxhash and "
            "xxhash_cbor chain at random bytes per process, so no routing score can match; "
            "sha256 and sha256_cbor use the fixed 'vllm-none-hash' instead)"
        )


class KvEventsHub:
    """The engines' views kept current by a subscriber thread, with hash verification."""

    def __init__(
        self,
        engines: Sequence[EngineConfig],
        *,
        max_blocks_per_engine: int = DEFAULT_MAX_BLOCKS_PER_ENGINE,
        replay_timeout_seconds: float = 2.0,
        poll_interval_seconds: float = 0.05,
        mismatch_alarm_after: int = 3,
        grace_seconds: float = DEFAULT_GRACE_SECONDS,
        silence_timeout_seconds: float = 0.0,
    ) -> None:
        if not engines:
            raise ValueError("a KV-events hub needs at least one engine")
        self.engines: tuple[EngineConfig, ...] = tuple(engines)
        self.grace_seconds = grace_seconds
        self.views = EngineViews(max_blocks_per_engine=max_blocks_per_engine)
        # Prompts' engine chains, kept across /v1/route requests: a repeated or extended
        # prompt hashes only its new blocks (bounded: about 34 bytes a block). The verifier
        # fills it with the prompts the engines store, so their first route is warm too.
        self.chain_memo = ChainMemo()
        self.verifier = SchemeVerifier(self.engines, chain_memo=self.chain_memo)
        self.subscriber = KvEventSubscriber(
            self.engines,
            self.views,
            verify=self.verifier,
            replay_timeout_seconds=replay_timeout_seconds,
            poll_interval_seconds=poll_interval_seconds,
            mismatch_alarm_after=mismatch_alarm_after,
            silence_timeout_seconds=silence_timeout_seconds,
        )

    @classmethod
    def following(cls, config: KvEventsConfig) -> KvEventsHub:
        """The hub of the engines the service's settings name, kept as they say (the
        config's fields are named as this constructor's arguments)."""
        return cls(**{field.name: getattr(config, field.name) for field in fields(config)})

    def start(self, *, timeout_seconds: float = 5.0) -> None:
        """Connect to every engine rank and start following their events (blocks until the
        subscriber's sockets are connecting: run it off the event loop)."""
        self.subscriber.start(timeout_seconds=timeout_seconds)
        log.info(
            "following KV events of %d engine(s): %s",
            len(self.engines),
            ", ".join(f"{engine.name} ({engine.hash_scheme})" for engine in self.engines),
        )

    def stop(self, *, timeout_seconds: float = 5.0) -> bool:
        """Stop the subscriber and close its sockets; False if it did not end in time."""
        return self.subscriber.stop(timeout_seconds=timeout_seconds)

    def engines_for(self, model: str | None) -> list[EngineConfig]:
        """The engines that may serve `model`: those configured for it and those configured
        for no model in particular (every engine when `model` is None)."""
        if model is None:
            return list(self.engines)
        return [engine for engine in self.engines if engine.model in (None, model)]

    def liveness(self) -> dict[str, EngineLiveness]:
        """Each engine: live, or down since when and why."""
        return self.subscriber.liveness()

    def gone(self, liveness: EngineLiveness, now: float) -> bool:
        """Whether an engine has been down past the grace at `time.monotonic()` = `now` (left
        out of routing answers)."""
        return not liveness.live and liveness.down_for(now) > self.grace_seconds

    def report(self) -> dict[str, dict[str, Any]]:
        """Per engine, what /v1/stats shows: where, how it hashes, and what came in."""
        stats = self.subscriber.stats()
        liveness, now = self.liveness(), time.monotonic()
        report: dict[str, dict[str, Any]] = {}
        for engine in self.engines:
            counters = stats[engine.name]
            alive = liveness[engine.name]
            report[engine.name] = {
                "endpoints": [rank.endpoint for rank in engine.ranks()],
                "replay_endpoints": [
                    rank.replay_endpoint for rank in engine.ranks() if rank.replay_endpoint
                ],
                "model": engine.model,
                "block_size": engine.block_size,
                "hash_scheme": engine.hash_scheme,
                "extra_keys_form": engine.extra_keys_form,
                "stale_ranks": counters.stale_ranks,
                "live": alive.live,
                "down_since": alive.down_since,
                "down_reason": alive.reason,
                "routable": not self.gone(alive, now),
                "rank_downs": counters.downs,
                "blocks": self.views.block_count(engine.name),
                "batches": counters.batches,
                "events": counters.events,
                "gaps": counters.gaps,
                "replays": counters.replays,
                "restarts": counters.restarts,
                "malformed": counters.malformed + counters.malformed_events,
                "dropped_entries": counters.dropped_entries,
                "verified": counters.verified,
                "mismatches": counters.mismatches,
                "last_mismatch": self.verifier.last_mismatch(engine.name),
                # Prompts whose first block could not be checked (no extra_keys shown).
                "unverifiable_starts": self.verifier.unverifiable_starts(engine.name),
                # Events reproduced only with the other vLLM release's extra-keys form.
                "wrong_extra_keys_form": self.verifier.wrong_form_events(engine.name),
                "last_wrong_extra_keys_form": self.verifier.last_wrong_form(engine.name),
                # Its prompts' segments ingestion put in /v1/route's memo (never hashed there).
                "route_memo_segments": self.verifier.memo_segments(engine.name),
            }
        return report
