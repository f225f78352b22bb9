"""The OpenAPI schema states what the service enforces (the rest of the agreement is checked
against a real server in tests/integration/test_schema_agreement.py and by the fuzz suite)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cache_service.service.api import create_app
from cache_service.service.api_keys import Role, key_file_entry, new_key
from cache_service.service.settings import Settings

PROBLEM = "application/problem+json"


def schema_of(settings: Settings) -> dict[str, Any]:
    """The schema the app would serve at /openapi.json."""
    return create_app(settings).openapi()


def test_with_keys_every_route_that_needs_one_documents_its_refusals(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text(key_file_entry("k", "team", Role.WRITER, new_key()))
    settings = Settings(data_dir=tmp_path / "data", auth="keys", api_keys_file=keys_file)
    paths = schema_of(settings)["paths"]
    for path, operations in paths.items():
        for operation in operations.values():
            answers = operation["responses"]
            if path in ("/healthz", "/readyz"):
                assert operation["security"] == [] and "401" not in answers
                continue
            for status in ("401", "403", "429"):
                assert PROBLEM in answers[status]["content"], (path, status)


def test_without_keys_no_route_documents_a_401(tmp_path: Path) -> None:
    paths = schema_of(Settings(data_dir=tmp_path / "data"))["paths"]
    assert not [
        path for path, ops in paths.items() for op in ops.values() if "401" in op["responses"]
    ]


def test_the_rules_of_two_fields_are_in_the_schema(tmp_path: Path) -> None:
    models = schema_of(Settings(data_dir=tmp_path / "data"))["components"]["schemas"]
    assert [branch["required"] for branch in models["PinRequest"]["oneOf"]] == [
        ["tokens"],
        ["keys"],
    ]
    assert models["PurgeRequest"]["anyOf"][0]["required"] == ["model"]
    for name in ("LookupRequest", "StoreHeader", "PinRequest", "PurgeRequest"):
        assert "block-size-mismatch" in models[name]["properties"]["block_size"]["description"]
    assert "unknown-retention" in models["LookupRequest"]["properties"]["retention"]["description"]


def test_every_reference_names_a_published_schema(tmp_path: Path) -> None:
    schema = schema_of(Settings(data_dir=tmp_path))
    published = set(schema["components"]["schemas"])

    def refs(node: Any) -> list[str]:
        if isinstance(node, dict):
            own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
            return own + [ref for value in node.values() for ref in refs(value)]
        if isinstance(node, list):
            return [ref for value in node for ref in refs(value)]
        return []

    prefix = "#/components/schemas/"
    names = {ref.removeprefix(prefix) for ref in refs(schema) if ref.startswith(prefix)}
    assert names and names <= published, sorted(names - published)


def test_every_refusal_of_every_route_is_a_problem(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text(key_file_entry("k", "team", Role.WRITER, new_key()))
    for settings in (
        Settings(data_dir=tmp_path / "data"),
        Settings(data_dir=tmp_path / "data", auth="keys", api_keys_file=keys_file),
    ):
        schema = schema_of(settings)
        refusals = [
            (path, method, status, answer)
            for path, operations in schema["paths"].items()
            for method, operation in operations.items()
            for status, answer in operation["responses"].items()
            if not status.startswith("2")
        ]
        assert ("/v1/pins", "get", "422") in {refusal[:3] for refusal in refusals}
        for path, method, status, answer in refusals:
            assert list(answer["content"]) == [PROBLEM], (path, method, status)
            assert answer["content"][PROBLEM]["schema"] == {"$ref": "#/components/schemas/Problem"}
        assert "HTTPValidationError" not in schema["components"]["schemas"]
