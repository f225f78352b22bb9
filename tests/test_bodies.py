"""Request bodies: an integer is what JSON Schema calls one (116.0 too), nothing else is."""

from __future__ import annotations

import json
from typing import Any

import httptools
import pytest

from cache_service.core.errors import InvalidField
from cache_service.service.api.bodies import parse_json, parse_object
from cache_service.service.api.protocol import parse_error_cause
from cache_service.service.api.schemas import LookupRequest, PinRequest, StoreHeader


def test_integral_floats_are_the_integers_they_equal_in_json_bodies() -> None:
    body = parse_json(
        LookupRequest, b'{"model": "m", "tokens": [1, 116.0, 1e2, -0.0], "block_size": 64.0}'
    )
    assert body.tokens == [1, 116, 100, 0]
    assert all(type(token) is int for token in body.tokens)
    assert body.block_size == 64 and type(body.block_size) is int


def test_integral_floats_are_the_integers_they_equal_in_frame_headers() -> None:
    header = {"model": "m", "tokens": [3.0, 4], "start_block": 1.0, "block_size": 2.0}
    body = parse_object(StoreHeader, header)
    assert (body.tokens, body.start_block, body.block_size) == ([3, 4], 1, 2)


@pytest.mark.parametrize(
    ("tokens", "field", "message"),
    [
        ([1, 116.5], "tokens[1]", "valid integer"),
        ([True], "tokens[0]", "valid integer"),
        (["7"], "tokens[0]", "valid integer"),
        ([5e9], "tokens[0]", "less than or equal to 4294967295"),
        ([-1.0], "tokens[0]", "greater than or equal to 0"),
    ],
)
def test_anything_else_is_refused_naming_the_field(
    tokens: list[Any], field: str, message: str
) -> None:
    raw = json.dumps({"model": "m", "tokens": tokens}).encode()
    for parse in (
        lambda: parse_json(LookupRequest, raw),
        lambda: parse_object(LookupRequest, json.loads(raw)),
    ):
        with pytest.raises(InvalidField) as refused:
            parse()
        assert refused.value.field == field
        assert message in str(refused.value)


def test_every_error_is_still_reported_after_the_integral_floats_are_read() -> None:
    raw = b'{"model": "m", "tokens": [1.0, "x", 2.5], "keys": ["nothex"]}'
    with pytest.raises(InvalidField) as refused:
        parse_json(PinRequest, raw)
    fields = [error["field"] for error in refused.value.extensions["errors"]]
    assert fields == ["tokens[1]", "tokens[2]", "keys[0]"]


def test_the_parser_error_names_the_cause() -> None:
    parser = httptools.HttpRequestParser(object())
    with pytest.raises(httptools.HttpParserError) as refused:
        parser.feed_data(b"G@T / HTTP/1.1\r\n\r\n")
    assert parse_error_cause(refused.value, "Invalid HTTP request received.") == (
        "Invalid method encountered"
    )
    assert parse_error_cause(None, "Invalid HTTP request received.") == (
        "Invalid HTTP request received"
    )
