"""Fuzzing a running service with its own OpenAPI schema (schemathesis): never a 5xx, every
answer as documented (status, media type, headers, body), every schema-valid request
accepted and every schema-invalid one refused.

Schemathesis loads /openapi.json from a real `cache-service serve` and runs its example,
coverage and fuzzing phases on every operation, positive and negative data, with a fixed seed
and a fixed number of examples per operation (`scale`), so a CI run is reproducible.

Two things no JSON Schema can state, and how this test treats them (nothing else is excused):
- Refusals that depend on the service's configuration: a block_size that is not the model's
  (422 block-size-mismatch), a retention class not configured (422 unknown-retention), and a
  route's instance that no engine configured names (422 unknown-instance). The
  schema describes both (field descriptions, the 422 answer); they count as `config_refusals`.
  The server runs with --block-size 1, so any non-empty token list holds a full block.
- The frame body (application/vnd.prompt-cache.frames) is a binary format: to JSON Schema any
  bytes are valid, so random bytes sent as frames are refused as malformed (400), counted as
  `frame_bodies_refused`; a frame body refused any other way is a failure.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import schemathesis
from schemathesis import Case, CheckContext, Response
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import events
from schemathesis.openapi.checks import RejectedPositiveData
from schemathesis.specs.openapi import checks

from cache_service.core.errors import PROBLEM_BASE
from cache_service.core.framing import MEDIA_TYPE
from cache_service.service.api_keys import Role, key_file_entry, new_key
from tests.integration.conftest import ServerProcess

SEED = 20261201
CONFIG_REFUSALS = {
    PROBLEM_BASE + "block-size-mismatch",
    PROBLEM_BASE + "unknown-retention",
    PROBLEM_BASE + "unknown-instance",
}
MALFORMED = PROBLEM_BASE + "malformed-body"


# A frame body is sent as the schema describes it: bytes, as application/octet-stream is.
schemathesis.serializer.alias(MEDIA_TYPE, "application/octet-stream")


def problem_type(response: Response) -> str | None:
    """The RFC 9457 `type` of a problem answer, or None."""
    if not response.headers.get("content-type", [""])[0].startswith("application/problem+json"):
        return None
    try:
        found = response.json().get("type")
    except ValueError:
        return None
    return found if isinstance(found, str) else None


def excused_refusal(case: Case, response: Response) -> str | None:
    """Why a refused schema-valid request is as documented (see the module docstring), or None."""
    found = problem_type(response)
    if response.status_code == 422 and found in CONFIG_REFUSALS:
        return "config_refusals"
    if case.media_type == MEDIA_TYPE and response.status_code == 400 and found == MALFORMED:
        return "frame_bodies_refused"
    return None


@schemathesis.check
def positive_data_accepted_as_documented(
    ctx: CheckContext, response: Response, case: Case
) -> bool | None:
    """positive_data_acceptance, excusing only the refusals the schema can only describe."""
    try:
        return checks.positive_data_acceptance(ctx, response, case)
    except RejectedPositiveData:
        reason = excused_refusal(case, response)
        if reason is None:
            raise
        EXCUSED[reason] += 1
        return None


EXCUSED: Counter[str] = Counter()  # refusals the check above excused, by reason


def fuzz_config(max_examples: int, **extra: Any) -> SchemathesisConfig:
    """Every phase but the stateful one, every check (acceptance as above), a fixed seed."""
    return SchemathesisConfig.from_dict(
        {
            "seed": SEED,
            # A fixed seed and no example database: the same cases on every run and machine.
            "generation": {
                "mode": "all",
                "max-examples": max_examples,
                "deterministic": True,
                "database": "none",
            },
            "phases": {"stateful": {"enabled": False}},
            "checks": {"enabled": True, "positive_data_acceptance": {"enabled": False}},
            **extra,
        }
    )


def run_fuzz(schema: schemathesis.BaseSchema) -> tuple[Counter[str], list[str]]:
    """Run the engine over every operation; its counts, and every failure and error found."""
    tally: Counter[str] = Counter()
    problems: list[str] = []
    EXCUSED.clear()
    for event in schemathesis.engine.from_schema(schema).execute():
        if isinstance(event, events.NonFatalError | events.FatalError):
            problems.append(f"error: {event}")
        if not isinstance(event, events.ScenarioFinished):
            continue
        recorder = event.recorder
        for node in recorder.cases.values():
            tally["cases"] += 1
            meta = node.value.meta
            tally[meta.generation.mode.value if meta else "unknown"] += 1
        for interaction in recorder.interactions.values():
            if interaction.response is not None:
                tally[f"{interaction.response.status_code // 100}xx"] += 1
        for check_nodes in recorder.checks.values():
            for node in check_nodes:
                if node.failure_info is not None:
                    problems.append(f"{recorder.label}: {node.name}: {node.failure_info.failure}")
    tally.update(EXCUSED)
    tally["failures"] = len(problems)
    return tally, problems


def fuzz_report(tally: Counter[str], seconds: float) -> dict[str, Any]:
    """The figures a fuzz run reports."""
    names = ["cases", "positive", "negative", "2xx", "4xx", "5xx", "failures"]
    figures: dict[str, Any] = {name: tally[name] for name in names}
    figures.update(
        {reason: tally[reason] for reason in ("config_refusals", "frame_bodies_refused")}
    )
    figures["seconds"] = round(seconds, 1)
    return figures


def fuzz_server(root: Path, **flags: str) -> ServerProcess:
    """A real service on a fresh data folder (blocks of 1 token: see the module docstring)."""
    return ServerProcess(
        root / "data", root / "server.log", block_size="1", capacity="256MiB", **flags
    )


def fuzz(server: ServerProcess, max_examples: int, **extra: Any) -> dict[str, Any]:
    """Fuzz a started server with its own schema; the figures, once nothing failed."""
    started = time.monotonic()
    config = fuzz_config(max_examples, **extra)
    headers = extra.get("headers", {})
    schema = schemathesis.openapi.from_url(
        server.url + "/openapi.json", config=config, headers=headers
    )
    tally, problems = run_fuzz(schema)
    figures = fuzz_report(tally, time.monotonic() - started)
    assert tally["cases"] > 0
    assert tally["5xx"] == 0
    assert problems == [], "\n\n".join(problems)
    return figures


def test_the_service_answers_every_generated_request_as_its_schema_says(
    tmp_path: Path, scale: Callable[[int, int], int], report: Callable[..., None]
) -> None:
    server = fuzz_server(tmp_path)
    server.start()
    try:
        report(**fuzz(server, scale(200, 3000)))
    finally:
        server.stop()


def test_with_api_keys_too(
    tmp_path: Path, scale: Callable[[int, int], int], report: Callable[..., None]
) -> None:
    """The same with --auth keys and an admin key (every route open to it); ignored_auth
    also checks that a request without the key, or with a wrong one, is refused."""
    secret = new_key()
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text(key_file_entry("fuzzer", "team-fuzz", Role.ADMIN, secret))
    server = fuzz_server(tmp_path, auth="keys", api_keys_file=str(keys_file))
    server.start()
    try:
        headers = {"Authorization": f"Bearer {secret}"}
        report(**fuzz(server, scale(40, 1000), headers=headers))
    finally:
        server.stop()
