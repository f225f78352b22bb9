"""The configuration reference page: `serve`'s settings, and the other subcommands' flags as
their argparse parsers declare them."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings

from cache_service.service.settings import ENV_PREFIX, Settings
from cache_service.tools.admin import add_admin_parser
from cache_service.tools.doctor import add_doctor_parser
from cache_service.tools.pd_proxy.command import add_pd_proxy_parser
from cache_service.tools.reference_markdown import code, page, prose, require_descriptions, table
from cache_service.tools.replay.arguments import add_replay_parser
from cache_service.tools.route_cli import add_route_parser

AddParser = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]
PROG = "cache-service"
# `demo` is left out: it lives in the integrations, which the tools layer may not import
# (pyproject.toml's layers); `serve` is documented from its settings.
SUBCOMMANDS: tuple[AddParser, ...] = (
    add_replay_parser,
    add_admin_parser,
    add_doctor_parser,
    add_route_parser,
    add_pd_proxy_parser,
)
# Defaults computed from the machine, shown as what they mean: the page must not depend on
# where it was generated.
SYMBOLIC_DEFAULTS = {("cache-service replay", "--jobs"): "one per core"}
SERVE_INTRO = (
    "Runs the HTTP service. Every flag can also be set as an environment variable; a flag "
    "wins over the variable, which wins over the default."
)


def serve_flag(name: str) -> str:
    """The `serve` flag of a setting, as cli.py names it."""
    return "--" + name.replace("_", "-")


def settings_table(settings: type[BaseSettings]) -> str:
    """Every setting as a flag, its environment variable, default and description."""
    fields = settings.model_fields
    require_descriptions([serve_flag(name) for name, f in fields.items() if not f.description])
    prefix = str(settings.model_config.get("env_prefix", "")).upper()
    rows = []
    for name, field in fields.items():
        description = prose(field.description or "")
        if field.annotation is bool:  # cli.py makes these switches too
            description += f" A bare {code(serve_flag(name))} means true."
        default = "*computed*" if field.default_factory else _default(field.default)
        rows.append([code(serve_flag(name)), code(prefix + name.upper()), default, description])
    return table(["Flag", "Environment variable", "Default", "Description"], rows)


def _default(value: Any) -> str:
    if value is PydanticUndefined:
        return "*required*"
    if value is None or value is argparse.SUPPRESS:
        return "*unset*"
    if isinstance(value, bool):
        return code(str(value).lower())
    if isinstance(value, list | tuple):  # a list flag's items, as it is given
        return code(",".join(map(str, value))) if value else ""
    return code(str(value)) if str(value) else "*empty*"


def command_parser(subcommands: Sequence[AddParser] = SUBCOMMANDS) -> argparse.ArgumentParser:
    """A `cache-service` parser with the documented subcommands, built without the
    CACHE_SERVICE_* variables some defaults are read from (an operator's URL, or API key)."""
    parser = argparse.ArgumentParser(prog=PROG)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    with _without_service_variables():
        for add in subcommands:
            add(commands)
    return parser


@contextmanager
def _without_service_variables() -> Iterator[None]:
    saved = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith(ENV_PREFIX)}
    try:
        yield
    finally:
        os.environ.update(saved)


def command_sections(parser: argparse.ArgumentParser, summary: str = "") -> Iterator[str]:
    """A section per command that takes flags, nested commands after their parent."""
    # argparse keeps its actions, and the help of each subcommand, in attributes only.
    actions = parser._actions
    nested = [a for a in actions if isinstance(a, argparse._SubParsersAction)]
    flags = [
        a for a in actions if not isinstance(a, argparse._SubParsersAction | argparse._HelpAction)
    ]
    if flags:
        require_descriptions([parser.prog] if not (parser.description or summary) else [])
        require_descriptions([f"{parser.prog} {_name(a)}" for a in flags if not a.help])
        rows = [
            [code(_name(a)), _flag_default(parser.prog, a), _flag_help(parser, a)] for a in flags
        ]
        intro = prose(parser.description or summary)
        yield f"## {parser.prog}\n\n{intro}\n\n" + table(["Flag", "Default", "Description"], rows)
    for action in nested:
        helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
        for name, command in action.choices.items():
            yield from command_sections(command, helps.get(name, ""))


def _name(action: argparse.Action) -> str:
    return ", ".join(action.option_strings) or str(action.metavar or action.dest)


def _flag_default(prog: str, action: argparse.Action) -> str:
    if action.required:
        return "*required*"
    symbolic = SYMBOLIC_DEFAULTS.get((prog, _name(action)))
    if symbolic is not None:
        return f"*{symbolic}*"
    if action.nargs == 0 or action.default is None:  # a switch, or nothing when not given
        return ""
    return _default(action.default)


def _flag_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    # As argparse's own --help does: %(default)s and the like expanded, %% made %.
    params = {key: value for key, value in vars(action).items() if value is not argparse.SUPPRESS}
    params["prog"] = parser.prog
    text = prose(str(action.help) % params)
    if action.choices is not None:
        text += "; one of " + ", ".join(code(str(choice)) for choice in action.choices)
    return text


def configuration_page() -> str:
    """The configuration reference page."""
    sections = command_sections(command_parser())
    serve = f"## {PROG} serve\n\n{SERVE_INTRO}\n\n" + settings_table(Settings)
    return page("Configuration reference", serve, *sections)
