"""The served OpenAPI schema and the service agree: a body the schema admits is accepted, a
body it refuses is refused (422), checked body by body against a real server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema_rs  # schemathesis's JSON Schema validator (the test extra pins it)
import pytest

from cache_service.core.framing import MEDIA_TYPE, encode_frames, join_frames
from tests.integration.conftest import ServerProcess

pytestmark = pytest.mark.integration

BLOCK = 4  # the server's block size: small, so a few tokens make whole blocks
PROMPT = list(range(3 * BLOCK))
KEY = "0" * 32
# (name, route, request body model, body, whether the schema and the service admit it)
BODIES: list[tuple[str, str, str, dict[str, Any], bool]] = [
    # An integral float is an integer to JSON Schema: accepted wherever an integer is.
    (
        "float tokens",
        "/v1/lookup",
        "LookupRequest",
        {"model": "m", "tokens": [float(t) for t in PROMPT]},
        True,
    ),
    (
        "float exponent and block_size",
        "/v1/lookup",
        "LookupRequest",
        {"model": "m", "tokens": [1e2], "block_size": 4.0},
        True,
    ),
    ("fractional token", "/v1/lookup", "LookupRequest", {"model": "m", "tokens": [1.5]}, False),
    ("boolean token", "/v1/lookup", "LookupRequest", {"model": "m", "tokens": [True]}, False),
    ("string token", "/v1/lookup", "LookupRequest", {"model": "m", "tokens": ["1"]}, False),
    (
        "explain float block_size",
        "/v1/explain",
        "ExplainRequest",
        {"model": "m", "tokens": [7.0], "block_size": 4.0},
        True,
    ),
    (
        "pin float block_size",
        "/v1/pin",
        "PinRequest",
        {"model": "m", "tokens": PROMPT[:BLOCK], "block_size": 4.0},
        True,
    ),
    # Pin and unpin: the prefix by its tokens or by its keys, exactly one of them.
    (
        "pin tokens and keys",
        "/v1/pin",
        "PinRequest",
        {"model": "m", "tokens": PROMPT, "keys": [KEY]},
        False,
    ),
    (
        "unpin tokens and keys",
        "/v1/unpin",
        "PinRequest",
        {"model": "m", "tokens": PROMPT, "keys": [KEY]},
        False,
    ),
    ("unpin neither", "/v1/unpin", "PinRequest", {"model": "m"}, False),
    (
        "unpin both null",
        "/v1/unpin",
        "PinRequest",
        {"model": "m", "tokens": None, "keys": None},
        False,
    ),
    (
        "unpin empty tokens",
        "/v1/unpin",
        "PinRequest",
        {"model": "m", "tokens": [], "keys": None},
        False,
    ),
    ("unpin empty keys", "/v1/unpin", "PinRequest", {"model": "m", "keys": []}, False),
    (
        "unpin tokens, null keys",
        "/v1/unpin",
        "PinRequest",
        {"model": "m", "tokens": PROMPT, "keys": None},
        True,
    ),
    (
        "unpin keys, null tokens",
        "/v1/unpin",
        "PinRequest",
        {"model": "m", "tokens": None, "keys": [KEY]},
        True,
    ),
    # Purge: kv_layout, salt and tokens only with a model (null counts as not given).
    ("purge tokens without model", "/v1/purge", "PurgeRequest", {"tokens": PROMPT}, False),
    ("purge salt without model", "/v1/purge", "PurgeRequest", {"salt": "s"}, False),
    (
        "purge kv_layout, null model",
        "/v1/purge",
        "PurgeRequest",
        {"kv_layout": "", "model": None},
        False,
    ),
    (
        "purge all null",
        "/v1/purge",
        "PurgeRequest",
        {"kv_layout": None, "salt": None, "tokens": None},
        True,
    ),
    (
        "purge float tokens with model",
        "/v1/purge",
        "PurgeRequest",
        {"model": "m", "tokens": [float(t) for t in PROMPT]},
        True,
    ),
    ("purge namespace", "/v1/purge", "PurgeRequest", {"model": "other", "salt": "s"}, True),
]


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with blocks of BLOCK tokens."""
    root = tmp_path_factory.mktemp("agreement")
    server = ServerProcess(root / "data", root / "server.log", block_size=str(BLOCK))
    server.start()
    yield server
    server.stop()


def admits(server: ServerProcess, model: str, body: dict[str, Any]) -> bool:
    """Whether the served schema's `model` component admits `body`."""
    components = httpx.get(server.url + "/openapi.json").json()["components"]
    document = {"$ref": f"#/components/schemas/{model}", "components": components}
    return bool(jsonschema_rs.Draft202012Validator(document).is_valid(body))


@pytest.mark.parametrize(
    ("path", "model", "body", "valid"), [row[1:] for row in BODIES], ids=[row[0] for row in BODIES]
)
def test_a_body_is_accepted_exactly_when_the_schema_admits_it(
    agreeing: ServerProcess, path: str, model: str, body: dict[str, Any], valid: bool
) -> None:
    assert admits(agreeing, model, body) == valid
    response = httpx.post(agreeing.url + path, json=body)
    if valid:
        assert response.status_code in (200, 409), response.text  # 409: that prefix is not pinned
    else:
        assert response.status_code == 422, response.text
        assert response.headers["content-type"] == "application/problem+json"


def store(server: ServerProcess, header: dict[str, Any], payloads: list[bytes]) -> httpx.Response:
    """POST /v1/blocks with a frame body."""
    body = join_frames(encode_frames(header, payloads))
    return httpx.post(server.url + "/v1/blocks", content=body, headers={"content-type": MEDIA_TYPE})


def test_integral_floats_are_the_integers_they_equal(agreeing: ServerProcess) -> None:
    assert store(agreeing, {"model": "m", "tokens": PROMPT}, [b"a", b"b", b"c"]).is_success
    as_ints = httpx.post(agreeing.url + "/v1/lookup", json={"model": "m", "tokens": PROMPT})
    as_floats = httpx.post(
        agreeing.url + "/v1/lookup",
        json={"model": "m", "tokens": [float(t) for t in PROMPT], "block_size": float(BLOCK)},
    )
    assert as_floats.status_code == 200, as_floats.text
    assert as_floats.json() == as_ints.json()
    assert as_ints.json()["matched_blocks"] == 3
    # In a frame header too: tokens and start_block.
    header = {"model": "m", "tokens": [float(t) for t in PROMPT], "start_block": 2.0}
    stored = store(agreeing, header, [b"c"])
    assert stored.status_code == 200, stored.text
    assert stored.json()["refreshed_blocks"] == 1
