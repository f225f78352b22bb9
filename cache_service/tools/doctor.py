"""`cache-service doctor`: do the engines' KV-event hashes line up with their configuration?

Subscribes to every configured engine for a bounded time (stopping early once each engine
has stored a block that starts a prompt: only such an event shows a wrong seed), then
diagnoses the stored events it saw with every registered scheme and common seeds, and
prints per engine what it saw and the likely cause: `ok`, `wrong-scheme` (naming the
scheme that matches), `wrong-seed` (naming the PYTHONHASHSEED that matches),
`wrong-block-size`, `wrong-extra-keys-form` (the scheme and seed match with the other vLLM
release's extra_keys_form), `unknown` (nothing matches: most likely PYTHONHASHSEED unset
in an xxhash engine, or any engine before vLLM 0.32), `unverifiable` (no event could tell),
or `no events`. Exits 0 only if every engine is ok. The same flags (and
CACHE_SERVICE_KV_EVENTS* variables) as `serve`.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from cache_service.core.engines.decoding import BlockStored
from cache_service.core.engines.schemes import SCHEMES, Diagnosis, diagnose_stored_event
from cache_service.core.engines.views import EngineViews
from cache_service.service.kv_events.config import EngineConfig
from cache_service.service.kv_events.hub import resolve_engines
from cache_service.service.kv_events.subscriber import KvEventSubscriber

DEFAULT_SECONDS = 10.0
EVENTS_PER_ENGINE = 8  # stored events kept per engine for the diagnosis
POLL_SECONDS = 0.05
# Worst first: an engine is reported with the worst cause its events show (events that
# cannot tell count only when none can).
SEVERITY = (
    "unknown",
    "wrong-seed",
    "wrong-scheme",
    "wrong-block-size",
    "wrong-extra-keys-form",
    "ok",
    "unverifiable",
)
_ENV = "CACHE_SERVICE_"
UNVERIFIABLE = (
    "no event that starts a prompt arrived, and the others cannot tell: send the engine a "
    "new prompt of more than one block while this runs"
)


def add_doctor_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The `doctor` subcommand."""
    doctor = commands.add_parser(
        "doctor",
        help="check that engines' KV-event hashes match their hash scheme and seed",
        description="Subscribe to the engines' KV events for a while and check that their "
        "block hashes are reproduced from their tokens with the configured hash scheme and "
        "seed; name the likely cause when not. Exits 0 only if every engine is ok. Flags "
        "default to the CACHE_SERVICE_KV_EVENTS* variables `serve` reads.",
    )
    flags = (
        ("--kv-events", str, "engines' endpoints: tcp://HOST:PORT[,...]"),
        ("--kv-events-config", str, "TOML file of engines (as for serve)"),
        ("--kv-events-model", str, "the engines' model (over the file's)"),
        ("--kv-events-block-size", int, "tokens per block (over the file's; default 16)"),
        ("--kv-events-hash-scheme", str, "the engines' hash scheme (default vllm-sha256)"),
        (
            "--kv-events-seed",
            str,
            "the engines' PYTHONHASHSEED (unset: vllm-none-hash for vllm-sha256 and "
            "vllm-sha256-cbor, as vLLM 0.32 uses; tried among common seeds)",
        ),
        (
            "--kv-events-extra-keys-form",
            str,
            "tagged (vLLM 0.32, the default) or untagged (older vLLM releases)",
        ),
    )
    for flag, kind, help_text in flags:
        name = flag.removeprefix("--").replace("-", "_")
        doctor.add_argument(flag, dest=name, type=kind, default=None, help=help_text)
    doctor.add_argument(
        "--seconds",
        type=float,
        default=DEFAULT_SECONDS,
        help=f"how long to listen at most (default {DEFAULT_SECONDS:g}); send a few "
        "prompts to the engines meanwhile",
    )


@dataclass
class _Seen:
    """What one engine sent: its stored events with tokens (the first few)."""

    events: list[BlockStored] = field(default_factory=list)
    stored: int = 0
    starts: int = 0  # events that start a prompt (no parent)


class _Recorder:
    """The subscriber's verify hook: keeps each engine's first stored events."""

    def __init__(self, engines: Sequence[EngineConfig]) -> None:
        self.seen = {engine.name: _Seen() for engine in engines}
        self._lock = threading.Lock()

    def __call__(self, engine: EngineConfig, event: BlockStored) -> bool | None:
        """Note one stored event; never judges it (the diagnosis does, afterwards)."""
        if event.bigram_tokens:
            return None
        with self._lock:
            seen = self.seen[engine.name]
            seen.stored += 1
            starts = event.parent_block_hash is None
            seen.starts += starts
            # Keep events that start a prompt first: they are the ones that show a seed.
            if len(seen.events) < EVENTS_PER_ENGINE:
                seen.events.append(event)
            elif starts and any(kept.parent_block_hash is not None for kept in seen.events):
                index = next(
                    i for i, kept in enumerate(seen.events) if kept.parent_block_hash is not None
                )
                seen.events[index] = event
        return None

    def every_engine_started_a_prompt(self) -> bool:
        """Whether each engine has stored a block that starts a prompt."""
        with self._lock:
            return all(seen.starts for seen in self.seen.values())


def run_doctor_command(parsed: argparse.Namespace) -> int:
    """Listen, diagnose, print per engine; 0 only if every engine is ok (2: bad flags)."""
    try:
        engines = resolve_engines(
            endpoints=_option(parsed, "kv_events") or "",
            config_file=_option(parsed, "kv_events_config"),
            model=_option(parsed, "kv_events_model"),
            block_size=_int_option(parsed, "kv_events_block_size"),
            hash_scheme=_option(parsed, "kv_events_hash_scheme"),
            seed=_option(parsed, "kv_events_seed"),
            extra_keys_form=_option(parsed, "kv_events_extra_keys_form"),
            require_seed=False,
        )
    except ValueError as exc:
        print(f"cache-service doctor: {exc}", file=sys.stderr)
        return 2
    if not engines:
        print("cache-service doctor: no engines: give --kv-events or --kv-events-config",
              file=sys.stderr)  # fmt: skip
        return 2
    recorder = _Recorder(engines)
    subscriber = KvEventSubscriber(
        engines, EngineViews(max_blocks_per_engine=1 << 16), verify=recorder
    )
    print(f"listening to {len(engines)} engine(s) for up to {parsed.seconds:g} s; send the "
          "engines a few prompts meanwhile", flush=True)  # fmt: skip
    subscriber.start()
    try:
        deadline = time.monotonic() + max(parsed.seconds, 0.0)
        while time.monotonic() < deadline and not recorder.every_engine_started_a_prompt():
            time.sleep(POLL_SECONDS)
    finally:
        subscriber.stop()
    counters = subscriber.stats()
    healthy = 0
    for engine in engines:
        cause, detail = diagnose_engine(engine, recorder.seen[engine.name])
        batches = counters[engine.name].batches
        seen = recorder.seen[engine.name]
        print(f"engine {engine.name} ({_describe(engine)}): {cause}\n"
              f"  saw {batches} batches, {seen.stored} stored events with tokens "
              f"({seen.starts} starting a prompt)\n  {detail}")  # fmt: skip
        healthy += cause == "ok"
    if healthy == len(engines):
        print(f"all {len(engines)} engine(s) ok")
        return 0
    print(f"{len(engines) - healthy} of {len(engines)} engine(s) need attention")
    return 1


def diagnose_engine(engine: EngineConfig, seen: _Seen) -> tuple[str, str]:
    """The engine's cause (the worst its events show) and what to do about it."""
    if not seen.events:
        where = ", ".join(rank.endpoint for rank in engine.ranks())
        return "no events", (
            f"nothing stored arrived from {where}: is the engine running with "
            "--kv-events-config (publisher zmq, that endpoint), prefix caching on, and "
            "serving requests? Send it a prompt of more than one block while this runs."
        )
    # Events that start a prompt tell most (a seed shows only there): the others only
    # when there are none.
    starts = [event for event in seen.events if event.parent_block_hash is None]
    results = [_diagnose_event(engine, event) for event in starts or seen.events]
    telling = [result for result in results if result[0] != "unverifiable"] or results
    return min(telling, key=lambda result: SEVERITY.index(result[0]))


def _diagnose_event(engine: EngineConfig, event: BlockStored) -> tuple[str, str]:
    assert engine.hash_scheme is not None and event.token_ids is not None
    if event.block_size is not None and event.block_size != engine.block_size:
        return "wrong-block-size", (
            f"the engine stores blocks of {event.block_size} tokens, the configuration says "
            f"{engine.block_size}: set the block size (vLLM --block-size, SGLang "
            "--page-size) and --kv-events-block-size alike"
        )
    if (
        event.parent_block_hash is not None
        and engine.seed is None
        and SCHEMES[engine.hash_scheme].uses_seed
    ):
        # Without a seed only an event that starts a prompt can find the engine's.
        return "unverifiable", UNVERIFIABLE
    hashes = event.raw_block_hashes or event.block_hashes
    parent = (
        event.raw_parent_block_hash
        if event.raw_parent_block_hash is not None
        else event.parent_block_hash
    )
    diagnosis: Diagnosis = diagnose_stored_event(
        scheme_name=engine.hash_scheme,
        seed=engine.seed,
        parent=parent,
        token_ids=event.token_ids,
        block_hashes=hashes,
        block_size=engine.block_size,
        extra_keys=event.extra_keys,
        lora_name=event.lora_name,
        lora_path=engine.lora_path(event.lora_name),
        extra_keys_form=engine.extra_keys_form,
    )
    detail = diagnosis.detail
    if diagnosis.cause == "wrong-seed" and engine.seed is None:
        detail += " (no seed is configured: set --kv-events-seed, or seed in the file)"
    return diagnosis.cause, detail


def _describe(engine: EngineConfig) -> str:
    seed = "no seed" if engine.seed is None else f"seed {engine.seed!r}"
    return f"{engine.hash_scheme}, {seed}, blocks of {engine.block_size}"


def _option(parsed: argparse.Namespace, name: str) -> str | None:
    value = getattr(parsed, name, None)
    if value is None:
        value = os.environ.get(_ENV + name.upper()) or None
    return None if value is None else str(value)


def _int_option(parsed: argparse.Namespace, name: str) -> int | None:
    value = _option(parsed, name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"--{name.replace('_', '-')} must be an integer, not {value!r}") from None
