"""The client reads what the OpenAPI document says the service sends: answers drawn from the
document's own schemas parse, keep every field, and the client reads no field the document
lacks; the service's reports read back to the very bytes it sent."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_service.client import AsyncCacheClient, CacheClient, Match, RouteAnswer
from cache_service.core.framing import MEDIA_TYPE, encode_frames, join_frames
from cache_service.service.api import create_app
from cache_service.service.settings import Settings
from cache_service.wire import answers, reports
from cache_service.wire.reader import UnreadableAnswer, read
from tests.wire_samples import sample_info

JSON = "application/json"
REF_PREFIX = "#/components/schemas/"
KEY = "0123456789abcdef0123456789abcdef"
Document = dict[str, Any]

# What each answer's route sends, and the answer class the client reads it with.
ANSWERS: list[tuple[str, str, type[Any]]] = [
    ("/v1/lookup", JSON, answers.LookupResponse),
    ("/v1/lookup", MEDIA_TYPE, answers.LookupResponse),
    ("/v1/blocks", JSON, answers.StoreResponse),
    ("/v1/blocks/fetch", MEDIA_TYPE, answers.FetchHeader),
    ("/v1/route", JSON, answers.RouteResponse),
    ("/v1/info", JSON, reports.InfoResponse),
    ("/v1/stats", JSON, reports.StatsResponse),
]
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=8)  # what JSON can carry
# Any JSON value, where a schema allows one (the kv_events section of /v1/stats); integers in
# the range a JSON encoder writes.
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def document(tmp_path_factory: pytest.TempPathFactory) -> Document:
    """The OpenAPI document the service publishes."""
    data_dir: Path = tmp_path_factory.mktemp("wire") / "data"
    return create_app(Settings(data_dir=data_dir)).openapi()


def answer_schema(document: Document, path: str, media: str) -> Document:
    """The schema of a route's 200 answer (for frames, of their JSON header)."""
    (operation,) = document["paths"][path].values()  # each answer's path has one method
    content = operation["responses"]["200"]["content"][media]
    ref = content["x-frame-header"] if media == MEDIA_TYPE else content["schema"]
    return resolve(document, ref)


def resolve(document: Document, schema: Document) -> Document:
    """A schema with its top-level $ref followed."""
    ref = schema.get("$ref")
    return schema if ref is None else document["components"]["schemas"][ref[len(REF_PREFIX) :]]


def instances(document: Document, schema: Document) -> st.SearchStrategy[Any]:
    """Every JSON value the schema allows, as far as the answers' schemas use JSON Schema."""
    schema = resolve(document, schema)
    if "anyOf" in schema:
        return st.one_of([instances(document, branch) for branch in schema["anyOf"]])
    kind = schema.get("type")
    if kind == "object" and "properties" not in schema:  # a mapping: names to values of a kind
        values = schema.get("additionalProperties", True)
        inner = JSON_VALUES if values is True else instances(document, values)
        return st.dictionaries(TEXT, inner, max_size=3)
    if kind == "object":
        properties = {
            name: instances(document, item) for name, item in schema["properties"].items()
        }
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {name: value for name, value in properties.items() if name in required},
            optional={name: value for name, value in properties.items() if name not in required},
        )
    if kind == "array":
        return st.lists(instances(document, schema["items"]), max_size=3)
    scalars: dict[str, st.SearchStrategy[Any]] = {
        "integer": st.integers(min_value=-1, max_value=6),
        "number": st.integers(min_value=-1, max_value=6) | st.floats(-1e9, 1e9),
        "string": TEXT,
        "boolean": st.booleans(),
        "null": st.none(),
    }
    return scalars[kind]


def client_answering(path: str, media: str, body: Document) -> CacheClient:
    """A client whose service answers `body` at `path` (frames: as the header, one payload
    per matched block)."""

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == path
        if media == JSON:
            return httpx.Response(200, content=orjson.dumps(body), headers={"Content-Type": JSON})
        count = body.get("matched_blocks", body.get("requested", 0))
        frames = join_frames(encode_frames(body, [b"kv"] * count))
        return httpx.Response(200, content=frames, headers={"Content-Type": MEDIA_TYPE})

    return CacheClient("http://cache.test", transport=httpx.MockTransport(answer))


def as_json(value: Any) -> Any:
    """A parsed answer back as JSON values (dataclasses as objects, tuples as lists)."""
    return orjson.loads(orjson.dumps(value))


def ask(path: str, media: str, body: Document) -> Any:
    """The client's call for a route, answered with `body`; what it kept, as JSON values."""
    client = client_answering(path, media, body)
    calls: dict[tuple[str, str], Callable[[], Any]] = {
        ("/v1/lookup", JSON): lambda: client.lookup("m", [1, 2, 3]),
        ("/v1/lookup", MEDIA_TYPE): lambda: client.lookup("m", [1, 2, 3], fetch=True),
        ("/v1/blocks", JSON): lambda: client.store("m", [1, 2, 3], [b"kv"]),
        ("/v1/blocks/fetch", MEDIA_TYPE): lambda: client.get_blocks("m", [KEY] * body["requested"]),
        ("/v1/route", JSON): lambda: client.route("m", [1, 2, 3]),
        ("/v1/info", JSON): client.info,
        # stats (an admin's call) returns the JSON object: read with the wire's reader here
        ("/v1/stats", JSON): lambda: read(reports.StatsResponse, client.stats()),
    }
    with client:
        kept = calls[path, media]()
    if isinstance(kept, Match):
        assert kept.payloads == (None if media == JSON else [b"kv"] * body["matched_blocks"])
        fields = as_json(dataclasses.replace(kept, payloads=None))
        del fields["payloads"]  # the client's own field: the frames, not the header
        return fields
    if isinstance(kept, RouteAnswer):
        unscored = [{"instance": name, "reason": why} for name, why in kept.unscored.items()]
        return {**as_json(kept), "unscored": unscored}
    if isinstance(kept, list):  # get_blocks keeps the payloads; the header is only checked
        assert kept == [b"kv"] * body["requested"]
        return body
    return as_json(kept)


@pytest.mark.parametrize(("path", "media", "kind"), ANSWERS)
def test_the_client_parses_every_answer_the_document_allows_and_keeps_its_fields(
    document: Document, path: str, media: str, kind: type[Any]
) -> None:
    schema = answer_schema(document, path, media)
    assert schema["title"] == kind.__name__

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(instances(document, schema))
    def check(body: Document) -> None:
        count = body.get("matched_blocks", body.get("requested", 0))
        if media == MEDIA_TYPE and count < 0:
            return  # a frame count cannot be negative: no service sends that header
        if path == "/v1/route":  # the client keeps unscored as a mapping: one reason each
            names = [row["instance"] for row in body["unscored"]]
            if len(names) != len(set(names)):
                return
        assert ask(path, media, body) == body

    check()


def readable_fields(kind: type[Any]) -> dict[str, tuple[Any, bool]]:
    """The fields the client reads from an answer: each one's type and whether it may be
    left out (nullable or with a default)."""
    hints = typing.get_type_hints(kind)
    out = {}
    for item in dataclasses.fields(kind):
        hint = hints[item.name]
        members = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        optional = types.NoneType in members or item.default is not dataclasses.MISSING
        out[item.name] = (hint, optional)
    return out


@pytest.mark.parametrize(("path", "media", "kind"), ANSWERS)
def test_every_field_the_client_reads_is_in_the_document(
    document: Document, path: str, media: str, kind: type[Any]
) -> None:
    def check(kind: type[Any], schema: Document) -> None:
        schema = resolve(document, schema)
        fields = readable_fields(kind)
        assert list(fields) == list(schema["properties"]), kind.__name__
        assert set(schema["required"]) == set(fields), kind.__name__  # the service sends all
        for name, (hint, _) in fields.items():
            for nested in _answer_classes(hint):
                (branch,) = _answer_branches(schema["properties"][name])
                check(nested, branch)

    check(kind, answer_schema(document, path, media))


def _answer_classes(hint: Any) -> list[type[Any]]:
    """The answer dataclasses inside a field's type (list[X], X | None)."""
    found = []
    for member in typing.get_args(hint) or (hint,):
        if dataclasses.is_dataclass(member):
            found.append(member)
        found += [item for item in typing.get_args(member) if dataclasses.is_dataclass(item)]
    return found


def _answer_branches(schema: Document) -> list[Document]:
    """The object schemas a property refers to, directly, as items, or as a branch."""
    if "$ref" in schema:
        return [schema]
    if "items" in schema:
        return _answer_branches(schema["items"])
    if isinstance(schema.get("additionalProperties"), dict):  # a mapping's values
        return _answer_branches(schema["additionalProperties"])
    return [branch for item in schema.get("anyOf", ()) for branch in _answer_branches(item)]


def test_a_field_of_another_type_is_unreadable_and_named() -> None:
    body = {"model": "m", "requested": True, "found": 1}  # JSON true is no count
    with pytest.raises(UnreadableAnswer, match="'requested'"):
        read(answers.FetchHeader, body)


def test_a_nested_field_is_named_by_its_path() -> None:
    usage = {"prompt_cache_hit_tokens": 0}
    body = {**orjson.loads(orjson.dumps(_miss())), "usage": usage}
    with pytest.raises(UnreadableAnswer, match=re.escape("'usage.prompt_cache_miss_tokens'")):
        read(answers.LookupResponse, body)


def test_a_miss_is_the_empty_answer() -> None:
    miss = _miss()
    assert (miss.matched_blocks, miss.cached_tokens, miss.keys) == (0, 0, [])
    assert miss.usage == answers.Usage(prompt_cache_hit_tokens=0, prompt_cache_miss_tokens=12)


def test_a_value_of_a_mapping_is_named_by_its_key() -> None:
    body = orjson.loads(orjson.dumps(_stats()))
    body["retention"]["chat"]["miss_tokens"] = "12"
    with pytest.raises(UnreadableAnswer, match=re.escape("""'retention["chat"].miss_tokens'""")):
        read(reports.StatsResponse, body)


def test_an_integer_is_a_float_but_a_float_no_integer() -> None:
    body = orjson.loads(orjson.dumps(_stats()))
    body["tenants"]["t"]["estimated_bytes"] = 1.0
    with pytest.raises(UnreadableAnswer, match=re.escape("""'tenants["t"].estimated_bytes'""")):
        read(reports.StatsResponse, body)
    info = orjson.loads(orjson.dumps(sample_info()))
    info["retention"]["classes"]["chat"] = 86400  # a TTL the JSON writes without a fraction
    ttl = read(reports.InfoResponse, info).retention.classes["chat"]
    assert (ttl, type(ttl)) == (86400.0, float)


def test_the_kv_events_section_is_taken_as_the_hub_reports_it() -> None:
    body = orjson.loads(orjson.dumps(_stats()))
    body["kv_events"] = {"e": {"live": True, "endpoints": ["tcp://h:1"], "down_since": None}}
    assert read(reports.StatsResponse, body).kv_events == body["kv_events"]


def test_the_service_s_reports_read_back_to_the_bytes_it_sent() -> None:
    """What the client reads of /v1/info and /v1/stats is all the service wrote, byte for
    byte (a service in this process, its store in memory)."""
    app = create_app(Settings(store="memory://", model_block_size="m=16", retention="chat=1.5d"))

    async def exchange() -> tuple[bytes, reports.InfoResponse, bytes, reports.StatsResponse]:
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://service") as http,
            AsyncCacheClient("http://service", transport=transport) as client,
        ):
            info, stats = await http.get("/v1/info"), await http.get("/v1/stats")
            read_stats = read(reports.StatsResponse, await client.stats())
            return info.content, await client.info(), stats.content, read_stats

    info_bytes, info, stats_bytes, stats = asyncio.run(exchange())
    assert orjson.dumps(info) == info_bytes
    assert (info.block_size_for("m"), info.retention.classes) == (16, {"chat": 129600.0})
    assert orjson.dumps(stats) == stats_bytes


def _stats() -> reports.StatsResponse:
    tenant = reports.StatsTenant(
        hit_tokens=1, miss_tokens=2, estimated_bytes=3, capacity_bytes=None
    )
    return reports.StatsResponse(
        blocks=0,
        payload_bytes=0,
        used_bytes=0,
        capacity_bytes=None,
        disk=None,
        pending_touches=0,
        retention={"chat": reports.StatsTokens(hit_tokens=0, miss_tokens=0)},
        tenants={"t": tenant},
        kv_events=None,
    )


def _miss() -> answers.LookupResponse:
    return answers.LookupResponse.miss(model="m", prompt_tokens=12, block_size=4, retention="")
