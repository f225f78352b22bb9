"""The docs site's reference pages are what the code gives on any machine, and the generator
refuses a setting, flag or metric that has no description. The pages are made with the
versions README's command installs (FastAPI's OpenAPI document differs between releases), so,
like the rest of tests/docs_site, this runs there and not again on the lowest or locked ones."""

from __future__ import annotations

import argparse
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from cache_service.cli import build_parser
from cache_service.service.settings import ENV_PREFIX, Settings
from cache_service.tools import docs_reference
from cache_service.tools.reference_cli import (
    command_parser,
    command_sections,
    serve_flag,
    settings_table,
)
from cache_service.tools.reference_markdown import MissingDescription
from cache_service.tools.reference_service import metric_sources, metric_table
from cache_service.tools.replay import arguments
from tests.docs_site.conftest import CONTENT

COMMITTED = CONTENT / "reference"
# A private name: `_Call`, `base._BaseCacheClient` (not a dunder, not `fail_open`).
PRIVATE_NAME = re.compile(r"(?<!\w)_[A-Za-z]\w*")
REGENERATE = "run `python -m cache_service.tools.docs_reference` and commit the pages"


def committed(name: str) -> str:
    """A committed reference page."""
    return (COMMITTED / name).read_text(encoding="utf-8")


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands of a parser by name."""
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_committed_pages_are_what_the_code_gives_on_any_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An operator's variables and another core count must change nothing (and leak no key).
    monkeypatch.setenv(ENV_PREFIX + "URL", "http://elsewhere:9")
    monkeypatch.setenv(ENV_PREFIX + "API_KEY", "an-operators-secret")
    monkeypatch.setenv(ENV_PREFIX + "PORT", "9999")
    monkeypatch.setattr(arguments, "default_jobs", lambda: 97)
    written = docs_reference.write_pages(tmp_path)
    assert sorted(path.name for path in COMMITTED.iterdir()) == sorted(p.name for p in written), (
        f"the reference folder holds other files than the generated pages: {REGENERATE}"
    )
    stale = [p.name for p in written if p.read_bytes() != (COMMITTED / p.name).read_bytes()]
    assert not stale, f"stale reference pages {stale}: {REGENERATE}"
    assert not any("an-operators-secret" in p.read_text() for p in written)


def test_check_mode_names_a_stale_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    docs_reference.write_pages(tmp_path)
    (tmp_path / "metrics.md").write_text("# edited by hand\n")
    assert docs_reference.main(["--check", "--out", str(tmp_path)]) == 1
    assert "metrics.md is stale" in capsys.readouterr().err


def test_a_setting_without_a_description_stops_the_generation() -> None:
    class Undocumented(BaseSettings):
        model_config = SettingsConfigDict(env_prefix="X_")
        told: int = Field(1, description="Has one.")
        silent_setting: int = 2

    with pytest.raises(MissingDescription, match="--silent-setting"):
        settings_table(Undocumented)


def test_a_flag_without_help_stops_the_generation() -> None:
    def add_thing(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
        thing = commands.add_parser("thing", help="does a thing")
        thing.add_argument("--told", help="has help")
        thing.add_argument("--silent-flag")

    with pytest.raises(MissingDescription, match="cache-service thing --silent-flag"):
        list(command_sections(command_parser([add_thing])))


def test_a_metric_without_help_stops_the_generation() -> None:
    registry = CollectorRegistry()
    Counter("docs_test_told", "Has help.", registry=registry)
    Counter("docs_test_silent", "", registry=registry)
    with pytest.raises(MissingDescription, match="docs_test_silent"):
        metric_table(registry)


def test_every_setting_metric_and_operation_is_on_its_page() -> None:
    configuration, metrics = committed("configuration.md"), committed("metrics.md")
    for name in Settings.model_fields:
        row = f"| `{serve_flag(name)}` | `{ENV_PREFIX}{name.upper()}` |"
        assert row in configuration, name
    names = [f.name for _, _, registry in metric_sources() for f in registry.collect()]
    assert len(names) > 40 and not [name for name in names if f"`{name}" not in metrics]
    # Label names come from prometheus_client's attributes: an upgrade must not lose them.
    assert "| `prompt_cache_requests_total` | counter | `route`, `code` |" in metrics
    assert "| `prompt_cache_kv_events_batches_total` | counter | `engine` |" in metrics
    http_api = committed("http-api.md")
    for path, operations in json.loads(committed("openapi.json"))["paths"].items():
        for method in operations:
            assert f"\n## {method.upper()} {path}\n" in http_api


def test_the_pages_document_every_flag_the_cli_accepts() -> None:
    cli = subcommands(build_parser())
    serve = {option for action in cli["serve"]._actions for option in action.option_strings}
    assert serve - {"-h", "--help"} == {serve_flag(name) for name in Settings.model_fields}
    # `demo` is in the integrations, out of the tools layer's reach (pyproject.toml).
    assert set(cli) - {"serve", "demo"} == set(subcommands(command_parser()))


class CodeRendered(HTMLParser):
    """The text of what mkdocstrings renders from the code itself on a page (headings, the
    "Bases:" lines, signatures), as opposed to the docstrings' prose."""

    KINDS = frozenset({"doc-heading", "doc-class-bases", "doc-signature"})
    VOID = frozenset({"br", "hr", "img", "input", "link", "meta", "wbr"})

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0  # open elements inside one of KINDS
        self.texts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.VOID:
            return
        classes = set((dict(attrs).get("class") or "").split())
        if self.depth or classes & self.KINDS:
            self.depth += 1

    def handle_endtag(self, tag: str) -> None:
        if self.depth and tag not in self.VOID:
            self.depth -= 1

    def handle_data(self, data: str) -> None:
        if self.depth:
            self.texts.append(data)


def test_the_python_client_reference_shows_no_private_name(built_site: Path) -> None:
    """`CacheClient(_BaseCacheClient)` and `-> _Call[RouteAnswer]` were on the page: a reader's
    reference names public objects only (docs/templates/python/material/class.html.jinja leaves
    private bases out; the page's filters leave out the twins' plumbing)."""
    page = CodeRendered()
    page.feed((built_site / "python-client.html").read_text(encoding="utf-8"))
    rendered = "".join(page.texts)
    assert "Bases:" in rendered and "lookup(" in rendered  # the parser found the parts
    assert PRIVATE_NAME.findall(rendered) == []
