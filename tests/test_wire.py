"""The client reads what the OpenAPI document says the service sends: answers drawn from the
document's own schemas parse, keep every field, and the client reads no field the document
lacks."""

from __future__ import annotations

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

from cache_service.client import CacheClient, Match, RouteAnswer
from cache_service.core.framing import MEDIA_TYPE, encode_frames, join_frames
from cache_service.service.api import create_app
from cache_service.service.settings import Settings
from cache_service.wire import answers
from cache_service.wire.reader import UnreadableAnswer, read

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
]


@pytest.fixture(scope="module")
def document(tmp_path_factory: pytest.TempPathFactory) -> Document:
    """The OpenAPI document the service publishes."""
    data_dir: Path = tmp_path_factory.mktemp("wire") / "data"
    return create_app(Settings(data_dir=data_dir)).openapi()


def answer_schema(document: Document, path: str, media: str) -> Document:
    """The schema of a route's 200 answer (for frames, of their JSON header)."""
    content = document["paths"][path]["post"]["responses"]["200"]["content"][media]
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
        "string": st.text(st.characters(exclude_categories=("Cs",)), max_size=8),
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


def _miss() -> answers.LookupResponse:
    return answers.LookupResponse.miss(model="m", prompt_tokens=12, block_size=4, retention="")
